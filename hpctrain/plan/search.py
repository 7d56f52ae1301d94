"""The layout search of `hpctrain plan`: which layouts of a model fit the GPUs, and how fast each is.

Owns: enumerating the layouts of a job at its global batch (tp over the divisors of the GPUs per
node, pp over the divisors of what is left, DDP or FSDP, and on more than one node HSDP (FSDP
sharded within a node, replicated across nodes: `hsdp_shard`), micro-batch 1/2/4/8, activation
checkpointing none/selective/full; grad_accum follows from the batch; context parallelism cp > 1
inside a node, ring or Ulysses, whichever is faster, searched only when the sequence binds: the
user's layout has cp, the sequence is long (attention FLOPs >= half the dense ones), or at cp = 1
nothing fits but a cp layout would, or every fitting layout recomputes all its blocks), judging
each one (`train`'s
rules via Job.check, the pipeline schedule's micro-batch rule, the peak per GPU of memory.py
against Job.usable_memory) with the reason when it is rejected, ranking those that fit by
step_time.py, the nearest fitting change to a layout that does not fit, the smallest node count
that fits when none does, and the `hpctrain train` flags of a layout. It must never format text.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hpctrain.plan import memory, offload
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
    host: int = 0  # bytes of offloaded state per rank in host memory (parallel.offload)


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
    elif mem.host:
        need, room = offload.host_need_and_room(mem.host, job)
        why = (f"offload {job.offload}: {fmt_bytes(need)} of host memory per node > {fmt_bytes(room)} "
               f"({offload.HOST_SHARE:.0%} of --node-memory)") if need > room else ""
    return Candidate(job, not why, why, mem.peak, setup, mem.stage.pp_rank, step_time(shape, job, mem),
                     mem.host)


def evaluate_cp(shape: ModelShape, job: Job) -> Candidate:
    """A cp > 1 layout with the ring, or with Ulysses where it fits (Job.check: cp divides each tp
    rank's heads) and is faster."""
    ring = evaluate(shape, replace(job, cp_attention="ring"))
    ulysses = evaluate(shape, replace(job, cp_attention="ulysses"))
    if ulysses.fits and (not ring.fits or ulysses.time.total < ring.time.total):
        return ulysses
    return ring


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_sizes(shape: ModelShape, base: Job, tp: int) -> list[int]:
    """cp > 1 for one tp: cp x tp ranks inside a node, block_size a multiple of 2 cp (sync only)."""
    return [cp for cp in divisors(base.gpus_per_node // tp)[1:]
            if shape.block_size % (2 * cp) == 0 and base.sync_mode == "sync"]


def layouts(base: Job, batch: int) -> list[Job]:
    """Every cp = 1 layout of `base`'s cluster at `batch` sequences per step."""
    return [job for tp in divisors(base.gpus_per_node) for pp in divisors(base.world // tp)
            for job in _variants(base, batch, tp, pp, 1)]


def cp_layouts(shape: ModelShape, base: Job, batch: int) -> list[Job]:
    """Every cp > 1 layout (cp x tp inside a node, no pipeline: cp runs at pp = 1)."""
    return [job for tp in divisors(base.gpus_per_node) for cp in cp_sizes(shape, base, tp)
            for job in _variants(base, batch, tp, 1, cp)]


def hsdp_shard(base: Job, tp: int, cp: int, dp: int) -> int:
    """HSDP's dp_shard for one tp x cp: the dp ranks of one node (their parameter all-gathers and
    reduce-scatters stay on its links; only the gradient shards' all-reduce crosses nodes); 0 where
    that is all of dp (one node: plain FSDP), one rank, or not a whole node."""
    shard = base.gpus_per_node // (tp * cp)
    ok = base.nodes > 1 and base.sync_mode == "sync" and shard > 1 and dp % shard == 0 and dp > shard
    return shard if ok else 0


def _variants(base: Job, batch: int, tp: int, pp: int, cp: int) -> list[Job]:
    """DDP / FSDP / HSDP x micro-batches x checkpointing modes of one tp x pp x cp."""
    dp = base.world // (tp * pp * cp)
    sharding = [("ddp", 0), ("fsdp", 0)] if dp * cp > 1 and base.sync_mode == "sync" else [("ddp", 0)]
    sharding += [("fsdp", hsdp_shard(base, tp, cp, dp))] * bool(hsdp_shard(base, tp, cp, dp))
    return [replace(base, dp=0, tp=tp, pp=pp, cp=cp, data_parallel=mode, dp_shard=shard,
                    pp_schedule="1f1b", micro_batch=mb, grad_accum=1, global_batch=batch,
                    activation_checkpoint=ac, offload=off)
            for mode, shard in sharding for mb in MICRO_BATCHES for ac in AC_MODES
            for off in OFFLOADS[mode] if off == "none" or (base.sync_mode == "sync" and cp == 1)]


OFFLOAD_MARGIN = 0.03  # an offloading layout must be 3% faster to rank above one without offload
# parallel.offload tried per data-parallel mode (cp = 1 layouts: where a sequence's activations
# bind, cp is the searched answer; --offload with --cp is still judged)
OFFLOADS = {"ddp": ("none", "optimizer"), "fsdp": ("none", "optimizer", "all")}


def paying_offload(cands: list[Candidate]) -> list[Candidate]:
    """`cands` less the offloading layouts whose twin without offload fits: offload only adds
    time (copies, AdamW on the host), so it pays only where it makes a layout fit."""
    fits = {c.job for c in cands if c.fits and c.job.offload == "none"}
    return [c for c in cands if c.job.offload == "none" or replace(c.job, offload="none") not in fits]


def paying_hsdp(cands: list[Candidate]) -> list[Candidate]:
    """`cands` less the HSDP layouts that are not faster than the same layout as FSDP over all
    of dp: HSDP shards over fewer ranks, so it never needs less memory, and where FSDP's transfers
    hide under compute it only costs memory (dominated: not listed)."""
    fsdp = {c.job: c for c in cands if c.job.data_parallel == "fsdp" and not c.job.dp_shard}

    def pays(c: Candidate) -> bool:
        twin = fsdp.get(replace(c.job, dp_shard=0))
        return c.fits and (twin is None or not twin.fits or c.time.total < twin.time.total)
    return [c for c in cands if not c.job.dp_shard or pays(c)]


def ranked(cands: list[Candidate], user: Job) -> list[Candidate]:
    """Fitting layouts fastest first (the most tokens/s: the shortest step at one global batch;
    async_diloco's replicas step at once) (ties: fewer changes to `user`'s layout, then the lower
    peak), then the rejected ones. An offloading layout ranks as if OFFLOAD_MARGIN slower: what
    its model leaves out (the host's own contention) is larger than a gain below that."""
    fit = sorted((c for c in cands if c.fits),
                 key=lambda c: (-c.time.tokens_per_s / (1 + OFFLOAD_MARGIN * (c.job.offload != "none")),
                                len(changes(user, c.job)), c.peak))
    return fit + [c for c in cands if not c.fits]


def search(shape: ModelShape, base: Job) -> list[Candidate]:
    """Every layout at `base`'s global batch, judged and ranked (cp > 1 ones when the sequence binds)."""
    checked = base.check(shape)
    judged = [evaluate(shape, j) for j in layouts(checked, checked.batch)]
    kept = {id(c) for c in paying_hsdp(judged)} & {id(c) for c in paying_offload(judged)}  # each against its twin
    cands = [c for c in judged if id(c) in kept]
    if sequence_binds(shape, checked, cands):
        cands += [evaluate_cp(shape, j) for j in cp_layouts(shape, checked, checked.batch)]
    return ranked(cands, checked)


LONG_ATTENTION_SHARE = 0.5  # a sequence is long when its attention FLOPs reach half the dense ones


def sequence_binds(shape: ModelShape, job: Job, cands: list[Candidate]) -> bool:
    """Whether cp > 1 layouts are worth searching: the user's layout has cp; or the sequence is
    long (attention's 12 L (heads x head_dim) s FLOPs per token >= LONG_ATTENTION_SHARE of the 6 N
    dense ones: s >= 3 n_embd for a dense llama or gpt2); or at cp = 1 every fitting layout
    checkpoints all its blocks (activation memory binds: cp may save the recompute); or none fits
    and a cp one of the least memory does."""
    dense = 6.0 * shape.active_params()
    if job.cp > 1 or shape.flops_per_token() - dense >= LONG_ATTENTION_SHARE * dense:
        return True
    fitting = [c for c in cands if c.fits]
    if fitting:
        return all(c.job.activation_checkpoint == "full" for c in fitting)
    return any(evaluate(shape, j).fits for j in frugal_layouts(shape, job, with_cp=True))


def changes(user: Job, other: Job) -> list[str]:
    """What differs between two layouts, in the words of a fix."""
    out = []
    if user.data_parallel != other.data_parallel:
        out.append("add FSDP" if other.data_parallel == "fsdp" else "DDP instead of FSDP")
    if user.offload != other.offload:
        out.append(f"CPU offload {other.offload}")
    if user.dp_shard != other.dp_shard and other.data_parallel == "fsdp":
        out.append(f"HSDP dp_shard={other.dp_shard}" if other.dp_shard else "FSDP over all of dp")
    out += [f"{k}={getattr(other, k)}" for k in ("tp", "pp") if getattr(user, k) != getattr(other, k)]
    if user.cp != other.cp or (other.cp > 1 and user.cp_attention != other.cp_attention):
        out.append(f"cp={other.cp}" + (f" ({other.cp_attention})" if other.cp > 1 else ""))
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


def frugal_layouts(shape: ModelShape, base: Job, with_cp: bool = False) -> list[Job]:
    """The least memory per GPU each pipeline depth allows: the widest tp that divides the heads,
    FSDP (sync), micro-batch 1, full checkpointing, the fewest micro-batches a pipeline runs;
    `with_cp`: instead each tp with the widest cp a node has room for (pp = 1)."""
    mode = "fsdp" if base.sync_mode == "sync" else "ddp"
    frugal = replace(base, dp=0, cp=1, cp_attention="ring", data_parallel=mode, dp_shard=0,
                     pp_schedule="1f1b",
                     micro_batch=1, global_batch=0, activation_checkpoint="full")
    if with_cp:
        return [replace(frugal, tp=t, pp=1, grad_accum=1, cp=max(cp_sizes(shape, base, t)))
                for t in divisors(base.gpus_per_node) if not shape.tp_problem(t) and cp_sizes(shape, base, t)]
    tp = max(t for t in divisors(base.gpus_per_node)
             if not shape.tp_problem(t))
    return [replace(frugal, tp=tp, pp=pp, grad_accum=pp)
            for pp in divisors(base.world // tp) if pp <= shape.n_layer]


def smallest_fitting_nodes(shape: ModelShape, base: Job) -> Candidate | None:
    """The first node count above `base.nodes` (up to MORE_NODES_LIMIT x) where a layout fits."""
    for nodes in range(base.nodes + 1, base.nodes * MORE_NODES_LIMIT + 1):
        more = replace(base, nodes=nodes)
        for job in frugal_layouts(shape, more) + frugal_layouts(shape, more, with_cp=True):
            cand = evaluate(shape, job)
            if cand.fits:
                return cand
    return None


def cp_activations(shape: ModelShape, job: Job) -> tuple[int, int]:
    """(activations per rank at cp 1, at the job's cp) of a cp layout, all else equal: why cp."""
    at_one = replace(job, dp=0, cp=1, cp_attention="ring")
    return (memory.largest_rank(shape, at_one).parts["activations"],
            memory.largest_rank(shape, job).parts["activations"])


def train_flags(job: Job) -> str:
    """The `hpctrain train` config overrides (config_schema.py keys) that give this layout."""
    flags = ["--parallel.dp=0", f"--parallel.tp={job.tp}", f"--parallel.pp={job.pp}",
             f"--parallel.pp_schedule={job.pp_schedule}",
             f"--parallel.data_parallel={job.data_parallel}",
             *[f"--parallel.dp_shard={job.dp_shard}"] * bool(job.dp_shard),
             *[f"--parallel.offload={job.offload}"] * (job.offload != "none"),
             f"--parallel.activation_checkpoint={job.activation_checkpoint}"]
    if job.activation_checkpoint == "selective":
        flags.append(f"--parallel.ac_every={job.ac_every}")
    if job.cp > 1:  # each sequence split over cp ranks
        flags += [f"--parallel.cp={job.cp}", f"--parallel.cp_attention={job.cp_attention}"]
    if job.ep > 1:  # a mixture-of-experts model's experts split over ep ranks
        flags.append(f"--parallel.ep={job.ep}")
    flags += [f"--train.micro_batch_size={job.micro_batch}", "--train.grad_accum=1",
              f"--train.global_batch={job.batch}", f"--train.precision={job.precision}"]
    return " ".join(flags)
