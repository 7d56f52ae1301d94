"""One member's side of population-based training: PBT's hooks on the Trainer's one loop.

Per member (hpctrain/train/hooks.py's points): resumed -> every member at the same step, this
member's values (the member's checkpoint holds the population's state); start -> the lineage's
start record; a span boundary at every `ready` step, and at_meeting -> the round when due:
validation loss, gathered over COMM_WORLD; exploit copies rank to rank; explore; the lineage. The
loop itself trains (the stop vote over COMM_WORLD) and saves at checkpoint steps or a stop. Every
rank of every member runs the same number of steps, rounds and saves, so the collectives line up.

Owns: the rounds' place in the loop. It must never decide who copies whom (pbt.Population), move
tensors (pbt_members.py), or save files but through the Trainer's checkpoint manager and LineageLog.
"""
from __future__ import annotations

from pathlib import Path

from hpctrain import logs
from hpctrain.distributed.preempt import Preemption
from hpctrain.errors import ConfigError
from hpctrain.train.loop import Trainer
from hpctrain.tune import pbt_members
from hpctrain.tune.pbt import LINEAGE, LineageLog, Population, check_same_step

log = logs.get_logger(__name__)


class MemberTrainer(Trainer):
    """The Trainer, whose checkpoints also hold the population's state."""

    population: Population
    _val: tuple[int, float | None] | None = None  # (step, validation loss) of these weights

    def evaluate(self) -> float | None:
        """The Trainer's validation, once per step and weights: a round at an eval step reuses the
        step record's value (the round's copy of weights calls ``forget_validation``)."""
        if self._val is None or self._val[0] != self.step:
            self._val = (self.step, super().evaluate())
        return self._val[1]

    def forget_validation(self) -> None:
        self._val = None

    def checkpoint_states(self, saved: dict | None = None) -> dict:
        return {**super().checkpoint_states(saved), "pbt": self.population}


def _next_multiple(step: int, every: int) -> int:
    return (step // every + 1) * every


def log_round(step: int, round_no: int, losses: list[float], plan: list[tuple[int, int]]) -> None:
    """The round's line (every rank calls it; the log shows rank 0's, HPCTRAIN_LOG_RANKS more):
    each member's validation loss, the best member, who copied whom (loser<-donor)."""
    moves = ", ".join(f"{loser}<-{donor}" for loser, donor in plan) or "none"
    best = min(range(len(losses)), key=lambda m: losses[m])
    log.info(f"[pbt] step {step} round {round_no}: val losses "
             f"{' '.join(f'{v:.4f}' for v in losses)}; best member {best}; copies {moves}")


class PopulationRun:
    """A member's Trainer with PBT's hooks on its one loop: the population's step and this member's
    values after the resume, the lineage's start, a round at every `ready` step (a span boundary:
    the members meet there; a checkpoint only at checkpoint steps)."""

    def __init__(self, cfg, ctx, tune, pbt, world, member: int, k: int, pbt_dir: Path):
        self.cfg, self.ctx, self.pbt, self.world = cfg, ctx, pbt, world
        self.member, self.k, self.pbt_dir = member, k, pbt_dir
        self.trainer = MemberTrainer(cfg, ctx)
        self.trainer.population = Population(tune, pbt)
        # one stop vote for the whole population: every member stops at the same step
        self.trainer.preempt = Preemption(cfg.slurm, world, world.Get_rank(),
                                          step_sleep_s=self.trainer.plan.faults.step_sleep_s)
        self.lineage: LineageLog | None = None
        hooks = self.trainer.hooks
        hooks.add("resumed", self._take_values)
        hooks.add("start", self._start)
        hooks.add_boundary(lambda step: _next_multiple(step, pbt.ready))
        hooks.add("at_meeting", self._round_if_due)
        hooks.validate_at_start = True  # round 0's losses: the starting point of every member

    @property
    def population(self) -> Population:
        return self.trainer.population

    def fit(self) -> int:
        return self.trainer.fit()

    def _take_values(self) -> None:
        """After the resume: every member at the same step, with its own values."""
        check_same_step(self.world, self.trainer.step)
        pbt_members.apply_values(self.trainer, self.population.values[self.member])

    def _start(self) -> None:
        step = self.trainer.step
        self.lineage = LineageLog(self.pbt_dir / LINEAGE, self.world.Get_rank() == 0, step)
        if step == 0:
            self.lineage.write({"step": 0, "round": 0, "event": "start",
                                "values": [dict(v) for v in self.population.values]})
        self._round_if_due()  # resumed from a stop that came before the round

    def _round_if_due(self) -> None:
        if self._round_due():
            self._round(self.lineage)

    def _round_due(self) -> bool:
        step = self.trainer.step
        return (step < self.cfg.train.steps and step // self.pbt.ready > self.population.round
                and step % self.pbt.ready == 0)

    def _round(self, lineage: LineageLog) -> None:
        """Every rank: gather the members' validation losses, exploit, explore, log."""
        tr = self.trainer
        val = tr.evaluate()
        if val is None:
            raise ConfigError(f"config key 'data.path': {self.cfg.data.path} has no validation "
                              f"split; PBT ranks members by validation loss")
        losses = self.world.allgather(val)[::self.k]  # each member's first rank speaks for it
        plan, records = self.population.next_round(tr.step, [float(v) for v in losses])
        pbt_members.copy_members(tr, self.world, plan, self.member, self.k)
        tr.forget_validation()  # a member that copied has other weights at the same step
        pbt_members.apply_values(tr, self.population.values[self.member])
        for record in records:
            lineage.write(record)
        log_round(tr.step, self.population.round, losses, plan)
