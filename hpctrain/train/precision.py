"""train.precision = "auto": bf16 where this hardware computes it faster than fp32, fp32 otherwise.

Owns: the one decision, taken once per job before the layout is applied, the same on every rank.
On CUDA: bf16 where the GPU supports it (A100/H100 class), fp32 otherwise (fp16 with loss scaling is
an explicit choice: `train.precision = "fp16"`). On CPUs it depends on the chip, so it is measured:
a matrix product of the model's own shape (one micro-batch of tokens times the MLP's first weight)
in fp32 and in bf16 on every rank. bf16 is chosen when the job-wide average speed-up is at least
`MIN_SPEEDUP`: the product is most of a training step, and autocast adds casts the product does
not show. Measured here (2 cores, AMD EPYC with avx512_bf16): ~4x on the product, 1.2x on the whole
step of configs/recipe.toml, the same final loss; an Intel Xeon without AMX ran bf16 slower than
fp32 (docs/benchmarks.md), and there auto keeps fp32. On CUDA only native bf16 counts (compute
capability >= 8.0): V100/T4 emulate it, far slower than fp32.

Also owns TF32 (`train.tf32`, on by default): fp32 matmuls on CUDA GPUs with TF32 units (compute
capability >= 8.0) run on tensor cores (torch.set_float32_matmul_precision("high")); and torch's
deterministic algorithms on CUDA where parallel.deterministic_experts asks for a run that adds in
one order (`apply_deterministic`).
"""
from __future__ import annotations

import os

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
        return cuda_auto_precision(torch.cuda.is_bf16_supported(including_emulation=False))
    speedup = torch.tensor(bf16_speedup(tokens, n_embd, 4 * n_embd), dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(speedup, op=dist.ReduceOp.AVG)
    return "bf16" if float(speedup) >= MIN_SPEEDUP else "fp32"


def cuda_auto_precision(native_bf16: bool) -> str:
    """"auto" on a GPU: bf16 where the GPU computes it natively, else fp32 (never emulated bf16)."""
    return "bf16" if native_bf16 else "fp32"


def tf32_wanted(capability: tuple[int, int] | None, tf32: bool) -> bool:
    """TF32 matmuls: asked for (train.tf32) on a CUDA GPU (capability not None) that has them."""
    return tf32 and capability is not None and capability >= (8, 0)


def apply_tf32(device: torch.device, tf32: bool) -> bool:
    """Set torch's fp32 matmul precision for this rank's device; True where TF32 is now on."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    on = tf32_wanted(capability, tf32)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if on else "highest")
        torch.backends.cudnn.allow_tf32 = on
    return on


def apply_deterministic(device: torch.device, deterministic_experts: bool) -> bool:
    """parallel.deterministic_experts on a CUDA GPU: torch's deterministic algorithms for the whole
    step (#49; attention's backward and some index kernels otherwise add with atomics, in a
    run-dependent order; the MoE layers never do: hpctrain/model/moe_rows.py), with cuBLAS's
    fixed workspace. warn_only: an op without a deterministic kernel warns instead of ending the
    run. A CPU adds in one order already. True where it is now on."""
    if not (deterministic_experts and device.type == "cuda"):
        return False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at cuBLAS's first use
    torch.use_deterministic_algorithms(True, warn_only=True)
    return True


def half_dtype(precision: str) -> torch.dtype | None:
    """The 16-bit dtype of autocast and FSDP2's parameters under a resolved train.precision
    (fp8: bf16, with float8 matmuls in the converted Linear layers: parallel/float8.py), or None."""
    return {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(precision)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The device's CUDA compute capability; None where it is not a CUDA GPU. The dry run's fake
    GPU (train/fake_device.py) is an H100's (9, 0)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    from hpctrain.train.fake_device import DEVICE, FAKE_CAPABILITY
    return FAKE_CAPABILITY if device.type == DEVICE else None
