"""A plan's figures gathered once (`make_plan`), its warnings, and its text: Markdown tables.

Owns: which figure goes in which table, byte formatting, and the budget checks (GPU memory per
rank, host memory per node, node disk for the cache, PFS files per checkpoint, TP across nodes),
each warning one line naming the option that sets the budget. It must never compute a figure.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hpctrain.plan import async_model, comm, memory, moe, storage
from hpctrain.plan.layout import Job
from hpctrain.plan.shape import ModelShape


def fmt_bytes(n: float) -> str:
    for unit, size in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


@dataclass
class Plan:
    shape: ModelShape
    job: Job
    mem: memory.RankMemory
    setup: dict
    sampler: dict
    cache: dict
    checkpoint: dict
    comm: list
    warnings: list = field(default_factory=list)
    servers: dict = field(default_factory=dict)  # async_diloco: host bytes and bytes per arrival


def make_plan(shape: ModelShape, job: Job) -> Plan:
    shape.check()
    job = job.check(shape)
    mem = memory.largest_rank(shape, job)
    rows = comm.rows_of_rank(shape, job, mem)
    plan = Plan(shape, job, mem, memory.setup_bytes(shape, job, mem), storage.sampler_bytes(shape, job),
                storage.cache_figures(shape, job), storage.checkpoint_figures(shape, job), rows)
    if job.sync_mode == async_model.MODE:
        plan.servers = async_figures(job, mem.local_params)
    plan.warnings = check_budgets(plan)
    return plan


def async_figures(job: Job, n_part: int) -> dict:
    """async_diloco's figures of the largest part (plan/async_model.py), in report order."""
    arrival = async_model.arrival_bytes(job, n_part)
    node, where = async_model.host_per_node(job, n_part)
    return {**{f"per arrival: {k}": v for k, v in arrival.items()},
            **{f"server rank (host): {k}": v for k, v in async_model.server_bytes(job, n_part).items()},
            **{f"replica pusher (host): {k}": v for k, v in async_model.pusher_bytes(job, n_part).items()},
            f"busiest node (host): {where}": node}


def check_budgets(p: Plan) -> list[str]:
    j, out = p.job, []
    node = next((v for k, v in p.servers.items() if k.startswith("busiest node")), 0)
    if node > j.node_memory:
        where = next(k for k in p.servers if k.startswith("busiest node")).split(": ", 1)[1]
        out.append(f"async_diloco: {where} hold {fmt_bytes(node)} of host memory on one node > "
                   f"--node-memory {fmt_bytes(j.node_memory)} (more --ps-servers split the "
                   f"global model)")
    if p.mem.peak > j.usable_memory:
        out.append(f"GPU memory: peak {fmt_bytes(p.mem.peak)} on pipeline rank {p.mem.stage.pp_rank} "
                   f"> {fmt_bytes(j.usable_memory)} usable (--gpu-memory {fmt_bytes(j.gpu_memory)} "
                   f"less --memory-margin {j.memory_margin:.0%})")
    what = ("its fp32 shard + the largest whole parameter" if j.meta_init else
            "the whole fp32 model before sharding (--meta-init false)")
    setup = p.setup["per rank (host, then GPU)"]
    if setup > j.gpu_memory:
        out.append(f"setup: every rank holds {what} ({fmt_bytes(setup)}): > --gpu-memory "
                   f"{fmt_bytes(j.gpu_memory)}")
    host = p.setup["per node (host)"]
    if host > j.node_memory:
        out.append(f"setup: {j.gpus_per_node} ranks x {fmt_bytes(host // j.gpus_per_node)} = "
                   f"{fmt_bytes(host)} of host memory per node > --node-memory "
                   f"{fmt_bytes(j.node_memory)}")
    per_rank = p.sampler["per rank (peak)"]
    sampler = per_rank * j.gpus_per_node + p.sampler["node leader (cache planner copy)"]
    if sampler > 0.1 * j.node_memory:
        out.append(f"sampler: {j.gpus_per_node} ranks x {fmt_bytes(per_rank)} "
                   f"(data.shuffle = '{j.shuffle}'; + the cache planner's copy) = "
                   f"{fmt_bytes(sampler)} per node, > 10% of --node-memory "
                   f"{fmt_bytes(j.node_memory)}")
    c = p.cache
    if c["cache budget"] > j.node_disk:
        out.append(f"node cache: --cache-bytes {fmt_bytes(c['cache budget'])} > --node-disk "
                   f"{fmt_bytes(j.node_disk)}")
    if c["prefetch window bytes"] > c["cache budget"]:
        out.append(f"node cache: the prefetch window ({c['prefetch window (shards)']:.0f} shards, "
                   f"{fmt_bytes(c['prefetch window bytes'])}) does not fit --cache-bytes "
                   f"{fmt_bytes(c['cache budget'])}: steps wait for the PFS")
    elif not c["corpus fits the cache"]:
        out.append(f"node cache: the corpus ({fmt_bytes(c['corpus on disk'])}) exceeds --cache-bytes "
                   f"{fmt_bytes(c['cache budget'])}: data.shuffle = '{j.shuffle}' re-reads "
                   f"from the PFS every epoch "
                   f"({fmt_bytes(c['PFS reads, each later epoch (all nodes)'])} over all nodes)")
    if p.checkpoint["files"] > j.pfs_files_limit:
        node = (f"; checkpoint.layout = 'node' writes {p.checkpoint['files, layout node']}"
                if j.checkpoint_layout == "rank" and j.gpus_per_node > 1 else "")
        out.append(f"checkpoint: {p.checkpoint['files']} files per checkpoint in one directory "
                   f"> --pfs-files-limit {j.pfs_files_limit} (PFS metadata load){node}")
    if j.tp > j.gpus_per_node:
        out.append(f"--tp {j.tp} > --gpus-per-node {j.gpus_per_node}: TP groups span nodes")
    return out


