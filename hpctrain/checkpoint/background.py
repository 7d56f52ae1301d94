"""Async checkpointing support: staging a state dict into host memory, and the one in-flight save.

Owns the copy of the tensors the step loop pays for (`stage`: a host tensor into host buffers
reused between saves; a GPU tensor into pinned memory from torch's pinned-memory cache, given back
when the save or snapshot holding it has been written, so that the async checkpoint and the peer
snapshot stage into the same pinned blocks: one pinned copy of the state per rank, not one per
stager kept all run), which rank stages a plain tensor several ranks hold (`assign_writers`:
one of them; DCP writes such a replicated tensor once, so DDP ranks each stage ~1/world of the
model + optimizer instead of all of it, in buffers kept between saves) and the background thread that runs the rest of a save (`InFlight`). The
manager decides what that thread does and which process group it uses; this module must never run
a collective itself, never share a tensor with the live model (the trainer keeps stepping while the
copy is written), and never swallow the thread's error: `result()` re-raises it on the caller.
"""
from __future__ import annotations

import threading
import time

import torch

from hpctrain.distributed.dtensor import is_dtensor


def _copy_into(buffers: dict, key: str, src: torch.Tensor) -> torch.Tensor:
    """src copied to host memory: a GPU tensor into a pinned block of torch's pinned-memory cache
    (asynchronously; not remembered: its holder drops it once written, module docstring), a host
    tensor into a buffer remembered under `key` (reused while shape/dtype/stride match)."""
    if src.device.type == "cuda":
        buf = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="cpu", pin_memory=True)
        buf.copy_(src.detach(), non_blocking=True)
        return buf
    buf = buffers.get(key)
    if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.stride() != src.stride():
        buf = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="cpu")
        buffers[key] = buf
    buf.copy_(src.detach())
    return buf


def plain_sizes(tensors: dict, path: str = "") -> dict[str, int]:
    """{path: bytes} of the plain (non-DTensor) tensors of a nested state dict: what DCP writes once
    for all the ranks that hold the same key (DDP's replicas, a pipeline stage's dp ranks)."""
    out = {}
    for k, v in tensors.items():
        if isinstance(v, dict):
            out.update(plain_sizes(v, f"{path}.{k}"))
        elif isinstance(v, torch.Tensor) and not is_dtensor(v):
            out[f"{path}.{k}"] = v.numel() * v.element_size()
    return out


def assign_writers(sizes_per_rank: list[dict[str, int]]) -> dict[str, int]:
    """Each plain tensor's path -> the one rank among those holding it that stages and writes it:
    largest first, to the holder with the fewest bytes so far (ties: the lowest rank)."""
    holders: dict[str, list[int]] = {}
    for rank, sizes in enumerate(sizes_per_rank):
        for path in sizes:
            holders.setdefault(path, []).append(rank)
    load, owner = [0] * len(sizes_per_rank), {}
    for path in sorted(holders, key=lambda p: (-sizes_per_rank[holders[p][0]][p], p)):
        rank = min(holders[path], key=lambda r: (load[r], r))
        owner[path] = rank
        load[rank] += sizes_per_rank[rank][path]
    return owner


def stage(tensors: dict, buffers: dict, keep: set | None = None) -> dict:
    """A copy of a (nested) dict of tensors in host memory; DTensors stay DTensors (same mesh,
    placements and global shape) around a host copy of their local shard. `keep`: the paths of
    the plain tensors to stage (assign_writers); the others are left out (another rank writes
    them). Buffers of paths not staged this time are freed."""
    used_cuda, used = False, set()
    dropped = object()

    def walk(node, path):
        nonlocal used_cuda
        if isinstance(node, dict):
            items = {k: walk(v, f"{path}.{k}") for k, v in node.items()}
            return {k: v for k, v in items.items() if v is not dropped}
        dtensor = is_dtensor(node)
        if keep is not None and isinstance(node, torch.Tensor) and not dtensor and path not in keep:
            return dropped
        used.add(path)
        if dtensor:
            from torch.distributed.tensor import DTensor  # imported: `node` is one

            local = node.to_local()
            used_cuda |= local.device.type == "cuda"
            # around the host copy as it is: DTensor.from_local would move it to the mesh's
            # device (under FSDP/TP on GPUs, one more copy of the shard in GPU memory)
            return DTensor(_copy_into(buffers, path, local), node._spec, requires_grad=False)
        if isinstance(node, torch.Tensor):
            used_cuda |= node.device.type == "cuda"
            return _copy_into(buffers, path, node)
        raise TypeError(f"async checkpoint: cannot stage {path} ({type(node).__name__})")

    out = walk(tensors, "")
    for path in set(buffers) - used:
        del buffers[path]
    if used_cuda:
        torch.cuda.synchronize()
    return out


class Pacer:
    """Duty cycle of the background writer: after each chunk it writes, the thread sleeps long
    enough that its busy time stays `share` of the wall time. Busy time is mostly serialization
    under the GIL (DCP writes each tensor through torch.save), which the training thread would
    otherwise queue for: unpaced, a step overlapping the write took 1.36x as long here, at share
    0.1 1.07x (bench/checkpoint.py, docs/benchmarks.md). `full_speed()` lifts the limit and cuts
    a sleep short (nothing left to protect: exit, a stop, the next save)."""

    MIN_BUSY_S = 0.002  # shorter bursts are not worth a sleep

    def __init__(self, share: float = 1.0, clock=time.perf_counter, sleep=None):
        self.share = share
        self._wake = threading.Event()  # full_speed() cuts a sleep short
        self._clock, self._sleep = clock, sleep or self._wake.wait
        self._since = clock()

    def pace(self) -> None:
        """Called by the writer after each chunk: sleeps (releasing the GIL) for
        busy * (1 - share) / share, busy being the time since the end of the previous sleep."""
        now = self._clock()
        busy = now - self._since
        if busy < self.MIN_BUSY_S:
            return
        if self.share < 1.0:
            self._sleep(busy * (1.0 - self.share) / self.share)
            now = self._clock()
        self._since = now

    def full_speed(self) -> None:
        self.share = 1.0
        self._wake.set()


class InFlight:
    """Runs `fn` in a daemon thread, paced by `pacer`; `result()` lets it
    finish at full speed, joins, and returns its value or re-raises."""

    def __init__(self, fn, name: str, pacer: Pacer | None = None):
        self._value = self._error = None
        self._pacer = pacer
        self.duration_s = 0.0
        # the writer's CUDA calls go to the caller's device, not device 0 (each rank owns one GPU)
        self._device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        t0 = time.perf_counter()
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)
            self._value = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by result() on the caller's thread
            self._error = e
        self.duration_s = time.perf_counter() - t0

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self):
        if self._pacer is not None:
            self._pacer.full_speed()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
