"""Checkpoint cost: async vs sync DCP saves, next to a raw sequential write of the same bytes.

Run:  python bench/checkpoint.py [--layers 6 --width 512] [--dir /path/on/the/target/fs]
      mpiexec -n 2 python bench/checkpoint.py ...        (each rank writes its shard)

Trains our GPT (AdamW, random tokens) and prints, per rank's shard and job-wide:
  normal step          median step time without a save in flight
  async save           what the step loop paid (stage to host memory), the background write time,
                       the median step time WHILE the write is in flight, and its ratio to normal
  sync DCP save        wall time and bandwidth of CheckpointManager.save (DCP + commit + fsync)
  raw write            the same number of bytes per rank written sequentially in 16 MiB blocks +
                       fsync (dd-style), the ceiling the file system gives one writer
  load                 CheckpointManager.load (resume: COMMIT check, data checksums, DCP read)
                       of a checkpoint saved with checksums and of one saved without, alternating;
                       `load: N.NN s, checksums +P.P%` (median of the per-round ratios) and the
                       time the load waited for its checksums (hashed alongside DCP's read)
  layouts              checkpoint.layout rank vs node: sync save and load (median of alternating
                       rounds, slowest rank) and the data files each writes (`--layouts-only`:
                       this part alone; 2 ranks on one machine = one node: 1 file instead of 2)
Numbers go to docs/benchmarks.md ("Checkpoints").
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

from hpctrain.checkpoint import CheckpointManager
from hpctrain.distributed import init_distributed, teardown
from hpctrain.model import GPT, GPTConfig


def raw_write(path: Path, nbytes: int, block: int = 16 << 20) -> float:
    buf = os.urandom(min(block, nbytes))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[:min(left, len(buf))])
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


def add_model_shape_args(ap: argparse.ArgumentParser) -> None:
    """The bench model's shape options (also bench/snapshot.py's)."""
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_shape_args(ap)
    ap.add_argument("--steps", type=int, default=8, help="normal steps per window")
    ap.add_argument("--cycles", type=int, default=3,
                    help="alternations of a window of normal steps and an async save")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir in /tmp)")
    ap.add_argument("--async-cpu-share", type=float, default=0.1,
                    help="the background writer's duty cycle (checkpoint.async_cpu_share)")
    ap.add_argument("--layouts-only", action="store_true",
                    help="time only checkpoint.layout rank vs node (save and load)")
    ap.add_argument("--threads", type=int, default=0,
                    help="compute threads per rank (0 = all cores / ranks; fewer leaves cores for I/O)")
    return ap.parse_args()


class Training:
    """Our GPT under DDP (world > 1) with AdamW on random tokens: timed steps and its state."""

    def __init__(self, args, rank: int, world: int):
        torch.manual_seed(0)
        self.args = args
        self.model = GPT(GPTConfig(args.layers, max(1, args.width // 64), args.width, args.seq,
                                   args.vocab))
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model) if world > 1 else self.model
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(rank)

    def step(self) -> float:
        t0 = time.perf_counter()
        x = torch.randint(0, self.args.vocab, (self.args.batch, self.args.seq + 1), generator=self.gen)
        loss = F.cross_entropy(self.ddp(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def state(self) -> dict:
        msd, osd = get_state_dict(self.ddp, self.opt)
        return {"model": msd, "optim": osd}


def time_sync_save(mgr, train: Training, root: Path, r: int) -> tuple[float, int, int]:
    """Two sync DCP saves (the first also creates files/dirs): (the second's seconds, this
    rank's shard bytes, the checkpoint's bytes)."""
    mgr.save(1, train.state(), {"step": 1})
    dist.barrier()
    t0 = time.perf_counter()
    mgr.save(2, train.state(), {"step": 2})
    sync_s = time.perf_counter() - t0
    shard = sum(p.stat().st_size for p in (root / "step_00000002").glob(f"__{r}_*.distcp"))
    total = sum(p.stat().st_size for p in (root / "step_00000002").iterdir())
    return sync_s, shard, total


def time_load(roots: dict, train: Training, r: int, w: int, cycles: int):
    """Resume time (CheckpointManager.load into the live state) of the newest checkpoint saved
    with checksums against the one saved without, alternating which goes first each round; every
    load is the slowest rank's.  (median load with, without, median ratio, median verify share,
    rounds)."""
    mgrs = {k: CheckpointManager(v, keep=1, rank=r, world_size=w, timeout_s=300)
            for k, v in roots.items()}
    paths = {k: m.latest() for k, m in mgrs.items()}
    rows = []
    for c in range(2 * cycles + 1):  # the first round warms the page cache: dropped
        t = {}
        for k in (("summed", "plain") if c % 2 else ("plain", "summed")):
            dist.barrier()
            t0 = time.perf_counter()
            mgrs[k].load(paths[k], train.state())
            t[k] = time.perf_counter() - t0
        if c:
            rows.append([t["summed"], t["plain"], mgrs["summed"].last_verify_s])
    return paired_medians(rows) + (len(rows),)


def paired_medians(rows: list) -> tuple[float, float, float, float]:
    """rows: per round, this rank's (with, without, inside the hash) seconds.  A save or load is
    collective: its job-wide time is the slowest rank's, round by round (a max over ranks of
    per-rank medians of ratios would lean above 1 even with no difference at all).  (median
    with, without, median ratio, median share of the hash)."""
    per_round = torch.tensor(rows, dtype=torch.float64)
    dist.all_reduce(per_round, op=dist.ReduceOp.MAX)
    rows = per_round.tolist()
    with_s, without_s = (statistics.median(x[i] for x in rows) for i in (0, 1))
    return (with_s, without_s, statistics.median(x[0] / x[1] for x in rows),
            statistics.median(x[2] / x[0] for x in rows))


def time_checksums(train: Training, root: Path, r: int, w: int, cycles: int):
    """The default checksums (xxh3-128 of every byte while it is written) against none: sync
    saves alternating between the two.  (median save with, without, median ratio, median share
    of the hash, pairs)."""
    plain = CheckpointManager(root / "plain", keep=1, rank=r, world_size=w, timeout_s=300,
                              full_checksums=False)
    summed = CheckpointManager(root / "summed", keep=1, rank=r, world_size=w, timeout_s=300)
    pairs, hash_s = [], []
    for c in range(2 * cycles + 1):  # the first pair also creates the directories: dropped
        times = []
        for m in ((summed, plain) if c % 2 else (plain, summed)):
            dist.barrier()
            t0 = time.perf_counter()
            m.save(10 + c, train.state(), {"step": 10 + c})
            times.append(time.perf_counter() - t0)
            if m is summed and c:
                hash_s.append(summed.last_hash_s)
        if c:
            pairs.append(tuple(times) if c % 2 else tuple(reversed(times)))  # (summed, plain)
    return paired_medians([[s, p, h] for (s, p), h in zip(pairs, hash_s)]) + (len(pairs),)


def time_layouts(train: Training, root: Path, r: int, w: int, node: int, cycles: int) -> list[str]:
    """checkpoint.layout "rank" vs "node": per round, a sync save then a load of it with each
    layout (the order alternating); rank 0's lines: median save / load (slowest rank), files."""
    mgrs = {k: CheckpointManager(root / f"layout_{k}", keep=1, rank=r, world_size=w, timeout_s=300,
                                 layout=k, node_id=node) for k in ("rank", "node")}
    rows = {k: [] for k in mgrs}
    for c in range(2 * cycles + 1):  # the first round creates the directories: dropped
        for k in (("node", "rank") if c % 2 else ("rank", "node")):
            dist.barrier()
            t0 = time.perf_counter()
            path = mgrs[k].save(20 + c, train.state(), {"step": 20 + c})
            save_s = time.perf_counter() - t0
            dist.barrier()
            t0 = time.perf_counter()
            mgrs[k].load(path, train.state())
            if c:
                rows[k].append([save_s, time.perf_counter() - t0])
    lines = []
    for k, got in rows.items():
        per_round = torch.tensor(got, dtype=torch.float64)
        dist.all_reduce(per_round, op=dist.ReduceOp.MAX)
        save_s, load_s = (statistics.median(x[i] for x in per_round.tolist()) for i in (0, 1))
        files = len(list(mgrs[k].latest().glob("*.distcp")))
        lines.append(f"layout {k:4s}  save {save_s * 1e3:7.1f} ms  load {load_s * 1e3:7.1f} ms  "
                     f"{files} data file(s)  (median of {len(got)} alternating rounds, slowest rank)")
    return lines


