"""train.precision = "auto": bf16 where this hardware computes it faster than fp32, fp32 otherwise.

Owns: the one decision, taken once per job before the layout is applied, the same on every rank.
On CUDA: bf16 where the GPU supports it (A100/H100 class), fp32 otherwise (fp16 with loss scaling is
an explicit choice: `train.precision = "fp16"`). On CPUs it depends on the chip, so it is measured:
a matrix product of the model's own shape (one micro-batch of tokens times the MLP's first weight)
in fp32 and in bf16 on every rank. bf16 is chosen when the job-wide average speed-up is at least
`MIN_SPEEDUP`: the product is most of a training step, and autocast adds casts the product does
not show. Measured here (2 cores, AMD EPYC with avx512_bf16): ~4x on the product, 1.2x on the whole
step of configs/recipe.toml, the same final loss; an Intel Xeon without AMX ran bf16 slower than
fp32 (docs/benchmarks.md), and there auto keeps fp32.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.metrics.mfu import timed_products

MIN_SPEEDUP = 1.3


def _best_time(a: torch.Tensor, b: torch.Tensor, budget_s: float = 0.03, trials: int = 3) -> float:
    """Seconds per product: the best of `trials` timings of enough products to fill `budget_s`."""
    timed_products(a, b, 1)  # warm-up (oneDNN builds its kernel on first use)
    one = max(timed_products(a, b, 1), 1e-6)
    reps = max(1, min(200, int(budget_s / one)))
    return min(timed_products(a, b, reps) for _ in range(trials)) / reps


def bf16_speedup(rows: int, inner: int, cols: int) -> float:
    """fp32 time / bf16 time of a [rows, inner] @ [inner, cols] product on this CPU thread."""
    a, b = torch.randn(rows, inner), torch.randn(inner, cols)
    fp32 = _best_time(a, b)
    bf16 = _best_time(a.bfloat16(), b.bfloat16())
    return fp32 / bf16


def resolve_precision(precision: str, device: torch.device, tokens: int, n_embd: int) -> str:
    """`precision` unless it is "auto"; then "bf16" or "fp32", the same on every rank (collective
    over the default group when it is initialized)."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    speedup = torch.tensor(bf16_speedup(tokens, n_embd, 4 * n_embd), dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(speedup, op=dist.ReduceOp.AVG)
    return "bf16" if float(speedup) >= MIN_SPEEDUP else "fp32"
