"""Activation checkpointing modes side by side (#52): peak memory and tokens/s of none,
selective_op (every block keeps its matmul and attention outputs), selective (every ac_every-th
block) and full, on one model, next to `hpctrain plan`'s peak and activations for each.

Run:  python bench/activation_checkpoint.py --config configs/llama_tiny.toml [--steps 3] \
          [--modes none,selective_op,selective,full] [--section.key=value ...]

Memory: each mode in its own process (one rank), bench/plan_memory.py's measurement (torch's CPU
allocator, live tensor bytes from the profiler's allocation records: the high bound, over 2 steps)
of a Trainer built as `train` builds it. Time: one more process builds a Trainer per mode and, after
a warm-up step each, runs `--steps` rounds of one step of every mode in turn (a shared machine's
load then falls on every mode alike); tokens/s = tokens per step / the mode's median step.
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


def memory_of(config: str, overrides: list[str]) -> dict:
    """This process: the measured and planned peak of the config as given."""
    from plan_memory import measure_profiler, predicted

    from hpctrain import config as config_mod
    from hpctrain.distributed import init_distributed, teardown

    cfg = config_mod.load(config, overrides)
    ctx = init_distributed(cfg.dist.backend, cfg.dist.timeout_s)
    plan = predicted(cfg, 1, "gloo")
    live, _ = measure_profiler(cfg, ctx, 2)
    teardown()
    return {"measured_peak": live.high, "planned_peak": plan.mem.peak,
            "planned_activations": plan.mem.parts["activations"]}


def tokens_per_s(config: str, overrides: list[str], modes: list[str], steps: int) -> dict:
    """This process: {mode: tokens/s}, the modes' steps interleaved."""
    from plan_memory import run_steps

    from hpctrain import config as config_mod
    from hpctrain.distributed import init_distributed, teardown
    from hpctrain.train.loop import Trainer

    cfgs = {m: config_mod.load(config, overrides + [f"--parallel.activation_checkpoint={m}"]) for m in modes}
    ctx = init_distributed(cfgs[modes[0]].dist.backend, cfgs[modes[0]].dist.timeout_s)
    trainers = {m: Trainer(cfg, ctx) for m, cfg in cfgs.items()}
    times = {m: [] for m in modes}
    for rnd in range(steps + 1):
        for m, trainer in trainers.items():
            start = time.perf_counter()
            run_steps(trainer, 1)
            if rnd:  # round 0: the warm-up
                times[m].append(time.perf_counter() - start)
    t, block = cfgs[modes[0]].train, cfgs[modes[0]].model.block_size
    teardown()
    return {m: t.micro_batch_size * t.grad_accum * block / statistics.median(ts) for m, ts in times.items()}


def _child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    parser.add_argument("--modes", default=MODES, help="comma-separated activation_checkpoint values")
    parser.add_argument("--child", choices=("memory", "time"), help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    modes = args.modes.split(",")
    if args.child:
        out = (memory_of(args.config, overrides) if args.child == "memory"
               else tokens_per_s(args.config, overrides, modes, args.steps))
        print(json.dumps(out))
        return 0
    from hpctrain.plan.report import fmt_bytes

    common = ["--config", args.config, "--steps", str(args.steps), "--modes", args.modes, *overrides]
    rows = {m: _child(["--child", "memory", *common, f"--parallel.activation_checkpoint={m}"]) for m in modes}
    for m, rate in _child(["--child", "time", *common]).items():
        rows[m]["tokens_per_s"] = rate
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
