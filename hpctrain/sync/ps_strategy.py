"""sync.mode = "ps": asynchronous SGD against parameter servers (the windows: param_server.py).

Each worker step: wait while more than sync.staleness steps ahead of the slowest worker -> pull
-> (the trainer's forward/backward and optimizer step on the worker's own copy) -> push the change
(new - pulled) -> advance its clock. Server ranks do not train: between checkpoints they only keep
MPI's progress engine turning (waiting in the meeting below) while workers read and write them.

Preemption: the stop flag lives in the clock window, and the meeting (hpctrain/sync/asynchronous.py)
gives the furthest worker's step; the others catch up to it, all save, and exit with
EXIT_PREEMPTED like any run.

Owns: the windows' contents around a worker's step. Workers take the same data a
data-parallel run would (step s, dp index = worker index), so 1 worker with staleness 0 is plain
SGD. Layouts (tp/pp/fsdp) do not apply: each worker holds one whole model. Mid-run validation is
off (workers are at different steps); the final model is evaluated and saved like any run.
"""
from __future__ import annotations

import numpy as np
import torch

from hpctrain.config import Config
from hpctrain.distributed import DistContext
from hpctrain.distributed.preempt import NONE
from hpctrain.errors import ConfigError
from hpctrain.sync.asynchronous import (AsynchronousStrategy, WorkerPosition, assign, count_workers,
                                        flat)
from hpctrain.sync.param_server import ParameterServer


def worker_position(cfg: Config, ctx: DistContext) -> WorkerPosition:
    if ctx.device.type != "cpu":
        raise ConfigError("config key 'sync.mode': 'ps' keeps parameters in host memory (MPI "
                          "windows); use it on CPU ranks, or diloco on GPUs")
    workers = count_workers(cfg, ctx)
    return WorkerPosition(ctx.rank if ctx.rank < workers else 0, workers)


class ParameterServerSGD(AsynchronousStrategy):
    mode = "ps"
    every_worker_steps = True  # each step index is trained by every worker (catch up at a stop)

    def __init__(self, cfg: Config, ctx: DistContext, model: torch.nn.Module):
        super().__init__(ctx, count_workers(cfg, ctx))
        self.staleness = cfg.sync.staleness
        self.params = list(model.parameters())
        self.ps = ParameterServer(ctx.comm, flat(self.params), cfg.sync.ps_servers)
        self.flags = self.ps
        self._pulled, self.lag = None, 0

    # ---- a worker's step ------------------------------------------------------------------------
    def before_step(self, step: int, stop_aware: bool = True, until: int | None = None) -> bool:
        self.lag, stop = self.ps.wait_within(step, self.staleness, stop_aware=stop_aware)
        if stop != NONE:
            return False
        self._pulled = np.empty(self.ps.n, dtype=np.float32)
        self.ps.pull(self._pulled)
        assign(self.params, self._pulled)
        return True

    def after_step(self, step: int) -> None:
        self.ps.push(flat(self.params) - self._pulled)
        self.ps.set_clock(self.ctx.rank, step)

    def step_metrics(self) -> dict:
        return {"staleness": self.lag}

    def comm_bytes(self, step: int) -> int:
        return self.ps.bytes_moved

    # ---- checkpoints: every rank takes part; workers' optimizer states are kept per worker -------
    def before_save(self) -> None:
        """Collective at a step every worker has finished: pull the servers' parameters."""
        self.ctx.comm.Barrier()  # every worker's pushes up to this step are complete
        pulled = np.empty(self.ps.n, dtype=np.float32)
        self.ps.pull(pulled)
        assign(self.params, pulled)
        # Passive-target RMA completes only while the target polls MPI: servers wait in this MPI
        # barrier (not in a Gloo collective of the save) until every rank's pull is done.
        self.ctx.comm.Barrier()

    def after_save(self) -> None:
        self.ctx.comm.Barrier()  # nobody pushes before everybody has read the saved parameters

    def state_dict(self) -> dict:
        state = {"mode": self.mode, "workers": self.n_workers, "bytes_moved": self.ps.bytes_moved}
        if self.trains:
            state["replica"] = {str(self.ctx.rank): {"optim": self.local_optim.state_dict()}}
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.trains:
            self.local_optim.load_state_dict(state["replica"][str(self.ctx.rank)]["optim"])
        self.ps.bytes_moved = int(state["bytes_moved"])

    def after_load(self, step: int) -> None:
        if not self.trains:  # the saved parameters (and every worker's clock) back into my windows
            lo, hi = self.ps.bounds[self.ps.servers.index(self.ctx.rank)]
            self.ps.memory[:] = flat(self.params)[lo:hi]
            if self.ps.clock_memory is not None:
                self.ps.reset_clocks(step)
        self.ctx.comm.Barrier()  # windows restored before any worker pulls

    def describe(self) -> str:
        return (f", sync ps: {self.n_workers} workers, {self.ctx.world_size - self.n_workers} servers, "
                f"staleness {self.staleness}")

    def close(self) -> None:
        self.ps.free()
