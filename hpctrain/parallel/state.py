"""Layout-free checkpoint state of a parallelized model and its optimizer.

Owns: the tensors a checkpoint holds for the model and the optimizer, keyed by the original FQNs
whatever the layout (torch.distributed.checkpoint.state_dict), and the one key renaming the layout
needs: on the last pipeline stage the tied embedding / head weight's optimizer state is saved and
loaded under its first name, tok_emb.weight, as in an unsplit model (the first stage writes the
same values under the same key). It must never write files or choose what to save when (the
checkpoint manager and the loop do), and never save optimizer hyper-parameters: they come from the
config (lr from the step).
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from hpctrain.parallel.parallelize import Layout

# Optimizer state keyed "state.<fqn>.<name>": the same keys on every layout and pipeline stage.
_SD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_TIED_LAST, _TIED_FIRST = "state.lm_head.weight.", "state.tok_emb.weight."


def checkpoint_state(layout: Layout, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": ..., "optim": ...} tensors with layout-free FQNs, for CheckpointManager."""
    model_sd, optim_sd = get_state_dict(layout.module, optimizer, options=_SD_OPTIONS)
    optim = {}
    for k, v in optim_sd.items():
        if isinstance(v, torch.Tensor):
            if layout.tied_weight_is_head_copy and k.startswith(_TIED_LAST):
                k = _TIED_FIRST + k[len(_TIED_LAST):]
            optim[k] = v
    return {"model": model_sd, "optim": optim}


def load_checkpoint_state(layout: Layout, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Apply a `checkpoint_state()` dict filled by CheckpointManager.load (any saved layout)."""
    _, current = get_state_dict(layout.module, optimizer, options=_SD_OPTIONS)
    optim = {k: v for k, v in current.items() if not isinstance(v, torch.Tensor)}
    for k, v in state["optim"].items():
        if layout.tied_weight_is_head_copy and k.startswith(_TIED_FIRST):
            k = _TIED_LAST + k[len(_TIED_FIRST):]
        optim[k] = v
    set_state_dict(layout.module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=optim, options=_SD_OPTIONS)
