"""The averaging wire formats' sizes, pure arithmetic: bytes per element of fp32, bf16, int8 and int4
(two 4-bit codes per byte), the fp32 scale per int8 / int4 block, the per-rank chunk layout, and the bytes one rank sends to average n
elements over p ranks.

Owns: those numbers, defined once: sync/compress.py and sync/inbox.py move tensors laid out by them,
sync/diloco.py and sync/synchronous.py count the bytes with `bytes_sent`, plan/comm.py predicts
them. It must never import torch.
"""
from __future__ import annotations

import math

WIRE_BITS = {"none": 32, "bf16": 16, "int8": 8, "int4": 4}  # per element, by sync.compression
SCALE_BYTES = 4  # one fp32 scale per int8 / int4 block
BLOCK_SCALED = ("int8", "int4")


def wire_layout(n: int, p: int, kind: str, block: int) -> tuple[int, int]:
    """(chunk, block): per-rank chunk length (a multiple of the int8 / int4 block) and the block
    used (int4: even, so a block's codes fill whole bytes)."""
    chunk = math.ceil(n / p)
    if kind in BLOCK_SCALED:
        block = min(block, chunk) if block else chunk
        block += block % 2 if kind == "int4" else 0
        chunk = math.ceil(chunk / block) * block
    return chunk, block


def code_bytes(chunk: int, kind: str) -> int:
    """Bytes of the element codes of one encoded chunk (without the scales)."""
    return chunk * WIRE_BITS[kind] // 8


def encoded_bytes(chunk: int, kind: str, block: int) -> int:
    """Bytes of one encoded chunk laid out by wire_layout: codes + one fp32 scale per block."""
    scales = chunk // block * SCALE_BYTES if kind in BLOCK_SCALED else 0
    return code_bytes(chunk, kind) + scales


def bytes_sent(n: int, p: int, kind: str, block: int = 256) -> int:
    """Bytes one rank sends to average n elements over p ranks (ring all-reduce for fp32)."""
    if p <= 1:
        return 0
    if kind == "none":
        return int(2 * (p - 1) / p * n * WIRE_BITS["none"] // 8)
    chunk, block = wire_layout(n, p, kind, block)
    return 2 * (p - 1) * encoded_bytes(chunk, kind, block)
