"""Gradient-sync bandwidth: our DDP paths (MPI hook, Gloo) next to raw all-reduces of the same bytes.

Run:  mpiexec -n 2 python bench/allreduce.py [--mib 32] [--reps 20]

Prints bus bandwidth (busbw = 2(n-1)/n * bytes / time, the NCCL-tests convention) for:
  raw MPI Allreduce (mpi4py, in place)   raw Gloo all_reduce (torch.distributed)
  DDP sync with the MPI hook             DDP sync with the default Gloo hook
The DDP figures time backward() with synchronization minus backward() under no_sync(), so they
contain only what gradient synchronization adds to a step (DDP built as hpctrain builds it:
gradient_as_bucket_view). The machine is noisy, so every repetition times all six things back to
back and the figures are medians over repetitions (DDP: of the per-repetition differences).
Ratios are printed against raw MPI.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpctrain.distributed import init_distributed, teardown
from hpctrain.parallel.mpi_grad_allreduce import use_mpi_grad_allreduce


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def busbw(nbytes: int, seconds: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=32.0, help="gradient bytes (MiB) to synchronize")
    ap.add_argument("--reps", type=int, default=20, help="repetitions (medians are reported)")
    args = ap.parse_args()
    ctx = init_distributed()
    from mpi4py import MPI

    n = ctx.world_size
    numel = int(args.mib * 2**20 / 4)
    buf = torch.ones(numel)
    # a model whose gradients total the same bytes: 8 square-ish Linear layers
    width = int((numel / 8) ** 0.5)
    nbytes = 8 * width * width * 4
    x = torch.randn(4, width)

    def ddp(mpi: bool) -> DDP:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(8)]),
                    gradient_as_bucket_view=True)  # as hpctrain's apply_ddp
        if mpi:  # as the trainer: the loss is divided by the group size, the hook only sums
            use_mpi_grad_allreduce(model, dist.group.WORLD, ctx.comm, prescaled=True)
        return model

    def backward(model: DDP, sync: bool, divisor: int):
        def run():
            with contextlib.nullcontext() if sync else model.no_sync():
                (model(x).sum() / divisor).backward()
        return run

    models = {"mpi": ddp(True), "gloo": ddp(False)}
    steps = {"raw MPI": lambda: ctx.comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM),
             "raw Gloo": lambda: dist.all_reduce(buf)}
    for name, model in models.items():
        d = n if name == "mpi" else 1
        steps[f"{name} sync"], steps[f"{name} nosync"] = backward(model, True, d), backward(model, False, d)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for rep in range(args.reps + 1):  # repetition 0 warms up
        for name, fn in steps.items():
            t = timed(fn)
            if rep:
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    sync = {m: statistics.median(max(1e-9, a - b) for a, b in zip(times[f"{m} sync"], times[f"{m} nosync"]))
            for m in models}
    if ctx.is_main:
        raw = busbw(numel * 4, med["raw MPI"], n)
        print(f"ranks {n}, {numel * 4 / 2**20:.1f} MiB raw / {nbytes / 2**20:.1f} MiB of gradients, "
              f"{args.reps} repetitions")
        print(f"{'path':<28}{'busbw GB/s':>12}{'vs raw MPI':>12}")
        for name, b in (("raw MPI Allreduce", raw), ("raw Gloo all_reduce", busbw(numel * 4, med["raw Gloo"], n)),
                        ("DDP + MPI hook (ours)", busbw(nbytes, sync["mpi"], n)),
                        ("DDP + Gloo (default)", busbw(nbytes, sync["gloo"], n))):
            print(f"{name:<28}{b:>12.2f}{b / raw:>11.2f}x")
    teardown()


if __name__ == "__main__":
    main()
