"""Time to a given loss: nanoGPT's CPU recipe trained to the end by hpctrain and by a torchrun + DDP loop.

Run:  python bench/recipe.py [--data data/shakespeare_bytes] [--pairs 2] [--steps 2000]
                             [--precision fp32|bf16]

The recipe (nanoGPT's `train_shakespeare_char` CPU command): byte-level GPT, 4 layers, 4 heads, 128
wide, 64-byte context, 12 sequences per step (6 per rank on 2 ranks), 2,000 steps, AdamW lr 1e-3 with
beta2 0.99, 100 warmup steps, cosine to 1e-4, clipping at 1.0, evaluation every 250 steps. Both sides
train the same GPT (hpctrain.model) on the same data with the same ranks; the baseline is
bench/ddp_baseline.py --recipe (nanoGPT's loop: rank 0 estimates train and val loss on 20 random
batches each, fp32 as nanoGPT on CPU). `--precision` sets hpctrain's precision only: the recipe's
`auto` (bf16 where this CPU computes it faster, measured at start; fp32 elsewhere), or fp32 to
compare like for like; the baseline stays what nanoGPT runs on CPU.

Each pair runs both sides back to back (the order alternates between pairs). Wall time = launch to
exit of the launcher (mpiexec / torchrun), start-up and evaluation included. Final loss = both
final models scored here by one function on every 64-byte window of the held-out validation split
(the same 1,379 windows for both), so the comparison does not depend on either side's evaluation
sample. The last line: the median ratio of walls and whether hpctrain's loss is within 0.005 of
the baseline's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

from bench.ddp_baseline import open_split  # noqa: E402
from hpctrain.export import find_checkpoint, load_model_state  # noqa: E402
from hpctrain.model import GPT, GPTConfig  # noqa: E402

MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=257)
RECIPE = dict(micro_batch=6, lr=1e-3, min_lr=1e-4, warmup=100, beta2=0.99, eval_interval=250)
TARGET_RATIO, LOSS_SLACK = 0.77, 0.005


def launch(cmd: list[str], log: Path) -> float:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    with open(log, "w") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=1800)
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"failed ({r.returncode}): {' '.join(map(str, cmd))}\n{log.read_text()[-3000:]}")
    return wall


def run_hpctrain(args, tmp: Path, tag: str) -> tuple[float, dict]:
    rundir = tmp / f"hpctrain_{tag}"
    r = RECIPE
    cmd = [str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "hpctrain", "train",
           "--config", "configs/recipe.toml", f"--run.dir={rundir}", f"--data.path={args.data}",
           f"--train.steps={args.steps}", f"--train.precision={args.precision}",
           f"--checkpoint.interval={args.steps}"]
    log = tmp / f"hpctrain_{tag}.log"
    wall = launch(cmd, log)
    start = next(line for line in log.read_text().splitlines() if line.startswith("training:"))
    args.chosen = "bf16" if ", bf16" in start else "fp32"  # what auto chose on this machine
    state, _ = load_model_state(find_checkpoint(rundir))
    return wall, state


def run_baseline(args, tmp: Path, tag: str) -> tuple[float, dict]:
    r, m = RECIPE, MODEL
    save = tmp / f"baseline_{tag}.pt"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "bench/ddp_baseline.py",
           "--recipe", "--data", args.data, "--steps", str(args.steps),
           "--n-layer", str(m["n_layer"]), "--n-head", str(m["n_head"]), "--n-embd", str(m["n_embd"]),
           "--block-size", str(m["block_size"]), "--micro-batch", str(r["micro_batch"]),
           "--lr", str(r["lr"]), "--min-lr", str(r["min_lr"]), "--warmup-iters", str(r["warmup"]),
           "--beta2", str(r["beta2"]), "--eval-interval", str(r["eval_interval"]), "--save", str(save)]
    wall = launch(cmd, tmp / f"baseline_{tag}.log")
    return wall, torch.load(save, weights_only=True)


@torch.no_grad()
def held_out_loss(state: dict, val: np.ndarray) -> float:
    """Mean next-byte loss over every non-overlapping 64-byte window of the validation split."""
    model = GPT(GPTConfig(**MODEL))
    model.load_state_dict(state)
    model.eval()
    T = MODEL["block_size"]
    n = (len(val) - 1) // T
    windows = torch.from_numpy(np.stack([val[i * T:i * T + T + 1].astype(np.int64) for i in range(n)]))
    total = 0.0
    for chunk in windows.split(256):
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
    return total / (n * T)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/shakespeare_bytes", help="byte-level dataset (make demo builds it)")
    ap.add_argument("--pairs", type=int, default=2, help="hpctrain/baseline pairs, order alternating")
    ap.add_argument("--steps", type=int, default=2000, help="recipe steps (2000 = nanoGPT's)")
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                    help="hpctrain's train.precision (the recipe's default: auto)")
    args = ap.parse_args()
    val = open_split(args.data, "val")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = ("hpctrain", "baseline") if i % 2 == 0 else ("baseline", "hpctrain")
            row = {}
            for side in order:
                wall, state = (run_hpctrain if side == "hpctrain" else run_baseline)(args, Path(tmp), str(i))
                row[side] = (wall, held_out_loss(state, val))
            rows.append(row)
            h, b = row["hpctrain"], row["baseline"]
            print(f"pair {i + 1}: hpctrain {h[0]:6.1f} s val {h[1]:.4f} | baseline {b[0]:6.1f} s val "
                  f"{b[1]:.4f} | ratio {h[0] / b[0]:.3f}", flush=True)
    ratio = statistics.median(r["hpctrain"][0] / r["baseline"][0] for r in rows)
    med = {s: (statistics.median(r[s][0] for r in rows), statistics.median(r[s][1] for r in rows))
           for s in ("hpctrain", "baseline")}
    print(json.dumps({"recipe": {**MODEL, **RECIPE, "steps": args.steps}, "precision": args.precision, "chosen": args.chosen,
                      "pairs": [{s: {"wall_s": round(r[s][0], 2), "val": round(r[s][1], 4)} for s in r}
                                for r in rows]}))
    print(f"hpctrain ({args.precision}: {args.chosen}) wall {med['hpctrain'][0]:.1f} s, val {med['hpctrain'][1]:.4f} | "
          f"torchrun+DDP (fp32) wall {med['baseline'][0]:.1f} s, val {med['baseline'][1]:.4f}")
    ok_loss = med["hpctrain"][1] <= med["baseline"][1] + LOSS_SLACK
    print(f"time to the recipe's loss: hpctrain / baseline = {ratio:.3f}x (target <= {TARGET_RATIO}x: "
          f"{'met' if ratio <= TARGET_RATIO else 'not met'}); loss within +{LOSS_SLACK}: "
          f"{'yes' if ok_loss else 'no'}")


if __name__ == "__main__":
    main()
