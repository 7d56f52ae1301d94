"""Host-sync counter: the ops of a training step that would make the host wait for the GPU.

On CUDA the host queues kernels and runs ahead; an op whose result the host must read (a Python
number, a data-dependent shape, a copy into host memory) stalls it until the stream drains, and
the next kernels start late. Such an op is invisible on a CPU run, where everything is host
memory, so this counter names the ops by what they are, not by where they ran:

  - aten::_local_scalar_dense (`.item()`, `float(t)`, `int(t)`, `bool(t)`, `if t:`)
  - data-dependent output shapes: nonzero, masked_select, boolean-mask indexing (index.Tensor /
    index_put_ with a bool index), unique (_unique2, unique_dim, unique_consecutive), and
    repeat_interleave without output_size
  - copies that leave the device: `Tensor.tolist()`, `Tensor.cpu()`, `.to(<cpu>)` of a tensor that
    is not on the CPU, and `copy_` of a device tensor into a CPU one without non_blocking

`.numpy()` is not counted: it only works on CPU tensors (the MPI paths read host buffers with it).
A pageable host-to-device copy (`torch.tensor(list, device="cuda")`) and collectives issued
through torch.distributed are not dispatched ops and are not counted. A DTensor op is counted once,
at the DTensor level (the mode runs before the subclass). DeviceMesh's rank grid is a host tensor
on every device: its ops (`get_local_rank`'s nonzero / tolist) are not counted.

Each count is keyed "op @ file:line", the innermost frame inside the hpctrain package that led to
it, so a test failure names the culprit. The trainer turns it on with HPCTRAIN_COUNT_HOST_SYNCS=1:
every training step's counts go to `<run.dir>/host_syncs.rank<r>.json` (StepSyncLog).

Owns: recognizing those ops and counting them per step. It must never change what an op returns.
"""
from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ENV = "HPCTRAIN_COUNT_HOST_SYNCS"
_PACKAGE = str(Path(__file__).resolve().parents[1])  # .../hpctrain
_THIS = str(Path(__file__).resolve())

# ops that always read device memory on the host (or size their output from it)
_ALWAYS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique",
           "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
           "aten::is_nonzero"}
_MASK_INDEXED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
# Python-level tensor methods that move data to the host (seen before dispatch; on a CPU run
# `.cpu()` and `.tolist()` never reach the dispatcher)
_TO_HOST_METHODS = {"tolist", "cpu"}


# torch code whose tensors live on the host by design on every device (DeviceMesh's rank grid)
_HOST_ONLY = (os.path.join("torch", "distributed", "device_mesh.py"),)


def caller() -> str | None:
    """file:line of the innermost frame in hpctrain (not this module), else the innermost frame;
    None inside torch code that works on host tensors by design (_HOST_ONLY)."""
    frame, first = sys._getframe(1), None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith(_HOST_ONLY):
            return None
        if name != _THIS and first is None and "torch" not in name:
            first = f"{name}:{frame.f_lineno}"
        if name.startswith(_PACKAGE) and name != _THIS:
            return f"{os.path.relpath(name, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"
        frame = frame.f_back
    return first or "?"


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def _leaves_device(func_name: str, args, kwargs) -> bool:
    """A copy from a non-CPU tensor into host memory."""
    if func_name == "aten::_to_copy":
        src, device = args[0], kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and src.device.type != "cpu"
    if func_name == "aten::copy_":
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return dst.device.type == "cpu" and src.device.type != "cpu" and blocking
    return False


def is_sync(func_name: str, overload: str, args, kwargs) -> bool:
    """Whether aten op `func_name`.`overload` on these arguments makes the host wait for the device."""
    if func_name in _ALWAYS:
        return True
    if func_name in _MASK_INDEXED:
        return _has_bool_index(args)
    if func_name == "aten::repeat_interleave":  # its output size is the sum of a device tensor
        return overload != "self_int" and kwargs.get("output_size") is None
    return _leaves_device(func_name, args, kwargs)


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, owner: "HostSyncCounter"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.owner.inside_method:
            name = func._schema.name
            if is_sync(name, func._overloadname, args, kwargs):
                self.owner.add(name)
        return func(*args, **kwargs)


class _MethodCounter(TorchFunctionMode):
    def __init__(self, owner: "HostSyncCounter"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        counted = name in _TO_HOST_METHODS or (name == "to" and _to_host(args, kwargs))
        if not counted or self.owner.inside_method:
            return func(*args, **kwargs)
        self.owner.add(f"Tensor.{name}")
        self.owner.inside_method = True  # its own _to_copy / _local_scalar_dense: counted once
        try:
            return func(*args, **kwargs)
        finally:
            self.owner.inside_method = False


def _to_host(args, kwargs) -> bool:
    """`t.to(...)` that targets the CPU from a tensor elsewhere."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
        return False
    targets = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
    return any(torch.device(t).type == "cpu" for t in targets)


class HostSyncCounter:
    """`with counter:` counts host syncs into `counter.counts` ({"op @ file:line": n})."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.inside_method = False
        self._modes = None

    def add(self, op: str) -> None:
        where = caller()
        if where is not None:
            self.counts[f"{op} @ {where}"] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> "HostSyncCounter":
        self._modes = (_MethodCounter(self), _DispatchCounter(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = None


class StepSyncLog:
    """Per-step counts of one rank, written to `<run_dir>/host_syncs.rank<r>.json` as
    {"rank": r, "steps": {"<step>": {"op @ file:line": n}}} (steps without a sync: {})."""

    def __init__(self, run_dir: str | Path, rank: int):
        self.path = Path(run_dir) / f"host_syncs.rank{rank}.json"
        self.rank, self.steps = rank, {}

    @staticmethod
    def enabled() -> bool:
        return os.environ.get(ENV, "0") not in ("", "0")

    def count(self, step: int):
        """Context manager: what runs inside is counted as step `step`."""
        return _StepScope(self, step)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": self.rank, "steps": self.steps}, indent=1), encoding="utf-8")
        os.replace(tmp, self.path)


class _StepScope:
    def __init__(self, log: StepSyncLog, step: int):
        self.log, self.step, self.counter = log, step, HostSyncCounter()

    def __enter__(self):
        self.counter.__enter__()
        return self.counter

    def __exit__(self, *exc) -> None:
        self.counter.__exit__(*exc)
        into = self.log.steps.setdefault(str(self.step), {})
        for key, n in self.counter.counts.items():
            into[key] = into.get(key, 0) + n
