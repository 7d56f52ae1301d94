"""Rotary positions of the DeepSeek-V3 family: the decoupled rope part of MLA (qk_rope_head_dim
wide, one key for all heads), optionally with YaRN context extension as DeepSeek-V3 ships it.

Owns: the inverse frequencies (default, or YaRN's blend of interpolated and extrapolated ones with
its linear ramp), the cos/sin scale (YaRN's attention factor), the softmax-scale multiplier
(mscale_all_dim's mscale squared) and the rotation itself (interleaved pairs or rotate_half).
Arithmetic as transformers' modeling_rope_utils (`_compute_yarn_parameters`, truncate on) and
DeepseekV3Attention (`yarn_apply_mscale`), in fp32; never imports distributed code.
"""
from __future__ import annotations

import math

import torch

from hpctrain.model.attention import rope_angles
from hpctrain.model.deepseek_v3.args import DeepseekV3Config
from hpctrain.model.llama import rotate_half


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(args: DeepseekV3Config) -> float:
    """1 / sqrt(nope + rope), times mscale(factor, mscale_all_dim)^2 under YaRN when that is set."""
    scale = args.qk_head_dim ** -0.5
    if args.rope_scaling_factor > 0 and args.rope_mscale_all_dim:
        scale *= yarn_mscale(args.rope_scaling_factor, args.rope_mscale_all_dim) ** 2
    return scale


def attention_factor(args: DeepseekV3Config) -> float:
    """YaRN's cos/sin multiplier (1.0 without YaRN)."""
    f = args.rope_scaling_factor
    if f <= 0:
        return 1.0
    if args.rope_mscale and args.rope_mscale_all_dim:
        return yarn_mscale(f, args.rope_mscale) / yarn_mscale(f, args.rope_mscale_all_dim)
    return yarn_mscale(f)


def inv_freq(args: DeepseekV3Config, device=None) -> torch.Tensor:
    """Inverse frequencies [qk_rope_head_dim / 2] in fp32."""
    d, base = args.qk_rope_head_dim, args.rope_theta
    pos_freqs = base ** (torch.arange(0, d, 2, device=device).float() / d)
    if args.rope_scaling_factor <= 0:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        return d * math.log(args.rope_original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(args.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.rope_beta_slow)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=device) - low)
            / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (args.rope_scaling_factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def rope_cos_sin(args: DeepseekV3Config, t: int, device, dtype,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [t, qk_rope_head_dim] for positions 0..t-1 ([B, 1, T, qk_rope_head_dim] for
    ``positions`` [B, T]) (fp32, scaled), returned in `dtype`."""
    emb = rope_angles(inv_freq(args, device), t, positions)
    factor = attention_factor(args)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [..., t, rope] rotated; interleaved: pairs (x0, x1), (x2, x3)... each by one frequency,
    the result laid out [rotated evens, rotated odds] (the same for q and k: dot products agree)."""
    if not interleave:
        return x * cos + rotate_half(x) * sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
