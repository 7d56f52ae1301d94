"""The advice of `hpctrain plan`: the fastest layouts that fit, the `recommended:` line with its
`hpctrain train` flags, and what would make the user's own layout fit (text and --json).

Owns the wording and units of the search's results (search.py) and the step-time model's
assumptions as printed (step_time.py): MFU, peak TFLOP/s, bandwidths, memory margin, global batch,
the token budget (--tokens). It must never judge a layout (search.py does).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace

from hpctrain.plan import search
from hpctrain.plan.layout import Job
from hpctrain.plan.report import fmt_bytes
from hpctrain.plan.shape import ModelShape

DAY = 86_400


@dataclass
class Advice:
    job: Job                                         # the user's layout (checked)
    user: search.Candidate
    ranked: list = field(default_factory=list)       # every searched layout, fitting ones first
    fixes: list = field(default_factory=list)        # (changes, Candidate) nearest to the user's
    more_nodes: search.Candidate | None = None       # when no layout fits this node count
    cp_why: str = ""                                  # the recommended layout's cp > 1: why
    hsdp_why: str = ""                                # the recommended layout's HSDP: why
    offload_why: str = ""                             # the recommended layout's CPU offload: why

    @property
    def best(self) -> search.Candidate | None:
        return self.ranked[0] if self.ranked and self.ranked[0].fits else None


def advise(shape: ModelShape, job: Job) -> Advice:
    """The search at the job's batch. A layout of another world size (a config's [parallel] for
    more nodes) is a layout that does not fit: the search runs on the job's cluster and batch."""
    problem = job.world_problem()
    checked = (replace(job, dp=0, tp=1, pp=1) if problem else job).check(shape)
    ranked = search.search(shape, checked)
    user = search.Candidate(job, False, problem) if problem else search.evaluate(shape, checked)
    advice = Advice(checked, user, ranked)
    if not user.fits:
        advice.fixes = search.nearest_fixes(user.job, ranked)
    if advice.best is None:
        advice.more_nodes = search.smallest_fitting_nodes(shape, job)
    else:
        advice.cp_why = cp_reason(shape, advice) if advice.best.job.cp > 1 else ""
        advice.hsdp_why = hsdp_reason(shape, advice.best) if advice.best.job.dp_shard else ""
        advice.offload_why = offload_reason(shape, advice) if advice.best.job.offload != "none" else ""
    return advice


def hsdp_reason(shape: ModelShape, best: search.Candidate) -> str:
    """Why the recommended layout is HSDP: its exposed data-parallel time against the same layout
    sharded over all of dp (plain FSDP), and what the smaller shard group costs in memory."""
    b = best.job
    plain = search.evaluate(shape, replace(b, dp_shard=0))
    against = (f"FSDP over all {b.grad_ranks} ranks: {fmt_seconds(plain.time.dp_exposed)} exposed, "
               f"{plain.time.tokens_per_s:,.0f} tokens/s, peak {fmt_bytes(plain.peak)}"
               if plain.fits else f"FSDP over all {b.grad_ranks} ranks: {plain.why}")
    return (f"HSDP {b.dp_replicate} x {b.dp_shard}: parameter all-gathers and gradient "
            f"reduce-scatters stay inside a node (dp_shard {b.dp_shard} = a node's dp ranks), only "
            f"the fp32 gradient shards' all-reduce crosses nodes: {fmt_seconds(best.time.dp_exposed)} "
            f"of exposed data-parallel time per step, {best.time.tokens_per_s:,.0f} tokens/s, peak "
            f"{fmt_bytes(best.peak)}; {against}")


