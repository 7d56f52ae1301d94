"""One member's side of population-based training: the Trainer's loop with rounds in it.

Per member: resume (the member's checkpoint holds the population's state) -> set this member's
values -> per span up to the next round or checkpoint step { train (the Trainer's own steps; the
stop vote over COMM_WORLD) -> round when due: validation loss, gathered over COMM_WORLD; exploit
copies rank to rank; explore; the lineage -> checkpoint when due or stopped }. Every rank of every
member runs the same number of steps, rounds and saves, so the collectives line up.

Owns: that order. It must never decide who copies whom (pbt.Population), move tensors
(pbt_members.py), or save files but through the Trainer's checkpoint manager and LineageLog.
"""
from __future__ import annotations

import time
from pathlib import Path

from hpctrain.distributed.preempt import NONE, Preemption
from hpctrain.errors import ConfigError
from hpctrain.step_faults import step_faults
from hpctrain.train.loop import Trainer, log, stop_at_step_line
from hpctrain.tune import pbt_members
from hpctrain.tune.pbt import LINEAGE, LineageLog, Population, check_same_step


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


class PopulationRun:
    def __init__(self, cfg, ctx, tune, pbt, world, member: int, k: int, pbt_dir: Path):
        self.cfg, self.ctx, self.pbt, self.world = cfg, ctx, pbt, world
        self.member, self.k, self.pbt_dir = member, k, pbt_dir
        self.trainer = MemberTrainer(cfg, ctx)
        self.trainer.population = Population(tune, pbt)
        # one stop vote for the whole population: every member stops at the same step
        self.trainer.preempt = Preemption(cfg.slurm, world, world.Get_rank(),
                                          step_sleep_s=step_faults().step_sleep_s)

    @property
    def population(self) -> Population:
        return self.trainer.population

    def fit(self) -> int:
        tr, t = self.trainer, self.cfg.train
        tr.maybe_resume()
        check_same_step(self.world, tr.step)
        pbt_members.apply_values(tr, self.population.values[self.member])
        end = t.stop_at_step or t.steps
        tr._write_run_config()
        metrics = tr._metrics_log()
        lineage = LineageLog(self.pbt_dir / LINEAGE, self.world.Get_rank() == 0, tr.step)
        tr.peak = tr._peak_flops()
        tr._log_start(end)
        if tr.step == 0:
            lineage.write({"step": 0, "round": 0, "event": "start",
                           "values": [dict(v) for v in self.population.values]})
            tr._validate(metrics)
        tr.t_start, tr.start_step = time.perf_counter(), tr.step
        stop = NONE
        while tr.step < end and stop == NONE:
            until = min(end, _next_multiple(tr.step, self.pbt.ready),
                        _next_multiple(tr.step, self.cfg.checkpoint.interval))
            if self._round_due():  # resumed from a stop that came before the round
                self._round(lineage)
            stop = tr._run_until(until, end, metrics)
            if self._round_due():
                self._round(lineage)
            if stop != NONE or tr.step % self.cfg.checkpoint.interval == 0 or tr.step == end:
                tr.save()
        tr.ckpt.wait()
        tr.sync.close()
        metrics.close()
        if tr.preempt.stopped:
            return tr.preempt.finish(tr.step)
        if t.stop_at_step and tr.step < t.steps:
            log(self.ctx, stop_at_step_line(t, tr.step))
        return 0

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
        if self.world.Get_rank() == 0:
            moves = ", ".join(f"{loser}<-{donor}" for loser, donor in plan) or "none"
            best = min(range(len(losses)), key=lambda m: losses[m])
            print(f"[pbt] step {tr.step} round {self.population.round}: val losses "
                  f"{' '.join(f'{v:.4f}' for v in losses)}; best member {best}; copies {moves}",
                  flush=True)
