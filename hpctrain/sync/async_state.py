"""The checkpoint entry of sync.mode = "async_diloco" (hpctrain/sync/async_diloco.py mixes it in).

What a checkpoint holds: "model" is the global model (read from the servers' windows into the
parameters around the save, so export and sample read it like any other run's); "sync" this
entry: the outer optimizer's state (momentum, accumulator), the arrivals and step times counted,
and per replica (under "replica.<key>") its own weights, round start point, inner optimizer,
round counters and, with sync.error_feedback, its push residual. Keys of what differs by part of
the model (a tp / pp position, an FSDP shard) carry the part (AsyncDiLoCo.state_key, outer_key).

Owns: before_save / after_save (the swap between the replica's weights and the global model),
state_dict / load_state_dict, after_load (the servers' windows restored). It must never take part
in a round: the replicas are between arrivals whenever these hooks run (the trainer's meeting).
"""
from __future__ import annotations

import torch

from hpctrain.sync.asynchronous import assign, flat, local_part


class AsyncCheckpoint:
    """The checkpoint hooks of AsyncDiLoCo (its attributes: windows, inbox, params, start, ...)."""

    def before_save(self) -> None:
        """Collective, every replica between arrivals: the global model into the model (what
        "model" saves), this replica's own weights kept aside, the claim counter set to the step."""
        self.ctx.comm.Barrier()
        self._stash = flat(self.params) if self.trains else None
        theta, momentum, acc = self.windows.read_all()
        self._outer = {"momentum": torch.from_numpy(momentum), "acc": torch.from_numpy(acc)}
        control = self.windows.read_control()
        self._arrivals, self._step_times = int(control[1]), control[3:].tolist()  # ns per replica
        assign(self.params, theta)
        self.ctx.comm.Barrier()  # servers progress the reads in MPI until every rank is done
        # the claim counter restarts at the checkpoint step: a claim past it was given back (its
        # batch is claimed again after the meeting)
        self.windows.set_position(self._step_at_meeting)

    def after_save(self) -> None:
        if self.trains and not self._finished:
            assign(self.params, self._stash)  # back to this replica's own weights
        self.ctx.comm.Barrier()  # nobody claims or arrives before every rank has saved

    def state_dict(self) -> dict:
        n = len(self.start)
        state = {"mode": self.mode, "replicas": self.n_workers, "outer_optimizer": self.kind,
                 "arrivals": self._arrivals, "step_times_ns": self._step_times,
                 self.outer_key: self._outer or {"momentum": torch.zeros(n), "acc": torch.zeros(n)}}
        if self.trains:
            local = self._stash if self._stash is not None else flat(self.params)
            counters = [self.round_steps, self.steps_this_round, self.last_arrival, self.windows.bytes_moved]
            state["replica"] = {self.state_key: {
                "local": torch.from_numpy(local.copy()), "start": torch.from_numpy(self.start.copy()),
                "optim": _local_optim_state(self.local_optim), "counters": torch.tensor(counters, dtype=torch.int64),
                "round_compute_s": torch.tensor([self.round_compute_s], dtype=torch.float64),
                "round_lr_sum": torch.tensor([self.round_lr_sum], dtype=torch.float64)}}
            if self.inbox is not None and self.inbox.push_residual is not None:
                residual = torch.from_numpy(self.inbox.push_residual.copy())
                state["replica"][self.state_key]["push_residual"] = residual
        return state

    def load_state_dict(self, state: dict) -> None:
        self._outer, self._arrivals = state[self.outer_key], int(state["arrivals"])
        self._step_times = [int(v) for v in state["step_times_ns"]]
        if not self.trains:
            return
        mine = state["replica"][self.state_key]
        _load_local_optim_state(self.local_optim, mine["optim"])
        assign(self.params, mine["local"].numpy())
        self.start = mine["start"].numpy().copy()
        self.round_steps, self.steps_this_round, self.last_arrival, self.windows.bytes_moved = (
            int(v) for v in mine["counters"])
        self.round_compute_s = float(mine["round_compute_s"][0])
        self.round_lr_sum = float(mine["round_lr_sum"][0])
        if self.inbox is not None and self.inbox.push_residual is not None and "push_residual" in mine:
            self.inbox.push_residual[:] = mine["push_residual"].numpy()

    def after_load(self, step: int) -> None:
        """Servers: the saved global model and outer state back into the windows."""
        theta = flat(self.params) if not self.trains else None
        if not self.trains:
            self.windows.restore(theta, self._outer["momentum"].numpy(), self._outer["acc"].numpy(),
                                 claims=step, arrivals=self._arrivals, step_times_ns=self._step_times)
            if self.inbox is not None:
                self.inbox.restart_at(self._arrivals)
        if self.inbox is not None:  # the servers' views: the replicas' restored start points
            self.inbox.set_views(self.replica, self.start if self.trains else None)
        self.ctx.comm.Barrier()  # windows restored before any replica claims



def _local_optim_state(optim) -> dict:
    """The inner optimizer's tensors (an OptimState) with this rank's shards as plain tensors: a
    replica's state is its own, under its own key (a DTensor would be read as one tensor over
    the replicas)."""
    return {k: local_part(v) for k, v in optim.state_dict().items()}


def _load_local_optim_state(optim, saved: dict) -> None:
    """Back from _local_optim_state: shards of tensor-parallel parameters become DTensors again."""
    from torch.distributed.tensor import DTensor

    def restore(now, v):
        if not isinstance(now, DTensor):
            return v
        return DTensor.from_local(v, now.device_mesh, now.placements, run_check=False,
                                  shape=now.shape, stride=now.stride())  # uneven shards too

    optim.load_state_dict({k: restore(now, saved[k]) for k, now in optim.state_dict().items()})
