"""The layout search of `hpctrain plan`: which layouts of a model fit the GPUs, and how fast each is.

Owns: enumerating the layouts of a job at its global batch (tp over the divisors of the GPUs per
node, pp over the divisors of what is left, DDP or FSDP, micro-batch 1/2/4/8, activation
checkpointing none/selective/full; grad_accum follows from the batch), judging each one (`train`'s
rules via Job.check, the pipeline schedule's micro-batch rule, the peak per GPU of memory.py
against Job.usable_memory) with the reason when it is rejected, ranking those that fit by
step_time.py, the nearest fitting change to a layout that does not fit, the smallest node count
that fits when none does, and the `hpctrain train` flags of a layout. It must never format text.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hpctrain.plan import memory
from hpctrain.plan.layout import Job
from hpctrain.plan.report import fmt_bytes
from hpctrain.plan.shape import ModelShape
from hpctrain.plan.step_time import StepTime, step_time

MICRO_BATCHES = (1, 2, 4, 8)
AC_MODES = ("none", "selective", "full")
MORE_NODES_LIMIT = 16  # look for a fitting node count up to 16 x the job's


@dataclass(frozen=True)
class Candidate:
    """One layout judged: `why` says what rejects it ('' when it fits)."""
    job: Job
    fits: bool
    why: str = ""
    peak: int = 0
    setup: int = 0
    pp_rank: int = 0
    time: StepTime | None = None


def pipeline_rule(job: Job) -> str:
    """torch's 1F1B / interleaved schedules refuse fewer micro-batches than stages."""
    if job.pp > 1 and job.pp_schedule != "gpipe" and job.grad_accum < job.pp:
        return (f"pp={job.pp} ({job.pp_schedule}) needs grad_accum >= pp micro-batches per step, "
                f"got {job.grad_accum} (global batch {job.batch} / micro-batch {job.micro_batch} "
                f"/ dp {job.dp_size})")
    return ""


