"""Context parallelism in the planner: what splitting each sequence over cp ranks (parallel.cp,
parallel/context_parallel.py) does to a rank's activations, its attention buffers, its traffic
and its step time.

Owns that arithmetic, for s = block_size tokens, b sequences per micro-batch, h = n_embd, kv the
k / v width (kv heads x head_dim), t = tp, w = 2 (16-bit) or 4 (fp32) bytes, c = s / cp:
- activations: every stored tensor of a block and of the head grows with the tokens a rank holds,
  so a rank's are the cp = 1 formulas (plan/activations.py) at block_size s / cp (`local_shape`),
  plus what the attention keeps beyond SDPA's (`stored_extra`): the ring's fp32 output, 4 c b h / t
  over 16-bit inputs (its merge is in fp32; the block's output is a 16-bit copy of it; nothing
  under fp32); Ulysses' head-sharded SDPA output beside the output all-to-all'd back, w c b h / t.
- transient, one layer at a time (`transient_bytes`, in its backward, the larger pass): the ring's
  K/V block and the one arriving (2 w c b 2 kv / t) with the dK/dV accumulators travelling with
  them and the one arriving (2 x 4 c b 2 kv / t, fp32) and its fp32 dQ (4 c b h / t); Ulysses' send
  and receive buffers of q, k and v (2 w c b (h + 2 kv) / t: the whole sequence for H / (t cp)
  heads is as many elements as c tokens of H / t heads).
- traffic per layer and micro-batch, sent by one rank (`traffic_bytes`): ring, forward cp - 1 K/V
  blocks (w c b 2 kv / t each), backward cp - 1 K/V blocks and cp fp32 dK/dV blocks (the last
  brings each home), a checkpointed block's forward again; Ulysses, four all-to-alls forward (q, k,
  v to heads, the output back) and four backward, each sending (cp - 1) / cp of its c-token tensor:
  (cp - 1) / cp w c b (2 h + 2 kv) / t per pass.
- time: the ring's transfers overlap the attention's compute of the block before (its FLOPs: the
  12 L (heads x head_dim) s per token of flops_per_token), only the excess is exposed; the
  all-to-alls are on the critical path.
It must never format text or judge a layout (search.py chooses ring or Ulysses by step time).
"""
from __future__ import annotations

import dataclasses

from hpctrain.plan.layout import Job
from hpctrain.plan.shape import ModelShape


def local_shape(shape: ModelShape, job: Job) -> ModelShape:
    """The shape whose block_size is the tokens of a sequence one cp rank holds."""
    return shape if job.cp == 1 else dataclasses.replace(shape, block_size=shape.block_size // job.cp)


def _tokens(shape: ModelShape, job: Job) -> int:
    """c x b: tokens of one micro-batch on one cp rank."""
    return shape.block_size // job.cp * job.micro_batch


def _width(job: Job) -> int:
    return 2 if job.half else 4


def stored_extra(shape: ModelShape, job: Job) -> int:
    """Bytes one block keeps beyond plan/activations.py's count at s / cp (module docstring)."""
    if job.cp == 1:
        return 0
    per_token = shape.n_embd // job.tp
    if job.cp_attention == "ulysses":
        return _width(job) * _tokens(shape, job) * per_token
    return 4 * _tokens(shape, job) * per_token if job.half else 0


def transient_bytes(shape: ModelShape, job: Job) -> int:
    """One layer's attention buffers in its backward (module docstring)."""
    if job.cp == 1:
        return 0
    n, h, kv, w = _tokens(shape, job), shape.n_embd // job.tp, shape.kv_dim // job.tp, _width(job)
    if job.cp_attention == "ulysses":
        return 2 * w * n * (h + 2 * kv)
    return 2 * w * n * 2 * kv + 2 * 4 * n * 2 * kv + 4 * n * h


def layer_traffic(shape: ModelShape, job: Job) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends for one layer and micro-batch."""
    if job.cp == 1:
        return 0, 0
    n, h, kv, w, cp = _tokens(shape, job), shape.n_embd // job.tp, shape.kv_dim // job.tp, _width(job), job.cp
    if job.cp_attention == "ulysses":
        one_pass = (cp - 1) * w * n * (2 * h + 2 * kv) // cp
        return one_pass, one_pass
    kv_block = n * 2 * kv
    return (cp - 1) * w * kv_block, (cp - 1) * w * kv_block + cp * 4 * kv_block


def traffic_bytes(shape: ModelShape, job: Job, n_blocks: int, n_ckpt: int) -> int:
    """Bytes one rank sends per optimizer step for `n_blocks` blocks, `n_ckpt` of them
    checkpointed (their forward runs twice)."""
    fwd, bwd = layer_traffic(shape, job)
    return job.grad_accum * (n_blocks * (fwd + bwd) + n_ckpt * fwd)


def attention_seconds(shape: ModelShape, job: Job) -> float:
    """Seconds per step of the attention's own FLOPs on one rank (what the ring overlaps)."""
    per_token = shape.flops_per_token() - 6.0 * shape.active_params()
    return per_token * job.batch * shape.block_size / (job.world * job.gpu_tflops * 1e12 * job.mfu)


def exposed_seconds(shape: ModelShape, job: Job, seconds: float) -> float:
    """The part of `seconds` of cp traffic on the critical path."""
    if job.cp_attention == "ulysses":
        return seconds
    return max(0.0, seconds - attention_seconds(shape, job))


def what_moves(job: Job) -> str:
    if job.cp_attention == "ulysses":
        return "Ulysses: all-to-alls of q, k, v to heads and the output back, forward + backward"
    return "ring: K/V blocks forward, K/V + fp32 dK/dV blocks backward, per block"