def _table(head: tuple, rows: list) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _memory_lines(p: Plan) -> list[str]:
    m, j = p.mem, p.job
    state = m.parts["parameters (fp32)"] * 4 + m.parts.get("16-bit weight copies (autocast)", 0)
    zero = "ZeRO paper: 16 B/param (2 + 2 + 12)" + (" / dp" if j.data_parallel == "fsdp" else "")
    ours = "our model state: 4 + 4 + 8 B/param" + (" (+2 B per matmul weight, 16-bit copy)" if j.half else "")
    rows = [(k, fmt_bytes(v)) for k, v in m.parts.items()]
    rows += [("**peak (model)**", f"**{fmt_bytes(m.peak)}**"),
             ("GPU budget (--gpu-memory)", fmt_bytes(j.gpu_memory)),
             (zero, fmt_bytes(m.zero_paper)), (ours, fmt_bytes(state))]
    acts = [(k, fmt_bytes(v)) for k, v in m.activations_by_mode.items()]
    st = m.stage
    title = (f"## Memory per rank (pipeline rank {st.pp_rank}: {len(st.block_ids)} blocks, "
             f"{st.in_flight} micro-batch(es) in flight, {m.local_params:,} parameters before FSDP)")
    formula = memory.activation_formula(j.half, p.shape.llama)
    formula += f"; s = block_size / cp = {p.shape.block_size // j.cp:,}" if j.cp > 1 else ""
    note = (f"Activations by checkpointing mode ({formula}, plus the head; "
            "one block recomputed when any is checkpointed):")
    return ([title, ""] + _table(("what", "bytes"), rows) + ["", note, ""]
            + _table(("activation_checkpoint", "activations"), acts))


def _shape_name(s: ModelShape) -> str:
    """The model's one line (its family's words, model/<arch>/spec.py)."""
    return s.family.describe(s, fmt_params, len(moe.sparse_layers(s)))


def title(s: ModelShape, j: Job) -> str:
    return f"# Plan: {_shape_name(s)}; {j.nodes} nodes x {j.gpus_per_node} = {j.world} ranks\n\n"


