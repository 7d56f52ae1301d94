"""Gradient-sync bandwidth: our DDP paths (MPI hook, Gloo) next to raw all-reduces of the same bytes.

Run:  mpiexec -n 2 python bench/allreduce.py [--mib 32] [--reps 20]

Prints bus bandwidth (busbw = 2(n-1)/n * bytes / time, the NCCL-tests convention) for:
  raw MPI Allreduce (mpi4py, in place)   raw Gloo all_reduce (torch.distributed)
  DDP sync with the MPI hook             DDP sync with the default Gloo hook
The DDP figures time backward() with synchronization minus backward() under no_sync(), so they
contain only what gradient synchronization adds to a step. Ratios are printed against raw MPI.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpctrain.dist import init_distributed, teardown
from hpctrain.parallel.mpi_grad_sync import use_mpi_grad_sync


def timed(fn, reps: int) -> float:
    fn()
    dist.barrier()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def busbw(nbytes: int, seconds: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=32.0, help="gradient bytes (MiB) to synchronize")
    ap.add_argument("--reps", type=int, default=20, help="repetitions (best time is reported)")
    args = ap.parse_args()
    ctx = init_distributed()
    from mpi4py import MPI

    n = ctx.world_size
    numel = int(args.mib * 2**20 / 4)
    buf = torch.ones(numel)
    raw_mpi = timed(lambda: ctx.comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM), args.reps)
    raw_gloo = timed(lambda: dist.all_reduce(buf), args.reps)

    # a model whose gradients total the same bytes: 8 square-ish Linear layers
    width = int((numel / 8) ** 0.5)
    nbytes = 8 * width * width * 4
    x = torch.randn(4, width)

    def ddp_sync_time(mpi: bool) -> float:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(8)]))
        if mpi:
            use_mpi_grad_sync(model, dist.group.WORLD, ctx.comm)

        def step(sync: bool):
            def run():
                if sync:
                    model(x).sum().backward()
                else:
                    with model.no_sync():
                        model(x).sum().backward()
            return run
        return max(1e-9, timed(step(True), args.reps) - timed(step(False), args.reps))

    ddp_mpi, ddp_gloo = ddp_sync_time(True), ddp_sync_time(False)
    if ctx.is_main:
        raw = busbw(numel * 4, raw_mpi, n)
        print(f"ranks {n}, {numel * 4 / 2**20:.1f} MiB raw / {nbytes / 2**20:.1f} MiB of gradients")
        print(f"{'path':<28}{'busbw GB/s':>12}{'vs raw MPI':>12}")
        for name, b in (("raw MPI Allreduce", raw), ("raw Gloo all_reduce", busbw(numel * 4, raw_gloo, n)),
                        ("DDP + MPI hook (ours)", busbw(nbytes, ddp_mpi, n)),
                        ("DDP + Gloo (default)", busbw(nbytes, ddp_gloo, n))):
            print(f"{name:<28}{b:>12.2f}{b / raw:>11.2f}x")
    teardown()


if __name__ == "__main__":
    main()
