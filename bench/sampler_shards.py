"""Cache behaviour of the sample orders (#21): distinct shards one node reads per N steps.

Run:  python bench/sampler_shards.py [--tokens 1e10] [--shard-tokens 1e7] [--block-size 2048]
          [--dp 64] [--micro-batch 8] [--ranks-per-node 8] [--block-shards 16] [--steps 1000]
          [--prefetch 4]

A virtual corpus (no token data: the samplers need only the windows per shard). One node's ranks
take dp ranks [0, ranks_per_node) of every global batch (sampler.split_for_rank); for each order
it prints the distinct shards the node reads in windows of N consecutive steps (mean over the
first --steps steps), what those shards weigh at 2 bytes per token, the sampler's memory
(tracemalloc peak while drawing), and the sampler's own bound (shards_between: the blocks).

Then, for the block order, the shared-file-system read rate the node cache needs so that no step
after the first block waits (shards copied per step of compute, peak over the --steps steps; the
shards of the blocks after the first, each staged once, as with two blocks in data.cache_bytes):
per-step staging may start copying a shard ``data.prefetch`` steps before the step that first
reads it; with the block look-ahead (data.prefetch_blocks = 1) it may start when the block before
the shard's block starts.  The peak over every interval [t1, t2] of steps of
(shards that may start at >= t1 and must be ready by t2) / (t2 - t1 + 1) is the rate below which
some step waits (a schedule by deadlines meets every deadline at that rate).
"--shuffle global" materializes 8 B x windows per epoch: keep --tokens small for it.
"""
from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from hpctrain.data.sampler import GlobalSampler, split_for_rank

WINDOWS_OF_STEPS = (1, 10, 100, 1000)


def virtual_shards(tokens: int, shard_tokens: int, block_size: int) -> np.ndarray:
    """Windows per shard of a corpus cut into shards of shard_tokens (the last one shorter)."""
    full, rest = divmod(tokens, shard_tokens)
    counts = [(shard_tokens - 1) // block_size] * full
    if rest > block_size:
        counts.append((rest - 1) // block_size)
    return np.asarray(counts, dtype=np.int64)


def node_shards(sampler, first_window, args, steps: int) -> list[np.ndarray]:
    """The shards the node reads at each of the first ``steps`` steps."""
    out = []
    for _ in range(steps):
        g = sampler.next_indices()
        mine = np.concatenate([split_for_rank(g, r, args.dp, args.micro_batch, 1)[0]
                               for r in range(args.ranks_per_node)])
        out.append(np.unique(np.searchsorted(first_window, mine, side="right") - 1))
    return out


def needed_rate(release: np.ndarray, deadline: np.ndarray) -> float:
    """Peak of (shards released at >= t1 with deadline <= t2) / (t2 - t1 + 1) over t1 <= t2."""
    best = 0.0
    for t1 in np.unique(release):
        due = np.sort(deadline[release >= t1])
        ends = np.unique(due)
        count = np.searchsorted(due, ends, side="right")
        best = max(best, float(np.max(count / (ends - t1 + 1))))
    return best


def stall_rates(sampler, per_step: list[np.ndarray], prefetch: int) -> tuple[float, float]:
    """Copies per step that avoid every wait after the first block (its shards are a cold start
    either way): (per-step staging, with the block look-ahead)."""
    first_read: dict[int, int] = {}
    for k, shards in enumerate(per_step):
        for s in shards.tolist():
            first_read.setdefault(s, k)
    prev_start, k, shard, deadline, ahead = None, 0, [], [], []
    while k < len(per_step):  # each block's shards: first read, the previous block's start
        a, z, block = sampler.block_steps(k)
        for s in block.tolist():
            if prev_start is not None and s in first_read and first_read[s] >= a:
                shard.append(s)
                deadline.append(first_read[s])
                ahead.append(prev_start)
        prev_start, k = a, z
    if not shard:
        return 0.0, 0.0
    deadline = np.array(deadline, dtype=np.int64)
    per_step_release = np.maximum(deadline - prefetch, 0)
    release = np.minimum(np.array(ahead, dtype=np.int64), per_step_release)
    return needed_rate(per_step_release, deadline), needed_rate(release, deadline)


def measure(shuffle: str, windows: np.ndarray, args) -> dict:
    gb = args.dp * args.micro_batch
    first_window = np.concatenate([[0], np.cumsum(windows)])
    tracemalloc.start()
    t0 = time.perf_counter()
    sampler = GlobalSampler(int(windows.sum()), gb, 1, windows, shuffle, args.block_shards)
    per_step = node_shards(sampler, first_window, args, args.steps)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    row = {"order": shuffle, "sampler peak MiB": peak / 2**20, "s per 1k steps":
           seconds * 1000 / args.steps}
    for n in WINDOWS_OF_STEPS:
        if n > args.steps:
            continue
        counts = [np.unique(np.concatenate(per_step[a:a + n])).size
                  for a in range(0, args.steps - n + 1, n)]
        row[f"shards / {n} steps"] = float(np.mean(counts))
    row["bound (blocks) / 100 steps"] = float(np.mean(
        [sampler.shards_between(a, a + 100).size for a in range(0, args.steps - 99, 100)]))
    rates = stall_rates(sampler.copy(), per_step, args.prefetch) if shuffle == "block" else ("-", "-")
    row[f"copies/step after block 0, prefetch {args.prefetch}"] = rates[0]
    row["+ block look-ahead"] = rates[1]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=1e10)
    p.add_argument("--shard-tokens", type=float, default=1e7)
    p.add_argument("--block-size", type=int, default=2048)
    p.add_argument("--dp", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--block-shards", type=int, default=16)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--shuffle", nargs="+", default=["global", "block"])
    p.add_argument("--prefetch", type=int, default=4, help="data.prefetch")
    args = p.parse_args()
    windows = virtual_shards(int(args.tokens), int(args.shard_tokens), args.block_size)
    shard_mb = args.shard_tokens * 2 / 1e6
    print(f"corpus {args.tokens:.3g} tokens, {windows.size:,} shards of {args.shard_tokens:.3g} "
          f"tokens ({shard_mb:.0f} MB), {int(windows.sum()):,} windows of {args.block_size}; "
          f"global batch {args.dp * args.micro_batch} (dp {args.dp} x {args.micro_batch}), one "
          f"node = {args.ranks_per_node} dp ranks; block = {args.block_shards} shards")
    rows = [measure(s, windows, args) for s in args.shuffle]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(v if isinstance(v, str) else f"{v:,.1f}" if v >= 10 else
                                f"{v:.2f}" for v in r.values()) + " |")


if __name__ == "__main__":
    main()
