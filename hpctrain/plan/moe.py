"""Mixture-of-experts arithmetic of `hpctrain plan` (hpctrain/model/moe.py's layer, #34): the
parameters of a sparse layer, total vs active, what one rank holds under expert parallelism
(parallel.ep: each sparse layer's routed experts split over ep ranks borrowed from dp x cp), and
the all-to-all traffic of the token dispatch.

A sparse layer's feed-forward (moe.py) is: router.weight [E, C] + its balancing bias [E], routed
experts w1, w3 [E, H, C] and w2 [E, C, H] (3 E C H), shared experts as one SwiGLU of width S
(3 C S) and Qwen2-MoE's shared gate [1, C]; it replaces the dense layer's SwiGLU (3 C F). One token
uses top_k of the E routed experts, so the active count (MFU's N, Llama.active_params) takes the
routed experts' (E - k) / E share away. Under ep, a rank holds E / ep of each layer's routed experts
(the rest of the layer, router and shared experts included, replicated). Under tp the whole layer
is replicated over the tp ranks (parallel/tensor_parallel.py: only attention and dense layers are
split), each tp rank routing its own sequence shard (tokens / tp), and its gradients are summed
over tp once per step (an fp32 all-reduce of the layer's parameters a rank holds).

All-to-all per optimizer step, sent by one rank: each sparse layer sends every routed row (tokens x
top_k rows of C activations) to the rank of its expert and gets the outputs back (dispatch +
combine), in forward and again in backward (the gradients): 4 x tokens x top_k x C x bytes per
layer, of which (ep - 1) / ep leave the rank when routing is balanced. Tokens per rank per step =
micro_batch x block_size x grad_accum / (tp x cp): with context parallelism (#51) a rank routes only
its part of each sequence, so its all-to-all shrinks with cp while the bytes per token stay; bytes:
2 in bf16 / fp16, 4 in fp32. Activation checkpointing repeats a checkpointed layer's forward
dispatch + combine (6 instead of 4 exchanges).

Gradients under ep > 1 (parallel/apply_expert.py): DDP and FSDP leave the routed experts out, so
FSDP never shards them (each rank keeps its E / ep whole, with their gradients and AdamW state),
and their fp32 gradients are all-reduced once per step over the (dp x cp) / ep replicas that hold
the same experts (nothing moves when ep = dp x cp), not over the whole dp x cp group.

Not modelled yet: a sparse layer's activations are counted as the dense SwiGLU's (memory.py's 8 f
term; top_k x the expert width is nearer), FSDP's gathered-block buffers as a dense block's, and a
real router's imbalance (the all-to-all assumes every expert gets its share).

It must never import torch.
"""
from __future__ import annotations


def sparse_layers(shape, block_ids=None) -> list[int]:
    """The sparse layers among `block_ids` (default: all): Llama's is_sparse rule."""
    ids = range(shape.n_layer) if block_ids is None else block_ids
    if not shape.moe_experts:
        return []
    return [i for i in ids if i >= shape.moe_first_dense and (i + 1) % shape.moe_every == 0]


def n_sparse_layers(shape) -> int:
    """len(sparse_layers(shape)), by arithmetic (no list: n_layer may be a typo of 10^9): the
    layers i >= moe_first_dense with i + 1 a multiple of moe_every."""
    if not shape.moe_experts:
        return 0
    every = shape.moe_every
    return max(0, shape.n_layer // every - shape.moe_first_dense // every)


def expert_hidden(shape) -> int:
    return shape.moe_expert_hidden or shape.ffn


def routed_params(shape) -> int:
    """One sparse layer's routed experts: 3 E C H."""
    return 3 * shape.moe_experts * shape.n_embd * expert_hidden(shape)


def layer_params(shape, ep: int = 1) -> int:
    """One sparse layer's feed-forward as one rank holds it under `ep` (1: the whole layer)."""
    c, e = shape.n_embd, shape.moe_experts
    shared = shape.moe_shared_hidden or expert_hidden(shape) * shape.moe_shared_experts
    gate = c if shape.moe_shared_experts and shape.moe_shared_gate else 0
    return e * c + e + routed_params(shape) // ep + 3 * c * shared + gate


def extra_params(shape, ep: int = 1, tp: int = 1) -> int:
    """A sparse layer's parameters minus the dense SwiGLU (3 C F / tp) the planner counted for it
    (the sparse layer itself is not split over tp)."""
    return layer_params(shape, ep) - 3 * shape.n_embd * shape.ffn // tp


def tp_grad_bytes(shape, job, block_ids) -> int:
    """Bytes one rank sends per step summing its sparse layers' fp32 gradients over tp (ring)."""
    if job.tp == 1:
        return 0
    n = len(sparse_layers(shape, block_ids)) * layer_params(shape, job.ep)
    return int(2 * (job.tp - 1) / job.tp * 4 * n)


def inactive_params(shape) -> int:
    """Routed-expert parameters one token does not use, over the model (Llama.active_params)."""
    e = shape.moe_experts
    return n_sparse_layers(shape) * (routed_params(shape) * (e - shape.moe_top_k) // e) if e else 0


def _checkpointed(job, layer: int) -> bool:
    """Whether activation checkpointing recomputes block `layer` (memory.py's rule)."""
    mode = job.activation_checkpoint  # selective_op recomputes the exchanges (op_checkpoint.py)
    return mode in ("full", "selective_op") or (mode == "selective" and layer % job.ac_every == 0)


def all_to_all_bytes(shape, job, block_ids) -> int:
    """Bytes one rank sends per optimizer step in the dispatch / combine of its stage's layers
    (a recomputed layer's forward exchanges twice)."""
    if job.ep == 1:
        return 0
    tokens = job.micro_batch * shape.block_size * job.grad_accum // (job.tp * job.cp)  # its shard
    exchanges = sum(4 + 2 * _checkpointed(job, i) for i in sparse_layers(shape, block_ids))
    act = 2 if job.half else 4
    return exchanges * tokens * shape.moe_top_k * shape.n_embd * act * (job.ep - 1) // job.ep


def held_experts(shape, job, block_ids) -> int:
    """Routed-expert parameters a rank holds outside DDP / FSDP (ep > 1; ep = 1: none, the experts
    are ordinary parameters)."""
    if job.ep == 1:
        return 0
    return len(sparse_layers(shape, block_ids)) * routed_params(shape) // job.ep


def replica_grad_bytes(shape, job, block_ids) -> int:
    """Bytes one rank sends per step summing its experts' fp32 gradients over the (dp x cp) / ep
    replicas holding the same experts (ring all-reduce)."""
    replicas = job.grad_ranks // job.ep
    return int(2 * (replicas - 1) / replicas * 4 * held_experts(shape, job, block_ids))


def sharded_bytes(shape, job, block_ids, n: int, shard: int, per_param: int) -> int:
    """`per_param` bytes of each of the `n` parameters a rank keeps after FSDP over `shard` ranks:
    the routed experts held under ep (already / ep) whole, FSDP leaves them out; the rest over all
    `shard` (per_param x n // shard for a dense model)."""
    experts = held_experts(shape, job, block_ids)
    return per_param * (n - experts) // shard + per_param * experts
