"""Tensor (+ sequence) parallelism with DTensor: `apply_tensor_parallel(model, tp_mesh, block_styles)`.

Owns: turning a family's per-block styles (its ModelSpec.block_tp_plan, hpctrain/model/<arch>/spec.py:
which submodule is column-/row-parallel, whose input is gathered, which norm is sequence-parallel,
which is a MoE layer) into DTensor plans, the ends' plan (the module contract of model/spec.py:
tok_emb, pos_emb, norm_f, lm_head) and re-tying the shared embedding / head weight after sharding. It must never edit the model's code or
parameter names, and works on a whole model or a pipeline stage (pieces set to None are skipped).

Layouts, per block (Megatron-style with sequence parallelism, as in torchtitan):
  residual stream       local [B, T/tp, C]   (Shard(1): each TP rank holds a slice of the sequence)
  norm1, norm2          SequenceParallel     (weights replicated, activations stay sequence-sharded)
  attn / mlp input      all-gather to Replicate
  wq, wk, wv, mlp.fc    ColwiseParallel      (each rank computes n_head / tp heads, 4C / tp hidden;
  (llama: mlp.gate/up)                        llama: n_kv_head / tp key/value heads, rotary inside)
  wo, mlp.proj          RowwiseParallel      (reduce-scatter back to Shard(1))
  (styles "gather", "norm", "colwise", "rowwise"; "experts" for a MoE layer, below)
Ends:
  tok_emb               vocab-parallel (RowwiseParallel on the [V, C] table: rows sharded), output
                        reduce-scattered to Shard(1); pos_emb the same on the [T, C] table
  norm_f                SequenceParallel
  lm_head               ColwiseParallel, output logits sharded over the vocabulary (Shard(-1)) and
                        left as a DTensor so `loss_parallel()` computes the cross-entropy without
                        gathering [B, T, V]
Tied weights: tok_emb.weight [V, C] (rows = vocab) and lm_head.weight [V, C] (out = vocab) both get
Shard(0) on the same mesh, so the tie is restored by pointing lm_head at tok_emb's DTensor: one
sharded parameter, gradients from both uses accumulate into it (exactly as unsharded).
Without sequence parallelism (parallel.sp = false, Megatron's plain TP): the residual stream stays
whole [B, T, C] on every tp rank, wo / proj / the embeddings all-reduce to Replicate instead of
reduce-scattering, and the norms' weights are Replicate DTensors run on their local tensors (every
tp rank computes the same norm, so their gradients are equal without a reduction).

Mixture-of-experts layers (Llama with model.moe_*; torchtitan without expert-tensor parallelism):
the router and the experts are NOT split over tp. Their weights become DTensors Replicate over the
tp mesh (so optimizer, clipping, grad norm and checkpoints treat them as the norms' weights), the
layer runs on plain local tensors (`_run_on_local_weights`) and is given this rank's sequence
shard [B, T/tp, C] as a local tensor (no all-gather); its output goes back as Shard(1). Every tp
rank thus routes different tokens, so the layer's gradients are partial sums: the runner sums them
over tp after backward (`sum_moe_grads_over_tp`), the MoE monitor sums the loads over tp too, and
the auxiliary loss is weighed 1 / tp per rank (the mean of the ranks' losses, as over dp). Without
SP every tp rank routes the whole sequence: same gradients and loads, nothing summed. Expert
parallelism (apply_expert.py) then shards the experts over ep ranks at the same tp coordinate.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.utils.stateless import _reparametrize_module

from hpctrain.distributed.dtensor import is_dtensor

if TYPE_CHECKING:  # DTensor is imported where tp > 1 only (distributed/dtensor.py)
    from torch.distributed.tensor import Replicate, Shard


def _block_plan(block: nn.Module, styles: dict[str, str], seq: Shard | Replicate,
                sequence_parallel: bool) -> tuple[dict, list[nn.Module], list[nn.Module]]:
    """The DTensor plan of one block from its family's styles (ModelSpec.block_tp_plan), the
    norms whose weights are replicated and run locally (no SP), and the MoE layers ("experts")."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleInputOutput, RowwiseParallel,
                                                   SequenceParallel)

    plan, local_norms, experts = {}, [], []
    for path, style in styles.items():
        if style == "partial":  # replicated weights on a local part (heads): handled by the caller
            continue
        if style == "gather":  # the input all-gathered (SP) to whole
            plan[path] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        elif style == "gather_local":  # the same, handed over as a local tensor
            plan[path] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                            use_local_output=True)
        elif style in ("replicate", "replicate_sum_grad"):  # whole input, replicated weights run locally
            local_norms.append(block.get_submodule(path))
        elif style == "colwise":
            plan[path] = ColwiseParallel()
        elif style == "rowwise":  # its output back to the residual stream's layout
            plan[path] = RowwiseParallel(output_layouts=seq)
        elif style == "norm" and sequence_parallel:
            plan[path] = SequenceParallel()
        elif style == "norm":
            local_norms.append(block.get_submodule(path))
        elif style == "experts":  # the tokens this rank holds in as a local tensor, out as `seq`
            plan[path] = PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(seq,), use_local_input=True,
                output_layouts=(seq,), desired_output_layouts=(seq,))
            experts.append(block.get_submodule(path))
        else:
            raise ValueError(f"tensor-parallel style {style!r} of {path!r}: expected gather, "
                             f"gather_local, colwise, rowwise, norm, experts, partial, replicate or "
                             f"replicate_sum_grad (hpctrain/model/spec.py)")
    return plan, local_norms, experts


