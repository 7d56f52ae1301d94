"""Peer snapshot cost: what a snapshot (hpctrain/checkpoint/snapshot.py) adds to the step loop.

Run:  HPCTRAIN_RANKS_PER_NODE=1 mpiexec -n 2 python bench/snapshot.py [--layers 6 --width 512]
      (2 ranks as 2 pretend nodes: each snapshot is written on its node and sent to the other)

Trains bench/checkpoint.py's GPT (DDP, AdamW, random tokens) and alternates windows of K =
`--interval` steps: one that starts with a peer snapshot (stage to host memory on the step loop's
thread; DCP write to node memory, paced at `--cpu-share` like the trainer's, replication to the
buddy node, agreement and COMPLETE marker in the background while the window's steps run;
finished before the window ends, as the next snapshot would wait for it) and one without.
Prints the normal step, what the step loop paid (staging), and the extra wall time of a window
with a snapshot over one without (median of the alternating pairs) in % of the window: the cost
at snapshot_interval K, from which its default is chosen (<= 3%). Numbers go to
docs/benchmarks.md ("Peer snapshots").
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpctrain.checkpoint.snapshot import PeerSnapshots
from hpctrain.distributed import init_distributed, teardown

_spec = importlib.util.spec_from_file_location("bench_checkpoint", Path(__file__).with_name("checkpoint.py"))
bench_checkpoint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_checkpoint)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_checkpoint.add_model_shape_args(ap)
    ap.add_argument("--interval", type=int, default=10, help="K: steps per window")
    ap.add_argument("--cycles", type=int, default=3, help="pairs of windows (with, without)")
    ap.add_argument("--cpu-share", type=float, default=0.1, help="checkpoint.async_cpu_share")
    ap.add_argument("--no-checksums", action="store_true",
                    help="checkpoint.full_checksums = false: sizes only for the data files (default: "
                         "xxh3-128 of each, hashed while written, as the trainer does)")
    ap.add_argument("--dir", default=None, help="snapshot folder (default: /dev/shm/...{node})")
    ap.add_argument("--threads", type=int, default=0, help="compute threads per rank (0: torch's)")
    return ap.parse_args()


class _Whole:
    """The bench's training state as one Stateful (model + optimizer, as get_state_dict gives)."""

    def __init__(self, train):
        self.train = train

    def state_dict(self) -> dict:
        return self.train.state()


def window(train, steps: int, snaps: PeerSnapshots | None, step: int) -> tuple[float, float]:
    """(wall seconds of `steps` steps, the first preceded by a snapshot when `snaps`; the
    snapshot finished inside the window), the step loop's share (staging)."""
    dist.barrier()
    t0 = time.perf_counter()
    staged = 0.0
    if snaps is not None:
        snaps.save(step, {"bench": _Whole(train)})
        staged = snaps.last_stage_s
    for _ in range(steps):
        train.step()
    if snaps is not None:
        snaps.wait()
    dist.barrier()
    return time.perf_counter() - t0, staged


def main() -> None:
    args = parse_args()
    ctx = init_distributed("gloo", 300)
    if args.threads:
        torch.set_num_threads(args.threads)
    setting = args.dir or str(Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
                              / "hpctrain-bench-snap" / "node{node}")
    snaps = PeerSnapshots(1, setting, f"/bench-snapshot-{ctx.world_size}", ctx, cpu_share=args.cpu_share,
                          full_checksums=not args.no_checksums)
    train = bench_checkpoint.Training(args, ctx.rank, ctx.world_size)
    for _ in range(3):
        train.step()
    window(train, 1, snaps, 1)  # allocates the staging buffers, makes the group and folders
    with_s, without_s, staged, steps = [], [], [], []
    for c in range(args.cycles):
        order = (True, False) if c % 2 == 0 else (False, True)
        for snap in order:
            dt, st = window(train, args.interval, snaps if snap else None, 2 + c)
            (with_s if snap else without_s).append(dt)
            if snap:
                staged.append(st)
    step = statistics.median(without_s) / args.interval
    ratio = statistics.median(w / wo for w, wo in zip(with_s, without_s))
    if ctx.rank == 0:
        params = sum(p.numel() for p in train.model.parameters()) / 1e6
        print(f"model {params:.1f}M params, {ctx.world_size} ranks on {ctx.n_nodes} node(s), snapshots in {setting}")
        print(f"normal step              {step * 1e3:8.1f} ms  (median of {args.cycles} windows of {args.interval})")
        print(f"snapshot: step loop paid {statistics.median(staged) * 1e3:8.1f} ms  (stage to host memory)")
        print(f"snapshot_interval {args.interval}: {(ratio - 1) * 100:+.1f} % step time (median of "
              f"{args.cycles} pairs of {args.interval}-step windows with / without a snapshot; "
              f"pairs {[round(w / wo, 3) for w, wo in zip(with_s, without_s)]})")
        extra = (ratio - 1) * args.interval * step  # one snapshot's cost in seconds
        print(f"  = {extra * 1e3:.0f} ms per snapshot; at a larger K (the background ends inside "
              f"the window all the more): " + ", ".join(
                  f"K={k}: {max(extra, 0.0) / (k * step) * 100:.1f} %" for k in (25, 50, 100, 200)))
    snaps.finish()
    teardown()


if __name__ == "__main__":
    main()
