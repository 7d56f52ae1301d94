"""`mpiexec -n P*k python -m hpctrain tune pbt CONFIG.toml`: population-based training in one job.

The ranks split into P members of k ranks (pbt_members.py); each member is a training run of its
own (its own communicator, process group, DistContext and run directory <run.dir>/member_<i>, the
unchanged Trainer). The members step together: every `tune.pbt.ready` steps each one evaluates its
validation loss, the losses are gathered over COMM_WORLD, the worst quantile copies weights and
optimizer state from a member of the best (rank to rank) and explores (pbt_space.py), and world
rank 0 appends what happened to <run.dir>/lineage.jsonl. The stop vote (signals, wall time) runs
over COMM_WORLD, so every member stops at the same step; each saves its checkpoint with the
population's state (every member's values, the explorer's RNG, the round) inside it: resumed, the
population goes on as if never stopped (the same lineage). One heartbeat watchdog spans
COMM_WORLD: a member rank that dies or hangs ends the whole job with one line naming it.

Owns: the population's state, its config and the lineage file (the job's entry is pbt_job.py,
the loop pbt_loop.py). It must never change the Trainer's
step (it drives the Trainer's own pieces), sample or perturb values itself, or move tensors.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from hpctrain.errors import ConfigError, UserError
from hpctrain.tune import pbt_space, space
from hpctrain.tune.space import TuneConfig

LINEAGE = "lineage.jsonl"


def load(config_path: str, overrides: list[str]):
    """(training Config, TuneConfig, PbtConfig), checked for PBT, or one ConfigError."""
    from hpctrain.tune import study

    raw, cfg, tune, source = study.read(config_path, overrides, "[tune.params] bounds and [tune.pbt]")
    pbt = space.parse_pbt(raw["tune"].get("pbt"), source)
    pbt_space.check_mutable(tune)
    if cfg.sync.mode != "sync":
        raise ConfigError(f"config key 'sync.mode': '{cfg.sync.mode}' in {source}; PBT members "
                          f"step together: use sync")
    if cfg.train.eval_interval <= 0:
        raise ConfigError(f"config key 'train.eval_interval': is 0 in {source}; PBT ranks members "
                          f"by validation loss, which needs a validation split and eval_batches")
    return cfg, tune, pbt


def member_config(cfg, member: int):
    """The member's own copy of the config: run directory <run.dir>/member_<i> (and checkpoint
    directory, if one is given, <checkpoint.dir>/member_<i>; node cache <cache>/pbt_member_<i>)."""
    cfg = copy.deepcopy(cfg)
    cfg.run.dir = str(Path(cfg.run.dir) / f"member_{member}")
    if cfg.checkpoint.dir:
        cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir) / f"member_{member}")
    cache = cfg.data.cache_dir  # a node cache is one job's: each member has its own folder
    if cache == "auto":
        cache = os.environ.get("SLURM_TMPDIR") or os.environ.get("TMPDIR") or "off"
    if cache not in ("", "off", "none"):
        cfg.data.cache_dir = os.path.join(cache, f"pbt_member_{member}")
    return cfg


class Population:
    """Every member's current values, the explorer's RNG and the rounds done: a Stateful saved
    (as JSON) in every member's checkpoint."""

    def __init__(self, tune: TuneConfig, pbt: space.PbtConfig):
        import random

        self.tune, self.pbt = tune, pbt
        self.rng = random.Random(pbt.seed)
        self.values = pbt_space.first_values(tune.params, pbt.population, self.rng)
        self.round = 0

    def state_dict(self) -> dict:
        return {"values": self.values, "rng": pbt_space.rng_state(self.rng), "round": self.round}

    def load_state_dict(self, state: dict) -> None:
        if len(state["values"]) != self.pbt.population:
            raise ConfigError(f"config key 'tune.pbt.population': {self.pbt.population}, but the "
                              f"checkpoint holds {len(state['values'])} members")
        self.values = [dict(v) for v in state["values"]]
        self.rng = pbt_space.rng_from_state(state["rng"])
        self.round = int(state["round"])

    def next_round(self, step: int, losses: list[float]) -> tuple[list, list[dict]]:
        """Exploit and explore after `losses` (one per member): (plan, lineage records)."""
        self.round += 1
        plan = pbt_space.exploit_plan(losses, self.pbt, self.rng)
        records = []
        for loser, donor in plan:
            old = self.values[loser]
            new = pbt_space.explore(self.tune.params, self.values[donor], self.rng, self.pbt)
            self.values[loser] = new
            records.append({"step": step, "round": self.round, "event": "exploit", "member": loser,
                            "copied_from": donor, "loss": losses[loser], "donor_loss": losses[donor],
                            "old": old, "donor": dict(self.values[donor]), "new": new})
        summary = {"step": step, "round": self.round, "event": "round", "losses": losses,
                   "values": [dict(v) for v in self.values]}
        return plan, [summary, *records]


class LineageLog:
    """<run.dir>/lineage.jsonl, world rank 0 only; resumed at step S, records after S are dropped."""

    def __init__(self, path: Path, enabled: bool, resume_step: int):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [line for line in (path.read_text().splitlines() if path.exists() else [])
                if line.strip() and json.loads(line)["step"] <= resume_step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())


def read_lineage(run_dir) -> list[dict]:
    path = Path(run_dir) / LINEAGE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_same_step(world, step: int) -> None:
    steps = world.allgather(step)
    if len(set(steps)) > 1:
        raise UserError(f"PBT members resumed at different steps {steps}: a stop left some members' "
                        f"checkpoints uncommitted; remove the newer ones so that all resume at "
                        f"step {min(steps)}")
