"""A modelled optimizer-step time of a layout: compute at a stated MFU + exposed communication.

Owns the step-time model `hpctrain plan` ranks layouts by (docs/scale.md, "Recommended layouts"):
- compute: the step's model FLOPs (GPT.flops_per_token x tokens per step, shape.py) times the
  recompute of activation checkpointing (a wrapped block runs its forward twice: + 1/3 of its
  6N FLOPs), shared by every rank, at Job.mfu x Job.gpu_tflops per GPU.
- TP: the sequence-parallel all-gathers / reduce-scatters of comm.tp_bytes, on the critical path
  (nothing overlaps them), over the intra-node bandwidth (the inter-node one when tp > a node).
- EP (mixture of experts): the all-to-all of plan/moe.py on the critical path (each layer waits for
  its tokens), over the intra-node bandwidth while tp x ep fits a node.
- CP (plan/context.py): the ring's block transfers, of which what the attention's compute does not
  hide is exposed, or Ulysses' all-to-alls, all on the critical path; over the intra-node
  bandwidth while cp x tp fits a node.
- PP: the micro-batch activations / gradients of comm.pp_bytes, on the critical path; the 1F1B /
  GPipe bubble idles (pp - 1) / micro-batches of the pipelined time (compute + TP + p2p).
- DP: comm.dp_bytes over the inter-node bandwidth when the dp group spans nodes (comm.link), the
  intra-node one otherwise; exposed is what does not hide under compute: DDP's bucketed all-reduce
  runs under the last micro-batch's backward (2/3 of its compute), FSDP's prefetched all-gathers
  and its reduce-scatter under every micro-batch's forward and backward, DiLoCo's round average
  under nothing. async_diloco: a step is one replica's batch on its ranks, the replicas step
  at once (tokens per step x replicas); its arrival (plan/async_model.py) is exposed, amortized
  over the round like DiLoCo's average (no collective blocks the other replicas).
- offload (plan/offload.py): its host <-> GPU copies (what FSDP2's prefetch does not hide under
  compute in the "all" mode; all of them in the "optimizer" mode) and AdamW on the host.
A lower bandwidth never makes a layout faster; the model ignores latency and kernel efficiency
beyond the one MFU, so it ranks layouts, it does not promise a wall clock. It must never
compute memory (memory.py) or format text (recommend.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.plan import async_model, comm, context, offload
from hpctrain.plan.layout import Job
from hpctrain.plan.memory import RankMemory, checkpointed_blocks
from hpctrain.plan.shape import ModelShape


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by part, and the throughput it gives."""
    compute: float
    tp: float
    pp: float
    bubble: float
    dp_exposed: float
    dp_total: float
    tokens_per_step: int
    ep: float = 0.0
    cp: float = 0.0  # exposed context-parallel transfers
    offload_pcie: float = 0.0  # parallel.offload's host <-> GPU copies on the critical path
    offload_adam: float = 0.0  # parallel.offload's AdamW on the host

    @property
    def offload(self) -> float:
        return self.offload_pcie + self.offload_adam

    @property
    def total(self) -> float:
        return (self.compute + self.tp + self.ep + self.cp + self.pp + self.bubble + self.dp_exposed
                + self.offload)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total


def recompute_factor(shape: ModelShape, job: Job, mem: RankMemory) -> float:
    """FLOPs done / model FLOPs: each checkpointed block repeats its forward (1/3 of 6N); under
    selective_op none of its matmuls or attention (the FLOPs counted) is repeated."""
    st = mem.stage
    if job.activation_checkpoint == "selective_op":
        return 1.0
    return 1 + checkpointed_blocks(job, st) / max(len(st.block_ids), 1) / 3


def bandwidth(job: Job, link: str) -> float:
    return job.intra_node_bw if link == "intra-node" else job.inter_node_bw


def step_time(shape: ModelShape, job: Job, mem: RankMemory) -> StepTime:
    """The step time of `job` (already checked) whose largest pipeline rank is `mem`."""
    tokens = job.batch * shape.block_size
    flops = shape.flops_per_token() * tokens * recompute_factor(shape, job, mem)
    ranks, streams = job.world, 1
    if job.sync_mode == "async_diloco":  # each replica steps on its own batch, all at once
        ranks, streams = async_model.group_ranks(job), async_model.replicas(job)
    compute = flops / (ranks * job.gpu_tflops * 1e12 * job.mfu)
    seconds = {axis: sent / bandwidth(job, link) if sent else 0.0
               for axis, link, sent, _ in comm.rows_of_rank(shape, job, mem)}
    cp = context.exposed_seconds(shape, job, seconds["cp"]) if "cp" in seconds else 0.0
    pipelined = compute + seconds["tp"] + seconds.get("ep", 0.0) + cp + seconds["pp"]
    bubble = pipelined * (job.pp - 1) / job.grad_accum
    if job.sync_mode == "diloco":
        window = 0.0
    elif job.data_parallel == "fsdp":
        window = compute
    else:
        window = compute * 2 / 3 / job.grad_accum
    dp = seconds["dp"] + seconds.get("dp_replicate", 0.0)  # HSDP: shard group + replicas
    exposed = max(0.0, dp - window) + seconds.get("replica", 0.0)  # (not overlapped)
    pcie, adam = offload.exposed_seconds(mem.host, job, compute)
    return StepTime(compute, seconds["tp"], seconds["pp"], bubble, exposed, dp, tokens * streams,
                    seconds.get("ep", 0.0), cp, pcie, adam)