def time_async(mgr, train: Training, steps: int, cycles: int):
    """Async saves while steps keep running.  The first one allocates the host staging buffers
    (page faults); the measured ones reuse them (steady state).  Windows of normal steps and of
    steps overlapping a write alternate, ``cycles`` times, so that drift of this shared machine's
    speed hits both sides alike.  Medians over all windows: (normal step, step during a write,
    what the step loop paid, the write), and the number of overlapping steps."""
    mgr.save_async(3, train.state(), {"step": 3})
    mgr.wait()
    normal_steps, during, blocked, write_s = [], [], [], []
    for c in range(cycles):
        normal_steps += [train.step() for _ in range(steps)]
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save_async(4 + c, train.state(), {"step": 4 + c})
        blocked.append(time.perf_counter() - t0)
        n0 = len(during)
        while not mgr.poll() or len(during) == n0:
            during.append(train.step())
        mgr.wait()
        write_s.append(mgr.last_write_s)
    return (statistics.median(normal_steps), statistics.median(during),
            statistics.median(blocked), statistics.median(write_s), len(during))


def report(g: torch.Tensor, args, train: Training, total: int, root: Path, w: int,
           n_during: int, n_pairs: int, n_loads: int) -> None:
    """Rank 0's lines from every rank's row (the slowest rank's times)."""
    normal, during_med, blocked, write_s, sync_s, raw_s, _, sum_s, plain_s, sum_ratio, \
        hash_share, load_s, load_plain_s, load_ratio, verify_share = g.max(0).values.tolist()
    shard_mb = g[:, 6].mean().item() / 1e6
    params = sum(p.numel() for p in train.model.parameters()) / 1e6
    print(f"model {params:.1f}M params; checkpoint {total / 1e6:.1f} MB ({w} rank(s), "
          f"{shard_mb:.1f} MB per rank shard) in {root}")
    print(f"normal step              {normal * 1e3:8.1f} ms   (median of {args.cycles} windows of "
          f"{args.steps} steps, alternating with the writes)")
    print(f"async: step loop paid    {blocked * 1e3:8.1f} ms   (stage to host memory)")
    print(f"async: background write  {write_s * 1e3:8.1f} ms   "
          f"{total / write_s / 1e6:8.1f} MB/s job-wide, {n_during / args.cycles:.0f} steps "
          f"overlap one write")
    print(f"async: step during write {during_med * 1e3:8.1f} ms   "
          f"{during_med / normal:6.2f}x a normal step")
    print(f"sync DCP save            {sync_s * 1e3:8.1f} ms   {total / sync_s / 1e6:8.1f} MB/s")
    print(f"save with checksums      {sum_s * 1e3:8.1f} ms   vs {plain_s * 1e3:.1f} ms without: "
          f"{sum_ratio:.3f}x (median of {n_pairs} alternating pairs; xxh3-128 while writing)")
    print(f"  time inside the hash     {hash_share * 100:6.2f} % of the save with checksums "
          f"(measured around every hash update, slowest rank)")
    print(f"load: {load_s:.2f} s, checksums {(load_ratio - 1) * 100:+.1f}%   (vs {load_plain_s:.2f} s "
          f"without; median of {n_loads} alternating rounds; waiting for the checksums after DCP's "
          f"read {verify_share * 100:.1f} % of the load, slowest rank)")
    print(f"raw write + fsync        {raw_s * 1e3:8.1f} ms   {total / raw_s / 1e6:8.1f} MB/s "
          f"(same bytes per rank, 16 MiB blocks)")


