"""Model FLOP utilization: achieved model FLOP/s over a measured peak of the same device.

The peak is measured, not looked up: a square matmul at the training precision, with the thread count
the rank trains with, run by all ranks of the node at once (so oversubscription is priced in). This
makes MFU meaningful on CPUs, whose datasheet peaks are far from reachable.
"""
from __future__ import annotations

import time

import torch


def timed_products(a: torch.Tensor, b: torch.Tensor, reps: int) -> float:
    """Seconds for `reps` products a @ b (synchronized on CUDA)."""
    if a.device.type == "cuda":
        torch.cuda.synchronize(a.device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if a.device.type == "cuda":
        torch.cuda.synchronize(a.device)
    return time.perf_counter() - t0


def measure_peak_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, reps: int = 8,
                       trials: int = 3, budget_s: float | None = 0.1) -> float:
    """FLOP/s of an n x n matmul: the best of `trials` timings of `reps` products (a shared machine
    slows single timings down at random; the best is the closest to what the hardware can do).
    `budget_s` bounds one trial: where a product is slow (fp16 on a CPU without fp16 units takes
    seconds at n=1024) n is halved and reps reduced, so start-up never waits a minute for a metric.
    The operands come from a private generator: the global one drives dropout and has just been
    restored by a resume (drawing from it here made resumes with model.dropout > 0 diverge)."""
    gen = torch.Generator(device=device).manual_seed(0)
    while True:
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        one = timed_products(a, b, 1)  # also the warm-up
        if budget_s is None or one * reps <= budget_s or n <= 128:
            break
        if one <= budget_s:
            reps = max(1, int(budget_s / one))
            break
        n //= 2
    best = min(timed_products(a, b, reps) for _ in range(trials))
    return 2.0 * n**3 * reps / best
