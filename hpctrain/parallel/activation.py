"""Activation checkpointing applied from outside: wrap whole transformer blocks with torch's
checkpoint wrapper, so their activations are recomputed in backward instead of stored. And
`train.compile`, applied the same way, per block (`compile_regions`).

Owns: which blocks are wrapped ("full": all; "selective": blocks 0, N, 2N, ... of the model, by
their original index, so a pipeline stage wraps the same blocks the unsplit model would). It must
never change parameter names as checkpoints see them: the wrapper's `_checkpoint_wrapped_module.`
prefix is stripped by torch.distributed.checkpoint.state_dict.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> int:
    """Wrap blocks of `model.blocks` (a ModuleDict keyed by layer index) in place; returns how many."""
    if mode == "none":
        return 0
    wrapped = 0
    for key in list(model.blocks.keys()):
        if mode == "full" or int(key) % every == 0:
            model.blocks[key] = checkpoint_wrapper(model.blocks[key], preserve_rng_state=True)
            wrapped += 1
    return wrapped


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
