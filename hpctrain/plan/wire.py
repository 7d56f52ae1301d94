"""The averaging wire formats' sizes, pure arithmetic: bytes per element of fp32, bf16 and int8, the
fp32 scale per int8 block, the per-rank chunk layout, and the bytes one rank sends to average n
elements over p ranks.

Owns: those numbers, defined once: sync/compress.py and sync/inbox.py move tensors laid out by them,
sync/diloco.py and sync/synchronous.py count the bytes with `bytes_sent`, plan/comm.py predicts
them. It must never import torch.
"""
from __future__ import annotations

import math

WIRE_BYTES = {"none": 4, "bf16": 2, "int8": 1}  # per element on the wire, by sync.compression
SCALE_BYTES = 4  # one fp32 scale per int8 block


def wire_layout(n: int, p: int, kind: str, block: int) -> tuple[int, int]:
    """(chunk, block): per-rank chunk length (a multiple of the int8 block) and the block used."""
    chunk = math.ceil(n / p)
    if kind == "int8":
        block = min(block, chunk) if block else chunk
        chunk = math.ceil(chunk / block) * block
    return chunk, block


def bytes_sent(n: int, p: int, kind: str, block: int = 256) -> int:
    """Bytes one rank sends to average n elements over p ranks (ring all-reduce for fp32)."""
    if p <= 1:
        return 0
    if kind == "none":
        return int(2 * (p - 1) / p * n * WIRE_BYTES["none"])
    chunk, block = wire_layout(n, p, kind, block)
    per_chunk = chunk * WIRE_BYTES[kind] + (chunk // block * SCALE_BYTES if kind == "int8" else 0)
    return 2 * (p - 1) * per_chunk
