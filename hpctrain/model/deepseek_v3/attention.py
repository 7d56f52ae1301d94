"""Multi-head latent attention (DeepSeek-V2/V3's MLA), architecture only: queries through an
optional low-rank bottleneck, keys and values expanded per head from one compressed latent, and a
decoupled rotary part, one key for all heads. Never imports distributed code (the tensor-parallel
plan, tensor_parallel.py beside this file, splits q_b / wq / kv_b over heads and wo over its input).

Parameters (inside blocks.{i}.attn.): q_a [q_lora_rank, C], q_norm [q_lora_rank], q_b [H x (nope +
rope), q_lora_rank] (or wq [H x (nope + rope), C] without q_lora_rank), kv_a [kv_lora_rank, C],
k_rope [rope, C] (HF's kv_a_proj_with_mqa is these two stacked: rows 0..r-1 and r..r+rope-1),
kv_norm [kv_lora_rank], kv_b [H x (nope + v), kv_lora_rank], wo [C, H x v].

Numerics follow transformers' DeepseekV3Attention: the latent norms' epsilon is 1e-6 whatever
rms_norm_eps says (HF builds them with its default), rotary positions as rope.py computes them
(interleaved pairs when rope_interleave; YaRN when rope_scaling_factor > 0), softmax scale
1 / sqrt(nope + rope) (times YaRN's mscale^2).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hpctrain.model.attention import causal_attention
from hpctrain.model.deepseek_v3.args import DeepseekV3Config
from hpctrain.model.deepseek_v3.rope import apply_rope, rope_cos_sin, softmax_scale
from hpctrain.model.llama import RMSNorm

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which HF's q_a / kv_a layernorms keep


class LatentAttention(nn.Module):
    def __init__(self, args: DeepseekV3Config):
        super().__init__()
        self.args = args
        c, h, qk = args.n_embd, args.n_head, args.qk_head_dim
        if args.q_lora_rank:
            self.q_a = nn.Linear(c, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b = nn.Linear(args.q_lora_rank, h * qk, bias=False)
        else:
            self.wq = nn.Linear(c, h * qk, bias=False)
        self.kv_a = nn.Linear(c, args.kv_lora_rank, bias=False)
        self.k_rope = nn.Linear(c, args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b = nn.Linear(args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(h * args.v_head_dim, c, bias=False)
        self.scale = softmax_scale(args)
        self.attend = causal_attention  # the attention kernel; parallel/ may swap it (context parallelism)
        self.resid_drop = nn.Dropout(args.dropout)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] -> q [B, T, heads x (nope + rope)] (this rank's heads under TP)."""
        return self.q_b(self.q_norm(self.q_a(x))) if self.args.q_lora_rank else self.wq(x)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, C]; doc_ids / positions [B, T]: see GPT.forward."""
        a, (b, t, _) = self.args, x.shape
        nope, rope, vdim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        # -1 heads: under tensor parallelism each rank holds n_head / tp heads
        q = self.queries(x).view(b, t, -1, nope + rope).transpose(1, 2)
        q_nope, q_rot = q.split([nope, rope], dim=-1)
        kv = self.kv_b(self.kv_norm(self.kv_a(x))).view(b, t, -1, nope + vdim).transpose(1, 2)
        k_nope, v = kv.split([nope, vdim], dim=-1)
        k_rot = self.k_rope(x).view(b, 1, t, rope)
        cos, sin = rope_cos_sin(a, t, x.device, q.dtype, positions)
        q = torch.cat([q_nope, apply_rope(q_rot, cos, sin, a.rope_interleave)], dim=-1)
        k_rot = apply_rope(k_rot, cos, sin, a.rope_interleave).expand(-1, k_nope.shape[1], -1, -1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        y = self.attend(q, k, v, doc_ids, scale=self.scale,
                        dropout_p=a.dropout if self.training else 0.0)
        return self.resid_drop(self.wo(y.transpose(1, 2).reshape(b, t, -1)))
