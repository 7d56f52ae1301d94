"""Bytes one rank holds while training: model state, activations, working copies, setup.

Owns the memory model of OUR code, per pipeline rank (the largest is what must fit):
- model state (model/optim.py, parallel/parallelize.py, train/precision.py): fp32 parameters,
  fp32 gradients and fused AdamW's fp32 m and v: 4 + 4 + 8 = 16 bytes per parameter in every
  precision (autocast keeps master weights fp32), divided by dp under FSDP. Under bf16 / fp16
  autocast adds a 16-bit copy of each Linear weight, alive from forward to the end of backward
  (+2 bytes per matmul parameter); FSDP instead holds the all-gathered 16-bit (fp32) parameters
  of the root (embeddings, never resharded) and of ~2 blocks (current + prefetched).
  The ZeRO paper's figure (2 fp16 param + 2 fp16 grad + 12 fp32 param, m, v = 16 B) is printed
  beside it: the same total, another split (our gradients are fp32).
- FSDP with one micro-batch (`fsdp_backward_sweep`): gradients start at None and are
  reduce-scattered block by block, so the peak is one point of the backward: activations of the
  blocks not yet done, one block's unsharded gradients, the previous block's fp32 reduce-scatter
  input (FSDP2 keeps one), the later blocks' gradient shards; on Gloo (Job.backend) each
  reduce-scatter also clones its fp32 input. Measured on 2 CPU ranks within 6% (docs/scale.md);
  summing every part instead over-counted by 20%.
- FSDP with grad_accum > 1 (`fsdp_accum_sweep`; runner.py: set_requires_gradient_sync(False) on
  all micro-batches but the last): gradients are reduced on the last micro-batch only, so each
  block's unsharded gradients stay after its backward, in fp32 (FSDP2 casts 16-bit ones to an
  fp32 copy), and the whole local model's (4 bytes per parameter) is held from the second
  micro-batch's forward on. The measured peak: the last micro-batch's backward of the last block
  (all activations, its new gradients, every block's accumulated gradients), or, activations
  being smaller, a later point of the walk where the reduce-scatters free them block by block.
  Measured on 2 and 4 CPU ranks within 3% (fp32, bf16, activation checkpointing, micro_batch 1,
  grad_accum 3: 0.97-1.01); summing every part at once over-counted by 14-25%. Under a pipeline
  (torch's stage keeps blocks unsharded between micro-batches) every part is still summed.
- DiLoCo (sync/diloco.py): fp32 anchor + outer momentum (+ start point and pending average with
  sync.overlap), and a round's flat fp32 delta + its average.
- activations: one block's, a checkpointed block's and the head's bytes (plan/activations.py),
  in the precision the layout gives the blocks (`params16`: FSDP's 16-bit parameters make the
  residual stream 16-bit); under context parallelism (parallel.cp) those of the s / cp tokens a
  rank holds, with the attention's own buffers (plan/context.py); FSDP shards over dp x cp
  (HSDP, Job.dp_shard: over dp_shard x cp only, `Job.shard_ranks`).
- peak = parameters + optimizer state + working copies + the highest activations + gradients of
  a step (FSDP with one micro-batch: the sweep above): with grad_accum > 1, micro-batches in
  flight (pipeline) or DDP (gradients are views of its buckets, allocated once) all gradients
  live through the forward passes and add; otherwise a backward sweep (`backward_sweep`) frees
  each block's activations as its gradients appear.
- setup (train/model_setup.py): with parallel.meta_init = true (the default) a rank holds its
  fp32 shard + one whole parameter at a time (initialized whole, then sliced: the largest is the
  embedding or an MLP matrix), measured within ~0.4 GB of that (docs/scale.md); with false,
  GPT(...) is built whole in fp32 on every rank, then moved and only then split: 4 bytes x all
  parameters per rank, on the host and on the GPU.
It must never format output (report.py) or count communication (comm.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from hpctrain.plan import context, moe, offload
from hpctrain.plan.activations import (activation_formula, checkpointed_layer_bytes,  # noqa: F401
                                       head_bytes, layer_activation_bytes, llama_layer_bytes,
                                       selective_op_layer_bytes)
from hpctrain.plan.layout import Job
from hpctrain.plan.shape import ModelShape
from hpctrain.plan.stages import layer_costs, split_stages, stages_of_rank

ADAM_BYTES = 8  # fused AdamW: exp_avg + exp_avg_sq, fp32
ZERO_PAPER = {"param (16-bit)": 2, "grad (16-bit)": 2, "fp32 param, m, v": 12}


@dataclass(frozen=True)
class Stage:
    """What one pipeline rank holds (parallel/pipeline.py's split)."""
    pp_rank: int
    block_ids: tuple[int, ...]
    has_first: bool
    has_last: bool
    in_flight: int  # micro-batches (interleaved: model chunks) whose activations it holds at once


def pipeline_stages(shape: ModelShape, job: Job) -> list[Stage]:
    """Every pipeline rank's blocks and in-flight micro-batches (1F1B: pp - r, GPipe: all,
    interleaved: Megatron's warm-up count + 1 chunks)."""
    m = job.grad_accum
    if job.pp == 1:
        return [Stage(0, tuple(range(shape.n_layer)), True, True, 1)]
    n_stages = job.pp * job.virtual
    bounds = split_stages(n_stages, *layer_costs(shape.n_layer, shape.n_embd, shape.block_size,
                                                 shape.vocab_size))
    out = []
    for r in range(job.pp):
        ids = stages_of_rank(r, job.pp, job.virtual)
        if job.pp_schedule == "gpipe":
            flight = m
        elif job.pp_schedule == "1f1b":
            flight = min(job.pp - r, m)
        else:
            flight = min((job.pp - r - 1) * 2 + (job.virtual - 1) * job.pp + 1, m * job.virtual)
        out.append(Stage(r, tuple(b for s in ids for b in bounds[s]), 0 in ids,
                         n_stages - 1 in ids, flight))
    return out


def params16(job: Job) -> bool:
    """Whether the blocks run on 16-bit parameters (FSDP2's MixedPrecisionPolicy under bf16 /
    fp16, dp > 1: parallel/parallelize.py), which makes the residual stream 16-bit (activations.py)."""
    return job.half and job.data_parallel == "fsdp" and job.grad_ranks > 1


def job_layer_bytes(shape: ModelShape, job: Job) -> int:
    """One block's stored activations for one micro-batch of `job` (a cp rank's tokens)."""
    return (layer_activation_bytes(context.local_shape(shape, job), job.micro_batch, job.tp, job.half,
                                   params16(job)) + context.stored_extra(shape, job))


def job_checkpointed_bytes(shape: ModelShape, job: Job) -> int:
    return checkpointed_layer_bytes(context.local_shape(shape, job), job.micro_batch, job.tp, params16(job))


def job_head_bytes(shape: ModelShape, job: Job) -> int:
    """The head's stored + transient bytes for one micro-batch of `job` (a cp rank's tokens)."""
    return sum(head_bytes(context.local_shape(shape, job), job.micro_batch, job.tp, job.half,
                          job.loss_chunk, params16(job)))


def job_selective_op_bytes(shape: ModelShape, job: Job) -> int:
    """A selective_op block's kept bytes for one micro-batch of `job` (a cp rank's tokens)."""
    return selective_op_layer_bytes(context.local_shape(shape, job), job.micro_batch, job.tp, job.half,
                                    params16(job)) + context.stored_extra(shape, job)


def is_wrapped(mode: str, layer: int, every: int) -> bool:
    """Whether activation checkpointing `mode` wraps block `layer` (parallel/activation.py)."""
    return mode in ("full", "selective_op") or (mode == "selective" and layer % every == 0)


def checkpointed_blocks(job: Job, stage: Stage) -> int:
    """How many of the stage's blocks activation checkpointing wraps."""
    return sum(1 for i in stage.block_ids if is_wrapped(job.activation_checkpoint, i, job.ac_every))


def _block_bytes(shape: ModelShape, job: Job, mode: str) -> tuple[int, int]:
    """(stored, recomputed in its backward) bytes of a block `mode` wraps: its input, or under
    selective_op its input and kept outputs, while the recomputation makes the rest of a block's."""
    full, ckpt = job_layer_bytes(shape, job), job_checkpointed_bytes(shape, job)
    if mode != "selective_op":
        return ckpt, full
    kept = min(job_selective_op_bytes(shape, job), full)
    return kept, full - kept + ckpt


def stage_activations(shape: ModelShape, job: Job, stage: Stage, mode: str) -> int:
    """Peak activation bytes of `stage` with activation checkpointing `mode`."""
    full, (ckpt, recomputed) = job_layer_bytes(shape, job), _block_bytes(shape, job, mode)
    wrapped = [i for i in stage.block_ids if is_wrapped(mode, i, job.ac_every)]
    kept = (len(stage.block_ids) - len(wrapped)) * full + len(wrapped) * ckpt
    per_chunk = kept // job.virtual if job.pp > 1 else kept
    stored = stage.in_flight * per_chunk
    if stage.has_last:
        stored += job_head_bytes(shape, job)
    return stored + (recomputed if wrapped else 0)  # one block recomputed in backward


@dataclass
class RankMemory:
    """Bytes on the largest pipeline rank (and its index); `parts` in report order."""
    stage: Stage
    local_params: int            # parameters this rank holds before FSDP sharding
    parts: dict = field(default_factory=dict)
    activations_by_mode: dict = field(default_factory=dict)
    peak: int = 0
    zero_paper: int = 0
    host: int = 0                # host bytes of offloaded state (parallel.offload: plan/offload.py)


def local_params(shape: ModelShape, job: Job, stage: Stage) -> tuple[int, int]:
    """(parameters, Linear weights autocast casts) this rank holds after TP and PP."""
    t = job.tp
    n = len(stage.block_ids) * shape.block_params_tp(t)
    mm = len(stage.block_ids) * shape.block_matmul_params_tp(t)
    sparse = len(moe.sparse_layers(shape, stage.block_ids))  # MoE: routed experts / ep (plan/moe.py)
    n += sparse * moe.extra_params(shape, job.ep, t)
    mm += sparse * (moe.extra_params(shape, job.ep, t) - shape.moe_experts)  # the router's bias is no matmul
    if stage.has_first:
        n += shape.embedding_params_tp(t) + shape.position_params_tp(t)
    if stage.has_last:
        n += shape.norm_f_params
        mm += shape.embedding_params_tp(t)  # lm_head (tied: a second copy on a later stage)
        if not (stage.has_first and shape.tied):
            n += shape.embedding_params_tp(t)
    return n, mm


def _fsdp_root_params(shape: ModelShape, job: Job, stage: Stage) -> int:
    """Parameters of FSDP's root group on this stage (embeddings, norm_f; never resharded)."""
    t, root = job.tp, 0
    if stage.has_first:
        root += shape.embedding_params_tp(t) + shape.position_params_tp(t)
    if stage.has_last:
        root += shape.norm_f_params + (0 if stage.has_first and shape.tied
                                       else shape.embedding_params_tp(t))
    return root


def _fsdp_buffers(shape: ModelShape, job: Job, stage: Stage) -> tuple[int, int]:
    """(all-gathered parameters held, gradient buffers of the block in backward) under FSDP: the
    root + 2 blocks (current + prefetched) in the parameter dtype; the block's unsharded gradients
    (parameter dtype) + the previous block's fp32 reduce-scatter input, kept until this block's
    reduce-scatter (FSDP2's reduce_scatter_max_input_buffers = 1). On Gloo the all-gather into a
    tensor allocates its whole output again (NCCL gathers in place): one block in the parameter
    dtype, while the next block is gathered, before this block's gradients exist: no higher."""
    pbytes, block = (2 if job.half else 4), shape.block_params_tp(job.tp)
    gathered = (_fsdp_root_params(shape, job, stage) + 2 * block) * pbytes
    return gathered, block * (pbytes + 4)


def fsdp_backward_sweep(shape: ModelShape, job: Job, stage: Stage) -> int:
    """Highest activations + FSDP buffers + gradients over one FSDP backward (gradients start at
    None, one micro-batch). Throughout: the gathered parameters (`_fsdp_buffers`) and the root's
    unsharded gradients (the tied head's, from the loss on). At the loss: all activations and the
    head's. In block i's backward (from the last): the activations of blocks <= i, its unsharded
    gradients, the fp32 reduce-scatter input of block i + 1 (kept until block i's reduce-scatter)
    and the fp32 shards of the later blocks' gradients. At block i's reduce-scatter: the activations
    of blocks < i, its fp32 input (+ Gloo's clone of it: Gloo reduces in place, so it all-reduces a
    copy and keeps its chunk) and the shards of blocks >= i."""
    blocks = _kept_per_block(shape, job, stage)
    pbytes, block = (2 if job.half else 4), shape.block_params_tp(job.tp)
    gathered, _ = _fsdp_buffers(shape, job, stage)
    shard = 4 * block // job.shard_ranks
    rs_input = 4 * block * (2 if job.backend == "gloo" else 1)
    high = sum(b for b, _ in blocks)
    if stage.has_last:
        high += job_head_bytes(shape, job)
    n = len(blocks)
    for i in range(n - 1, -1, -1):
        later = shard * (n - 1 - i)
        kept_input = 4 * block if i < n - 1 else 0
        in_block = (sum(b for b, _ in blocks[:i + 1]) + blocks[i][1]
                    + pbytes * block + kept_input + later)
        at_reduce = sum(b for b, _ in blocks[:i]) + rs_input + later + shard
        high = max(high, in_block, at_reduce)
    return gathered + pbytes * _fsdp_root_params(shape, job, stage) + high


def fsdp_accum_sweep(shape: ModelShape, job: Job, stage: Stage) -> int:
    """`fsdp_backward_sweep` with grad_accum > 1 (the runner's set_requires_gradient_sync(False) on
    every micro-batch but the last). Parameters are resharded after each block's backward, but its
    unsharded gradients stay, accumulated in fp32 (under bf16 FSDP2 casts them to fp32 after the
    block's backward; later micro-batches add into that copy). Throughout: the gathered parameters
    and the root's accumulated fp32 + newest 16-bit (fp32) gradients. First micro-batch, block i
    from the last: activations of blocks <= i, its new gradients (+ their fp32 copy under bf16) and
    the accumulated gradients of blocks > i. Every later one: at the loss all activations, the
    head's and every block's accumulated gradients; in block i's backward the activations of
    blocks <= i and its new gradients (the slot Gloo's all-gather temporary fills first) beside
    the accumulated ones: of every block, or in the last micro-batch of blocks <= i, with block
    i + 1's kept fp32 reduce-scatter input and the later blocks' shards. At block i's
    reduce-scatter: the accumulated gradients of blocks < i and its own copied into its fp32 input
    (then Gloo's clone of that).
    The micro-batches before the last never exceed the last one's block n-1 point (at most the same
    gradients beside fewer activations); they are walked all the same."""
    blocks = _kept_per_block(shape, job, stage)
    n = len(blocks)
    pbytes, block = (2 if job.half else 4), shape.block_params_tp(job.tp)
    acc, shard = 4 * block, 4 * block // job.shard_ranks
    rs_input = 4 * block * (2 if job.backend == "gloo" else 1)
    convert = 4 * block if job.half else 0  # bf16 gradients cast to an fp32 copy, both alive

    def kept(i: int) -> int:  # activations of blocks < i
        return sum(b for b, _ in blocks[:i])

    head = (job_head_bytes(shape, job)
            if stage.has_last else 0)
    high = kept(n) + head + acc * n  # the loss of every micro-batch after the first
    for i in range(n - 1, -1, -1):
        here = kept(i + 1) + blocks[i][1] + pbytes * block  # block i's backward
        first = here + convert + acc * (n - 1 - i)
        middle = here + acc * n if job.grad_accum > 2 else 0
        later = shard * (n - 1 - i)
        last = here + acc * (i + 1) + (4 * block if i < n - 1 else 0) + later
        at_reduce = kept(i) + acc * i + later + max(acc + 4 * block, rs_input + shard)
        high = max(high, first, middle, last, at_reduce)
    gathered, _ = _fsdp_buffers(shape, job, stage)
    return gathered + (4 + pbytes) * _fsdp_root_params(shape, job, stage) + high


def rank_memory(shape: ModelShape, job: Job, stage: Stage) -> RankMemory:
    n, mm = local_params(shape, job, stage)
    shard = job.shard_ranks if job.data_parallel == "fsdp" else 1
    fsdp = job.data_parallel == "fsdp" and job.grad_ranks > 1
    kept = functools.partial(moe.sharded_bytes, shape, job, stage.block_ids, n, shard)
    parts = {"parameters (fp32)": kept(4), "gradients (fp32)": kept(4), "AdamW m, v (fp32)": kept(ADAM_BYTES)}
    if fsdp:
        gathered, grad_transient = _fsdp_buffers(shape, job, stage)
        parts["FSDP all-gathered params"] = gathered
        parts["FSDP unsharded grad (transient)"] = grad_transient
        if job.grad_accum > 1:
            parts["FSDP accumulated grads (grad_accum > 1)"] = 4 * n
    elif job.half:
        parts["16-bit weight copies (autocast)"] = 2 * mm
    if job.sync_mode == "diloco":
        parts["DiLoCo anchor + momentum"] = 8 * n * (2 if job.overlap else 1)
        parts["DiLoCo round delta + average (transient)"] = 8 * n
    modes = ("none", "selective", "full") + (("selective_op",) if job.activation_checkpoint == "selective_op" else ())
    by_mode = {m: stage_activations(shape, job, stage, m) for m in modes}
    parts["activations"] = by_mode[job.activation_checkpoint]
    if job.cp > 1:
        parts[f"cp {job.cp_attention} attention buffers (transient)"] = context.transient_bytes(shape, job)
    out = RankMemory(stage, n, offload.device_parts(parts, job), by_mode)  # on the GPU
    out.host = offload.host_bytes_per_rank(parts, job)
    out.peak = _peak(shape, job, stage, out.parts)
    out.zero_paper = kept(16)
    return out


def _kept_per_block(shape: ModelShape, job: Job, stage: Stage) -> list[tuple[int, int]]:
    """(stored bytes, bytes its recomputation makes in its backward: 0 unless checkpointed) of
    each of the stage's blocks for one micro-batch."""
    full = job_layer_bytes(shape, job)
    ckpt, recomputed = _block_bytes(shape, job, job.activation_checkpoint)
    wrapped = [is_wrapped(job.activation_checkpoint, i, job.ac_every) for i in stage.block_ids]
    return [(ckpt, recomputed) if w else (full, 0) for w in wrapped]


def backward_sweep(shape: ModelShape, job: Job, stage: Stage) -> int:
    """Highest activations + gradients over one backward when gradients start at zero: at the
    loss (all activations, the head's gradient (under train.loss_chunk: the head's dW, counted
    once), the loss's transient), then at each block from the
    last (the activations of the blocks before it, its recomputation if checkpointed, and the
    gradients of it and the blocks after it)."""
    blocks = _kept_per_block(shape, job, stage)
    block_grad = 4 * shape.block_params_tp(job.tp)
    head_grad, head, dw = 0, 0, 0
    if stage.has_last:
        head_grad = 4 * shape.embedding_params_tp(job.tp)
        head = job_head_bytes(shape, job)
        dw = head_grad if job.loss_chunk else 0  # the chunked loss's dW becomes the head's grad
    high = sum(b for b, _ in blocks) + head + head_grad - dw
    for i in range(len(blocks) - 1, -1, -1):
        here = (sum(b for b, _ in blocks[:i + 1]) + blocks[i][1] + head_grad
                + block_grad * (len(blocks) - i))
        high = max(high, here)
    return high


def _peak(shape: ModelShape, job: Job, stage: Stage, p: dict) -> int:
    grads = p["gradients (fp32)"]
    state = p["parameters (fp32)"] + p["AdamW m, v (fp32)"] + p.get("DiLoCo anchor + momentum", 0)
    work = (p.get("16-bit weight copies (autocast)", 0) + p.get("FSDP all-gathered params", 0)
            + p.get("FSDP unsharded grad (transient)", 0)
            + p.get("FSDP accumulated grads (grad_accum > 1)", 0))
    acts = p["activations"] + p.get(f"cp {job.cp_attention} attention buffers (transient)", 0)
    ddp_buckets = (job.data_parallel == "ddp" and job.grad_ranks > (job.replicas or 1)
                   and (job.sync_mode == "sync" or job.replicas > 0)  # hierarchical: DDP inside
                   and job.tp == 1 and job.pp == 1)  # gradient_as_bucket_view: grads never freed
    fsdp = job.data_parallel == "fsdp" and job.grad_ranks > 1
    if fsdp and stage.in_flight == 1 and (job.grad_accum == 1 or job.pp == 1):
        sweep = fsdp_backward_sweep if job.grad_accum == 1 else fsdp_accum_sweep
        cp_buffers = acts - p["activations"]
        return state + max(sweep(shape, job, stage) + cp_buffers,  # reduce-scattered block by block
                           grads + _tp_embedding_grad(shape, job, stage))
    if fsdp:  # pipelines (torch's stage: reshard_after_backward(False) until the last
        # micro-batch; not measured): every FSDP part summed at once
        head_grad = 4 * shape.embedding_params_tp(job.tp) if stage.has_last else 0
        during = acts + head_grad // job.shard_ranks + grads
    elif ddp_buckets or job.grad_accum > 1 or stage.in_flight > 1:
        during = acts + grads  # gradients live through the forward passes
    else:
        during = backward_sweep(shape, job, stage) + acts - p["activations"]  # + cp's buffers
    step_end = (grads + p.get("DiLoCo round delta + average (transient)", 0)
                + _tp_embedding_grad(shape, job, stage))
    return state + max(work + during, step_end)


def _tp_embedding_grad(shape: ModelShape, job: Job, stage: Stage) -> int:
    """Under TP the vocabulary-parallel embedding's backward (aten::embedding_dense_backward)
    allocates a gradient for the whole [vocab, width] table, not this rank's shard, at the end of
    the backward while every other gradient is alive (measured: 24.6 MiB at vocab 50,304 x 128 on
    2 ranks, bench/plan_memory.py --top)."""
    return 4 * shape.vocab_size * shape.n_embd if job.tp > 1 and stage.has_first else 0


def largest_rank(shape: ModelShape, job: Job) -> RankMemory:
    """The pipeline rank with the highest peak (all ranks of one pipeline rank are alike)."""
    return max((rank_memory(shape, job, s) for s in pipeline_stages(shape, job)), key=lambda r: r.peak)


def largest_parameter(shape: ModelShape) -> int:
    """Elements of the largest single parameter: the embedding (or head), an MLP matrix or pos_emb."""
    c = shape.n_embd
    return max(shape.vocab_size * c, shape.ffn * c, shape.position_params)


def setup_bytes(shape: ModelShape, job: Job, rank: RankMemory) -> dict:
    """Bytes a rank holds while the model is built and split (train/model_setup.py)."""
    if not job.meta_init:  # the whole fp32 model on every rank, then split
        whole = 4 * shape.total_params()
        return {"per rank (host, then GPU)": whole, "per node (host)": whole * job.gpus_per_node}
    one = 4 * largest_parameter(shape)  # initialized whole, then this rank's slice copied
    shard = rank.parts["parameters (fp32)"]
    return {"per rank (host, then GPU)": shard + one, "per node (host)": one * job.gpus_per_node}
