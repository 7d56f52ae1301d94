"""Asynchronous Local-SGD on an uneven cluster: one replica 2x slower, equal token budget.

Run:  python bench/async_localsgd.py [--data data/shakespeare_bytes] [--steps 240] [--plot PNG]
          [--replicas 2] [--compute-sleep 0] [--compression none|bf16|int8|int4]
          [--pull-compression same|bf16|int8|int4] [--defer-momentum-pull]
          [--async-compression same|bf16|int8|int4] [--push-error-feedback] [--async-h H] [--keep DIR]

Two replicas train the demo GPT (128 wide, block 128, 0.8M parameters) on byte-level Shakespeare;
rank 1 computes `--slow`x slower (the test fault slow_factor in HPCTRAIN_TEST_FAULTS: it sleeps
(k - 1) x its own step's compute time). Every mode trains the same number of tokens (`--steps` synchronous steps
of 2 x 8 sequences; the asynchronous modes claim 2 x --steps batches of 8 sequences):
  ddp              synchronous data parallelism (both ranks wait for the slow one every step)
  sync DiLoCo      H inner AdamW steps, then the averaged pseudo-gradient (Nesterov 0.7 / 0.5);
                   the fast replica waits for the slow one every round
  async naive      async_diloco, Nesterov applied on every arrival          (+1 server rank)
  async DN         async_diloco, delayed Nesterov (momentum once per 2 arrivals)
  async DN+DyLU    async_diloco, delayed Nesterov + dynamic local steps
  async DN+DyLU no catch-up   the same as Liu et al. publish it: a replica sees the others'
                   arrivals only at its own next arrival (sync.catch_up = false; the asynchronous
                   modes above add them to their weights at the next step)
Each run saves checkpoints at 8 points; afterwards each checkpoint's global model is scored on the
same held-out windows, giving validation loss against wall time (from launch to the checkpoint's
commit). Prints the final loss, the wall time, the bytes rank 0 moved for synchronization
(`comm_bytes`), the wall time at which each mode first reaches
synchronous DiLoCo's final loss and the seconds its checkpoint writes took (the 8 checkpoints that
draw the curves; the ratio is printed with and without them: start-up, meetings and arrivals stay in); then the equal-speed check (sync DiLoCo vs async DN+DyLU at slow 1);
last, async DN+DyLU's bytes per token over sync DiLoCo's, both as rank 0's bytes sent + received,
per token of the whole run and per token rank 0 itself trained
(sync DiLoCo's comm_bytes counts the sent half of its symmetric average; with --compression the
asynchronous modes pull the global model's change in that format too, or in --pull-compression's
(sync.pull_compression), and skip the pull of an arrival whose change is their own; with
--defer-momentum-pull the delayed-Nesterov modes also skip it on a momentum arrival, the step
owed to the next pull: sync.defer_momentum_pull).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent

from hpctrain import step_faults  # noqa: E402
from hpctrain.checkpoint import directory  # noqa: E402
from hpctrain.export import load_model_state  # noqa: E402
from hpctrain.model import build_model_from_section  # noqa: E402

ASYNC = ["--sync.mode=async_diloco", "--sync.ps_servers=1"]
SAVE_LINE = re.compile(r"checkpoint: step (\d+) -> \S+ \((\d+\.\d+)s\)")  # rank 0's log line per save


def modes(h: int, n: int = 2, compression: str = "none", pulls: str = "same",
          defer: bool = False, pushes: str = "same", feedback: bool = False,
          async_h: int = 0) -> dict[str, tuple[int, list[str]]]:
    """name -> (ranks, overrides), for n replicas; `compression`: the pseudo-gradients' wire format
    (sync DiLoCo's all-reduce, the asynchronous modes' pushes unless `pushes` says otherwise);
    `pulls`: the asynchronous modes' pulls (sync.pull_compression); `defer`:
    sync.defer_momentum_pull (delayed Nesterov); `feedback`: sync.error_feedback on their pushes;
    `async_h`: the asynchronous modes' inner steps per round (0: `h`, sync DiLoCo's)."""
    sync_wire = [f"--sync.compression={compression}"]
    wire = ([f"--sync.compression={compression if pushes == 'same' else pushes}"]
            + ([] if pulls == "same" else [f"--sync.pull_compression={pulls}"])
            + (["--sync.error_feedback=true"] if feedback else []))
    ah = async_h or h
    dn = ["--sync.outer_optimizer=delayed_nesterov"] + (["--sync.defer_momentum_pull=true"] if defer else [])
    return {
        "ddp": (n, []),
        "sync DiLoCo": (n, ["--sync.mode=diloco", f"--sync.inner_steps={h}", *sync_wire]),
        "async naive": (n + 1, ASYNC + [f"--sync.inner_steps={ah}", "--sync.outer_optimizer=nesterov", *wire]),
        "async DN": (n + 1, ASYNC + [f"--sync.inner_steps={ah}", *dn, *wire]),
        "async DN+DyLU": (n + 1, ASYNC + [f"--sync.inner_steps={ah}", *dn, "--sync.local_steps=dynamic", *wire]),
        "async DN+DyLU no catch-up": (n + 1, ASYNC + [
            f"--sync.inner_steps={ah}", *dn, "--sync.local_steps=dynamic", "--sync.catch_up=false", *wire]),
    }


def train(name: str, ranks: int, extra: list[str], args, tmp: Path, slow: float) -> dict:
    run = tmp / f"{name.replace(' ', '_').replace('+', '_')}_{slow:g}"
    shutil.rmtree(run, ignore_errors=True)
    asynchronous = name.startswith("async")
    per_step = args.replicas if asynchronous else 1  # batches of 8 vs n x 8: the same tokens
    steps, warmup = args.steps * per_step, 20 * per_step
    cmd = [BIN / "mpiexec", "-n", str(ranks), sys.executable, "-m", "hpctrain", "train",
           "--config", "configs/demo.toml", f"--run.dir={run}", f"--data.path={args.data}",
           "--model.n_embd=128", "--model.block_size=128", "--train.micro_batch_size=8",
           "--train.grad_accum=1", f"--train.steps={steps}", "--train.stop_at_step=0",
           f"--train.warmup_steps={warmup}", f"--train.seed={args.seed}", "--train.eval_interval=0",
           f"--checkpoint.interval={steps // 8}",
           "--checkpoint.keep=100", "--data.verify=size", "--data.cache_dir=off",
           "--dist.heartbeat_timeout_s=0", *extra]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", HPCTRAIN_TENSORBOARD="0",
               **step_faults.env(delay_rank=1, slow_factor=slow, compute_sleep_s=args.compute_sleep))
    if args.replicas > 2:  # more ranks than cores: one thread each
        env.setdefault("HPCTRAIN_THREADS", "1")
    t0 = time.time()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    wall = time.time() - t0
    if r.returncode:
        sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saves = {int(step): float(s) for step, s in SAVE_LINE.findall(r.stdout + r.stderr)}
    arrivals = [r for r in recs if "pushed_bytes" in r]  # rank 0's (replica 0's) arrivals
    return {"run": run, "t0": t0, "wall_s": wall, "moved": max((r.get("comm_bytes", 0) for r in recs), default=0),
            "batches": sum("loss" in r for r in recs),  # rank 0's: every step (sync), its claims (async)
            "arrivals": len(arrivals), "saves": saves, "pushed": sum(r["pushed_bytes"] for r in arrivals),
            "pulled": sum(r["pulled_bytes"] for r in arrivals)}


@torch.no_grad()
def score(run: Path, t0: float, val: torch.Tensor) -> list[tuple[float, float, int]]:
    """[(seconds from launch to the checkpoint's commit, held-out loss of its global model, step)]."""
    out = []
    for info in directory.list_checkpoints(run / "checkpoints"):
        if info.status != "committed":
            continue
        state, model_cfg = load_model_state(info.path)
        model = build_model_from_section(model_cfg)
        model.load_state_dict(state)
        model.eval()
        total = sum(F.cross_entropy(model(c[:, :-1]).flatten(0, 1), c[:, 1:].flatten(), reduction="sum").item()
                    for c in val.split(128))
        when = json.loads((info.path / "COMMIT.json").read_text())["unix_time"] - t0
        out.append((when, total / (val.shape[0] * (val.shape[1] - 1)), info.step))
    return sorted(out)


def without_saves(scored: list[tuple[float, float, int]], saves: dict[int, float]) -> list[tuple[float, float]]:
    """The curve with the time of the checkpoint writes so far taken out of each point: what the
    run would have taken without the 8 checkpoints the bench writes to draw its curve (a real run
    writes one every ~30 minutes), the same for every mode; start-up, meetings and arrivals stay."""
    return [(t - sum(s for k, s in saves.items() if k <= step), loss) for t, loss, step in scored]


def held_out(data: str, windows: int, block: int = 128) -> torch.Tensor:
    from hpctrain.data import open_split

    val = open_split(data, "val", block)
    idx = np.linspace(0, len(val) - 1, windows).astype(np.int64)
    return torch.as_tensor(val.batch(idx), dtype=torch.long)


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """Wall time at which the curve first reaches `target` (linear between checkpoints)."""
    prev = None
    for t, loss in curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return t
            (t_a, l_a) = prev
            return t_a + (t - t_a) * (l_a - target) / (l_a - loss)
        prev = (t, loss)
    return None


def reach_ratio(curves: dict, target: float) -> float:
    """Time to `target` of async DN+DyLU over sync DiLoCo's (inf: async never reached it)."""
    reach = time_to(curves["async DN+DyLU"], target)
    return reach / time_to(curves["sync DiLoCo"], target) if reach is not None else float("inf")


def plot(curves: dict, path: Path, slow: float, replicas: int = 2) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, curve in curves.items():
        ax.plot([t for t, _ in curve], [v for _, v in curve], marker="o", ms=3, label=name)
    ax.set_xlabel("wall time from launch (s)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(f"{replicas} replicas, one {slow:g}x slower, equal tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/shakespeare_bytes", help="byte-level dataset (make demo builds it)")
    ap.add_argument("--steps", type=int, default=240, help="synchronous steps of 2 x 8 sequences (token budget)")
    ap.add_argument("--h", type=int, default=16, help="inner steps per round (the fastest replica's)")
    ap.add_argument("--async-h", type=int, default=0,
                    help="the asynchronous modes' inner steps per round (0: --h): an asynchronous replica "
                         "may spend the bytes its cheaper wire format saves on more frequent arrivals")
    ap.add_argument("--slow", type=float, default=2.0, help="how many times slower rank 1 computes")
    ap.add_argument("--windows", type=int, default=512, help="held-out windows scored per checkpoint")
    ap.add_argument("--only", nargs="*", help="run only these modes (names as printed)")
    ap.add_argument("--plot", default="", help="write loss against wall time to this PNG")
    ap.add_argument("--no-equal-speed", action="store_true", help="skip the equal-speed check")
    ap.add_argument("--replicas", type=int, default=2, help="replicas (rank 1 is the slow one)")
    ap.add_argument("--seed", type=int, default=1337, help="train.seed: init and data order")
    ap.add_argument("--compression", default="none", choices=["none", "bf16", "int8", "int4"],
                    help="pseudo-gradient wire format of sync DiLoCo and the asynchronous modes")
    ap.add_argument("--pull-compression", default="same", choices=["same", "bf16", "int8", "int4"],
                    help="the asynchronous modes' pulls (sync.pull_compression; same = --compression)")
    ap.add_argument("--async-compression", default="same", choices=["same", "bf16", "int8", "int4"],
                    help="the asynchronous modes' pushes (same = --compression, which stays sync DiLoCo's)")
    ap.add_argument("--push-error-feedback", action="store_true",
                    help="sync.error_feedback on the asynchronous modes' int8 / int4 pushes")
    ap.add_argument("--defer-momentum-pull", action="store_true",
                    help="sync.defer_momentum_pull in the delayed-Nesterov modes (needs --compression)")
    ap.add_argument("--keep", default="",
                    help="keep the runs (run dirs, metrics.jsonl, checkpoints) in this folder instead of a temporary one")
    ap.add_argument("--compute-sleep", type=float, default=0.0,
                    help="seconds every step sleeps as stand-in accelerator time (compute_sleep_s fault): "
                         "with many replicas on few cores, keeps the CPU from being what times them")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    val = held_out(args.data, args.windows)
    curves, walls, moved, split, net = {}, {}, {}, {}, {}
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory()) as tmp:
        wire = (args.compression, args.pull_compression, args.defer_momentum_pull, args.async_compression,
                args.push_error_feedback, args.async_h)
        for name, (ranks, extra) in modes(args.h, args.replicas, *wire).items():
            if args.only and name not in args.only:
                continue
            res = train(name, ranks, extra, args, Path(tmp), args.slow)
            scored = score(res["run"], res["t0"], val)
            curves[name], walls[name], moved[name] = [(t, v) for t, v, _ in scored], res["wall_s"], res["moved"]
            net[name] = without_saves(scored, res["saves"])
            split[name] = res
            print(f"  done {name} in {res['wall_s']:.0f}s", file=sys.stderr, flush=True)
        equal = {}
        if not args.no_equal_speed:
            for name in ("sync DiLoCo", "async DN+DyLU"):
                ranks, extra = modes(args.h, args.replicas, *wire)[name]
                res = train(name, ranks, extra, args, Path(tmp), 1.0)
                equal[name] = score(res["run"], res["t0"], val)[-1][1]
    target = curves["sync DiLoCo"][-1][1] if "sync DiLoCo" in curves else None
    print(f"{'mode':<26} {'final loss':>10} {'wall s':>8} {'rank 0 MB':>10} {'s to sync-DiLoCo loss':>22} "
          f"{'checkpoint writes s':>20}")
    for name, curve in curves.items():
        reach = time_to(curve, target) if target is not None else None
        print(f"{name:<26} {curve[-1][1]:>10.4f} {walls[name]:>8.1f} {moved[name] / 1e6:>10.1f} "
              f"{f'{reach:.1f}' if reach is not None else 'not reached':>22} "
              f"{sum(split[name]['saves'].values()):>20.1f}")
    if equal:
        a, b = equal["async DN+DyLU"], equal["sync DiLoCo"]
        print(f"equal speeds: async DN+DyLU {a:.4f} vs sync DiLoCo {b:.4f} ({(a / b - 1) * 100:+.1f}%, target within 2%)")
    if args.plot:
        plot(curves, Path(args.plot), args.slow, args.replicas)
        print(f"curves: {args.plot}")
    if target is not None and "async DN+DyLU" in curves:
        print(f"time to sync-DiLoCo loss, async+DN+DyLU / sync DiLoCo: {reach_ratio(curves, target):.2f}x")
        print(f"  the same without the bench's checkpoint writes "
              f"({len(split['async DN+DyLU']['saves'])} per mode): {reach_ratio(net, target):.2f}x")
    for name in (n for n in split if split[n]["arrivals"]):
        res = split[name]
        print(f"{name}, rank 0: {res['arrivals']} arrivals, pushed {res['pushed'] / 1e6:.1f} MB, "
              f"pulled {res['pulled'] / 1e6:.1f} MB (catch-ups included); per arrival "
              f"{res['pushed'] / res['arrivals'] / 1e3:.0f} + {res['pulled'] / res['arrivals'] / 1e3:.0f} kB")
    if "sync DiLoCo" in moved and "async DN+DyLU" in moved and moved["sync DiLoCo"]:
        # every mode trains the same tokens, so rank 0's bytes per token compare as its bytes.
        # Like with like: sync DiLoCo's comm_bytes is what rank 0 sends, and its average (ring or
        # two-phase) receives exactly as much; an asynchronous replica's counts its pushes and pulls
        # the arrival records' pushes + pulls: comm_bytes misses the final meeting's arrival
        res = split["async DN+DyLU"]
        mine = res["pushed"] + res["pulled"] if res["arrivals"] else moved["async DN+DyLU"]
        print(f"async DN+DyLU bytes per token / sync DiLoCo: "
              f"{mine / (2 * moved['sync DiLoCo']):.2f}x (sent + received by rank 0)")
        # per token rank 0 itself trained (the fast replica trains ~2/3 of them, a sync rank 1/2)
        per_own = (mine / res["batches"]) / (2 * moved["sync DiLoCo"] / split["sync DiLoCo"]["batches"])
        print(f"async DN+DyLU bytes per token rank 0 trained / sync DiLoCo: {per_own:.2f}x "
              f"({res['batches']} vs {split['sync DiLoCo']['batches']} batches of 8 sequences)")


if __name__ == "__main__":
    main()
