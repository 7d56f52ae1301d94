"""Async checkpointing support: staging a state dict into host memory, and the one in-flight save.

Owns the copy of the tensors the step loop pays for (`stage`: into reused host buffers, pinned when
the source is on a GPU) and the background thread that runs the rest of a save (`InFlight`). The
manager decides what that thread does and which process group it uses; this module must never run
a collective itself, never share a tensor with the live model (the trainer keeps stepping while the
copy is written), and never swallow the thread's error: `result()` re-raises it on the caller.
"""
from __future__ import annotations

import threading
import time

import torch

try:
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = ()


def _copy_into(buffers: dict, key: str, src: torch.Tensor) -> torch.Tensor:
    """src copied into a host buffer remembered under `key` (reused while shape/dtype match)."""
    buf = buffers.get(key)
    if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.stride() != src.stride():
        pin = src.device.type == "cuda"
        buf = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="cpu",
                                  pin_memory=pin)
        buffers[key] = buf
    buf.copy_(src.detach(), non_blocking=src.device.type == "cuda")
    return buf


def stage(tensors: dict, buffers: dict) -> dict:
    """A copy of a (nested) dict of tensors in host memory; DTensors stay DTensors (same mesh,
    placements and global shape) around a host copy of their local shard."""
    used_cuda = False

    def walk(node, path):
        nonlocal used_cuda
        if isinstance(node, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in node.items()}
        if DTensor and isinstance(node, DTensor):
            local = node.to_local()
            used_cuda |= local.device.type == "cuda"
            return DTensor.from_local(_copy_into(buffers, path, local), node.device_mesh,
                                      node.placements, run_check=False, shape=node.shape,
                                      stride=node.stride())
        if isinstance(node, torch.Tensor):
            used_cuda |= node.device.type == "cuda"
            return _copy_into(buffers, path, node)
        raise TypeError(f"async checkpoint: cannot stage {path} ({type(node).__name__})")

    out = walk(tensors, "")
    if used_cuda:
        torch.cuda.synchronize()
    return out


class InFlight:
    """Runs `fn` in a daemon thread; `result()` joins and returns its value or re-raises."""

    def __init__(self, fn, name: str):
        self._value = self._error = None
        self.duration_s = 0.0
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        t0 = time.perf_counter()
        try:
            self._value = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by result() on the caller's thread
            self._error = e
        self.duration_s = time.perf_counter() - t0

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