def offload_reason(shape: ModelShape, a: Advice) -> str:
    """Why the recommended layout offloads to the CPU: the same layout without offload does not
    fit; what offload costs (host memory per node, PCIe and CPU AdamW seconds per step); and the
    fastest layout without offload, if any fits."""
    best, b = a.best, a.best.job
    plain = search.evaluate(shape, replace(b, offload="none"))
    rival = next((c for c in a.ranked if c.fits and c.job.offload == "none"), None)
    alone = (f"the fastest without offload, {rival.job.layout_name}, runs "
             f"{rival.time.tokens_per_s:,.0f} tokens/s" if rival else "no layout fits without offload")
    return (f"offload {b.offload}: without it this layout does not fit ({plain.why}); with it the "
            f"peak is {fmt_bytes(best.peak)} per GPU and each node holds "
            f"{fmt_bytes(best.host * b.gpus_per_node)} of offloaded state in host memory, at "
            f"{fmt_seconds(best.time.offload_pcie)} of exposed PCIe copies and "
            f"{fmt_seconds(best.time.offload_adam)} of AdamW on the CPU per step "
            f"({best.time.tokens_per_s:,.0f} tokens/s); {alone}")


def cp_reason(shape: ModelShape, a: Advice) -> str:
    """Why the recommended layout splits each sequence: its activations at cp 1 and at its cp, and
    the fastest cp = 1 layout that fits (if any)."""
    b = a.best.job
    at_one, at_cp = search.cp_activations(shape, b)
    plain = next((c for c in a.ranked if c.fits and c.job.cp == 1), None)
    alone = (f"the fastest at cp 1, {plain.job.layout_name}, runs {plain.time.tokens_per_s:,.0f} "
             f"tokens/s" if plain else "no layout fits at cp 1")
    return (f"cp {b.cp}: a {shape.block_size:,}-token sequence needs {fmt_bytes(at_one)} of activations "
            f"per rank at cp 1 (tp {b.tp}, micro-batch {b.micro_batch}, ac={b.activation_checkpoint}), "
            f"{fmt_bytes(at_cp)} at cp {b.cp}; {alone}; {b.cp_attention} attention "
            f"({fmt_seconds(a.best.time.cp)} of exposed cp transfers per step)")


def fmt_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def fmt_seconds(s: float) -> str:
    for unit, size in (("d", DAY), ("h", 3600), ("min", 60), ("s", 1)):
        if s >= size:
            return f"{s / size:.3g} {unit}"
    return f"{s * 1000:.3g} ms"


def candidate_dict(c: search.Candidate) -> dict:
    j, t = c.job, c.time
    out = {"layout": j.layout_name, "fits": c.fits, "why": c.why, "dp": j.dp_size, "tp": j.tp,
           "pp": j.pp, "data_parallel": j.data_parallel, **({"dp_shard": j.dp_shard} if j.dp_shard else {}),
           **({"offload": j.offload, "host_bytes_per_rank": c.host} if j.offload != "none" else {}),
           "micro_batch": j.micro_batch,
           "grad_accum": j.grad_accum, "activation_checkpoint": j.activation_checkpoint,
           "peak_bytes": c.peak, "setup_bytes": c.setup, "pp_rank": c.pp_rank}
    if j.cp > 1:
        out.update(cp=j.cp, cp_attention=j.cp_attention)
    if t is not None and j.cp > 1:
        out.update(cp_s=t.cp)
    if t is not None and j.offload != "none":
        out.update(offload_pcie_s=t.offload_pcie, offload_adam_s=t.offload_adam)
    if t is not None:
        out.update(step_s=t.total, compute_s=t.compute, tp_s=t.tp, pp_s=t.pp, bubble_s=t.bubble,
                   dp_exposed_s=t.dp_exposed, dp_total_s=t.dp_total, tokens_per_s=t.tokens_per_s,
                   tokens_per_day=t.tokens_per_s * DAY, days_to_tokens=j.tokens / t.tokens_per_s / DAY)
    return out


def assumptions(job: Job) -> dict:
    return {"mfu": job.mfu, "gpu_tflops": job.gpu_tflops, "intra_node_bw": job.intra_node_bw,
            "inter_node_bw": job.inter_node_bw, "gpu_memory": job.gpu_memory,
            "memory_margin": job.memory_margin, "usable_memory": job.usable_memory,
            "global_batch": job.batch, "tokens": job.tokens}


