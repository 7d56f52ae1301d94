"""Context-parallel attention speed per rank (#51): one attention layer's forward + backward with the
sequence split over the cp ranks (ring / Ulysses, hpctrain/parallel/context_parallel.py) next to
the reference, plain causal SDPA of the whole sequence on one rank (cp = 1).

Run:  mpiexec -n 2 python bench/cp_attention.py [--seq 2048 8192] [--dtype fp32 bf16] [--rounds 3]

Every rank runs every kernel, alternating within each round (the machine is shared and noisy), a
barrier around each timing: the reference attends the whole sequence S on every rank at once (so
the ranks compete for the cores as the cp kernels' ranks do); the cp kernels attend S / cp per
rank. Figures are medians over rounds. Per-rank tokens/s: S / t at cp = 1, (S / cp) / t at cp; the
ratio (cp's over cp = 1's, = t_ref / (cp * t)) is the issue's bench figure (target: ring >= 0.8x
at 8k with cp = 2). `--matmul` adds the ring with its pre-fused block arithmetic (fp32 matmuls
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


def fwd_bwd_seconds(attend, q, k, v) -> float:
    """Wall time of attend(q, k, v) forward + backward of sum(out), between two barriers."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dist.barrier()
    t0 = time.perf_counter()
    attend(*leaves).sum().backward()
    dist.barrier()
    return time.perf_counter() - t0


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
              f"{args.threads} thread(s), median of {args.rounds}; ratio = per-rank tokens/s vs cp=1")
    for seq in args.seq:
        for name in args.dtype:
            times = measure(seq, DTYPES[name], args, rank, cp)
            ref = statistics.median(times["sdpa cp=1"])
            cells = [f"{kernel} {statistics.median(t) * 1e3:7.0f} ms"
                     + ("" if kernel == "sdpa cp=1" else f" {ref / (cp * statistics.median(t)):.2f}x")
                     for kernel, t in times.items()]
            if rank == 0:
                print(f"S {seq:6d} {name}: " + " | ".join(cells), flush=True)
    teardown()


if __name__ == "__main__":
    main()