def main() -> None:
    args = parse_args()
    ctx = init_distributed("gloo", 300)
    if args.threads:
        torch.set_num_threads(args.threads)
    r, w = ctx.rank, ctx.world_size
    root = Path(args.dir or tempfile.gettempdir()) / f"hpctrain-bench-ckpt-{os.getppid()}"
    train = Training(args, r, w)
    for _ in range(3):
        train.step()
    layouts = time_layouts(train, root, r, w, ctx.node_rank, args.cycles)
    if r == 0:
        print("\n".join(layouts), flush=True)
    if args.layouts_only:
        finish(root, r)
        return
    mgr = CheckpointManager(root, keep=1, rank=r, world_size=w, timeout_s=300,
                            async_cpu_share=args.async_cpu_share)
    sync_s, shard, total = time_sync_save(mgr, train, root, r)
    sum_s, plain_s, sum_ratio, hash_share, n_pairs = time_checksums(train, root, r, w, args.cycles)
    # raw sequential write of this rank's shard size, all ranks at once (same contention)
    dist.barrier()
    raw_s = raw_write(root / f"raw.{r}", shard)
    normal, during_med, blocked, write_s, n_during = time_async(mgr, train, args.steps, args.cycles)
    mgr.wait()
    load_s, load_plain_s, load_ratio, verify_share, n_loads = time_load(
        {"summed": root / "summed", "plain": root / "plain"}, train, r, w, args.cycles)

    rows = torch.tensor([normal, during_med, blocked, write_s, sync_s, raw_s, shard, sum_s, plain_s,
                         sum_ratio, hash_share, load_s, load_plain_s, load_ratio, verify_share],
                        dtype=torch.float64)
    gathered = [torch.zeros_like(rows) for _ in range(w)]
    dist.all_gather(gathered, rows)
    if r == 0:
        report(torch.stack(gathered), args, train, total, root, w, n_during, n_pairs, n_loads)
    mgr.wait()
    finish(root, r)


def finish(root: Path, r: int) -> None:
    dist.barrier()
    if r == 0:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    teardown()


if __name__ == "__main__":
    main()
