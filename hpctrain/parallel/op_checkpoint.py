"""Per-op selective activation checkpointing (`parallel.activation_checkpoint = "selective_op"`):
every block is checkpoint-wrapped, and a policy (torch.utils.checkpoint's
create_selective_checkpoint_contexts, as torchtitan's per-op SAC) keeps the outputs of the ops
that are expensive to recompute and recomputes the rest (norms, rotary, activations, casts, adds:
cheap elementwise work) in backward.

Kept (`SAVED_OPS`): the matmuls (mm, addmm, bmm, baddbmm: every nn.Linear reaches one of them),
the grouped expert matmul (`_grouped_mm`), and attention: the fused SDPA kernels (CUDA flash,
memory-efficient, cuDNN, the CPU's fused flash op, a backend's overrideable one), whose outputs
include the log-sum-exp their backward reads; plus a MoE layer's routing (`topk`) and the host copy
of its counts (`.to("cpu")`: a device->host sync, #49). Unlike torchtitan's variant every matmul
is kept (not every other one): one rule, and the planner counts it (plan/activations.py).

Recomputed whatever its op:
- an SDPA call with dropout_p > 0: its kernel draws from the RNG, and a cached output would not
  advance the generator in the recomputation, so later dropouts would draw other masks;
- every op inside a custom autograd.Function's forward (grad mode off there): such a Function
  saves its own tensors for backward (context parallelism's ring and all-to-all attention: its
  blockwise kernels and communication run again, as under "full"), and caching its matmuls would
  keep what the Function itself never saves (the score blocks of the fp32 matmul path).
It must never change parameter names (the wrapper's prefix is stripped by DCP's state_dict) nor
the numbers: a cached output is the forward's own tensor, recomputed ops run in the same order with
the RNG state restored (`preserve_rng_state`).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
_SDPA_OPS = frozenset({
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_fused_attention_overrideable.default,
})
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._grouped_mm.default, _aten.topk.default,
}) | _SDPA_OPS


def _dropout_p(func, args, kwargs) -> float:
    """The SDPA kernel's dropout probability (positional argument 3 in every variant above but
    the efficient one, whose 4th is compute_log_sumexp and 5th dropout_p)."""
    if "dropout_p" in kwargs:
        return kwargs["dropout_p"]
    index = 5 if func is _aten._scaled_dot_product_efficient_attention.default else 3
    value = args[index] if len(args) > index else 0.0
    return value if isinstance(value, float) else 0.0


def op_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """MUST_SAVE for the ops the module docstring names, PREFER_RECOMPUTE for the rest."""
    if func is _aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
        return CheckpointPolicy.MUST_SAVE
    if func not in SAVED_OPS or not torch.is_grad_enabled():
        return CheckpointPolicy.PREFER_RECOMPUTE
    if func in _SDPA_OPS and _dropout_p(func, args, kwargs) > 0.0:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def op_policy_contexts():
    """The checkpoint wrapper's context_fn for `op_policy`."""
    return create_selective_checkpoint_contexts(op_policy)
