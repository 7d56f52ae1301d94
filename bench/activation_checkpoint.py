"""Activation checkpointing modes side by side (#52): peak memory and tokens/s of none,
selective_op (every block keeps its matmul and attention outputs), selective (every ac_every-th
block) and full, on one model, next to `hpctrain plan`'s peak and activations for each.

Run:  python bench/activation_checkpoint.py --config configs/llama_tiny.toml [--steps 3] \
          [--modes none,selective_op,selective,full] [--section.key=value ...]

Each mode runs in its own process (one rank): bench/plan_memory.py's measurement (torch's CPU
allocator, live tensor bytes from the profiler's allocation records: the high bound, over 2 steps)
of a Trainer built as `train` builds it, then a fresh Trainer's `--steps` timed steps after one
warm-up step (no profiler), tokens/s = tokens per step / the median step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = "none,selective_op,selective,full"


def one_mode(config: str, overrides: list[str], steps: int) -> dict:
    """This process: the measured and planned figures of the config as given."""
    from plan_memory import measure_profiler, predicted, run_steps

    from hpctrain import config as config_mod
    from hpctrain.distributed import init_distributed, teardown
    from hpctrain.train.loop import Trainer

    cfg = config_mod.load(config, overrides)
    ctx = init_distributed(cfg.dist.backend, cfg.dist.timeout_s)
    plan = predicted(cfg, 1, "gloo")
    live, _ = measure_profiler(cfg, ctx, 2)
    trainer = Trainer(cfg, ctx)
    run_steps(trainer, 1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run_steps(trainer, 1)
        times.append(time.perf_counter() - start)
    t = cfg.train
    tokens = t.micro_batch_size * t.grad_accum * cfg.model.block_size
    teardown()
    return {"measured_peak": live.high, "planned_peak": plan.mem.peak,
            "planned_activations": plan.mem.parts["activations"],
            "tokens_per_s": tokens / statistics.median(times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    parser.add_argument("--modes", default=MODES, help="comma-separated activation_checkpoint values")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    args, overrides = parser.parse_known_args()
    if args.one:
        print(json.dumps(one_mode(args.config, overrides, args.steps)))
        return 0
    from hpctrain.plan.report import fmt_bytes

    rows = {}
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--one", "--config", args.config, "--steps", str(args.steps),
               *overrides, f"--parallel.activation_checkpoint={mode}"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
    base = rows.get("none")
    print("| activation_checkpoint | measured peak | planned peak | measured / planned | "
          "planned activations | tokens/s |" + (" vs none |" if base else ""))
    print("|---|---|---|---|---|---|" + ("---|" if base else ""))
    for mode, r in rows.items():
        line = (f"| {mode} | {fmt_bytes(r['measured_peak'])} | {fmt_bytes(r['planned_peak'])} | "
                f"{r['measured_peak'] / r['planned_peak']:.3f} | {fmt_bytes(r['planned_activations'])} | "
                f"{r['tokens_per_s']:,.0f} |")
        print(line + (f" {r['tokens_per_s'] / base['tokens_per_s']:.2f}x |" if base else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
