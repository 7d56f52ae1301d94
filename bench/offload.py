"""CPU offload side by side (#52): parallel.offload = none / optimizer / all on FSDP2, the step
time each costs on this CPU machine and the GPU bytes each frees on a fake 8-GPU layout.

Run:  python bench/offload.py --config configs/llama_tiny.toml [--steps 8] [--ranks 2] [--rounds 2] \
          [--modes none,optimizer,all] [--section.key=value ...]

Time: each mode trains `--steps` steps under `mpiexec -n RANKS` with FSDP2 (its own run dir, no
checkpoints, no evaluation); a run's figure is the median step_time_s of metrics.jsonl from step 3
on (steps 1-2 build the optimizer state); the modes run in turn for `--rounds` rounds (a shared
machine's load then falls on each alike) and each mode's fastest round is kept. On a CPU the "device" is the host, so this measures the
bookkeeping offload adds (the optimizer mode's copies into host buffers and back; the all mode's
FSDP2 CPU-offload path), not PCIe. Memory: `hpctrain train --dry-run 8 --json` of the same config
per mode (fake GPU tensors, hpctrain/train/dry_run.py): bytes per GPU and what offload keeps in
host memory instead. The losses of the runs are compared too (bit-equal: tests/mpi/test_offload.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = "none,optimizer,all"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def timed_run(config: str, mode: str, overrides: list[str], steps: int, ranks: int, tmp: Path) -> dict:
    """{median step seconds, losses} of `steps` FSDP2 steps with parallel.offload = mode."""
    run = tmp / mode
    args = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "hpctrain", "train", "--config", config,
            "--parallel.data_parallel=fsdp", f"--parallel.offload={mode}", f"--train.steps={steps}",
            "--train.log_interval=1", "--train.eval_interval=0", f"--checkpoint.interval={steps + 1}",
            f"--train.warmup_steps={min(2, steps)}",
            f"--run.dir={run}", *overrides]
    subprocess.run(args, cwd=ROOT, env=_env(), check=True, capture_output=True, text=True, timeout=600)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "loss" in r and "step_time_s" in r]
    return {"step_s": statistics.median(r["step_time_s"] for r in steps_ if r["step"] >= 3),
            "losses": [r["loss"] for r in steps_]}


def dry_run(config: str, mode: str, overrides: list[str], tmp: Path) -> dict:
    """Rank 0 of `--dry-run 8` with parallel.offload = mode (bf16, FSDP2)."""
    args = [sys.executable, "-m", "hpctrain", "train", "--config", config, "--dry-run", "8", "--json",
            "--parallel.data_parallel=fsdp", f"--parallel.offload={mode}", "--train.precision=bf16",
            f"--run.dir={tmp / ('dry_' + mode)}", *overrides]
    out = subprocess.run(args, cwd=ROOT, env=_env(), check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout)["ranks"][0]


def mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB"


def table(times: dict, dry: dict) -> str:
    base = times["none"]
    lines = ["| offload | step (CPU, median) | vs none | losses = none's | GPU: params / grads / AdamW | "
             "GPU peak | host: params / grads / AdamW |", "|---|---|---|---|---|---|---|"]
    for mode, t in times.items():
        d = dry[mode]
        host = d["in_host_memory"] or {"parameters": 0, "gradients": 0, "optimizer": 0}
        lines.append(f"| {mode} | {t['step_s'] * 1000:.1f} ms | {base['step_s'] / t['step_s']:.2f}x | "
                     f"{t['losses'] == base['losses']} | {mib(d['parameters'])} / {mib(d['gradients'])} / "
                     f"{mib(d['optimizer'])} | {mib(d['peak'])} | {mib(host['parameters'])} / "
                     f"{mib(host['gradients'])} / {mib(host['optimizer'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default=MODES)
    args, overrides = p.parse_known_args(argv)
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        rounds = [{m: timed_run(args.config, m, overrides, args.steps, args.ranks, Path(tmp) / str(r))
                   for m in modes} for r in range(args.rounds)]
        times = {m: min((rnd[m] for rnd in rounds), key=lambda t: t["step_s"]) for m in modes}
        dry = {m: dry_run(args.config, m, overrides, Path(tmp)) for m in modes}
    print(table(times, dry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
