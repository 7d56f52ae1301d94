"""Averaging a flat fp32 tensor over a process group, optionally compressed on the wire.

Owns: the wire formats (fp32, bf16, int8 / int4 with one fp32 scale per block; int4 packs two
codes per byte) and the collective that
averages with them (their sizes and the bytes each rank sends: plan/wire.py, shared with the planner). It must never know about models or rounds.

Compressed averaging is two-phase, like a ring all-reduce, so the bytes per rank stay ~2n/elem
whatever the group size: (1) all-to-all: rank j receives everyone's encoded chunk j, decodes, and
averages it in fp32; (2) all-gather of the re-encoded chunk averages. Every rank decodes the same
gathered bytes, so replicas stay bit-identical. int8 error per element is at most half a
quantization step in each phase: |avg - exact| <= mean_r(s1_r) / 2 + s2 / 2, s = block absmax / 127;
int4 the same with s = block absmax / 7. (Streaming DiLoCo, arXiv 2501.18512, sends 4-bit floats,
E3M0, and accumulates in fp32; int4 here is the symmetric integer variant with a per-block scale,
which bounds the error per block as int8 does.)

Error feedback (`feedback`, Streaming DiLoCo's sync.error_feedback): what a rank's codes left out
is kept and added to what it encodes next time, in both phases: (1) e_sent, over the whole flat
tensor, the residual of this rank's own encoded values; (2) e_owned, only on the chunk this rank
averages, the residual of its re-encoded average. So over K calls the sum of the results tracks
the sum of the exact averages within one call's error, instead of K of them adding up.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.distributed.collectives import all_gather_single
from hpctrain.plan.wire import code_bytes, wire_layout



def quantize_int8(x: torch.Tensor, block: int, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of `block` elements (x.numel() must be a multiple of it):
    returns (int8 codes, fp32 scales); scale = absmax / levels, codes = round(x / scale)."""
    xb = x.float().view(-1, block)
    scale = xb.abs().amax(dim=1) / float(levels)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xb / safe[:, None]).clamp_(-levels, levels).to(torch.int8)
    return q.view(-1), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return (q.view(-1, block).float() * scale[:, None]).view(-1)


def quantize_int4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 4-bit per block of `block` (even) elements: (uint8 bytes holding two codes each,
    element 2i in the low nibble, fp32 scales); scale = absmax / 7, codes in [-7, 7] stored + 8."""
    q, scale = quantize_int8(x, block, levels=7)
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(-1, 2)
    return u[:, 0] | (u[:, 1] << 4), scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    codes = torch.stack([packed & 15, packed >> 4], dim=1).view(-1).to(torch.int16) - 8
    return dequantize_int8(codes, scale, block)


class Codec:
    """Encode/decode one chunk of `chunk` elements in a wire format."""

    def __init__(self, kind: str, chunk: int, block: int):
        self.kind, self.chunk, self.block = kind, chunk, block

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Wire parts as uint8 tensors (bit-reinterpreted: Gloo moves bytes, not bf16/int16)."""
        if self.kind == "bf16":
            return [x.to(torch.bfloat16).view(torch.uint8)]
        if self.kind == "int4":
            packed, s = quantize_int4(x, self.block)
            return [packed, s.view(torch.uint8)]
        q, s = quantize_int8(x, self.block)
        return [q.view(torch.uint8), s.view(torch.uint8)]

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.kind == "bf16":
            return parts[0].contiguous().view(torch.bfloat16).float()
        scale = parts[1].contiguous().view(torch.float32)
        if self.kind == "int4":
            return dequantize_int4(parts[0].contiguous(), scale, self.block)
        return dequantize_int8(parts[0].contiguous().view(torch.int8), scale, self.block)

    def split(self, wire: torch.Tensor) -> list[torch.Tensor]:
        """The parts of one encoded chunk sent as one uint8 buffer (encode's parts concatenated)."""
        n_codes = code_bytes(self.chunk, self.kind)
        return [wire[:n_codes]] if self.kind == "bf16" else [wire[:n_codes], wire[n_codes:]]


def _keep_residual(residual: torch.Tensor | None, meant: torch.Tensor, codec: Codec,
                   parts: list[torch.Tensor]) -> None:
    """residual <- what was meant minus what the codes say, in place (positions past its end are
    padding, whose residual is zero); nothing without error feedback (None)."""
    if residual is not None:
        residual.copy_((meant - codec.decode(parts))[:residual.numel()])


def average(flat: torch.Tensor, group, kind: str = "none", block: int = 256,
            feedback: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Mean of `flat` (1-D fp32) over `group`; identical result on every rank. Blocking.
    `feedback`: (e_sent, e_owned), fp32 like `flat`, this rank's residuals (module docstring),
    added to what is encoded and updated in place; ignored for fp32 and bf16."""
    p = dist.get_world_size(group)
    if p == 1:
        return flat.clone()
    if kind == "none":
        out = flat.clone()
        dist.all_reduce(out, group=group)
        return out.div_(p)
    n = flat.numel()
    chunk, block = wire_layout(n, p, kind, block)
    codec = Codec(kind, chunk, block)
    e_sent, e_owned = feedback if feedback is not None and kind in ("int8", "int4") else (None, None)
    padded = torch.zeros(p * chunk, dtype=torch.float32, device=flat.device)
    padded[:n] = flat if e_sent is None else flat + e_sent
    sent = codec.encode(padded)
    _keep_residual(e_sent, padded, codec, sent)
    got = [torch.empty_like(t) for t in sent]
    for s, g in zip(sent, got):  # phase 1: chunk j of every rank -> rank j
        dist.all_to_all_single(g, s, group=group)
    me = [g.view(p, -1) for g in got]
    mine = torch.stack([Codec(kind, chunk, block).decode([m[r] for m in me]) for r in range(p)]).mean(0)
    owned = None if e_owned is None else e_owned[dist.get_rank(group) * chunk:][:chunk]
    if owned is not None:  # my chunk's residual (padding past n has none)
        mine[:owned.numel()] += owned
    part = codec.encode(mine)
    _keep_residual(owned, mine, codec, part)
    full = [torch.empty(p * t.numel(), dtype=t.dtype, device=t.device) for t in part]
    for f, t in zip(full, part):  # phase 2: every chunk average -> every rank
        all_gather_single(f, t, group=group)
    chunks = [f.view(p, -1) for f in full]
    out = torch.cat([codec.decode([c[r] for c in chunks]) for r in range(p)])
    return out[:n]