def as_json(a: Advice, config: str | None = None) -> dict:
    best = a.best
    return {"assumptions": assumptions(a.job), "user": candidate_dict(a.user),
            "fixes": [{"changes": ch, **candidate_dict(c)} for ch, c in a.fixes],
            "recommended": {**candidate_dict(best), "train_command": train_command(best.job, config),
                            **({"cp_why": a.cp_why} if a.cp_why else {}),
                            **({"hsdp_why": a.hsdp_why} if a.hsdp_why else {}),
                            **({"offload_why": a.offload_why} if a.offload_why else {})}
            if best else None,
            "more_nodes": {"nodes": a.more_nodes.job.nodes, **candidate_dict(a.more_nodes)}
            if a.more_nodes else None,
            "candidates": [candidate_dict(c) for c in a.ranked]}


def train_command(job: Job, config: str | None) -> str:
    return f"python -m hpctrain train --config {shlex.quote(config or 'YOUR.toml')} {search.train_flags(job)}"


def _row(c: search.Candidate, tokens: float) -> tuple:
    t = c.time
    return (c.job.layout_name, fmt_bytes(c.peak), fmt_seconds(t.total), f"{t.tokens_per_s:,.0f}",
            fmt_count(t.tokens_per_s * DAY), fmt_seconds(tokens / t.tokens_per_s))


def _user_lines(a: Advice) -> list[str]:
    u = a.user
    if u.fits:
        return [f"your layout: {u.job.layout_name} fits (peak {fmt_bytes(u.peak)}), step "
                f"{fmt_seconds(u.time.total)}, {u.time.tokens_per_s:,.0f} tokens/s"]
    lines = [f"your layout: {u.job.layout_name} does not fit: {u.why}"]
    for ch, c in a.fixes:
        lines.append(f"- fits with: {' + '.join(ch)} (peak {fmt_bytes(c.peak)}, step "
                     f"{fmt_seconds(c.time.total)}, {c.time.tokens_per_s:,.0f} tokens/s)")
    return lines


def _dp_note(b: Job) -> str:
    cp, cp_of = (" x cp", f"{b.cp} x ") if b.cp > 1 else ("", "")
    return (f"  (--parallel.dp=0: dp = world / ({cp.strip(' x ') + ' x ' if cp else ''}tp x pp), parallel.dp "
            f"of `hpctrain train --help`; {b.world} / ({cp_of}{b.tp} x {b.pp}) = {b.dp_size} here, and it "
            f"follows the world of an elastic restart on fewer nodes)")


def render(a: Advice, top: int = 5, config: str | None = None) -> str:
    j = a.job
    fit = [c for c in a.ranked if c.fits]
    lines = ["", "## Recommended layouts", "",
             f"Searched {len(a.ranked)} layouts at global batch {j.batch} sequences: {len(fit)} fit "
             f"{fmt_bytes(j.usable_memory)} usable per GPU (--gpu-memory less --memory-margin "
             f"{j.memory_margin:.0%}); --json lists every one with why it is rejected. Step time = "
             f"compute at --mfu {j.mfu:g} of --gpu-tflops {j.gpu_tflops:g} per GPU (the peak at "
             f"{j.precision}) + exposed "
             f"communication (--intra-node-bw {j.intra_node_bw / 1e9:g} GB/s, --inter-node-bw "
             f"{j.inter_node_bw / 1e9:g} GB/s per GPU) + the pipeline bubble.", ""]
    head = ("layout", "peak / GPU", "step", "tokens/s (job)", "tokens/day",
            f"time to {fmt_count(j.tokens)} tokens")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_row(c, j.tokens)) + " |" for c in fit[:top]]
    lines.append("")
    if a.best:
        b = a.best.job
        lines += [f"recommended: {b.layout_name}: {train_command(b, config)}",
                  _dp_note(b)]
        lines += [f"  ({a.cp_why})"] * bool(a.cp_why) + [f"  ({a.hsdp_why})"] * bool(a.hsdp_why)
        lines += [f"  ({a.offload_why})"] * bool(a.offload_why)
    else:
        more = a.more_nodes
        lines.append(f"nothing fits {j.nodes} x {j.gpus_per_node} GPUs of {fmt_bytes(j.gpu_memory)}: "
                     + (f"more nodes: {more.job.nodes} ({more.job.layout_name}, peak "
                        f"{fmt_bytes(more.peak)})" if more else
                        f"not within {search.MORE_NODES_LIMIT}x the nodes either"))
    return "\n".join(lines + [""] + _user_lines(a)) + "\n"
