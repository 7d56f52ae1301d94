"""Measured peak memory of real training steps next to `hpctrain plan`'s prediction (#21).

Run:  [mpiexec -n 2] python bench/plan_memory.py --config configs/demo.toml [--steps 4] \
          [--top N [--top-at low] [--top-depth 6]] [--malloc] [--section.key=value ...]

Builds the Trainer exactly as `python -m hpctrain train` does (data, model, layout, optimizer) and
runs `--steps` optimizer steps (the step engine) (no validation, no checkpoint). Each rank reports (on a GPU the
plan's figures would be device memory; here the model lives in host memory):
- torch's CPU allocator, live tensor bytes: torch.profiler with profile_memory records every
  allocation and free with its address and time; pairing them by address and summing in time order
  gives the bytes alive at each moment, from just before the Trainer is built: tensors only, what
  the plan models. Some frees are not recorded (a tensor released on a Gloo worker thread, where
  the profiler is off: the inputs Gloo's collectives clone and hold until the work is destroyed),
  so two figures bound the peak: `low` counts such a block as never allocated, `high` keeps it
  until its address is handed out again (or to the end). NOT FunctionEvent.self_cpu_memory_usage:
  torch credits each memory record to every op whose time interval contains it, on any thread, so
  a record made while a Gloo thread's `gloo:all_gather` is open is counted twice (2 ranks FSDP:
  the ops' self memory sums to 377 MiB over 3 steps, the records to 86 MiB), which made FSDP look
  2.3x and TP 1.5x the plan (docs/scale.md);
- --malloc (instead of the profiler): glibc's mallinfo2() in-use bytes, every arena and thread,
  sampled before and after every aten op (a TorchDispatchMode), less the bytes in use before the
  Trainer: independent of the profiler, but it also counts Python objects and library buffers
  (10-19 MiB here) and misses peaks inside an op;
- peak RSS (VmHWM) less VmRSS before the Trainer: also what the plan does not model: library code
  paged in on first use, oneDNN / Gloo work buffers, Python objects, and memory glibc keeps
  after a free.
Rank 0 prints the planner's figure for the same shape and layout (nodes = 1, GPUs per node =
ranks, --backend the one the run used: gloo here).
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import sys
import time


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def predicted(cfg, world: int, backend: str):
    from hpctrain.plan.layout import Job
    from hpctrain.plan.report import make_plan
    from hpctrain.plan.shape import ModelShape

    p, t = cfg.parallel, cfg.train
    shape = ModelShape.of_model_config(cfg.model)
    job = Job(nodes=1, gpus_per_node=world, tokens=1e9, dp=p.dp, tp=p.tp, pp=p.pp,
              cp=getattr(p, "cp", 1), cp_attention=getattr(p, "cp_attention", "ring"),
              data_parallel=p.data_parallel, pp_schedule=p.pp_schedule,
              pp_virtual_stages=p.pp_virtual_stages, micro_batch=t.micro_batch_size,
              grad_accum=t.grad_accum, loss_chunk=t.loss_chunk,
              activation_checkpoint=p.activation_checkpoint,
              ac_every=p.ac_every, precision=t.precision, sync_mode=cfg.sync.mode,
              inner_steps=cfg.sync.inner_steps, overlap=cfg.sync.overlap, backend=backend)
    return make_plan(shape, job)


def allocation_records(prof) -> tuple[list[tuple], int]:
    """([(time ns, address, bytes (< 0: a free), op path)], start of "steps" ns) from the profiler's
    event tree: every allocation and free it recorded, on any thread, in time order."""
    from torch._C._profiler import _EventType

    out, mark = [], None
    stack = [(n, "") for n in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, path = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            f = node.typed[1]
            out.append((node.start_time_ns, f.ptr, f.alloc_size, path))
            continue
        if node.name == "steps" and mark is None:
            mark = node.start_time_ns
        here = f"{path} > {node.name}" if path else node.name
        stack.extend((c, here) for c in node.children)
    out.sort(key=lambda r: r[0])
    return out, mark


@dataclasses.dataclass
class LivePeaks:
    setup: int = 0        # highest live bytes before the steps (high bound)
    low: int = 0          # highest live bytes in the steps, unrecorded frees' blocks not counted
    high: int = 0         # ... those blocks kept until their address is reused (or the end)
    missed: int = 0       # blocks allocated whose free was never recorded
    missed_bytes: int = 0
    at_high: dict = dataclasses.field(default_factory=dict)  # address -> (bytes, op path)
    at_low: dict = dataclasses.field(default_factory=dict)   # ... at the low peak, recorded only


def live_peaks(records, mark_ns: int) -> LivePeaks:
    """Pair allocations and frees by address and sum them in time order (see the docstring). A
    block whose address is allocated again with no free recorded in between had its free missed, as
    had one a collective allocated (a c10d:: op: Gloo's clones and temporaries, never kept) still
    allocated at the end; other blocks allocated at the end count as alive; a free of a block
    allocated before profiling began is ignored."""
    unfreed, live = set(), {}  # indices of allocations whose free was never recorded
    for i, (_, ptr, size, _) in enumerate(records):
        if size > 0:
            if ptr in live:
                unfreed.add(live[ptr])
            live[ptr] = i
        elif ptr in live:
            del live[ptr]
    unfreed |= {i for i in live.values() if "c10d::" in records[i][3]}  # collectives' buffers
    out, live, low, high = LivePeaks(), {}, 0, 0
    for i, (t, ptr, size, path) in enumerate(records):
        if size > 0:
            if ptr in live:  # its free was not recorded: it was freed before this
                old, _, missed = live.pop(ptr)
                high -= old
                low -= 0 if missed else old
            live[ptr] = (size, path, i in unfreed)
            high += size
            low += 0 if i in unfreed else size
            if i in unfreed and t >= mark_ns:
                out.missed += 1
                out.missed_bytes += size
        elif ptr in live:
            old, _, missed = live.pop(ptr)
            high -= old
            low -= 0 if missed else old
        if t < mark_ns:
            out.setup = max(out.setup, high)
        else:
            if low > out.low:
                out.low = low
                out.at_low = {a: (b, p) for a, (b, p, m) in live.items() if not m}
            if high > out.high:
                out.high = high
                out.at_high = {a: (b, p) for a, (b, p, _) in live.items()}
    return out


class _MallocInUse(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc():
    libc = ctypes.CDLL("libc.so.6")  # loaded once: 6 us a sample instead of 94
    libc.mallinfo2.restype = _MallocInUse
    return libc


def malloc_in_use() -> int:
    """glibc's bytes in use: every arena's allocated chunks + mmap'ed blocks (all threads)."""
    m = _libc().mallinfo2()
    return m.uordblks + m.hblkhd


def run_steps(trainer, steps: int) -> None:
    """`steps` optimizer steps through the trainer's step engine (at the optimizer's initial lr)."""
    for _ in range(steps):
        batches = trainer.data.next_train_micro_batches(None)
        trainer.engine.step(batches, trainer.step + 1, trainer.hparams.grad_clip, time.perf_counter())
        trainer.step += 1


def measure_profiler(cfg, ctx, steps: int) -> tuple[LivePeaks, int]:
    """(live tensor bytes from the profiler's records, peak RSS - RSS before the Trainer)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from hpctrain.train.loop import Trainer

    before = vm("VmRSS")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(cfg, ctx)
        with record_function("steps"):
            run_steps(trainer, steps)
    rss = vm("VmHWM") - before
    return live_peaks(*allocation_records(prof)), rss


def measure_malloc(cfg, ctx, steps: int) -> tuple[int, int]:
    """(malloc in use after setup, highest in the steps), both less the bytes before the Trainer;
    sampled before and after every aten op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpctrain.train.loop import Trainer

    high = [0]

    class Sample(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            high[0] = max(high[0], malloc_in_use())
            out = func(*args, **(kwargs or {}))
            high[0] = max(high[0], malloc_in_use())
            return out

    before = malloc_in_use()
    trainer = Trainer(cfg, ctx)
    setup = malloc_in_use() - before
    with Sample():
        run_steps(trainer, steps)
    return setup, high[0] - before


def top_alive(live: LivePeaks, n: int, at: str = "high", depth: int = 3) -> list[tuple[int, str]]:
    """The n op paths (last `depth` ops) with the most bytes alive at the `at` ("low": recorded
    frees only, | "high") peak."""
    by = {}
    for size, path in (live.at_low if at == "low" else live.at_high).values():
        key = " > ".join(path.split(" > ")[-depth:])
        by[key] = by.get(key, 0) + size
    return sorted(((b, k) for k, b in by.items()), reverse=True)[:n]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=0, help="also print the N op paths with the most "
                        "bytes alive at the peak on rank 0")
    parser.add_argument("--top-at", choices=("low", "high"), default="high", help="--top lists "
                        "what is alive at the low bound's peak (recorded frees only) or the high's")
    parser.add_argument("--top-depth", type=int, default=3, help="--top: ops of each path shown")
    parser.add_argument("--malloc", action="store_true", help="measure glibc's in-use bytes at "
                        "every aten op instead of the profiler's records")
    args, overrides = parser.parse_known_args()
    from hpctrain import config
    from hpctrain.distributed import init_distributed, teardown
    from hpctrain.plan.report import fmt_bytes

    cfg = config.load(args.config, overrides)
    ctx = init_distributed(cfg.dist.backend, cfg.dist.timeout_s)
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    plan = predicted(dataclasses.replace(cfg), ctx.world_size, "nccl" if backend == "nccl" else "gloo")
    pred = plan.mem.peak

    def each(x):  # every rank's figure, on rank 0
        xs = ctx.comm.gather(x)
        return ", ".join(fmt_bytes(b) for b in xs) if ctx.is_main else ""

    if args.malloc:
        setup, high = measure_malloc(cfg, ctx, args.steps)
        setups, highs = each(setup), ctx.comm.gather(high)
        if ctx.is_main:
            print(f"malloc in use after setup, per rank: {setups}")
            print(f"malloc in use, peak in the steps, per rank: "
                  f"{', '.join(fmt_bytes(b) for b in highs)}; / predicted {max(highs) / pred:.3f}")
    else:
        live, rss = measure_profiler(cfg, ctx, args.steps)
        rsss, setups, lows = each(rss), each(live.setup), each(live.low)
        highs = ctx.comm.gather(live.high)
        missed = ctx.comm.gather((live.missed, live.missed_bytes))
        tops = ctx.comm.gather(top_alive(live, args.top, args.top_at, args.top_depth))
        peaks = highs if args.top_at == "high" else ctx.comm.gather(live.low)
        if ctx.is_main:
            r = max(range(len(peaks)), key=lambda i: peaks[i])
            for b, key in tops[r]:
                print(f"  rank {r}, alive at the peak {fmt_bytes(b):>10}  {key}")
            print(f"measured peak RSS - RSS before the Trainer, per rank: {rsss}")
            print(f"torch CPU allocator, live tensor bytes in setup, per rank: {setups}; "
                  f"predicted setup {fmt_bytes(plan.setup['per rank (host, then GPU)'])}")
            print(f"frees not recorded (blocks, bytes), per rank: "
                  f"{[(m, fmt_bytes(b)) for m, b in missed]}")
            print(f"torch CPU allocator, live tensor bytes in the steps, per rank: low {lows}; "
                  f"high {', '.join(fmt_bytes(b) for b in highs)}")
            print(f"allocator (high) / predicted: {max(highs) / pred:.3f}")
    if ctx.is_main:
        print(f"predicted peak (pipeline rank {plan.mem.stage.pp_rank}): {fmt_bytes(pred)} "
              f"({pred}); parts: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.mem.parts.items()))
    teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