def evaluate(shape: ModelShape, job: Job) -> Candidate:
    """Judge one layout; a rule it breaks or the memory it lacks becomes `why`."""
    try:
        job = job.check(shape)
    except ValueError as e:
        return Candidate(job, False, str(e))
    rule = pipeline_rule(job)
    if rule:
        return Candidate(job, False, rule)
    mem = memory.largest_rank(shape, job)
    setup = memory.setup_bytes(shape, job, mem)["per rank (host, then GPU)"]
    usable, why = job.usable_memory, ""
    if mem.peak > usable:
        why = (f"peak {fmt_bytes(mem.peak)} on pipeline rank {mem.stage.pp_rank} > "
               f"{fmt_bytes(usable)} usable")
    elif setup > usable:
        why = f"setup {fmt_bytes(setup)} per rank > {fmt_bytes(usable)} usable"
    return Candidate(job, not why, why, mem.peak, setup, mem.stage.pp_rank, step_time(shape, job, mem))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(base: Job, batch: int) -> list[Job]:
    """Every layout of `base`'s cluster at `batch` sequences per step."""
    out = []
    for tp in divisors(base.gpus_per_node):
        for pp in divisors(base.world // tp):
            dp = base.world // (tp * pp)
            sharding = ("ddp", "fsdp") if dp > 1 and base.sync_mode == "sync" else ("ddp",)
            for mode in sharding:
                for mb in MICRO_BATCHES:
                    for ac in AC_MODES:
                        out.append(replace(base, dp=0, tp=tp, pp=pp, data_parallel=mode,
                                           pp_schedule="1f1b", micro_batch=mb, grad_accum=1,
                                           global_batch=batch, activation_checkpoint=ac))
    return out


def ranked(cands: list[Candidate], user: Job) -> list[Candidate]:
    """Fitting layouts fastest first (the most tokens/s: the shortest step at one global batch;
    async_diloco's replicas step at once) (ties: fewer changes to `user`'s layout, then the lower
    peak), then the rejected ones."""
    fit = sorted((c for c in cands if c.fits),
                 key=lambda c: (-c.time.tokens_per_s, len(changes(user, c.job)), c.peak))
    return fit + [c for c in cands if not c.fits]


def search(shape: ModelShape, base: Job) -> list[Candidate]:
    """Every layout at `base`'s global batch, judged and ranked."""
    checked = base.check(shape)
    return ranked([evaluate(shape, j) for j in layouts(checked, checked.batch)], checked)


def changes(user: Job, other: Job) -> list[str]:
    """What differs between two layouts, in the words of a fix."""
    out = []
    if user.data_parallel != other.data_parallel:
        out.append("add FSDP" if other.data_parallel == "fsdp" else "DDP instead of FSDP")
    out += [f"{k}={getattr(other, k)}" for k in ("tp", "pp") if getattr(user, k) != getattr(other, k)]
    if other.pp > 1 and user.pp_schedule != other.pp_schedule:
        out.append(f"pp_schedule {other.pp_schedule}")
    if user.micro_batch != other.micro_batch:
        out.append(f"micro-batch {other.micro_batch}")
    if user.activation_checkpoint != other.activation_checkpoint:
        ac = other.activation_checkpoint
        out.append("no activation checkpointing" if ac == "none" else f"activation checkpointing {ac}")
    return out


def nearest_fixes(user: Job, cands: list[Candidate], n: int = 4) -> list[tuple[list[str], Candidate]]:
    """The fitting layouts fewest changes away from `user`'s: the fastest of each kind of change
    (FSDP, tp, pp, micro-batch, checkpointing, or a mix), fewest changes first, then fastest."""
    best: dict[tuple, tuple[list[str], Candidate]] = {}
    for c in cands:  # `ranked`: the fastest of a kind comes first
        if c.fits:
            ch = changes(user, c.job)
            kind = tuple(sorted(w.split("=")[0].split(" ")[0] for w in ch))
            best.setdefault(kind, (ch, c))
    return sorted(best.values(), key=lambda fc: (len(fc[0]), fc[1].time.total))[:n]


def frugal_layouts(shape: ModelShape, base: Job) -> list[Job]:
    """The least memory per GPU each pipeline depth allows: the widest tp that divides the heads,
    FSDP (sync), micro-batch 1, full checkpointing, the fewest micro-batches a pipeline runs."""
    tp = max(t for t in divisors(base.gpus_per_node)
             if not shape.tp_problem(t))
    mode = "fsdp" if base.sync_mode == "sync" else "ddp"
    return [replace(base, dp=0, tp=tp, pp=pp, data_parallel=mode, pp_schedule="1f1b", micro_batch=1,
                    grad_accum=pp, global_batch=0, activation_checkpoint="full")
            for pp in divisors(base.world // tp) if pp <= shape.n_layer]


def smallest_fitting_nodes(shape: ModelShape, base: Job) -> Candidate | None:
    """The first node count above `base.nodes` (up to MORE_NODES_LIMIT x) where a layout fits."""
    for nodes in range(base.nodes + 1, base.nodes * MORE_NODES_LIMIT + 1):
        for job in frugal_layouts(shape, replace(base, nodes=nodes)):
            cand = evaluate(shape, job)
            if cand.fits:
                return cand
    return None


def train_flags(job: Job) -> str:
    """The `hpctrain train` config overrides (config_schema.py keys) that give this layout."""
    flags = ["--parallel.dp=0", f"--parallel.tp={job.tp}", f"--parallel.pp={job.pp}",
             f"--parallel.pp_schedule={job.pp_schedule}",
             f"--parallel.data_parallel={job.data_parallel}",
             f"--parallel.activation_checkpoint={job.activation_checkpoint}"]
    if job.activation_checkpoint == "selective":
        flags.append(f"--parallel.ac_every={job.ac_every}")
    if job.ep > 1:  # a mixture-of-experts model's experts split over ep ranks
        flags.append(f"--parallel.ep={job.ep}")
    flags += [f"--train.micro_batch_size={job.micro_batch}", "--train.grad_accum=1",
              f"--train.global_batch={job.batch}", f"--train.precision={job.precision}"]
    return " ".join(flags)
