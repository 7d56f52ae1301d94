"""Model FLOP utilization: achieved model FLOP/s of `hpctrain train` next to this machine's measured peak.

Run:  python bench/mfu.py [--data data/shakespeare_bytes] [--steps 12] [--threads 2]

One rank using all cores (HPCTRAIN_THREADS), fp32 then bf16, eager and with train.compile. The
FLOP count per token is GPT.flops_per_token(): 6 x non-embedding params (forward + backward
matmuls) + 12 x layers x width x context (attention scores and values), as in PaLM appendix B /
nanoGPT. The peak is a 2048^3 matmul at the same precision and thread count
(hpctrain/metrics/mfu.py), the best of several timings taken right before and right after the
training runs of that precision (this machine is shared: single timings vary by up to 30%).
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

import torch

from hpctrain.metrics.mfu import measure_peak_flops
from hpctrain.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(n_layer=4, n_head=8, n_embd=512, block_size=256, vocab_size=257)  # matmul-heavy bench model


def train_tok_s(args, precision: str, compile: bool, tmp: Path) -> float:
    run = tmp / precision
    shutil.rmtree(run, ignore_errors=True)
    overrides = [f"--model.{k}={v}" for k, v in MODEL.items()]
    cmd = [sys.executable, "-m", "hpctrain", "train", "--config", "configs/demo.toml", f"--run.dir={run}",
           f"--data.path={args.data}", *overrides, "--train.micro_batch_size=16", "--train.grad_accum=1",
           f"--train.steps={args.steps}", "--train.warmup_steps=2", f"--train.precision={precision}",
           f"--train.compile={str(compile).lower()}",
           "--train.eval_interval=0", f"--checkpoint.interval={10**6}", "--data.verify=size"]
    env = dict(os.environ, HPCTRAIN_THREADS=str(args.threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in recs if r.get("step", 0) > 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/shakespeare_bytes")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fpt = GPT(GPTConfig(**MODEL)).flops_per_token()
    print(f"model {MODEL}: {fpt / 1e6:.1f} MFLOP/token, 1 rank x {args.threads} threads")
    print(f"{'precision':<10}{'mode':<9}{'tokens/s':>10}{'achieved TFLOP/s':>18}{'peak TFLOP/s':>14}{'MFU':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            peaks = [measure_peak_flops(torch.device("cpu"), dtype, n=2048, reps=4, budget_s=None)]
            tok = {mode: train_tok_s(args, precision, mode == "compile", Path(tmp))
                   for mode in ("eager", "compile")}
            peak = max(peaks + [measure_peak_flops(torch.device("cpu"), dtype, n=2048, reps=4, budget_s=None)])
            for mode, tok_s in tok.items():
                achieved = tok_s * fpt
                print(f"{precision:<10}{mode:<9}{tok_s:>10,.0f}{achieved / 1e12:>18.3f}{peak / 1e12:>14.3f}"
                      f"{achieved / peak:>8.1%}")
    print("(target: MFU >= 60% in bf16)")

if __name__ == "__main__":
    main()
