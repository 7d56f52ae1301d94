"""Bytes one rank sends per optimizer step, per link kind, for our layouts.

Owns the communication model (ring collectives: an all-reduce of M bytes over p ranks sends
2 (p-1)/p M per rank, an all-gather or reduce-scatter of a full M sends (p-1)/p M):
- TP with sequence parallelism (parallel/tensor_parallel.py), per block and micro-batch: forward
  all-gathers of the attention and MLP inputs (LayerNorm output: fp32 under autocast) and
  reduce-scatters of the wo / proj outputs (16-bit under autocast); backward the mirror images;
  a checkpointed block repeats its forward ones. Ends: the embedding's reduce-scatter and the
  head's all-gather (fp32), forward and backward. MoE layers (replicated over tp): their fp32
  gradients all-reduced over tp once per step (plan/moe.py).
- DP (parallel/parallelize.py): DDP or the flat after-backward all-reduce of fp32 gradients once
  per step (under ep > 1 the experts' over their dp / ep replicas only: plan/moe.py); FSDP all-gathers parameters (16-bit under autocast) in forward and again in backward
  for every micro-batch and reduce-scatters fp32 gradients once per step (HSDP, Job.dp_shard:
  those over the dp_shard x cp group only, a "dp" row of that group's link, and a "dp_replicate"
  row: the all-reduce of each rank's fp32 gradient shard over dp_replicate groups, inter-node
  when the shard group fills a node); DiLoCo averages the
  pseudo-gradient once per round of inner_steps (plan/wire.py bytes_sent, on the wire fp32,
  bf16, int8 or int4 + a scale per block), nothing in between. Hierarchical (sync.replica_nodes):
  the dp row is DDP's all-reduce inside a replica of nodes (its own link kind), the "replica" row
  DiLoCo's rounds between the replicas (inter-node: the thin link); with pp > 1 a replica holds
  pp x dp x tp ranks (each stage's parameters averaged over the replicas at its position).
  async_diloco (plan/async_model.py): no dp row in the flat layout (DDP inside a replica of nodes
  otherwise); the "replica" row is one arrival's bytes out and back, amortized over its round.
- CP (parallel.cp > 1: parallel/context_parallel.py): the ring's K/V and dK/dV blocks or
  Ulysses' all-to-alls, per block and micro-batch (plan/context.py), a row only when cp > 1; the
  gradients are then reduced over dp x cp (the weights are replicated over cp).
- PP (parallel/pipeline.py): each micro-batch's fp32 residual stream (b, s / tp, h) to the next
  stage and its gradient back, per model chunk; the tied embedding / head gradient all-reduced
  between the first and last stage once per step.
A link is "intra-node" when the group fits in one node (ranks are numbered TP innermost, then cp,
dp, then pp: distributed/mesh.py), else "inter-node". It must never compute memory.
"""
from __future__ import annotations

from hpctrain.plan import async_model, context, moe
from hpctrain.plan.layout import Job
from hpctrain.plan.memory import RankMemory, checkpointed_blocks
from hpctrain.plan.shape import ModelShape
from hpctrain.plan.wire import bytes_sent

def ring_share(p: int) -> float:
    return (p - 1) / p if p > 1 else 0.0


def tp_bytes(shape: ModelShape, job: Job, n_blocks: int, n_ckpt: int, ends: int) -> int:
    """Per step: `n_blocks` blocks (of which `n_ckpt` checkpointed) and `ends` (embedding on the
    first stage, head on the last) on one tp rank."""
    if job.tp == 1:
        return 0
    act = shape.block_size * job.micro_batch * shape.n_embd  # elements of a full (b, s, h)
    w = 2 if job.half else 4
    fwd = 2 * 4 + 2 * w   # 2 all-gathers of fp32 norm outputs, 2 reduce-scatters of 16-bit outputs
    bwd = 2 * 4 + 2 * w
    per_micro = act * (n_blocks * (fwd + bwd) + n_ckpt * fwd + ends * (4 + 4))
    return int(ring_share(job.tp) * per_micro * job.grad_accum)


def diloco_bytes(job: Job, n_local: int, p: int) -> tuple[int, str]:
    """(bytes per step, what moves) of DiLoCo's rounds over `p` replicas."""
    per_round = bytes_sent(n_local, p, job.compression)
    return per_round // job.inner_steps, (f"DiLoCo: {per_round / 1e9:.3g} GB per round of "
                                          f"{job.inner_steps} steps ({job.compression})")


def dp_bytes(shape: ModelShape, job: Job, n_local: int) -> tuple[int, str]:
    """(bytes per step, what moves) over the dp group for `n_local` parameters (after TP / PP);
    hierarchical: DDP inside one replica."""
    p = job.grad_ranks // job.replicas if job.replicas else job.grad_ranks
    if p == 1:
        return 0, "none (dp = 1)"
    if job.replicas:
        return int(2 * ring_share(p) * n_local * 4), "all-reduce of fp32 gradients inside a replica"
    if job.sync_mode == "async_diloco":  # flat: a replica is tp x pp ranks
        return 0, "none (async_diloco: each replica trains apart)"
    if job.sync_mode == "diloco":
        return diloco_bytes(job, n_local, p)
    if job.data_parallel == "fsdp":
        p = job.shard_ranks  # HSDP: the dp_shard x cp group (its replicas: hsdp_replicate_row)
        gather = ring_share(p) * n_local * (2 if job.half else 4) * 2 * job.grad_accum
        scatter = ring_share(p) * n_local * 4
        return int(gather + scatter), "FSDP all-gather (fwd + bwd per micro-batch) + reduce-scatter"
    return int(2 * ring_share(p) * n_local * 4), "all-reduce of fp32 gradients"


