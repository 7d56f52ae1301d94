"""The dry run's report: per rank, what it holds (parameters, gradients, optimizer state, the
step's peak) beside what `hpctrain plan` predicts for the same rank, as a table or JSON.

Owns: the planner's figures for a dry-run rank (plan/memory.py on the config's job at that world
size: the same pipeline stage) and the formatting. It must never run a step (train/dry_run.py
does) nor compute bytes of its own.
"""
from __future__ import annotations

import dataclasses

from hpctrain.config import Config
from hpctrain.plan.layout import Job
from hpctrain.plan.memory import pipeline_stages, rank_memory
from hpctrain.plan.report import fmt_bytes
from hpctrain.plan.shape import ModelShape
from hpctrain.train.dry_run import GPUS_PER_NODE, RankBytes

PLANNER_PRECISION = {"auto": "bf16", "fp8": "bf16"}  # fp8: bf16 activations and parameters
ROWS = (("parameters", "parameters (fp32)"), ("gradients", "gradients (fp32)"),
        ("optimizer", "AdamW m, v (fp32)"))


def planner_job(cfg: Config, world: int, grad_accum: int) -> Job:
    """The planner's Job of this config on `world` GPU ranks (nodes of up to 8)."""
    p, t = cfg.parallel, cfg.train
    per_node = min(world, GPUS_PER_NODE)
    return Job(nodes=world // per_node, gpus_per_node=per_node, dp=p.dp, tp=p.tp, pp=p.pp, ep=p.ep,
               data_parallel=p.data_parallel, dp_shard=p.dp_shard, offload=p.offload,
               pp_schedule=p.pp_schedule,
               pp_virtual_stages=p.pp_virtual_stages, micro_batch=t.micro_batch_size,
               grad_accum=grad_accum, activation_checkpoint=p.activation_checkpoint,
               ac_every=p.ac_every, precision=PLANNER_PRECISION.get(t.precision, t.precision),
               loss_chunk=t.loss_chunk, meta_init=p.meta_init, backend="nccl")


def planner_figures(cfg: Config, world: int, rank: RankBytes) -> dict:
    """The planner's parameters, gradients, optimizer state and peak for this rank's stage."""
    shape = ModelShape.of_model_config(cfg.model)
    job = planner_job(cfg, world, rank.grad_accum)
    memory = rank_memory(shape, job, pipeline_stages(shape, job)[rank.coords["pp"]])
    figures = {ours: memory.parts[theirs] for ours, theirs in ROWS}
    figures["peak"] = memory.peak
    return figures


def as_dict(cfg: Config, world: int, ranks: list[RankBytes]) -> dict:
    out = []
    for r in ranks:
        mine = dataclasses.asdict(r)
        mine["planner"] = planner_figures(cfg, world, r)
        mine["peak_vs_planner"] = round(r.peak / mine["planner"]["peak"], 4) if mine["planner"]["peak"] else None
        out.append(mine)
    return {"world_size": world, "layout": _layout(cfg), "ranks": out}


def _layout(cfg: Config) -> str:
    p = cfg.parallel
    hsdp = f" dp_shard{p.dp_shard}" if p.dp_shard else ""
    hsdp += f" offload={p.offload}" if p.offload != "none" else ""
    return (f"{p.data_parallel}{hsdp} tp{p.tp} pp{p.pp} ep{p.ep} mb{cfg.train.micro_batch_size} "
            f"ac={p.activation_checkpoint} {cfg.train.precision}")


def render(report: dict) -> str:
    """A markdown table per rank: dry run | planner | dry / planner."""
    lines = [f"dry run: {report['world_size']} ranks, {report['layout']} (fake GPU tensors, "
             f"fake process group, a process per rank run)"]
    for r in report["ranks"]:
        plan = r["planner"]
        coords = " ".join(f"{k}{v}" for k, v in r["coords"].items())
        lines += ["", f"rank {r['rank']} ({coords}): {r['micro_batches']} of {r['grad_accum']} "
                  f"micro-batches per step, 2 steps in {r['seconds']:.1f} s, "
                  f"{r['host_reads']} host reads of device values",
                  *([r["fp8"]] if r.get("fp8") else []),
                  "| per rank | dry run | planner | dry / planner |", "|---|---|---|---|"]
        for key in ("parameters", "gradients", "optimizer", "peak"):
            ratio = f"{r[key] / plan[key]:.3f}" if plan[key] else "-"
            lines.append(f"| {key} | {fmt_bytes(r[key])} | {fmt_bytes(plan[key])} | {ratio} |")
        lines.append("| at the peak: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r["peak_parts"].items())
                     + " | | | |")
        if any(r["in_host_memory"].values()):  # parallel.offload: what the GPU no longer holds
            lines.append("| in host memory (parallel.offload): " + ", ".join(
                f"{k} {fmt_bytes(v)}" for k, v in r["in_host_memory"].items()) + " | | | |")
    return "\n".join(lines) + "\n"
