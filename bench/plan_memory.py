"""Measured peak memory of real training steps next to `hpctrain plan`'s prediction (#21).

Run:  [mpiexec -n 2] python bench/plan_memory.py --config configs/demo.toml [--steps 4] \
          [--section.key=value ...]

Builds the Trainer exactly as `python -m hpctrain train` does (data, model, layout, optimizer) and
runs `--steps` train_step() calls (no validation, no checkpoint), under torch.profiler with
profile_memory. Each rank reports two measures of host memory (on a GPU the plan's figures would
be device memory; here the model lives in host memory):
- torch's CPU allocator: the highest running sum of every allocation minus every free since just
  before the Trainer was built, during setup and during the steps: tensors only, what the plan
  models (it misses numpy arrays such as the sampler's permutation);
- peak RSS (VmHWM) less VmRSS before the Trainer: also what the plan does not model: library code
  paged in on first use, oneDNN / Gloo work buffers, Python objects, and memory glibc keeps
  after a free. Rank 0 prints the
planner's figure for the same shape and layout (nodes = 1, GPUs per node = ranks).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def predicted(cfg, world: int):
    from hpctrain.plan.layout import Job
    from hpctrain.plan.report import make_plan
    from hpctrain.plan.shape import ModelShape

    m, p, t = cfg.model, cfg.parallel, cfg.train
    shape = ModelShape(m.n_layer, m.n_embd, m.n_head, m.vocab_size, m.block_size)
    job = Job(nodes=1, gpus_per_node=world, tokens=1e9, dp=p.dp, tp=p.tp, pp=p.pp,
              data_parallel=p.data_parallel, pp_schedule=p.pp_schedule,
              pp_virtual_stages=p.pp_virtual_stages, micro_batch=t.micro_batch_size,
              grad_accum=t.grad_accum, activation_checkpoint=p.activation_checkpoint,
              ac_every=p.ac_every, precision=t.precision, sync_mode=cfg.sync.mode,
              inner_steps=cfg.sync.inner_steps, overlap=cfg.sync.overlap)
    return make_plan(shape, job)


def allocator_peaks(prof, steps_start_us: float) -> tuple[int, int]:
    """(setup peak, step peak): the highest running sum of torch's CPU allocations minus frees
    (torch.profiler with profile_memory; every op's own allocations and the frees outside ops,
    in time order) before and after the steps began."""
    running, setup, step = 0, 0, 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        running += ev.self_cpu_memory_usage
        if ev.time_range.start < steps_start_us:
            setup = max(setup, running)
        else:
            step = max(step, running)
    return setup, step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=0, help="also print the N ops that allocate "
                        "most (net) during the steps on rank 0")
    args, overrides = parser.parse_known_args()
    from hpctrain import config
    from hpctrain.distributed import init_distributed, teardown
    from hpctrain.train.loop import Trainer

    cfg = config.load(args.config, overrides)
    ctx = init_distributed(cfg.dist.backend, cfg.dist.timeout_s)
    from torch.profiler import ProfilerActivity, profile, record_function

    before = vm("VmRSS")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(cfg, ctx)
        with record_function("steps"):
            for _ in range(args.steps):
                trainer.train_step()
                trainer.step += 1
    peak = vm("VmHWM") - before
    peaks = ctx.comm.gather(peak)
    mark = min(e.time_range.start for e in prof.events() if e.name == "steps")
    setup, step = allocator_peaks(prof, mark)
    allocated = ctx.comm.gather(step)
    setups = ctx.comm.gather(setup)
    if ctx.is_main:
        from hpctrain.plan.report import fmt_bytes

        if args.top:
            net = {}
            for ev in prof.events():
                if ev.time_range.start >= mark:
                    net[ev.name] = net.get(ev.name, 0) + ev.self_cpu_memory_usage
            for name, b in sorted(net.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
                print(f"  net {fmt_bytes(b):>10}  {name}")

        plan = predicted(dataclasses.replace(cfg), ctx.world_size)
        print(f"measured peak RSS - RSS before the Trainer, per rank: "
              f"{', '.join(fmt_bytes(b) for b in peaks)} ({[int(b) for b in peaks]})")
        print(f"predicted peak (pipeline rank {plan.mem.stage.pp_rank}): {fmt_bytes(plan.mem.peak)} "
              f"({plan.mem.peak}); parts: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.mem.parts.items()))
        print(f"torch CPU allocator peak in setup (Trainer built), per rank: "
              f"{', '.join(fmt_bytes(b) for b in setups)}; predicted whole fp32 model "
              f"{fmt_bytes(plan.setup['per rank (host, then GPU)'])}")
        print(f"torch CPU allocator peak in the steps (profiler), per rank: "
              f"{', '.join(fmt_bytes(b) for b in allocated)} ({[int(b) for b in allocated]})")
        print(f"RSS / predicted: {max(peaks) / plan.mem.peak:.3f}; allocator / predicted: "
              f"{max(allocated) / plan.mem.peak:.3f}")
    teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
