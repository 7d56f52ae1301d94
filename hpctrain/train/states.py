"""What a training checkpoint holds, as objects with state_dict() / load_state_dict()
(torch.distributed.checkpoint.stateful.Stateful), handed to CheckpointManager.save_states as one
dict {name: object}. The names are the checkpoint's top-level keys:

    model    this rank's parameters under layout-free FQNs (ModelState; DiLoCo: the global model;
             LoRA: the adapters and a pointer to the frozen base)
    optim    the optimizer's tensors, "state.<fqn>.<name>" on every layout (OptimState)
    trainer  step, world size, config, tokenizer (the trainer itself)
    sampler  the data order's position        rng  every rank's dropout stream (RNGStates)
    loss_scaling  fp16's scaler                sync  the sync strategy's own state (DiLoCo, ps)

Owns: turning live objects into those entries and back. It must never write files (the manager
does) or decide what a mode saves (the strategy's checkpoint_states does).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hpctrain.errors import UserError
from hpctrain.parallel.lora import is_adapter
from hpctrain.train import rng

LORA_BASE_KEY = "lora_base"  # the model entry's pointer to LoRA's frozen base

_TIED_LAST, _TIED_FIRST = "state.lm_head.weight.", "state.tok_emb.weight."


def _sd():
    """(torch.distributed.checkpoint.state_dict, our options), imported on the first save or load:
    DCP imports DTensor and sympy (~0.5 s CPU per rank), which a run's start-up does not need.
    Optimizer state keyed "state.<fqn>.<name>": the same keys on every layout and pipeline stage."""
    from torch.distributed.checkpoint import state_dict as sd

    return sd, sd.StateDictOptions(flatten_optimizer_state_dict=True)


def _inner(t: torch.Tensor) -> torch.Tensor:
    """A tensor subclass that only wraps one plain tensor of its own shape and dtype (torchao's
    float8 FSDP weights: WeightWithDynamicFloat8CastTensor) -> that tensor (same storage); else t."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return t
    names, _ = t.__tensor_flatten__()
    inner = getattr(t, names[0]) if len(names) == 1 else None
    keep = inner is not None and inner.shape == t.shape and inner.dtype == t.dtype
    return inner if keep and not is_traceable_wrapper_subclass(inner) else t


def plain_tensors(state: dict) -> dict:
    """`state` with wrapper-subclass tensors (and DTensor shards holding one) replaced by the plain
    tensors they wrap, sharing storage: a checkpoint holds plain tensors only, which any process
    loads with weights_only (no torchao import needed to sample or export an fp8 run's
    checkpoint), and DCP's in-place load still writes the parameters' own storage."""
    from hpctrain.distributed.dtensor import is_dtensor

    out = {}
    for key, v in state.items():
        if is_dtensor(v) and _inner(v.to_local()) is not v.to_local():
            from torch.distributed.tensor import DTensor
            v = DTensor.from_local(_inner(v.to_local()), v.device_mesh, v.placements, run_check=False,
                                   shape=v.shape, stride=v.stride())
        elif isinstance(v, torch.Tensor) and not is_dtensor(v):
            v = _inner(v)
        out[key] = v
    return out


class ModelState:
    """The parameters this rank holds (a pipeline stage: a subset), DTensor shards included. With
    LoRA (`lora_base`: a pointer to the frozen base, train/model_setup.py's `lora_base`) only the
    adapters, and the pointer, which a resume must match."""

    def __init__(self, module: nn.Module, lora_base: str = ""):
        self.module, self.lora_base = module, lora_base

    def state_dict(self) -> dict:
        sd, options = _sd()
        state = plain_tensors(sd.get_model_state_dict(self.module, options=options))
        if self.lora_base:
            state = {k: v for k, v in state.items() if is_adapter(k)}
            state[LORA_BASE_KEY] = self.lora_base
        return state

    def load_state_dict(self, state: dict) -> None:
        sd, options = _sd()
        if self.lora_base:
            state = dict(state)
            saved = state.pop(LORA_BASE_KEY)
            if saved != self.lora_base:
                raise UserError(f"the checkpoint's LoRA adapters were trained on base {saved}, this "
                                f"run's base is {self.lora_base}: resume with the same init.from "
                                f"folder / seed and [model], or start a new run.dir")
            options = sd.StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        sd.set_model_state_dict(self.module, state, options=options)


class OptimState:
    """The optimizer's tensors. Hyper-parameters are not saved: they come from the config (lr from
    the step). The tied weight's state is saved under its first name, tok_emb.weight, as in an
    unsplit model: a last pipeline stage without the first (`renames_tied`) renames it."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, renames_tied: bool = False):
        self.module, self.optimizer, self.renames_tied = module, optimizer, renames_tied

    def _rename(self, key: str, old: str, new: str) -> str:
        return new + key[len(old):] if self.renames_tied and key.startswith(old) else key

    def state_dict(self) -> dict:
        sd, options = _sd()
        state = sd.get_optimizer_state_dict(self.module, self.optimizer, options=options)
        return {self._rename(k, _TIED_LAST, _TIED_FIRST): v for k, v in plain_tensors(state).items()
                if isinstance(v, torch.Tensor)}

    def load_state_dict(self, state: dict) -> None:
        sd, options = _sd()
        current = sd.get_optimizer_state_dict(self.module, self.optimizer, options=options)
        optim = {k: v for k, v in current.items() if not isinstance(v, torch.Tensor)}
        optim.update({self._rename(k, _TIED_FIRST, _TIED_LAST): v for k, v in state.items()})
        sd.set_optimizer_state_dict(self.module, self.optimizer, optim, options=options)


class RNGStates:
    """Every rank's random state (dropout), gathered so that rank 0 saves them all. Restored per
    rank on the same world size; on another, each rank's stream is seeded afresh from
    (seed + step, rank): deterministic, not the uninterrupted run's."""

    def __init__(self, comm, seed: int, step_of_resume):
        self.comm, self.seed, self.step_of_resume = comm, seed, step_of_resume

    def state_dict(self) -> list:
        return self.comm.allgather(rng.capture())

    def load_state_dict(self, saved: list) -> None:
        if len(saved) == self.comm.Get_size():
            rng.restore(saved[self.comm.Get_rank()])
        else:
            rng.seed_rank(self.seed + self.step_of_resume(), self.comm.Get_rank())
