"""Peak host memory per rank of setting up a large GPT with meta-device initialization (#21).

Run:  mpiexec -n 4 python bench/meta_init.py [--n_layer 8] [--n_embd 4096] [--n_head 32] \\
          [--vocab_size 50304] [--block_size 2048] [--data_parallel fsdp] [--tp 1] [--pp 1] \\
          [--meta_init true|false]

Each rank builds the model exactly as the Trainer does (hpctrain/train/model_setup.py: meta device,
layout, then only its shards materialized and initialized), gloo on CPU, no optimizer step, and
prints one line:
  RANK r baseline_MB peak_MB grown_MB shard_MB largest_MB whole_MB seconds
baseline: VmRSS before the build (Python, torch, MPI, the process group); peak: VmHWM after it;
grown = peak - baseline; shard: bytes of the parameters this rank holds (local shards, ties
once); largest: the largest whole parameter (meta init replays one whole tensor at a time);
whole: 4 bytes x every parameter (what each rank built before meta init). Rank 0 then prints
`BOUND ok|EXCEEDED` for grown <= shard + largest + its shard + 256 MB (allocator and library slack).

--in_turn: the ranks build one after another (the others wait in a sleeping MPI barrier), and each
frees its model before the next starts. Setup has no collective after the mesh, so each rank's
build is the same as in a job; what changes is that only one rank's shard is in memory at a time.
That is how the 7B shape (32 x 4096: 26.6 GB of fp32 shards over 4 ranks) is measured on a 24 GiB
machine; each rank's peak is its own (VmHWM is per process).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import time

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpctrain import config as config_mod
from hpctrain.distributed.bootstrap import init_distributed, teardown
from hpctrain.distributed.mesh import Mesh, ParallelDims
from hpctrain.train.model_setup import build_model

MB = 1024 ** 2
SLACK = 256 * MB


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def held_bytes(module) -> int:
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return total


def measured_build(cfg, mesh, ctx, free: bool) -> tuple:
    """(baseline RSS, peak RSS, shard bytes, seconds, parameters) of one build_model; ``free``:
    drop the model and give its memory back to the system afterwards."""
    baseline, t0 = vm("VmRSS"), time.perf_counter()
    built = build_model(cfg, mesh, ctx.device, cfg.train.precision)  # as given: a bench resolves no run plan
    seconds, peak = time.perf_counter() - t0, vm("VmHWM")
    shard, n_params = held_bytes(built.layout.module), built.n_params
    if free:
        del built
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        print(f"rank {ctx.rank}: built in {seconds:.0f} s, peak {peak / MB:.0f} MB, "
              f"{vm('VmRSS') / MB:.0f} MB after freeing it", flush=True)
    return baseline, peak, shard, seconds, n_params


def sleeping_barrier(comm) -> None:
    """MPI barrier that sleeps while it waits (a spinning one takes a core from the builder)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    for k, v in dict(n_layer=8, n_embd=4096, n_head=32, vocab_size=50304, block_size=2048,
                     tp=1, pp=1).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--data_parallel", default="fsdp")
    ap.add_argument("--meta_init", default="true")
    ap.add_argument("--in_turn", action="store_true", help="ranks build one at a time (see above)")
    a = ap.parse_args()
    ctx = init_distributed("gloo")
    cfg = config_mod.load(None, [
        "--run.dir=/nonexistent", "--data.path=/nonexistent", "--train.steps=1",
        "--train.warmup_steps=0", "--train.micro_batch_size=1", f"--parallel.meta_init={a.meta_init}",
        f"--parallel.data_parallel={a.data_parallel}", f"--parallel.tp={a.tp}", f"--parallel.pp={a.pp}",
        *[f"--model.{k}={getattr(a, k)}" for k in ("n_layer", "n_embd", "n_head", "vocab_size",
                                                     "block_size")]])
    mesh = Mesh(ParallelDims.from_config(ctx.world_size, cfg.parallel), ctx)
    dist.barrier()
    for turn in range(ctx.world_size) if a.in_turn else [ctx.rank]:
        if turn == ctx.rank:
            baseline, peak, shard, seconds, n_params = measured_build(cfg, mesh, ctx, a.in_turn)
        if a.in_turn:
            sleeping_barrier(ctx.comm)
    c = cfg.model
    largest = 4 * max(c.vocab_size * c.n_embd, 4 * c.n_embd * c.n_embd)
    whole = 4 * (n_params + c.block_size * c.n_embd)
    grown = peak - baseline
    row = (ctx.rank, baseline, peak, grown, shard, largest, whole, seconds)
    rows = ctx.comm.gather(row, root=0)
    if ctx.rank == 0:
        print(f"model {c.n_layer}x{c.n_embd} vocab {c.vocab_size} T {c.block_size}: "
              f"{whole / 4 / 1e9:.2f}B parameters; {ctx.world_size} ranks, "
              f"{a.data_parallel} tp={a.tp} pp={a.pp}, meta_init={a.meta_init}")
        print("RANK r baseline_MB peak_MB grown_MB shard_MB largest_MB whole_MB seconds")
        ok = True
        for r, b, p, g, s, l, w, sec in rows:
            print(f"RANK {r} {b / MB:.0f} {p / MB:.0f} {g / MB:.0f} {s / MB:.0f} {l / MB:.0f} "
                  f"{w / MB:.0f} {sec:.1f}", flush=True)
            ok &= g <= s + l + l // ctx.world_size + SLACK
        print(f"BOUND {'ok' if ok else 'EXCEEDED'} (grown <= shard + largest + largest / ranks "
              f"+ {SLACK // MB} MB)", flush=True)
    teardown()


if __name__ == "__main__":
    main()
