"""Meta-device initialization: build the model without memory, lay it out, then materialize and
initialize only this rank's shards, bit-identical to building it whole on every rank.

    recipe, model = build_on_meta(lambda: GPT(cfg))   # no parameter memory; records the init
    ... pipeline split, tensor parallel, activation checkpointing, FSDP2 (on meta modules) ...
    materialize(model, recipe, seed, device)         # before DDP (which broadcasts rank 0's)

Owns: recording the initialization a model's constructor performs (every in-place op on its
tensors, e.g. nn.Linear's kaiming_uniform_ at construction and GPT.reset_parameters' normal_ /
zeros_ / ones_ afterwards, in call order), replaying it on CPU one tensor at a time from the same
seed (so the global RNG stream, and hence every value, is the one of `torch.manual_seed(seed);
model = factory()`), and copying each replayed full tensor's part this rank holds into the laid-out
model: a DTensor's local shard (TP, FSDP2, both: `distribute_tensor(..., src_data_rank=None)`
slices locally, no communication), a plain tensor whole, nothing where a pipeline stage dropped the
parameter (the replay still draws it, so the RNG stays in step). It must never know the model's
architecture or the layout's rules: parameters are matched by their fully qualified names.

Memory: one full tensor at a time (the largest parameter, e.g. a 50304 x 4096 embedding, 824 MB
fp32) plus its local shard, on top of this rank's shards. Time: the replay draws every parameter
of the whole model on every rank, as building it whole did.

Limits (raise, never guess): an init op that reads another tensor (e.g. copy_ from a computed
tensor), a random factory call (torch.randn ...) during construction, or a buffer (its value would
come from a factory call, not recorded). The GPT has none of these.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from hpctrain.distributed.dtensor import is_dtensor

# In-place ops whose result does not depend on the tensor's previous contents: the value before
# them is dead. Any other recorded op updates the value and needs it (e.g. trunc_normal_'s mul_).
OVERWRITE = {"uniform_", "normal_", "zero_", "zeros_", "ones_", "fill_", "constant_", "random_",
             "bernoulli_", "exponential_", "cauchy_", "log_normal_", "geometric_", "eye_",
             "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
             "trunc_normal_", "orthogonal_", "sparse_", "dirac_"}
NOT_INIT = {"requires_grad_", "share_memory_", "retain_grad", "set_", "resize_", "detach_"}
RANDOM_FACTORIES = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
                    "normal", "bernoulli", "multinomial", "poisson"}
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass
class InitOp:
    """One recorded call `func(*args, **kwargs)` on a tensor of `shape` / `dtype` (_TARGET in
    args / kwargs stands for it)."""
    key: int                 # which tensor (index into InitRecipe.fqns)
    func: Callable
    args: tuple
    kwargs: dict
    shape: torch.Size
    dtype: torch.dtype
    keep_after: bool = False  # the value is needed later (an update op follows, or it is final)
    final: bool = False       # the tensor's last write: copy it into the model


@dataclass
class InitRecipe:
    """The initialization a model's constructor performed, replayable one tensor at a time."""
    ops: list[InitOp] = field(default_factory=list)
    fqns: list[tuple[str, ...]] = field(default_factory=list)  # per tensor key: its names (ties: all)


_TARGET = object()  # stands for the initialized tensor in a recorded call's arguments


