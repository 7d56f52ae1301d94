"""What the asynchronous modes (ps, async_diloco) share: worker ranks that never step together and
server ranks that hold MPI one-sided windows.

Preemption (a Slurm signal or the wall-time guard, see hpctrain/distributed/preempt.py) cannot use
the per-step all-reduce of lockstep training: workers are at different steps and servers sit in MPI.
Any rank with a reason raises the stop flag in a window; a worker sees it at its next step boundary
(or while waiting) and goes to the meeting; the servers check their own signals while they wait
there. The meeting (one non-blocking all-reduce MAX of (step, reason), polled) gives the step where
every rank stops: the furthest worker's, never past the next regular checkpoint.

Owns: the worker/server split, the stop flag protocol and the meeting. Subclasses own `flags`
(an object with raise_stop(reason) / stop_flag()) and what happens around a step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from hpctrain.config import Config
from hpctrain.distributed import DistContext
from hpctrain.distributed.preempt import NONE
from hpctrain.errors import ConfigError
from hpctrain.sync.strategy import SyncStrategy, refuse_other_mode


@dataclass(frozen=True)
class WorkerPosition:
    """Where a rank sits in the data order (servers read no batches)."""
    dp_rank: int
    dp_size: int


def count_workers(cfg: Config, ctx: DistContext) -> int:
    workers = ctx.world_size - cfg.sync.ps_servers
    if workers < 1:
        raise ConfigError(f"config key 'sync.ps_servers': {cfg.sync.ps_servers} servers leave no "
                          f"worker among {ctx.world_size} ranks (run more ranks)")
    return workers


def local_part(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a tensor-parallel DTensor's local shard)."""
    return p.to_local() if hasattr(p, "to_local") else p


def flat(params) -> np.ndarray:
    """This rank's part of the parameters as one fp32 host vector (a copy): every part copied into
    one host buffer, pinned when they are on a GPU (asynchronous copies, one wait at the end; a
    pageable `.cpu()` per parameter blocked once each)."""
    parts = [local_part(p).detach().reshape(-1) for p in params]
    cuda = any(t.device.type == "cuda" for t in parts)
    out = torch.empty(sum(t.numel() for t in parts), dtype=torch.float32, pin_memory=cuda)
    at = 0
    for t in parts:
        out[at:at + t.numel()].copy_(t, non_blocking=cuda)  # (a 16-bit part converted as .float())
        at += t.numel()
    if cuda:
        torch.cuda.synchronize()
    return out.numpy()


def assign(params, vector: np.ndarray) -> None:
    """Copy a flat host vector into this rank's part of the parameters (vector_to_parameters
    would alias them)."""
    src, at = torch.from_numpy(vector), 0
    with torch.no_grad():
        for p in params:
            local = local_part(p)
            local.copy_(src[at:at + local.numel()].view_as(local))
            at += local.numel()


def add_into(params, vector: np.ndarray) -> None:
    """Add a flat host vector to this rank's part of the parameters in place: one copy to the
    device, none back (`assign(params, flat(params) + vector)` would copy the model both ways);
    the same fp32 sum (a lower-precision part rounds it as its copy_ would)."""
    src, at = torch.from_numpy(vector), 0
    with torch.no_grad():
        for p in params:
            local = local_part(p)
            local.add_(src[at:at + local.numel()].view_as(local).to(local.device))
            at += local.numel()


class AsynchronousStrategy(SyncStrategy):
    global_each_step = True  # each worker decides about its own update alone: no vote
    collective_steps = False

    def __init__(self, ctx: DistContext, n_workers: int, trains: bool | None = None):
        """`trains`: whether this rank is a worker (default: the first `n_workers` ranks are)."""
        self.ctx, self.n_workers = ctx, n_workers
        self.trains = ctx.rank < n_workers if trains is None else trains
        self.workers = ctx.comm.Split(0 if self.trains else 1, ctx.rank)
        self._raised = NONE
        self.flags = None  # set by the subclass: raise_stop(reason) / stop_flag()

    def _raise_if_mine(self, preempt) -> None:
        """Raise the stop flag if this rank has a reason to stop (once per reason)."""
        mine = preempt.local_reason()
        if mine > self._raised:
            self.flags.raise_stop(mine)
            self._raised = mine

    def stop_reason(self, preempt, step: int) -> int:
        preempt.debug_sleep()
        self._raise_if_mine(preempt)
        return self.flags.stop_flag()

    def meet(self, preempt, step: int, stop: int, end: int) -> tuple[int, int]:
        """All ranks: (the furthest worker's step, the highest stop reason; none at the last
        step: that just finishes). Non-blocking, so a server (here for a whole checkpoint
        interval) raises the flag on its own signals, and polling keeps the workers' one-sided
        operations on its windows progressing."""
        from mpi4py import MPI

        if not self.trains:
            step, stop = -1, NONE
        elif stop == NONE:
            self._raise_if_mine(preempt)
            stop = self.flags.stop_flag()
        send, got = np.array([step, stop], dtype=np.int64), np.empty(2, dtype=np.int64)
        req = self.ctx.comm.Iallreduce(send, got, op=MPI.MAX)
        while not req.Test():
            if not self.trains:
                self._raise_if_mine(preempt)
                self.serve()
            time.sleep(0.0005)  # leave the core to the replicas still training (servers idle here)
        step, stop = int(got[0]), int(got[1])
        stop = stop if step < end else NONE
        preempt.agreed(stop, step)
        return step, stop

    def serve(self) -> None:
        """Server ranks, polled while they wait in the meeting (async_diloco's compressed
        arrivals are applied here)."""

    count_key = "workers"  # the checkpoint's "sync" entry: how many workers wrote it

    def checkpoint_states(self, saved: dict | None = None) -> dict:
        """{"model": the global model, "sync": this strategy (per-worker state inside)}; a
        checkpoint of another mode or another number of workers is refused, naming the key."""
        if saved is not None:
            refuse_other_mode(saved, self.mode, "use a new run.dir")
            if saved.get(self.count_key) != self.n_workers:
                raise ConfigError(f"config key 'sync.ps_servers': the checkpoint was written with "
                                  f"{saved.get(self.count_key)} {self.count_key}, now {self.n_workers}; "
                                  f"resume with the same ranks and servers, or use a new run.dir")
        return {"model": self.local_model, "sync": self}

    def mean_over_replicas(self, value: float) -> float:
        return self.workers.allreduce(value) / self.workers.size
