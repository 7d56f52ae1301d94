"""Activation checkpointing applied from outside: wrap whole transformer blocks with torch's
checkpoint wrapper, so their activations are recomputed in backward instead of stored. And
`train.compile`, applied the same way: per block (`compile_regions`) or the whole forward in place
(`compile_whole_model`), as train.compile_scope says (`compile_scope`).

Owns: which blocks are wrapped ("full": all; "selective": blocks 0, N, 2N, ... of the model, by
their original index, so a pipeline stage wraps the same blocks the unsplit model would;
"selective_op": all, each with the per-op policy of op_checkpoint.py), and in a fully
checkpointed block with a MoE layer the one thing kept from the forward: the routing counts' host
copy. It must
never change parameter names as checkpoints see them: the wrapper's `_checkpoint_wrapped_module.`
prefix is stripped by torch.distributed.checkpoint.state_dict.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from hpctrain.model.moe import MoEFeedForward
from hpctrain.parallel.op_checkpoint import op_policy_contexts


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> int:
    """Wrap blocks of `model.blocks` (a ModuleDict keyed by layer index) in place; returns how many."""
    if mode == "none":
        return 0
    wrapped = 0
    for key in list(model.blocks.keys()):
        if mode in ("full", "selective_op") or int(key) % every == 0:
            block = model.blocks[key]
            moe = any(isinstance(m, MoEFeedForward) for m in block.modules())
            extra = {"context_fn": _keep_host_copies_context} if moe else {}
            if mode == "selective_op":
                extra = {"context_fn": op_policy_contexts}
            model.blocks[key] = checkpoint_wrapper(block, preserve_rng_state=True, **extra)
            wrapped += 1
    return wrapped


def _keep_host_copy(ctx, func, *args, **kwargs):
    """Selective checkpointing policy of a block with a MoE layer: the host copy of the layer's
    routing counts (`.to("cpu", copy=True)`: a device->host sync on a GPU) is kept from the
    forward, everything else recomputed as in full checkpointing (#49: the recomputation read the
    counts on the host again, a second sync per layer)."""
    from torch.utils.checkpoint import CheckpointPolicy

    to_host = func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu")
    return CheckpointPolicy.MUST_SAVE if to_host else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_host_copies_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_host_copy)


def compile_scope(requested: str, device: torch.device, layout_allows_model: bool,
                  has_experts: bool) -> str:
    """train.compile_scope resolved: "auto" is the whole model on CUDA where the layout allows it
    and the model has no experts (an H200 ran GPT-2's shape 1.20x and Llama's 1.16x faster
    compiled whole than per block: docs/benchmarks.md), else per block (on a CPU the two ran alike
    and the whole model takes ~2.5x the compile time; a mixture of experts reads its routing counts
    on the host, which breaks a whole-model graph in every layer)."""
    if requested != "auto":
        return requested
    whole = device.type == "cuda" and layout_allows_model and not has_experts
    return "model" if whole else "blocks"


def compile_blocked(device: torch.device) -> str | None:
    """Why torch.compile cannot build its kernels on `device` here (None: it can). On a CPU,
    Inductor links C++ against torch's and Python's library folders, passed unquoted to the
    linker (pytorch/pytorch#191010, torch 2.13): a folder with whitespace in its path fails every
    compile at the first forward with a linker traceback, so it is refused up front instead."""
    if device.type != "cpu":
        return None
    import sysconfig
    folders = [os.path.join(os.path.dirname(torch.__file__), "lib"), sysconfig.get_config_var("LIBDIR") or ""]
    spaced = next((f for f in folders if any(c.isspace() for c in f)), None)
    if spaced is None:
        return None
    return (f"torch.compile's C++ build cannot link against a library folder whose path holds a "
            f"space ({spaced}; pytorch/pytorch#191010): install the environment under a path "
            f"without spaces, or set train.compile = false")


def compile_whole_model(model: nn.Module) -> None:
    """train.compile_scope = model: the model's whole forward torch.compile'd in place
    (nn.Module.compile: parameter names, state_dict and hooks unchanged). Under DDP, which calls
    this module, dynamo's DDP optimizer splits the graph at the gradient buckets so the all-reduce
    still overlaps backward. A chunked loss head returns the hidden states and compiles its chunks."""
    model.compile()
    if getattr(model.lm_head, "returns_hidden", False):
        model.lm_head.compiled = True


def compile_regions(model: nn.Module) -> int:
    """train.compile, regionally as torchtitan does: each block's forward is torch.compile'd in
    place (one compile serves every block of the same shape: ~10 s on CPU instead of minutes for
    the whole model), so parameter names stay as they are and the hooks of DDP, FSDP2 and the
    checkpoint wrapper stay outside the compiled code; a chunked loss head compiles its chunks
    (loss.py). Returns how many blocks."""
    for block in model.blocks.values():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        inner.forward = torch.compile(inner.forward)
    if getattr(model.lm_head, "returns_hidden", False):
        model.lm_head.compiled = True
    return len(model.blocks)
