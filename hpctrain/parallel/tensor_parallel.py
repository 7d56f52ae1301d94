"""Tensor (+ sequence) parallelism for the GPT and Llama with DTensor: `apply_tensor_parallel(model, tp_mesh)`.

Owns: the plan (which module is column-/row-parallel, where activations are sequence-sharded) and
re-tying the shared embedding / head weight after sharding. It must never edit the model's code or
parameter names, and works on a whole model or a pipeline stage (pieces set to None are skipped).

Layouts, per block (Megatron-style with sequence parallelism, as in torchtitan):
  residual stream       local [B, T/tp, C]   (Shard(1): each TP rank holds a slice of the sequence)
  norm1, norm2          SequenceParallel     (weights replicated, activations stay sequence-sharded)
  attn / mlp input      all-gather to Replicate
  wq, wk, wv, mlp.fc    ColwiseParallel      (each rank computes n_head / tp heads, 4C / tp hidden;
  (llama: mlp.gate/up)                        llama: n_kv_head / tp key/value heads, rotary inside)
  wo, mlp.proj          RowwiseParallel      (reduce-scatter back to Shard(1))
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
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)


def _mlp_plan(mlp: nn.Module) -> dict:
    """GPT's fc, or llama's SwiGLU gate and up: column-parallel; proj: row-parallel."""
    cols = ("gate", "up") if hasattr(mlp, "gate") else ("fc",)
    return {**{f"mlp.{c}": ColwiseParallel() for c in cols},
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard `model` (a GPT or a pipeline stage of one) in place over `tp_mesh`."""
    tied = (model.tok_emb is not None and model.lm_head is not None
            and model.lm_head.weight is model.tok_emb.weight)
    plan = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.tok_emb is not None and model.pos_emb is not None:  # llama: rotary, no table
        plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    if model.norm_f is not None:
        plan["norm_f"] = SequenceParallel()
    if model.lm_head is not None:
        # train.loss_chunk: the head returns the gathered hidden states (Replicate) for the
        # chunked vocabulary-parallel loss (hpctrain/parallel/loss.py) instead of logits
        chunked = getattr(model.lm_head, "returns_hidden", False)
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1),
                                          output_layouts=Replicate() if chunked else Shard(-1),
                                          use_local_output=False)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, {
            "norm1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "norm2": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            **_mlp_plan(block.mlp),
        })
    if tied:
        model.lm_head.weight = model.tok_emb.weight
