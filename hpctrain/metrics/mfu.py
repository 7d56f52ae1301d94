"""Model FLOP utilization: the model FLOP/s the job achieves over the peak of its devices.

    MFU = flops_per_token (whole model: 6N + 12 L C T) x tokens/s (global batch) / job peak
    job peak = sum over ranks of (rank peak x the share of its cores it can use)

The FLOPs and tokens are the whole job's and the peak is every rank's, so one model at equal
tokens/s on equal ranks gets the same MFU in every layout (DDP, FSDP, TP, PP, DiLoCo). A rank's
peak comes from hpctrain/metrics/peak.py (GPU datasheet, or a CPU matmul peak measured once per
machine; this module owns the measurement). Ranks that share cores (local ranks x threads > cores)
count only their share. MFU is never above 1: an achieved rate above the peak shows the peak was
measured under load, and raises it (MfuMeter).
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


def core_share(local_size: int, threads: int, cores: int) -> float:
    """The share of its threads' peak a rank can reach when the node's ranks want more threads
    than the node has cores."""
    return min(1.0, cores / max(1, local_size * threads))


def job_peak_flops(rank_peak: float, pp: int, dp: int, tp: int, local_size: int, threads: int,
                   cores: int) -> float:
    """The job's peak for ranks of equal `rank_peak` in a pp x dp x tp layout: the layout only
    counts ranks."""
    return rank_peak * core_share(local_size, threads, cores) * pp * dp * tp


def model_flops_utilization(flops_per_token: float, tokens_per_s: float, job_peak: float) -> float:
    return flops_per_token * tokens_per_s / job_peak


class MfuMeter:
    """MFU of each step against the job's peak (None: unknown, then every MFU is None). A step that
    achieves more than the peak raises the peak to what it achieved (a loaded peak measurement)
    and calls `on_raise(ratio)` (the CPU peak cache keeps the raised value)."""

    def __init__(self, flops_per_token: float, job_peak: float | None, on_raise=None):
        self.flops_per_token, self.peak, self.on_raise = flops_per_token, job_peak, on_raise

    def __call__(self, tokens_per_s: float) -> float | None:
        if self.peak is None:
            return None
        achieved = self.flops_per_token * tokens_per_s
        if achieved > self.peak:
            ratio, self.peak = achieved / self.peak, achieved
            if self.on_raise is not None:
                self.on_raise(ratio)
        return model_flops_utilization(self.flops_per_token, tokens_per_s, self.peak)