def render(p: Plan, head: bool = True) -> str:
    """The report of the plan's layout; `head`: under its title line."""
    s, j = p.shape, p.job
    tokens_step = j.batch * s.block_size
    cp = f"cp {j.cp} ({j.cp_attention}: {s.block_size // j.cp:,} tokens of each sequence per rank) x " if j.cp > 1 else ""
    lines = [f"Layout: dp {j.dp_size} ({j.sharding}{f', ep {j.ep}' if j.ep > 1 else ''}) x {cp}tp {j.tp} x pp {j.pp} ({j.pp_schedule}), "
             f"micro_batch {j.micro_batch} x grad_accum {j.grad_accum} -> global batch "
             f"{j.batch} sequences ({tokens_step:,} tokens); activation_checkpoint "
             f"{j.activation_checkpoint}; {j.precision}; sync {j.sync_mode}"
             + (f" (inner_steps {j.inner_steps}, {j.compression})" if j.sync_mode == "diloco" else "")
             + (async_model.sync_line(j) if j.sync_mode == async_model.MODE else "")
             + f". Corpus {j.tokens:.3g} tokens: {p.sampler['windows'] // j.batch:,} steps per epoch.", ""]
    lines += _memory_lines(p)
    how = ("meta init: the rank's fp32 shard + the largest whole parameter" if p.job.meta_init else
           "--meta-init false: the whole fp32 model before sharding")
    lines += ["", f"## Setup (train/model_setup.py, {how})", ""]
    lines += _table(("where", "bytes"), [(k, fmt_bytes(v)) for k, v in p.setup.items()])
    lines += ["", "## Data: sampler and node cache", ""]
    rows = [(k, f"{v:,}" if k == "windows" else fmt_bytes(v)) for k, v in p.sampler.items()]
    for k, v in p.cache.items():
        rows.append((k, v if isinstance(v, bool) else f"{v:,.0f}" if "shards" in k else fmt_bytes(v)))
    lines += _table(("what", "value"), rows)
    lines += ["", "## Checkpoint", ""]
    lines += _table(("what", "value"), [(k, _checkpoint_value(k, v)) for k, v in p.checkpoint.items()])
    if p.checkpoint["recommended layout"] != j.checkpoint_layout:
        lines += ["", f"Recommended: --checkpoint.layout={p.checkpoint['recommended layout']} "
                      f"({p.checkpoint['files, layout node']:,} files per checkpoint instead of "
                      f"{p.checkpoint['files']:,}; from {storage.NODE_LAYOUT_FROM_RANKS} ranks)"]
    if p.servers:
        lines += ["", "## async_diloco: bytes per arrival (one part, upper bound) and host memory", ""]
        lines += _table(("what", "bytes"), [(k, fmt_bytes(v)) for k, v in p.servers.items()])
    lines += ["", "## Communication per optimizer step, sent by one rank", ""]
    lines += _table(("axis", "link", "bytes", "what"), [(a, l, fmt_bytes(b), w) for a, l, b, w in p.comm])
    lines += ["", "## Warnings", ""] + ([f"- {w}" for w in p.warnings] or ["- none: every budget holds"])
    return (title(s, j) if head else "") + "\n".join(lines) + "\n"


def _checkpoint_value(key: str, value) -> str:
    return value if isinstance(value, str) else f"{value:,}" if key.startswith("files") else fmt_bytes(value)


SUMMARY_HEAD = ("model", "nodes x GPUs", "layout", "peak / GPU", "setup / GPU", "sampler / rank",
                "ckpt files", "dp bytes / step", "first warning")


def summary_row(p: Plan) -> tuple:
    j, m = p.job, p.mem
    layout = j.layout_name
    dp = sum(b for a, _, b, _ in p.comm if a in ("dp", "dp_replicate"))  # (HSDP: both)
    return (fmt_params(p.shape.family.named_params(p.shape)), f"{j.nodes} x {j.gpus_per_node}", layout,
            fmt_bytes(m.peak), fmt_bytes(p.setup["per rank (host, then GPU)"]),
            fmt_bytes(p.sampler["per rank (kept)"]), f"{p.checkpoint['files']:,}", fmt_bytes(dp),
            p.warnings[0] if p.warnings else "-")
