"""sync.mode = "ps": asynchronous SGD against parameter servers (the windows: param_server.py).

Each worker step: wait while more than sync.staleness steps ahead of the slowest worker -> pull
-> (the trainer's forward/backward and optimizer step on the worker's own copy) -> push the change
(new - pulled) -> advance its clock. Server ranks do not train: between checkpoints they only keep
MPI's progress engine turning (waiting in the meeting below) while workers read and write them.

Preemption (a Slurm signal or the wall-time guard, see hpctrain/distributed/preempt.py) cannot use
the per-step all-reduce of lockstep training: workers are at different steps and servers sit in MPI.
Any rank with a reason raises the stop flag in the clock window; a worker sees it at its next step
boundary (or while waiting for a straggler) and goes to the meeting; the servers check their own
signals while they wait there. The meeting (one all-reduce MAX of (step, reason)) gives the stop
step: the furthest worker's step, never past the next regular checkpoint; the others catch up to
it, all save, and exit with EXIT_PREEMPTED like any run.

Owns: the worker/server roles, the windows' contents and the meeting. Workers take the same data a
data-parallel run would (step s, dp index = worker index), so 1 worker with staleness 0 is plain
SGD. Layouts (tp/pp/fsdp) do not apply: each worker holds one whole model. Mid-run validation is
off (workers are at different steps); the final model is evaluated and saved like any run.
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
from hpctrain.sync.param_server import ParameterServer
from hpctrain.sync.strategy import SyncStrategy, refuse_other_mode


@dataclass(frozen=True)
class WorkerPosition:
    """Where a rank sits in the data order: workers are the dp ranks (servers read no batches)."""
    dp_rank: int
    dp_size: int


def _flat(params) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in params]).numpy()


def _assign(params, flat: np.ndarray) -> None:
    """Copy into the parameters (vector_to_parameters would alias them to `flat`)."""
    src, at = torch.from_numpy(flat), 0
    with torch.no_grad():
        for p in params:
            p.copy_(src[at:at + p.numel()].view_as(p))
            at += p.numel()


def worker_position(cfg: Config, ctx: DistContext) -> WorkerPosition:
    if ctx.device.type != "cpu":
        raise ConfigError("config key 'sync.mode': 'ps' keeps parameters in host memory (MPI "
                          "windows); use it on CPU ranks, or diloco on GPUs")
    workers = ctx.world_size - cfg.sync.ps_servers
    if workers < 1:
        raise ConfigError(f"config key 'sync.ps_servers': {cfg.sync.ps_servers} servers leave no "
                          f"worker among {ctx.world_size} ranks (run more ranks)")
    return WorkerPosition(ctx.rank if ctx.rank < workers else 0, workers)


class ParameterServerSGD(SyncStrategy):
    mode = "ps"
    global_each_step = True  # each worker decides about its own update alone: no vote
    collective_steps = False

    def __init__(self, cfg: Config, ctx: DistContext, model: torch.nn.Module):
        self.ctx, self.staleness = ctx, cfg.sync.staleness
        self.n_workers = ctx.world_size - cfg.sync.ps_servers
        self.trains = ctx.rank < self.n_workers
        self.params = list(model.parameters())
        self.ps = ParameterServer(ctx.comm, _flat(self.params), cfg.sync.ps_servers)
        self.workers = ctx.comm.Split(0 if self.trains else 1, ctx.rank)
        self._raised, self._pulled, self.lag = NONE, None, 0
        self._optim = None

    # ---- a worker's step ------------------------------------------------------------------------
    def before_step(self, step: int, stop_aware: bool = True) -> bool:
        self.lag, stop = self.ps.wait_within(step, self.staleness, stop_aware=stop_aware)
        if stop != NONE:
            return False
        self._pulled = np.empty(self.ps.n, dtype=np.float32)
        self.ps.pull(self._pulled)
        _assign(self.params, self._pulled)
        return True

    def after_step(self, step: int) -> None:
        self.ps.push(_flat(self.params) - self._pulled)
        self.ps.set_clock(self.ctx.rank, step)

    def step_metrics(self) -> dict:
        return {"staleness": self.lag}

    def comm_bytes(self, step: int) -> int:
        return self.ps.bytes_moved

    # ---- stopping and meeting -----------------------------------------------------------------
    def _raise_if_mine(self, preempt) -> None:
        """Raise the stop flag if this rank has a reason to stop (once per reason)."""
        mine = preempt.local_reason()
        if mine > self._raised:
            self.ps.raise_stop(mine)
            self._raised = mine

    def stop_reason(self, preempt, step: int) -> int:
        preempt.debug_sleep()
        self._raise_if_mine(preempt)
        return self.ps.stop_flag()

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
            stop = self.ps.stop_flag()
        send, got = np.array([step, stop], dtype=np.int64), np.empty(2, dtype=np.int64)
        req = self.ctx.comm.Iallreduce(send, got, op=MPI.MAX)
        while not req.Test():
            if not self.trains:
                self._raise_if_mine(preempt)
            time.sleep(0)  # yield the core: ranks may be oversubscribed
        step, stop = int(got[0]), int(got[1])
        stop = stop if step < end else NONE
        preempt.agreed(stop, step)
        return step, stop

    # ---- checkpoints: every rank takes part; workers' optimizer states are kept per worker -------
    def before_save(self) -> None:
        """Collective at a step every worker has finished: pull the servers' parameters."""
        self.ctx.comm.Barrier()  # every worker's pushes up to this step are complete
        pulled = np.empty(self.ps.n, dtype=np.float32)
        self.ps.pull(pulled)
        _assign(self.params, pulled)
        # Passive-target RMA completes only while the target polls MPI: servers wait in this MPI
        # barrier (not in a Gloo collective of the save) until every rank's pull is done.
        self.ctx.comm.Barrier()

    def after_save(self) -> None:
        self.ctx.comm.Barrier()  # nobody pushes before everybody has read the saved parameters

    def checkpoint_states(self, model, optim, saved: dict | None = None) -> dict:
        if saved is not None:
            refuse_other_mode(saved, self.mode, "use a new run.dir")
            if saved.get("workers") != self.n_workers:
                raise ConfigError(f"config key 'sync.ps_servers': the checkpoint was written with "
                                  f"{saved.get('workers')} workers, now {self.n_workers}; use a new "
                                  f"run.dir")
        self._optim = optim
        return {"model": model, "sync": self}

    def state_dict(self) -> dict:
        state = {"mode": self.mode, "workers": self.n_workers, "bytes_moved": self.ps.bytes_moved}
        if self.trains:
            state["replica"] = {str(self.ctx.rank): {"optim": self._optim.state_dict()}}
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.trains:
            self._optim.load_state_dict(state["replica"][str(self.ctx.rank)]["optim"])
        self.ps.bytes_moved = int(state["bytes_moved"])

    def after_load(self, step: int) -> None:
        if not self.trains:  # the saved parameters (and every worker's clock) back into my windows
            lo, hi = self.ps.bounds[self.ps.servers.index(self.ctx.rank)]
            self.ps.memory[:] = _flat(self.params)[lo:hi]
            if self.ps.clock_memory is not None:
                self.ps.reset_clocks(step)
        self.ctx.comm.Barrier()  # windows restored before any worker pulls

    def describe(self) -> str:
        return (f", ps: {self.n_workers} workers, {self.ctx.world_size - self.n_workers} servers, "
                f"staleness {self.staleness}")

    def mean_over_replicas(self, value: float) -> float:
        return self.workers.allreduce(value) / self.workers.size

    def close(self) -> None:
        self.ps.free()
