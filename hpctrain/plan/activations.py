"""Activation bytes of one block, a checkpointed block and the head, for one micro-batch.

Owns the activation model of OUR blocks (model/gpt.py, model/llama.py, parallel/loss.py), bytes
for s tokens, b sequences, h = n_embd, a heads, t = tp (`activation_formula` states it). Three
precisions of the tensors a block works on:
- fp32: no autocast.
- 16-bit autocast over fp32 parameters (DDP, TP or one rank under bf16 / fp16): the residual
  stream stays fp32, each Linear casts its input to 16-bit (a cast per Linear).
- 16-bit parameters (`params16`: FSDP2 over dp > 1 under bf16 / fp16, its MixedPrecisionPolicy
  all-gathers the parameters in 16-bit): the embedding's output, and with it the residual stream
  and every block's input, is 16-bit; RMSNorm's output is 16-bit and feeds its Linears uncast
  (one tensor for q/k/v, one for gate/up). GPT's LayerNorm is on autocast's fp32 list, so its
  saved input is an fp32 copy either way: a GPT block saves the same bytes as under autocast.
  Measured with autograd's saved-tensor hooks inside the dry run (train/dry_run.py) of a small
  Llama and GPT, fsdp dp2 and dp2 x tp2: exactly these counts (docs/scale.md).
Our blocks with flash / memory-efficient SDPA (no a s^2 scores) and dropout 0:
- GPT stores s b h (A / t + 8) + (4 a + 16) s b / t (SDPA's fp32 logsumexp, LayerNorm mean and
  rstd), A = 32 under 16-bit (fp32 residual and LayerNorm inputs, three separate 16-bit casts of
  the q/k/v input), 56 in fp32; the "+ 8" is the all-gathered (sequence-parallel) input of q/k/v
  and fc, which torch's DTensor keeps whole. Korthikanti et al. 2022 count s b h (34 + 5 a s / h)
  for Megatron's blocks.
- Llama (`llama_layer_bytes`: RMSNorm, GQA's kv-wide k and v, SwiGLU's f-wide gate, up, silu and
  product) stores s b (W h + (R h + K kv + M f + 4 a + 8) / t) + the rotary tables, W, R, K, M =
  8, 24, 8, 16 in fp32, 10, 20, 4, 8 under 16-bit autocast, 4, 16, 4, 8 with 16-bit parameters:
  what autograd saves, exactly.
- A checkpointed block keeps its input (4 s b h / t; 2 with 16-bit parameters) and recomputes one
  block in backward.
- A block under per-op checkpointing (selective_op: parallel/op_checkpoint.py) keeps its input
  and the outputs of its matmuls and attention (`selective_op_layer_bytes`): e s b (q + 2 kv +
  MLP-in + attention out) / t + 4 a s b / t (the fp32 log-sum-exp) + 2 e s b h (the two row-parallel
  outputs, wo and the MLP's down projection: whole partial sums under tp), e = 4 in fp32, 2 in
  16-bit; MLP-in is SwiGLU's gate and up (2 f) or GPT's fc (f), GPT's q/k/v one 3 h tensor.
  Measured: exactly these bytes at tp 1 (tests/unit/test_op_checkpoint.py).
- The head keeps its logits (2|4 b s V / t) and log-softmax (4 b s V / t), +8 b s V / t in backward
  (llama: + RMSNorm's fp32 copy, 4 b s h / t, and its normalized copy, 4 b s h / t, 2 with 16-bit
  parameters, with or without chunking). With train.loss_chunk = n (parallel/loss.py) it keeps
  the gradients its forward computed, dh (4 b s h, gathered under tp) and dW (4 V h / t, fp32),
  and briefly one chunk's logits (4 n V / t, + a 16-bit copy 2 n V / t and, over fp32
  parameters, of h 2 b s h under 16-bit autocast).
It must never decide which precision a job runs in (memory.py passes it) nor format output.
"""
from __future__ import annotations

from hpctrain.plan.shape import ModelShape


def _llama_factors(half: bool, params16: bool) -> tuple[int, int, int, int]:
    """(W, R, K, M) of `llama_layer_bytes` (the module docstring)."""
    if half and params16:
        return 4, 16, 4, 8
    return (10, 20, 4, 8) if half else (8, 24, 8, 16)


def activation_formula(half: bool, llama: bool = False, params16: bool = False) -> str:
    if llama:
        w, r, k, m = _llama_factors(half, params16)
        return (f"s*b*({w}*h + ({r}*h + {k}*kv + {m}*f + 4*a + 8)/t) + 2*s*head_dim*{4 - 2 * half} "
                f"bytes per layer")
    a = 32 if half else 56
    return f"s*b*h*({a}/t + 8) + (4*a + 16)*s*b/t bytes per layer"


