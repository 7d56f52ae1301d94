"""Hyperparameter tuning, measured (issue #20).

Run:  python bench/tune.py [--data data/shakespeare_bytes] [--steps 300] [--ready 50] [--seed 0]
                           [--plot docs/img/pbt.png]

(a) PBT vs fixed: `tune pbt` with 4 members of 1 rank (configs/demo_tune.toml's search space:
    train.lr log-uniform [3e-4, 1e-2], warmup_steps 0..200 step 50, beta2 0.95|0.99, weight_decay
    [0, 0.2]; a smaller model, 2 layers 64 wide, block 64) against the same 4 first values trained
    to the end without exploit (`--tune.pbt.exploit=false`: the same seed draws the same values):
    equal compute, the same steps and data. Final validation loss of every member of both.
(b) Optuna vs a grid, the same number of trials (--trials, 16) on 1 rank each, `tune search`
    over train.lr log-uniform [3e-4, 3e-2] only: the grid is the trials' lr log-spaced over the
    range, trained to the end (pruner none); the search is TPE (3 random trials first) with the
    median pruner (--pruner; after 2 finished trials, from the first validation on, at --ready
    steps). S1: the training steps the search had spent (trials in order) when a trial first
    finished at or below the grid's best validation loss ("not reached": all of its steps, and
    the best it found); S2: the grid's steps. With --keep DIR the grid of an earlier run in DIR
    with the same --steps, --ready, --eval-batches and --trials is reused (it does not depend on
    --seed: its points are enqueued, not sampled).

Last two lines: `pbt best L1 vs best fixed L2` and `search steps to grid-best S1 vs grid S2`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MEMBERS = 4


def population(name: str, extra: list[str], args, tmp: Path) -> list[float]:
    """Train a population; every member's final validation loss."""
    run = tmp / name
    shutil.rmtree(run, ignore_errors=True)
    cmd = [BIN / "mpiexec", "-n", str(MEMBERS), sys.executable, "-m", "hpctrain", "tune", "pbt",
           "configs/demo_tune.toml", f"--run.dir={run}", f"--data.path={args.data}",
           "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=64", "--model.block_size=64",
           "--train.micro_batch_size=8", f"--train.steps={args.steps}", "--train.log_interval=50",
           f"--train.eval_interval={args.ready}", "--train.eval_batches=8", "--data.verify=size",
           f"--checkpoint.interval={10**6}", "--dist.heartbeat_timeout_s=0",
           f"--tune.pbt.population={MEMBERS}", f"--tune.pbt.ready={args.ready}",
           f"--tune.pbt.seed={args.seed}", *extra]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", HPCTRAIN_TENSORBOARD="0")
    # 4 ranks share the machine's cores: more threads than cores made it 13x slower here (2 vCPUs)
    env.setdefault("HPCTRAIN_THREADS", str(max(1, (os.cpu_count() or 1) // MEMBERS)))
    t0 = time.perf_counter()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=3600)
    if r.returncode:
        sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
    finals = []
    for m in range(MEMBERS):
        recs = [json.loads(line) for line in (run / f"member_{m}" / "metrics.jsonl").read_text().splitlines()]
        finals.append(next(r["val_loss"] for r in reversed(recs) if "val_loss" in r))
    print(f"{name}: {time.perf_counter() - t0:.0f}s, final val loss per member "
          f"{' '.join(f'{v:.4f}' for v in finals)}", flush=True)
    return finals


SEARCH_TOML = """
[run]
dir = "{study}"
[data]
path = "{data}"
verify = "size"
[model]
n_layer = 2
n_head = 2
n_embd = 64
block_size = 64
vocab_size = 257
[train]
steps = {steps}
micro_batch_size = 8
min_lr = 1e-4
warmup_steps = 25
beta2 = 0.99
eval_interval = {ready}
eval_batches = {eval_batches}
log_interval = 100
[checkpoint]
interval = 1000000
keep = 1
[dist]
heartbeat_timeout_s = 0
[tune]
n_trials = {trials}
pruner = "{pruner}"
seed = {seed}
prune_startup_trials = {prune_startup}
prune_warmup_steps = {warmup}
min_resource = {ready}
sampler_startup_trials = 3
[tune.params]
train.lr = {{ log_uniform = [3e-4, 3e-2] }}
"""


def study(name: str, pruner: str, grid: list | None, args, tmp: Path) -> list:
    """Run one search worker over a fresh study; its trials in number order."""
    from hpctrain.tune.search import load
    from hpctrain.tune.study import load_study, open_study

    shutil.rmtree(tmp / name, ignore_errors=True)
    cfg = tmp / f"{name}.toml"
    cfg.write_text(SEARCH_TOML.format(study=tmp / name, data=Path(args.data).resolve(), steps=args.steps,
                                      ready=args.ready, trials=args.trials, pruner=pruner,
                                      seed=args.seed, warmup=args.ready,
                                      prune_startup=args.prune_startup,
                                      eval_batches=args.eval_batches))
    _, tune, _ = load(str(cfg), [])
    for lr in grid or []:
        open_study(tune).enqueue_trial({"train.lr": lr})
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", HPCTRAIN_TENSORBOARD="0")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "hpctrain", "tune", "search", str(cfg), "--worker", name],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=7200)
    if r.returncode:
        sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
    trials = sorted(load_study(tune.journal).get_trials(deepcopy=False), key=lambda t: t.number)
    print(f"{name}: {time.perf_counter() - t0:.0f}s, " + ", ".join(
        f"lr {t.params['train.lr']:.2e} {t.state.name} {t.user_attrs.get('steps', 0)} steps"
        + (f" val {t.value:.4f}" if t.value is not None else "") for t in trials), flush=True)
    return trials


def reuse(cfg: Path, args) -> list | None:
    """The grid's trials from a --keep folder of an earlier run of the same --steps, --ready and
    --trials (the grid does not depend on --seed: its points are enqueued, not sampled)."""
    from hpctrain.tune.search import load
    from hpctrain.tune.study import load_study

    if not cfg.exists():
        return None
    train, tune, _ = load(str(cfg), [])
    t = train.train
    if (t.steps, t.eval_interval, t.eval_batches, tune.n_trials) != (args.steps, args.ready,
                                                                      args.eval_batches, args.trials):
        return None
    trials = sorted(load_study(tune.journal).get_trials(deepcopy=False), key=lambda t: t.number)
    done = [t for t in trials if t.state.name == "COMPLETE"]
    return trials if len(done) == tune.n_trials else None


def search_vs_grid(args, tmp: Path) -> tuple[str, int]:
    """(S1 as text, S2): the search's steps to the grid's best loss, the grid's steps."""
    lo, hi, n = 3e-4, 3e-2, args.trials
    grid = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    grid_trials = reuse(tmp / "grid.toml", args) or study("grid", "none", grid, args, tmp)
    best = min(t.value for t in grid_trials if t.value is not None)
    spent = 0
    trials = study("search", args.pruner, None, args, tmp)
    for t in trials:
        spent += int(t.user_attrs.get("steps", 0))
        if t.value is not None and t.value <= best:
            return str(spent), sum(int(t.user_attrs.get("steps", 0)) for t in grid_trials)
    found = min((t.value for t in trials if t.value is not None and t.state.name == "COMPLETE"),
                default=float("nan"))
    return (f"not reached ({spent} steps, best {found:.6f} vs grid-best {best:.6f})",
            sum(int(t.user_attrs.get("steps", 0)) for t in grid_trials))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/shakespeare_bytes")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ready", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", help="PNG of the PBT population (tune pbt-plot)")
    ap.add_argument("--trials", type=int, default=16, help="(b): trials of the grid and of the search")
    ap.add_argument("--pruner", choices=["median", "successive_halving"], default="median")
    ap.add_argument("--prune-startup", type=int, default=2,
                    help="(b): finished trials before the median pruner prunes")
    ap.add_argument("--eval-batches", type=int, default=8,
                    help="(b): validation batches of 8 x 64 bytes behind each reported loss")
    ap.add_argument("--part", choices=["a", "b", "ab"], default="ab")
    ap.add_argument("--keep", help="train in this folder and keep it (default: a temporary one)")
    args = ap.parse_args()
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-tune-"))
    tmp.mkdir(parents=True, exist_ok=True)
    pbt = fixed = []
    s1, s2 = "not measured", "not measured"
    try:
        if "a" in args.part:
            fixed = population("fixed", ["--tune.pbt.exploit=false"], args, tmp)
            pbt = population("pbt", [], args, tmp)
            report_lineage(tmp / "pbt", args.plot)
        if "b" in args.part:
            s1, s2 = search_vs_grid(args, tmp)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"pbt best {min(pbt):.4f} vs best fixed {min(fixed):.4f}" if pbt else
          "pbt best not measured vs best fixed not measured")
    print(f"search steps to grid-best {s1} vs grid {s2}")


def report_lineage(run: Path, plot: str | None) -> None:
    lineage = [json.loads(line) for line in (run / "lineage.jsonl").read_text().splitlines()]
    print(f"first values: {json.dumps(lineage[0]['values'])}")
    print(f"exploits: {sum(r['event'] == 'exploit' for r in lineage)}; final values: "
          f"{json.dumps(next(r for r in reversed(lineage) if r['event'] == 'round')['values'])}")
    if plot:
        from hpctrain.tune.pbt_plot import plot_population

        print(f"plot: {plot_population(run, plot)}")


if __name__ == "__main__":
    main()