def _ends_plan(model: nn.Module, seq: Shard | Replicate) -> dict:
    """The embeddings (vocab-parallel, output in the residual stream's layout `seq`) and the head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.tok_emb is not None and model.pos_emb is not None:  # llama: rotary, no table
        plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=Shard(0) if seq == Shard(1) else seq)
    if model.norm_f is not None and seq == Shard(1):
        plan["norm_f"] = SequenceParallel()
    if model.lm_head is not None:
        # train.loss_chunk: the head returns the gathered hidden states (Replicate) for the
        # chunked vocabulary-parallel loss (hpctrain/parallel/loss.py) instead of logits
        chunked = getattr(model.lm_head, "returns_hidden", False)
        plan["lm_head"] = ColwiseParallel(input_layouts=seq,
                                          output_layouts=Replicate() if chunked else Shard(-1),
                                          use_local_output=False)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, block_styles: Callable[[int], dict[str, str]],
                          sequence_parallel: bool = True) -> None:
    """Shard `model` (a whole model or a pipeline stage of one) in place over `tp_mesh`; each
    block by `block_styles(layer)`, its family's ModelSpec.block_tp_plan. Without
    `sequence_parallel` (parallel.sp = false) the residual stream stays whole on every tp rank
    (Megatron's plain TP: wo / proj all-reduce instead of reduce-scatter) and the norms run on
    their replicated weights' local tensors."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    seq = Shard(1) if sequence_parallel else Replicate()
    tied = (model.tok_emb is not None and model.lm_head is not None
            and model.lm_head.weight is model.tok_emb.weight)
    plan = _ends_plan(model, seq)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    norms = [model.norm_f] if model.norm_f is not None and not sequence_parallel else []
    for layer, block in model.blocks.items():
        block_plan, local_norms, experts = _block_plan(block, block_styles(int(layer)), seq,
                                                       sequence_parallel)
        parallelize_module(block, tp_mesh, block_plan)
        norms += local_norms
        for moe in experts:
            _replicate(moe, tp_mesh, splits_tokens=sequence_parallel)
        for path in [p for p, style in block_styles(int(layer)).items() if style == "partial"]:
            _replicate_partial(block.get_submodule(path), tp_mesh)
        for path in [p for p, style in block_styles(int(layer)).items() if style == "replicate_sum_grad"]:
            _sum_output_grad_over_tp(block.get_submodule(path), tp_mesh)
    for norm in norms:
        _replicate(norm, tp_mesh, splits_tokens=False)
    if tied:
        model.lm_head.weight = model.tok_emb.weight


def _replicate(module: nn.Module, tp_mesh: DeviceMesh, splits_tokens: bool) -> None:
    """`module`'s weights as DTensors Replicate over tp (so optimizer, clipping, grad norm and
    checkpoints treat them as every other TP weight), its forward run on their local tensors.
    `splits_tokens` (a MoE layer under SP): the tp ranks route different tokens; the layer
    remembers that tp group (`tp_token_group`: gradients and loads are summed over it)."""
    from torch.distributed.tensor import distribute_module

    distribute_module(module, tp_mesh)  # no partition function: every parameter Replicate
    if splits_tokens:
        module.tp_token_group = tp_mesh.get_group()
    _run_on_local_weights(module, tp_mesh, dist.get_world_size(tp_mesh.get_group()) if splits_tokens else 1)


def _replicate_partial(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Style "partial": `module` (e.g. a per-head norm after a column-parallel projection) sees
    a different part on each tp rank (its heads), as a local tensor; its weights are Replicate
    DTensors run on their local tensors, and its gradients, each rank's partial sums, are summed
    over tp after backward (as a token-split MoE layer's: `tp_token_group`)."""
    from torch.distributed.tensor import distribute_module

    distribute_module(module, tp_mesh)
    module.tp_token_group = tp_mesh.get_group()
    _run_on_local_weights(module, tp_mesh, 1)


def _sum_output_grad_over_tp(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Style "replicate_sum_grad": `module` computes the same (local) output on every tp rank,
    which each rank uses with its own part (e.g. MLA's one rope key, used by every rank's heads),
    so each rank's gradient of it is a partial sum: identity forward, the gradient summed over tp
    in backward (the output marked Replicate and read back with a Partial gradient), so its
    weights' and its input's gradients are whole on every rank."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def hook(_module, _args, output):
        whole = DTensor.from_local(output, tp_mesh, (Replicate(),), run_check=False)
        return whole.to_local(grad_placements=(Partial(),))
    module.register_forward_hook(hook)


def _run_on_local_weights(module: nn.Module, tp_mesh: DeviceMesh, token_shares: int) -> None:
    """`module`'s forward sees its tp-replicated weights as plain local tensors (to_local: the
    gradients land in the DTensors' .grad, Replicate, as this rank's sums). Weights on another
    mesh (expert-parallel shards) are left to their module. A MoE layer's auxiliary loss is
    weighed 1 / `token_shares` (the mean of the tp ranks' when each routes T / tp tokens)."""
    from torch.distributed.tensor import DTensor

    inner = module.forward

    def forward(*args, **kwargs):
        local = {name: p.to_local() for name, p in module.named_parameters()
                 if isinstance(p, DTensor) and p.device_mesh is tp_mesh}
        scale = getattr(module, "aux_scale", None)
        if token_shares > 1:
            module.aux_scale = scale / token_shares
        try:
            with _reparametrize_module(module, local):
                return inner(*args, **kwargs)
        finally:
            if token_shares > 1:
                module.aux_scale = scale
    module.forward = forward


def tp_token_split_moe(model: nn.Module) -> tuple[list[nn.Module], dist.ProcessGroup | None]:
    """The modules whose tp ranks see different parts (MoE layers routing different tokens under
    SP, "partial" modules), whose gradients are summed over tp, and that tp group (None: none)."""
    layers = [m for m in model.modules() if getattr(m, "tp_token_group", None) is not None]
    return layers, layers[0].tp_token_group if layers else None


def sum_moe_grads_over_tp(layers: list[nn.Module], group: dist.ProcessGroup) -> None:
    """After backward: each tp rank's MoE gradients are its tokens' partial sums; make every rank's
    the sum over the tp group (one flat all-reduce for all layers; expert shards included)."""
    grads = [p.grad.to_local() if is_dtensor(p.grad) else p.grad
             for m in layers for p in m.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    for g, v in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(v.view_as(g))
