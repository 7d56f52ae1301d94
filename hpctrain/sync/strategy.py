"""What a sync mode is to the trainer: a strategy object with a few hooks, called by the one
training loop (hpctrain/train/loop.py) at fixed points:

    before_step(step, stop_aware) -> bool    may wait / pull; False: a stop came up meanwhile
    after_step(step)                         DiLoCo: end a round; ps: push the update
    stop_reason(preempt, step) -> int        per step: has the job been asked to stop?
    meet(preempt, step, stop, end) -> (step, stop)   at a checkpoint step: where every rank stops
    before_save() / after_save()             around a checkpoint (ps: pull the servers' model);
                                             registered as the loop's save hooks (train/hooks.py)
    bind_local_state(model, optim)           once, from the loop: this rank's model and optimizer
                                             state (Stateful wrappers), what the checkpoint holds
    checkpoint_states(saved) -> dict         the checkpoint's entries in this mode; reads only
                                             (raises for a checkpoint it cannot resume)
    before_load(saved) / after_load(step)    around loading a checkpoint (DiLoCo: one written
                                             with sync.mode='sync' restarts its rounds from it)
    state_dict() / load_state_dict()         its own "sync" entry
    step_metrics() / comm_bytes(step), mean_over_replicas(value), describe(), close()
    step_loss(loss) -> float                 the step's loss as logged (hierarchical DiLoCo: the
                                             replicas' means averaged; else as the layout gives it)
    round_line(step, log_interval) -> str | None   DiLoCo, async_diloco: the log line of a round

and four facts: `trains` (False on a server rank), `global_each_step` (the loss and grad norm
are the same on every rank after a step, so a non-finite one needs no vote), `collective_steps`
(all ranks step together, so per-step collectives are allowed: the stop vote, validation, data and
straggler statistics) and `every_worker_steps` (every worker trains every step index: after a stop
the others catch up with the furthest; False where a step's batch is claimed by one replica).
The step counter itself advances through next_step(step) (async_diloco: the claimed batch + 1), and
batch_index(step) names the batch a step trains (None: the sampler's next one).

Owns: the defaults of those hooks, which are the synchronous case. It must never touch the
optimizer or the data order.
"""
from __future__ import annotations

from hpctrain.errors import ConfigError


def refuse_other_mode(saved: dict, mode: str, how: str) -> None:
    """ConfigError naming sync.mode when a checkpoint's "sync" entry is of another mode."""
    saved_mode = saved.get("mode", "sync")
    if saved_mode != mode:
        raise ConfigError(f"config key 'sync.mode': the checkpoint was written with sync.mode="
                          f"'{saved_mode}'; {how}")


class SyncStrategy:
    mode = "sync"
    trains = True
    global_each_step = True
    collective_steps = True
    every_worker_steps = True
    ranks_per_record: int | None = None  # the ranks whose tokens a metrics record counts (None: all)
    local_model = local_optim = None  # bind_local_state: this rank's ModelState / OptimState

    @property
    def writes_metrics(self) -> bool:
        """Whether this rank writes its own metrics file where steps are not collective (one
        per worker: a replica of several ranks writes one)."""
        return self.trains

    def before_step(self, step: int, stop_aware: bool = True, until: int | None = None) -> bool:
        return True

    def batch_index(self, step: int) -> int | None:
        return None

    def next_step(self, step: int) -> int:
        return step + 1

    def after_step(self, step: int) -> None:
        pass

    def stop_reason(self, preempt, step: int) -> int:
        """One small all-reduce: every rank gets the same answer at the same step."""
        return preempt.vote(step)

    def meet(self, preempt, step: int, stop: int, end: int) -> tuple[int, int]:
        return step, stop  # every rank is at `step` and agreed on `stop` already

    def before_save(self) -> None:
        pass

    def bind_local_state(self, model, optim) -> None:
        """Called once by the loop before any checkpoint: this rank's model and optimizer state."""
        self.local_model, self.local_optim = model, optim

    def checkpoint_states(self, saved: dict | None = None) -> dict:
        """{name: Stateful} of a checkpoint in this mode. `saved`: the "sync" entry of one about
        to be loaded; a mode that cannot resume it raises ConfigError naming the key. Changes
        nothing (before_load does)."""
        return {"model": self.local_model, "optim": self.local_optim, "sync": self}

    def before_load(self, saved: dict) -> None:
        """Before loading a checkpoint whose "sync" entry is `saved` (its states were checked)."""

    def after_save(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"mode": self.mode}

    def load_state_dict(self, state: dict) -> None:
        pass

    def after_load(self, step: int) -> None:
        pass

    def step_metrics(self) -> dict:
        return {}

    def meeting_metrics(self) -> dict:
        """What happened at the meeting just held (async_diloco: the last round's arrival), for
        this rank's metrics; {} for nothing."""
        return {}

    def comm_bytes(self, step: int) -> int:
        return 0

    def mean_over_replicas(self, value: float) -> float:
        return value  # the layout's losses are global means already

    def step_loss(self, loss: float) -> float:
        return loss  # the layout's training loss is the global batch's mean already

    def describe(self) -> str:
        """What the start-up line says about this mode and its parameters (", sync ...")."""
        return f", sync {self.mode}"

    def round_line(self, step: int, log_interval: int) -> str | None:
        """The log line of the round that ended with step `step`, where one ended and a line
        is due (at most one per `log_interval` steps, and the last); None otherwise."""
        return None

    def close(self) -> None:
        pass
