"""Training throughput: `hpctrain train` next to a plain torchrun + DDP script (bench/ddp_baseline.py).

Run:  python bench/train.py [--data data/shakespeare_bytes] [--steps 30] [--rounds 4]
                            [--precision fp32|bf16] [--compile]

Every side: the same GPT, batch, precision and 2 ranks on this machine; each reports the median
tokens/s of its timed steps (compilation happens before them). Variants run in turn in every round
so drifting machine load hits all alike; the ratio is taken within each round (runs a minute
apart) and the median over rounds is reported:
  hpctrain train, defaults (eager)           torchrun + DDP baseline, eager (PyTorch's DDP tutorial)
and with --compile also
  hpctrain train, train.compile = true       torchrun + DDP baseline, torch.compile (nanoGPT)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(cmd, env=None) -> str:
    e = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {}))
    r = subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=ROOT, timeout=900)
    if r.returncode:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{r.stderr[-3000:]}")
    return r.stdout


# The models compared: (hpctrain overrides, baseline flags).  "demo" is the 0.8M-parameter model
# the demo used until issue 17 (configs/demo.toml with 128 wide, 256 context: 16 x 256 tokens per
# rank per step, matmul-bound; the baseline's defaults), pinned so docs/benchmarks.md stays comparable; "wide" is bench/mfu.py's
# 4 x 512 GPT (12.7M parameters) with 2 x 256 tokens per rank per step — the small per-device
# batch of a model near its memory limit, where the optimizer step and the gradient all-reduce
# are a real share of the step.
MODELS = {
    "demo": (["--model.n_embd=128", "--model.block_size=256", "--train.micro_batch_size=16"], []),
    "wide": (["--model.n_embd=512", "--model.n_head=8", "--train.micro_batch_size=2"],
             ["--n-embd", "512", "--n-head", "8", "--micro-batch", "2"]),
}


def ours(args, tmp: Path, compile: bool) -> float:
    rundir = tmp / "run"
    shutil.rmtree(rundir, ignore_errors=True)
    run([BIN / "mpiexec", "-n", str(args.ranks), sys.executable, "-m", "hpctrain", "train",
         "--config", "configs/demo.toml", *MODELS[args.model][0], f"--run.dir={rundir}",
         f"--data.path={args.data}",
         f"--train.steps={args.steps + 5}", "--train.warmup_steps=2", f"--train.precision={args.precision}",
         "--train.eval_interval=0", f"--checkpoint.interval={10**6}", "--data.verify=size",
         f"--train.compile={str(compile).lower()}"])
    recs = [json.loads(l) for l in (rundir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in recs if r.get("step", 0) > 5)


def baseline(args, compile: bool) -> float:
    out = run([BIN / "torchrun", "--standalone", f"--nproc_per_node={args.ranks}", "bench/ddp_baseline.py",
               "--data", args.data, "--steps", str(args.steps), "--precision", args.precision,
               *MODELS[args.model][1], *(["--compile"] if compile else [])])
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/shakespeare_bytes", help="byte-level dataset (make demo builds it)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=4, help="A/B rounds")
    ap.add_argument("--compile", action="store_true", help="also compare both sides under torch.compile")
    ap.add_argument("--model", default="demo", choices=sorted(MODELS), help="which model and batch (see MODELS)")
    args = ap.parse_args()
    names = {"ours": "hpctrain train, eager", "base": "torchrun + DDP, eager"}
    if args.compile:
        names |= {"ours_compiled": "hpctrain train, compile", "base_compiled": "torchrun + DDP, compile"}
    runs: dict[str, list[float]] = {k: [] for k in names}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for k in names:
                compiled = k.endswith("_compiled")
                runs[k].append(ours(args, Path(tmp), compiled) if k.startswith("ours")
                               else baseline(args, compiled))

    def ratio(a, b):  # median over rounds of the within-round ratio
        return statistics.median(x / y for x, y in zip(runs[a], runs[b]))

    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"model {args.model}: {' '.join(MODELS[args.model][0]) or 'configs/demo.toml'}, {args.ranks} ranks, {args.precision}, {args.steps} timed steps x "
          f"{args.rounds} rounds")
    for k, name in names.items():
        print(f"{name:<28}{med[k]:>10,.0f} tokens/s  {ratio(k, 'base'):>5.2f}x eager baseline   "
              f"runs: {', '.join(f'{x:,.0f}' for x in runs[k])}")
    print(f"ratio hpctrain / baseline (both defaults, eager)   {ratio('ours', 'base'):.2f}x   (target >= 1.05x)")
    print("  per round: " + " ".join(f"{x / y:.2f}" for x, y in zip(runs["ours"], runs["base"])))
    if args.compile:
        print(f"ratio hpctrain (compile) / compiled baseline      {ratio('ours_compiled', 'base_compiled'):.2f}x")


if __name__ == "__main__":
    main()
