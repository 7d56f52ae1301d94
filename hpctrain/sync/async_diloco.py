"""sync.mode = "async_diloco": asynchronous Local-SGD. Each replica takes its local steps, pushes
its pseudo-gradient to the global model as soon as its round ends, gets the updated model back and
goes on; no replica ever waits for another between checkpoints.

A replica's step: claim the next global batch index from the shared counter (each batch goes to
exactly one replica, so every sample is trained once per epoch across replicas however uneven
their speeds; a fast replica simply claims more) -> train it with the inner optimizer -> after
`steps_this_round` steps: g = start - local, arrive(g) applies the outer update under the servers'
locks (hpctrain/sync/outer.py: sgd | nesterov | delayed_nesterov) and returns the new global model,
which becomes the replica's weights and start point. Staleness of an arrival = arrivals by others
since this replica last took the global model. With sync.local_steps = "dynamic" each replica
publishes its mean step time at every arrival and sets its next round's steps from the fastest
replica's (outer.dynamic_local_steps), so rounds take about the same wall time.

The step counter is global: a replica that trained batch k is at step k + 1 (the learning rate
follows global progress); checkpoints come at the regular steps, when the claim counter reaches
them: every replica finishes the batches it claimed and meets the others there.

Owns: the round (local steps, start point, arrival, dynamic step count), its metrics and its
checkpoint entry. Not yet: tp / pp inside a replica (config_rules refuses), compressed pushes.
"""
from __future__ import annotations

import time

import torch

from hpctrain.config import Config
from hpctrain.distributed import DistContext
from hpctrain.sync.asynchronous import AsynchronousStrategy, assign, count_workers, flat
from hpctrain.sync.global_model import GlobalModelWindows
from hpctrain.sync.outer import apply_arrival, dynamic_local_steps


class AsyncDiLoCo(AsynchronousStrategy):
    mode = "async_diloco"
    every_worker_steps = False  # a step's batch is trained by the replica that claimed it
    count_key = "replicas"

    def __init__(self, cfg: Config, ctx: DistContext, model: torch.nn.Module):
        super().__init__(ctx, count_workers(cfg, ctx))
        s = cfg.sync
        self.kind, self.inner_steps, self.dynamic = s.outer_optimizer, s.inner_steps, s.local_steps == "dynamic"
        self.outer = dict(lr=s.outer_lr, mu=s.outer_momentum, replicas=self.n_workers,
                          delay=s.nesterov_delay or self.n_workers)
        self.params = list(model.parameters())
        self.windows = GlobalModelWindows(ctx.comm, flat(self.params), s.ps_servers, self.n_workers)
        self.flags = self.windows
        self.start = flat(self.params)
        self.replica = ctx.rank if self.trains else -1
        self.steps_this_round, self.round_steps = self.inner_steps, 0
        self.claimed, self.last_arrival, self.arrivals_seen = -1, 0, 0
        self.round_compute_s, self._t0 = 0.0, 0.0
        self.pending: dict = {}
        self._optim = self._stash = self._outer = None
        self._arrivals, self._finished, self._step_at_meeting = 0, False, 0
        self._step_times = [0] * self.n_workers

    # ---- a replica's step ---------------------------------------------------------------------
    def before_step(self, step: int, stop_aware: bool = True, until: int | None = None) -> bool:
        """Claim the next batch; False when the claim is at or past `until` (a checkpoint step:
        time to meet) or the stop flag is up."""
        if stop_aware and self.flags.stop_flag():
            return False
        self.claimed = self.windows.claim()
        if until is not None and self.claimed >= until:
            return False
        self._t0 = time.perf_counter()
        return True

    def batch_index(self, step: int) -> int | None:
        return self.claimed

    def next_step(self, step: int) -> int:
        return self.claimed + 1

    def after_step(self, step: int) -> None:
        self.round_compute_s += time.perf_counter() - self._t0
        self.round_steps += 1
        self.pending = {}
        if self.round_steps >= self.steps_this_round:
            self._arrive()

    def _arrive(self) -> None:
        g = self.start - flat(self.params)

        def apply(theta, momentum, acc, g_slice, arrival):
            apply_arrival(self.kind, theta, momentum, acc, g_slice, arrival, **self.outer)

        t0 = time.perf_counter()
        arrival, theta = self.windows.arrive(g, apply)
        arrive_s = time.perf_counter() - t0
        assign(self.params, theta)  # the replica goes on from the global model
        self.start = theta
        step_s = self.round_compute_s / self.round_steps
        self.pending = {"arrival": arrival, "replica": self.replica, "local_steps": self.round_steps,
                        "staleness": arrival - 1 - self.last_arrival, "round_step_s": step_s,
                        "arrive_s": arrive_s}
        self.last_arrival = arrival
        self.windows.set_step_time(self.replica, step_s)
        if self.dynamic:
            times = self.windows.step_times()
            self.steps_this_round = dynamic_local_steps(self.inner_steps, step_s, float(times[times > 0].min()))
        self.pending["next_local_steps"] = self.steps_this_round
        self.round_steps, self.round_compute_s = 0, 0.0

    def step_metrics(self) -> dict:
        return dict(self.pending)

    def comm_bytes(self, step: int) -> int:
        return self.windows.bytes_moved

    def describe(self) -> str:
        return (f", async_diloco: {self.n_workers} replicas, {self.ctx.world_size - self.n_workers} "
                f"servers, {self.kind}, {'dynamic' if self.dynamic else 'fixed'} local steps "
                f"(<= {self.inner_steps})")

    # ---- the end of training, checkpoints --------------------------------------------------------
    def meet(self, preempt, step: int, stop: int, end: int) -> tuple[int, int]:
        step, stop = super().meet(preempt, step, stop, end)
        self._finished, self._step_at_meeting = step >= end, step
        if self._finished and self.trains and self.round_steps > 0:
            self._arrive()  # the last, partial round: the global model holds all work
        return step, stop

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
                 "outer": self._outer or {"momentum": torch.zeros(n), "acc": torch.zeros(n)}}
        if self.trains:
            local = self._stash if self._stash is not None else flat(self.params)
            counters = [self.round_steps, self.steps_this_round, self.last_arrival, self.windows.bytes_moved]
            state["replica"] = {str(self.replica): {
                "local": torch.from_numpy(local.copy()), "start": torch.from_numpy(self.start.copy()),
                "optim": self._optim.state_dict(), "counters": torch.tensor(counters, dtype=torch.int64),
                "round_compute_s": torch.tensor([self.round_compute_s], dtype=torch.float64)}}
        return state

    def load_state_dict(self, state: dict) -> None:
        self._outer, self._arrivals = state["outer"], int(state["arrivals"])
        self._step_times = [int(v) for v in state["step_times_ns"]]
        if not self.trains:
            return
        mine = state["replica"][str(self.replica)]
        self._optim.load_state_dict(mine["optim"])
        assign(self.params, mine["local"].numpy())
        self.start = mine["start"].numpy().copy()
        self.round_steps, self.steps_this_round, self.last_arrival, self.windows.bytes_moved = (
            int(v) for v in mine["counters"])
        self.round_compute_s = float(mine["round_compute_s"][0])

    def after_load(self, step: int) -> None:
        """Servers: the saved global model and outer state back into the windows."""
        theta = flat(self.params) if not self.trains else None
        if not self.trains:
            self.windows.restore(theta, self._outer["momentum"].numpy(), self._outer["acc"].numpy(),
                                 claims=step, arrivals=self._arrivals, step_times_ns=self._step_times)
        self.ctx.comm.Barrier()  # windows restored before any replica claims

    def close(self) -> None:
        self.windows.free()
