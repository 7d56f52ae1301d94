"""Context-parallel attention speed per rank (#51): one attention layer's forward + backward with the
sequence split over the cp ranks (ring / Ulysses, hpctrain/parallel/context_parallel.py) next to
the reference, plain causal SDPA of the whole sequence on one rank (cp = 1).

Run:  mpiexec -n 2 python bench/cp_attention.py [--seq 2048 8192] [--dtype fp32 bf16] [--rounds 3]

Every rank runs every kernel, alternating within each round (the machine is shared and noisy), a
barrier around each timing: the reference attends the whole sequence S on every rank at once (so
the ranks compete for the cores as the cp kernels' ranks do); the cp kernels attend S / cp per
rank. Per-rank tokens/s: S / t at cp = 1, (S / cp) / t at cp; the ratio (cp's over cp = 1's,
= t_ref / (cp * t)) is the issue's bench figure (target: ring >= 0.8x at 8k with cp = 2), taken
per round (the reference and the kernel timed back to back) and its median printed, by wall time
and by CPU time (process time, all threads, averaged over the ranks: what other jobs' load on a
shared machine does not move; wall time also counts waiting for the other rank). `--matmul` adds the ring with its pre-fused block arithmetic (fp32 matmuls
with [c, c] score matrices), the "before" of the fused CPU kernel; `--docs LEN` packs documents
of LEN tokens (the reference then SDPA with the document mask, as the model at cp = 1).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.distributed import init_distributed, teardown
from hpctrain.model.attention import document_mask
from hpctrain.parallel import attention_blocks
from hpctrain.parallel.context_parallel import CPPlan, ring_attention, ulysses_attention
from hpctrain.parallel.zigzag import split_for_rank

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fwd_bwd_seconds(attend, q, k, v) -> tuple[float, float]:
    """attend(q, k, v) forward + backward of sum(out): wall seconds between two barriers, and CPU
    seconds of this process (all its threads) averaged over the ranks."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    attend(*leaves).sum().backward()
    cpu = torch.tensor(time.process_time() - c0, dtype=torch.float64)
    dist.barrier()
    wall = time.perf_counter() - t0
    dist.all_reduce(cpu)
    return wall, cpu.item() / dist.get_world_size()


def with_matmul_blocks(attend):
    """`attend` with the ring's blocks on the plain fp32 matmul arithmetic (the pre-fused kernel)."""
    def run(*args):
        fused = attention_blocks._fused
        attention_blocks._fused = lambda t: False
        try:
            return attend(*args)
        finally:
            attention_blocks._fused = fused
    return run


def reference(doc_ids: torch.Tensor | None):
    """cp = 1 as the model attends (hpctrain/model/attention.py): SDPA, causal or with the mask."""
    if doc_ids is None:
        return lambda *t: F.scaled_dot_product_attention(*t, is_causal=True)
    return lambda *t: F.scaled_dot_product_attention(*t, attn_mask=document_mask(doc_ids))


def measure(seq: int, dtype: torch.dtype, args, rank: int, cp: int) -> dict[str, list[float]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, seq, args.head_dim, generator=g).to(dtype) for _ in range(3))
    part = lambda t: split_for_rank(t, cp, rank, dim=2)  # noqa: E731
    doc_ids = None if args.docs is None else (torch.arange(seq) // args.docs).view(1, seq)
    plan = CPPlan.build(dist.group.WORLD, seq // cp,
                        None if doc_ids is None else split_for_rank(doc_ids, cp, rank, dim=1))
    ring = lambda *t: ring_attention(*t, plan)  # noqa: E731
    kernels = {"sdpa cp=1": (reference(doc_ids), (q, k, v)),
               f"ring cp={cp}": (ring, tuple(map(part, (q, k, v)))),
               f"ulysses cp={cp}": (lambda *t: ulysses_attention(*t, plan), tuple(map(part, (q, k, v))))}
    if args.matmul:
        kernels[f"ring-matmul cp={cp}"] = (with_matmul_blocks(ring), tuple(map(part, (q, k, v))))
    times = {name: [] for name in kernels}
    for _ in range(args.rounds):
        for name, (attend, inputs) in kernels.items():
            times[name].append(fwd_bwd_seconds(attend, *inputs))
    return times


def cells(times: dict[str, list[tuple[float, float]]], cp: int) -> list[str]:
    """Per kernel: median wall ms and, against cp = 1, the median over rounds of the per-rank
    tokens/s ratio by wall time and by CPU time (the latter blind to other jobs' load)."""
    ref = times["sdpa cp=1"]
    found = [f"sdpa cp=1 {statistics.median(w for w, _ in ref) * 1e3:.0f} ms"]
    for kernel, t in times.items():
        if kernel != "sdpa cp=1":
            wall = statistics.median(r[0] / (cp * w[0]) for r, w in zip(ref, t))
            cpu = statistics.median(r[1] / (cp * w[1]) for r, w in zip(ref, t))
            found.append(f"{kernel} {statistics.median(w for w, _ in t) * 1e3:.0f} ms "
                         f"{wall:.2f}x (cpu {cpu:.2f}x)")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 8192], help="whole sequence lengths")
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--heads", type=int, default=8, help="query = key/value heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="alternating repetitions (medians reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--matmul", action="store_true", help="also time the ring on fp32 matmul blocks")
    ap.add_argument("--docs", type=int, default=None, metavar="LEN",
                    help="packed documents of LEN tokens each (document masking); default: none")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ctx = init_distributed("gloo")
    rank, cp = ctx.rank, ctx.world_size
    if rank == 0:
        docs = "causal" if args.docs is None else f"causal within documents of {args.docs}"
        print(f"B 1, {args.heads} heads x {args.head_dim}, {docs}, fwd+bwd, {cp} ranks x "
              f"{args.threads} thread(s), medians of {args.rounds} rounds; ratio = per-rank tokens/s vs cp=1")
    for seq in args.seq:
        for name in args.dtype:
            times = measure(seq, DTYPES[name], args, rank, cp)
            if rank == 0:
                print(f"S {seq:6d} {name}: " + " | ".join(cells(times, cp)), flush=True)
    teardown()


if __name__ == "__main__":
    main()
