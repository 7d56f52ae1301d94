"""Model FLOP utilization: achieved model FLOP/s over a measured peak of the same device.

The peak is measured, not looked up: a square matmul at the training precision, with the thread count
the rank trains with, run by all ranks of the node at once (so oversubscription is priced in). This
makes MFU meaningful on CPUs, whose datasheet peaks are far from reachable.
"""
from __future__ import annotations

import time

import torch


def measure_peak_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, reps: int = 8,
                       trials: int = 3) -> float:
    """FLOP/s of an n x n matmul: the best of `trials` timings of `reps` products (a shared machine
    slows single timings down at random; the best is the closest to what the hardware can do)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(trials):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 * reps / best