class _Recorder(TorchFunctionMode):
    """Records in-place ops on meta tensors while the model is built, outermost call only
    (nn.init.normal_ is recorded, not the Tensor.normal_ it calls). nn.init's functions are
    wrapped too: some return early on meta tensors without a trace (trunc_normal_, orthogonal_)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[torch.Tensor, InitOp]] = []
        self.depth = 0  # > 0 inside a recorded nn.init call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in RANDOM_FACTORIES:
            raise NotImplementedError(f"meta init: the model's constructor calls torch.{name}, "
                                      f"which cannot be replayed; set parallel.meta_init = false")
        if self.depth == 0 and name.endswith("_") and not name.startswith("__") \
                and name not in NOT_INIT:
            self.record(func, args, kwargs)
        return func(*args, **kwargs)

    def record(self, func, args: tuple, kwargs: dict) -> None:
        # nn.init functions pass everything by keyword (torch.overrides.handle_torch_function)
        target = args[0] if args else kwargs.get("tensor")
        if not (isinstance(target, torch.Tensor) and target.is_meta):
            return
        name = func.__name__
        args_ = tuple(_TARGET if a is target else a for a in args)
        kwargs_ = {k: _TARGET if v is target else v for k, v in kwargs.items()}
        if any(isinstance(a, torch.Tensor) for a in (*args_, *kwargs_.values())):
            raise NotImplementedError(f"meta init: {name} reads another tensor, which cannot be "
                                      f"replayed; set parallel.meta_init = false")
        self.ops.append((target, InitOp(-1, func, args_, kwargs_, target.shape, target.dtype)))

    def wrap(self, func: Callable) -> Callable:
        def recorded(*args, **kwargs):
            if self.depth == 0:
                self.record(func, args, kwargs)
            self.depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.depth -= 1
        return recorded

    @contextlib.contextmanager
    def nn_init_wrapped(self):
        saved = {name: f for name, f in vars(nn.init).items()
                 if name.endswith("_") and not name.startswith("_") and callable(f)}
        try:
            for name, f in saved.items():
                setattr(nn.init, name, self.wrap(f))
            yield
        finally:
            for name, f in saved.items():
                setattr(nn.init, name, f)


def build_on_meta(factory: Callable[[], nn.Module]) -> tuple[InitRecipe, nn.Module]:
    """`factory()` built on the meta device (no parameter memory, no RNG drawn) and the recipe of
    the initialization it performed."""
    recorder = _Recorder()
    with torch.device("meta"), recorder, recorder.nn_init_wrapped():
        model = factory()
    if next(model.buffers(), None) is not None:
        raise NotImplementedError("meta init: the model has buffers; set parallel.meta_init = false")
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    recipe, keys = InitRecipe(), {}
    for tensor, op in recorder.ops:
        if id(tensor) not in keys:
            keys[id(tensor)] = len(recipe.fqns)
            recipe.fqns.append(tuple(names.get(id(tensor), ())))
        op.key = keys[id(tensor)]
        recipe.ops.append(op)
    _mark_liveness(recipe.ops)
    return recipe, model


def _mark_liveness(ops: list[InitOp]) -> None:
    """Mark each tensor's final write, and which values must outlive their op. An update (an op
    not in OVERWRITE) before any recorded write means a write was missed: refused."""
    first: dict[int, InitOp] = {}
    for op in ops:
        first.setdefault(op.key, op)
    for op in first.values():
        if op.func.__name__ not in OVERWRITE:
            raise NotImplementedError(f"meta init: {op.func.__name__} updates a {tuple(op.shape)} "
                                      f"tensor with no recorded write before it; set "
                                      f"parallel.meta_init = false")
    seen: set[int] = set()
    for op in reversed(ops):  # walking back: `nxt` is the next op on the same tensor
        if op.key not in seen:
            op.final = op.keep_after = True
            seen.add(op.key)
    nxt: dict[int, InitOp] = {}
    for op in reversed(ops):
        later = nxt.get(op.key)
        if later is not None and getattr(later.func, "__name__", "") not in OVERWRITE:
            op.keep_after = True
        nxt[op.key] = op


def _held_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """This rank's parameters by their original names (wrapper prefixes removed; ties: each name)."""
    held = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        for prefix in WRAPPER_PREFIXES:
            fqn = fqn.replace(prefix, "")
        held[fqn] = p
    return held


def _to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)` (FSDP2 re-registers its sharded parameters), then restore
    parameters shared between modules (tied embeddings): to_empty gives each module its own."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    for places in owners.values():
        first_module, first_name = places[0]
        for module, name in places[1:]:
            setattr(module, name, getattr(first_module, first_name))


def allocate(model: nn.Module, device: torch.device) -> None:
    """This rank's (meta) parameters allocated on `device`, uninitialized (ties kept): for a
    caller that writes every parameter itself (init.from: hpctrain/interop/hf_import.py)."""
    _to_empty_keeping_ties(model, device)


@torch.no_grad()
def _copy_part(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the part of `full` (the whole tensor, CPU) that `param` holds on this rank."""
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        part = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(part.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def materialize(model: nn.Module, recipe: InitRecipe, seed: int, device: torch.device) -> None:
    """Allocate `model`'s (meta) parameters on `device` and initialize them as
    `torch.manual_seed(seed); factory()` would have: replay the recipe on CPU, copying each
    tensor's final value into the part this rank holds. Leaves the global RNG where building the
    whole model would have left it."""
    _to_empty_keeping_ties(model, device)
    held = _held_params(model)
    written: set[int] = set()
    values: dict[int, torch.Tensor] = {}
    torch.manual_seed(seed)
    for op in recipe.ops:
        name = getattr(op.func, "__name__", "")
        value = values.pop(op.key, None)
        if value is None or name in OVERWRITE:
            value = torch.empty(op.shape, dtype=op.dtype, device="cpu")
        op.func(*(value if a is _TARGET else a for a in op.args),
                **{k: value if v is _TARGET else v for k, v in op.kwargs.items()})
        if op.final:
            for fqn in recipe.fqns[op.key]:
                param = held.get(fqn)
                if param is not None and id(param) not in written:
                    _copy_part(param, value)
                    written.add(id(param))
        elif op.keep_after:
            values[op.key] = value
        del value
    missing = [fqn for fqn, p in held.items() if id(p) not in written]
    if missing:
        raise RuntimeError(f"meta init: no initialization recorded for {missing[:5]}")


def on_meta(model: nn.Module) -> bool:
    """Whether `model`'s parameters are still on the meta device (not yet materialized)."""
    p = next(model.parameters(), None)
    return p is not None and p.is_meta
