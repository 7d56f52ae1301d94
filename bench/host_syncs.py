"""Host syncs per optimizer step on each layout (#49): the ops that would stall the host on a GPU,
counted on the CPU by the trainer's own counter (HPCTRAIN_COUNT_HOST_SYNCS=1,
hpctrain/metrics/host_syncs.py) over the steady steps of a real run (mpiexec for 2 ranks).

Run:  python bench/host_syncs.py [--layouts one ddp ...] [--steps 8] [--log-interval 4] [--top 3]

Per layout: the most syncs any rank had on a step between log steps and on a log step (steps 3..N;
1-2 set things up), and the op @ file:line that had the most. The model is the layout-parity GPT
(4 blocks, 64 wide, 32 tokens; tests/helpers.py PARITY_GPT); the data: 6 Shakespeare plays as bytes.
tests/mpi/test_host_syncs.py holds the same layouts with the bound each must keep.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.helpers import PARITY_GPT  # noqa: E402

LLAMA = ["--model.arch=llama", "--model.n_kv_head=2", "--model.multiple_of=32"]
MOE = LLAMA + ["--model.moe_experts=4", "--model.moe_top_k=2"]
PP = ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=4"]
TP = ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1"]
LAYOUTS = {
    "one": (1, []),
    "ddp": (2, ["--train.grad_accum=1"]),
    "fsdp2": (2, ["--parallel.data_parallel=fsdp", "--train.grad_accum=1"]),
    "tp2": (2, TP),
    "pp2": (2, PP + ["--parallel.pp_schedule=1f1b"]),
    "diloco": (2, ["--train.grad_accum=1", "--sync.mode=diloco", "--sync.inner_steps=2"]),
    "chunked_loss": (1, ["--train.loss_chunk=16"]),
    "chunked_loss_tp2": (2, TP + ["--train.loss_chunk=16"]),
    "fp16": (2, ["--train.grad_accum=1", "--train.precision=fp16"]),
    "moe_one": (1, MOE),
    "moe_ep2": (2, MOE + ["--parallel.ep=2", "--train.grad_accum=1"]),
}


def run(args: list[str], ranks: int, env: dict | None = None) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env or {}))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    launcher = [] if ranks == 1 else ["mpiexec", "-n", str(ranks)]
    r = subprocess.run([*launcher, sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    if r.returncode:
        sys.exit(f"error: {' '.join(args[:4])} exited {r.returncode}: {r.stderr.strip()[-800:]}")


def shard(out: Path) -> None:
    from data_tools.corpora import shakespeare_files

    run(["-m", "data_tools", "shard", "--input", *map(str, sorted(shakespeare_files())[:6]),
         "--output", str(out), "--tokenizer", "bytes", "--shard-tokens", "400000",
         "--val-fraction", "0.2", "--seed", "3", "--no-progress"], 1)


def measure(work: Path, data: Path, name: str, steps: int, log_every: int) -> dict:
    ranks, overrides = LAYOUTS[name]
    run_dir, cfg = work / name, work / f"{name}.toml"
    cfg.write_text(PARITY_GPT.format(run=run_dir, data=data))
    run(["-m", "hpctrain", "train", "--config", str(cfg), f"--train.steps={steps}",
         f"--train.log_interval={log_every}", "--train.eval_interval=0", "--checkpoint.interval=1000",
         *overrides], ranks, env={"HPCTRAIN_COUNT_HOST_SYNCS": "1", "HPCTRAIN_METRICS_FLUSH_S": "3600"})
    between, at_log, ops = 0, 0, {}
    for r in range(ranks):
        per_step = json.loads((run_dir / f"host_syncs.rank{r}.json").read_text())["steps"]
        for step in range(3, steps + 1):
            counts = per_step.get(str(step), {})
            n = sum(counts.values())
            if step % log_every == 0:
                at_log = max(at_log, n)
            else:
                between = max(between, n)
            for key, k in counts.items():
                ops[key] = max(ops.get(key, 0), k)
    return {"between": between, "at_log": at_log, "ops": ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--log-interval", type=int, default=4)
    ap.add_argument("--top", type=int, default=3, help="culprits named per layout")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="host_syncs_") as tmp:
        work = Path(tmp)
        shard(work / "data")
        print(f"{'layout':<18} {'between logs':>12} {'at a log step':>13}  most frequent (op @ file:line: per step)")
        for name in a.layouts:
            m = measure(work, work / "data", name, a.steps, a.log_interval)
            top = sorted(m["ops"].items(), key=lambda kv: -kv[1])[:a.top]
            print(f"{name:<18} {m['between']:>12} {m['at_log']:>13}  "
                  f"{'; '.join(f'{k}: {n}' for k, n in top) or '-'}", flush=True)


if __name__ == "__main__":
    main()