def pp_bytes(shape: ModelShape, job: Job, has_first: bool, has_last: bool) -> int:
    if job.pp == 1:
        return 0
    act = shape.block_size * job.micro_batch * shape.n_embd // job.tp * 4
    boundaries = job.virtual * 2 - (1 if has_first else 0) - (1 if has_last else 0)
    tied = (4 * shape.embedding_params_tp(job.tp) if shape.tied and (has_first or has_last)
            else 0)  # 2-rank all-reduce of the tied weight's gradient
    # each boundary this rank borders: send activations one way, gradients the other
    return act * job.grad_accum * boundaries + tied


def link(group_span: int, job: Job) -> str:
    return "intra-node" if group_span <= job.gpus_per_node else "inter-node"


def comm_per_step(shape: ModelShape, job: Job, blocks: int, ckpt_blocks: int, has_first: bool,
                  has_last: bool, n_local: int, block_ids=()) -> list[tuple[str, str, int, str]]:
    """Rows (axis, link kind, bytes sent per step by this rank, what moves); an MoE model's
    all-to-all first (ep: plan/moe.py, over the sparse layers among `block_ids`)."""
    ends = int(has_first) + int(has_last)
    inner_dp = job.grad_ranks // job.replicas if job.replicas else job.grad_ranks  # a replica's pp x dp x cp x tp
    dp, what = dp_bytes(shape, job, n_local - moe.held_experts(shape, job, block_ids))
    if moe.held_experts(shape, job, block_ids):  # ep > 1: left out of DDP / FSDP (plan/moe.py)
        dp += moe.replica_grad_bytes(shape, job, block_ids)
        what += " + all-reduce of the experts' fp32 gradients over dp / ep replicas"
    span = job.tp * (job.shard_ranks if job.dp_shard else inner_dp)
    ep = [("ep", link(job.tp * job.ep, job), moe.all_to_all_bytes(shape, job, block_ids),
           "MoE all-to-all: routed rows to their experts' ranks and back, forward + backward")]
    return ep * bool(shape.moe_experts) + [
        ("tp", link(job.tp, job),
         tp_bytes(shape, job, blocks, ckpt_blocks, ends) + moe.tp_grad_bytes(shape, job, block_ids),
         "sequence-parallel all-gathers + reduce-scatters per block"
         + ", MoE gradients all-reduced" * bool(shape.moe_experts and job.tp > 1)),
        *cp_row(shape, job, blocks, ckpt_blocks),
        ("dp", link(span, job), dp, what),
        *hsdp_replicate_row(job, n_local - moe.held_experts(shape, job, block_ids), inner_dp),
        *across_replicas(job, n_local),
        ("pp", link(job.tp * inner_dp * 2, job) if job.pp > 1 else "-",
         pp_bytes(shape, job, has_first, has_last), "activations forward, gradients back"),
    ]


def hsdp_replicate_row(job: Job, n_dense: int, inner_dp: int) -> list[tuple[str, str, int, str]]:
    """HSDP's all-reduce of each rank's fp32 gradient shard (n_dense / shard_ranks values) over
    dp_replicate groups (none without HSDP)."""
    if not job.dp_shard or job.dp_replicate == 1:
        return []
    sent = int(2 * ring_share(job.dp_replicate) * n_dense * 4 / job.shard_ranks)
    return [("dp_replicate", link(job.tp * inner_dp, job), sent,
             f"HSDP all-reduce of fp32 gradient shards over {job.dp_replicate} replicas")]


def cp_row(shape: ModelShape, job: Job, blocks: int, ckpt_blocks: int) -> list[tuple[str, str, int, str]]:
    """The context-parallel row (none at cp = 1): its group is cp x tp consecutive ranks."""
    if job.cp == 1:
        return []
    return [("cp", link(job.tp * job.cp, job), context.traffic_bytes(shape, job, blocks, ckpt_blocks),
             context.what_moves(job))]


def across_replicas(job: Job, n_local: int) -> list[tuple[str, str, int, str]]:
    """The row of what crosses between replicas: DiLoCo's rounds over the replicas of nodes, or
    async_diloco's arrivals at the servers (plan/async_model.py; amortized over a round)."""
    if job.sync_mode == "async_diloco":
        return [("replica", async_model.link(job), *async_model.per_step(job, n_local))]
    return [("replica", "inter-node", *diloco_bytes(job, n_local, job.replicas))] if job.replicas else []


def rows_of_rank(shape: ModelShape, job: Job, mem: RankMemory) -> list[tuple[str, str, int, str]]:
    """`comm_per_step` of the pipeline rank `mem` describes."""
    st = mem.stage
    return comm_per_step(shape, job, len(st.block_ids), checkpointed_blocks(job, st), st.has_first,
                         st.has_last, mem.local_params, st.block_ids)