def layer_activation_bytes(shape: ModelShape, micro_batch: int, tp: int, half: bool,
                           params16: bool = False) -> int:
    """One block's stored activations for one micro-batch (see the module docstring; a family
    that counts its own blocks: its shape's layer_activation_bytes, the largest of its layers, as
    over fp32 parameters: with 16-bit ones it overcounts the residual stream's copies)."""
    own = getattr(shape.family, "layer_activation_bytes", None)
    if own is not None:
        return own(shape, micro_batch, tp, half)
    if shape.llama:
        return llama_layer_bytes(shape, micro_batch, tp, half, params16)
    s, b, h, a = shape.block_size, micro_batch, shape.n_embd, shape.n_head
    sharded = 32 if half else 56
    return s * b * h * sharded // tp + 8 * s * b * h + (4 * a + 16) * s * b // tp


def llama_layer_bytes(shape: ModelShape, micro_batch: int, tp: int, half: bool,
                      params16: bool = False) -> int:
    """A LlamaBlock's saved tensors per token (exactly what autograd saves at tp = 1). Over fp32
    parameters: the fp32 residual input and RMSNorm's normalized fp32 copy of each half (4 h each,
    + its 4-byte rsqrt), the q/k/v/fc input (fp32: one tensor, 4 h; 16-bit: one cast per Linear,
    3 x 2 h and 2 x 2 h). With 16-bit parameters (`params16`): each RMSNorm's fp32 copy of its
    16-bit input (4 h) and 16-bit normalized copy (2 h), its 16-bit output, the q/k/v (fc) input
    (2 h each half). Then SDPA's rotated q (h) and k (kv) and v (kv) and its output (= wo's input,
    h), fp32 logsumexp (4 a), SwiGLU's gate, silu(gate), up and product (4 f); the rotary cos/sin
    tables (2 s head_dim). Under tp the q/k/v and MLP inputs are whole (sequence-parallel
    all-gather), the norms' on a sequence shard, the heads and f on a head / column shard: all
    those / t."""
    s, b, h, a = shape.block_size, micro_batch, shape.n_embd, shape.n_head
    whole, rest, kv, mlp = _llama_factors(half, params16)
    sharded = rest * h + kv * shape.kv_dim + mlp * shape.ffn + 4 * a + 8
    return s * b * whole * h + s * b * sharded // tp + 2 * s * (h // a) * (2 if half else 4)


def checkpointed_layer_bytes(shape: ModelShape, micro_batch: int, tp: int,
                             params16: bool = False) -> int:
    """A checkpoint-wrapped block keeps only its input (sequence-sharded under tp): fp32, or
    16-bit with 16-bit parameters."""
    return (2 if params16 else 4) * shape.block_size * micro_batch * shape.n_embd // tp


def selective_op_layer_bytes(shape: ModelShape, micro_batch: int, tp: int, half: bool,
                             params16: bool = False) -> int:
    """A block under parallel.activation_checkpoint = selective_op (the module docstring); a family
    that counts its own blocks (mixtures of experts) is counted as without checkpointing."""
    if getattr(shape.family, "layer_activation_bytes", None) is not None:
        return layer_activation_bytes(shape, micro_batch, tp, half, params16)
    s, b, h, a = shape.block_size, micro_batch, shape.n_embd, shape.n_head
    e = 2 if half else 4
    mlp_in = 2 * shape.ffn if shape.llama else shape.ffn
    column = h + 2 * shape.kv_dim + mlp_in + h  # q, k, v, the MLP's input projections, attention out
    kept = e * s * b * column // tp + 4 * a * s * b // tp + 2 * e * s * b * h
    return checkpointed_layer_bytes(shape, micro_batch, tp, params16) + kept


def head_bytes(shape: ModelShape, micro_batch: int, tp: int, half: bool,
               chunk: int = 0, params16: bool = False) -> tuple[int, int]:
    """(stored, transient in backward) of norm_f + lm_head + loss for one micro-batch;
    `chunk` > 0: train.loss_chunk's chunked loss (transient: in its forward)."""
    s, b, h, v = shape.block_size, micro_batch, shape.n_embd, shape.vocab_size
    rms = 4 * s * b * (h + 1) // tp if shape.llama else 0  # RMSNorm's fp32 copy + rsqrt
    normed = (2 if params16 and half and shape.llama else 4) * s * b * h // tp
    if chunk:
        n = min(chunk, s * b)
        stored = rms + normed + 4 * s * b * h + 4 * v * h // tp
        cast_h = 2 * s * b * h if half and not params16 else 0
        return stored, (6 if half else 4) * n * v // tp + cast_h
    logits = (2 if half else 4) * s * b * v // tp
    stored = rms + normed + (2 if half else 4) * s * b * h + logits + 4 * s * b * v // tp
    # under TP the vocabulary-parallel loss's backward holds one more fp32 logits shard (exp, its
    # sum, the gradient: measured, bench/plan_memory.py, llama 50k tp 2)
    return stored, (12 if tp > 1 else 8) * s * b * v // tp
