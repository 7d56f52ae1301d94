"""The `[tune]` section of a training TOML: the study's settings and the search space.

    [tune]
    n_trials = 16                 # trials in the study (finished, pruned and failed ones count)
    pruner = "median"             # median | successive_halving | none
    journal = "runs/lr-search/study.journal"   # trials train in runs/lr-search/trial_<n>
    [tune.params]
    train.lr = { log_uniform = [1e-4, 1e-2] }
    train.warmup_steps = { int = [0, 40], step = 10 }
    train.micro_batch_size = { choice = [4, 8] }
    model.dropout = { uniform = [0.0, 0.2] }

Owns: that schema, parsing and checking it (each failure one ConfigError naming the key), a
distribution's Optuna suggestion, and a sampled point as `--section.key=value` overrides. It must
never import torch, nor optuna at parse time (`hpctrain train` reads the section too), nor touch
the file system.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hpctrain.config_schema import coerce, sections
from hpctrain.errors import ConfigError

KINDS = ("log_uniform", "uniform", "int", "choice")
NOT_TUNABLE = ("run.dir",)  # the worker gives every trial its own run directory


@dataclass(frozen=True)
class Param:
    """One distribution over one config key ("train.lr")."""

    key: str
    kind: str                      # one of KINDS
    low: float | int | None = None
    high: float | int | None = None
    step: int = 1                  # int only
    choices: tuple = ()            # choice only

    def suggest(self, trial):
        """The trial's value (sampled now, or the one it already has: a resumed trial)."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, step=self.step)
        return trial.suggest_float(self.key, self.low, self.high, log=self.kind == "log_uniform")

    def describe(self) -> str:
        if self.kind == "choice":
            return f"{self.key} in {list(self.choices)}"
        step = f" step {self.step}" if self.kind == "int" and self.step != 1 else ""
        return f"{self.key} ~ {self.kind}[{self.low}, {self.high}]{step}"


@dataclass(frozen=True)
class TuneConfig:
    params: tuple[Param, ...] = field(metadata={"help": "[tune.params]: key = { kind = ... }"})
    n_trials: int = field(default=16, metadata={
        "help": "trials in the study; COMPLETE, PRUNED, FAIL and RUNNING ones all count"})
    metric: Literal["val_loss"] = field(default="val_loss", metadata={
        "help": "minimized: the validation loss at the last step (train.eval_interval > 0)"})
    journal: str = field(default="", metadata={
        "help": "the study's Optuna journal file on the shared file system (default "
                "<run.dir>/study.journal); trial n trains in <its folder>/trial_<n>"})
    study_name: str = field(default="hpctrain", metadata={"help": "study name in the journal"})
    seed: int = field(default=0, metadata={
        "help": "sampler seed: trial n's sampler is seeded with seed + n"})
    sampler_startup_trials: int = field(default=10, metadata={
        "help": "TPE: trials sampled at random before the model of good/bad points is used"})
    pruner: Literal["median", "successive_halving", "none"] = field(default="median", metadata={
        "help": "median (stop a trial whose val loss is worse than the median of earlier trials "
                "at the same step) | successive_halving (asynchronous SHA rungs) | none"})
    prune_startup_trials: int = field(default=2, metadata={
        "help": "median: trials that must finish before any is pruned"})
    prune_warmup_steps: int = field(default=0, metadata={
        "help": "median: a trial is not pruned before this training step"})
    min_resource: int = field(default=0, metadata={
        "help": "successive_halving: training steps before the first rung (0 = Optuna's estimate)"})
    reduction_factor: int = field(default=3, metadata={
        "help": "successive_halving: 1 / the fraction of trials promoted at each rung"})

    @property
    def study_dir(self) -> Path:
        return Path(self.journal).parent

    def trial_dir(self, number: int) -> Path:
        return self.study_dir / f"trial_{number}"


@dataclass(frozen=True)
class PbtConfig:
    population: int = 4
    ready: int = 50
    quantile: float = 0.25
    perturb: tuple = (0.8, 1.2)
    resample_probability: float = 0.25
    seed: int = 0
    exploit: bool = True

    def n_exchanged(self) -> int:
        """How many members are replaced each round (and how many are the donors' pool)."""
        if self.population < 2 or not self.exploit:
            return 0
        return max(1, min(self.population // 2, int(self.population * self.quantile)))


def parse_pbt(raw, source: str = "config") -> PbtConfig:
    """The [tune.pbt] table (absent: the defaults) -> PbtConfig, or one ConfigError naming the key."""
    raw = {} if raw is None else raw
    _check(isinstance(raw, dict), "tune.pbt", f"expected a [tune.pbt] table in {source}")
    hints = typing.get_type_hints(PbtConfig)
    known = [f.name for f in dataclasses.fields(PbtConfig)]
    kwargs = {}
    for key, value in raw.items():
        _check(key in known, f"tune.pbt.{key}", f"unknown key in {source} (known: {', '.join(known)})")
        if key == "perturb":
            _check(isinstance(value, (list, tuple)) and len(value) >= 1 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value),
                "tune.pbt.perturb", f"expected a list of positive factors such as [0.8, 1.2], got {value!r}")
            kwargs[key] = tuple(float(v) for v in value)
        else:
            kwargs[key] = coerce(f"tune.pbt.{key}", value, hints[key])
    pbt = PbtConfig(**kwargs)
    _check(pbt.population >= 1, "tune.pbt.population", "must be >= 1")
    _check(pbt.ready >= 1, "tune.pbt.ready", "must be >= 1 (steps between rounds)")
    _check(0.0 < pbt.quantile <= 0.5, "tune.pbt.quantile", "must be in (0, 0.5]")
    _check(0.0 <= pbt.resample_probability <= 1.0, "tune.pbt.resample_probability", "must be in [0, 1]")
    return pbt


def parse(raw, source: str = "config", run_dir: str = "", cli_keys: frozenset = frozenset()
          ) -> TuneConfig:
    """The [tune] table (with any --tune.key=value overrides merged) -> TuneConfig, or one
    ConfigError naming the key (and where it was given)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config key 'tune': expected a [tune] table in {source}")
    raw = fold_pbt_overrides(raw)
    hints = typing.get_type_hints(TuneConfig)
    known = {f.name for f in dataclasses.fields(TuneConfig)} - {"params"}
    kwargs = {}
    for key, value in raw.items():
        if key in ("params", "pbt"):  # pbt: population-based training's table (pbt_space.py)
            continue
        if key not in known:
            where = "on the command line" if f"tune.{key}" in cli_keys else f"in {source}"
            raise ConfigError(f"unknown config key 'tune.{key}' {where} (known: params, pbt, "
                              f"{', '.join(sorted(known))})")
        kwargs[key] = coerce(f"tune.{key}", value, hints[key])
    kwargs["params"] = _parse_params(raw.get("params"), source)
    if "pbt" in raw:
        parse_pbt(raw["pbt"], source)
    if not kwargs.get("journal"):
        kwargs["journal"] = str(Path(run_dir or ".") / "study.journal")
    tune = TuneConfig(**kwargs)
    _validate(tune)
    return tune


def fold_pbt_overrides(raw: dict) -> dict:
    """`--tune.pbt.ready=10` arrives as {"pbt.ready": "10"}: into the [tune.pbt] table."""
    dotted = {k: v for k, v in raw.items() if k.startswith("pbt.")}
    if not dotted:
        return raw
    out = {k: v for k, v in raw.items() if k not in dotted}
    out["pbt"] = {**out.get("pbt", {}), **{k[len("pbt."):]: v for k, v in dotted.items()}}
    return out


def _validate(t: TuneConfig) -> None:
    _check(t.n_trials >= 1, "tune.n_trials", "must be >= 1")
    _check(t.sampler_startup_trials >= 0, "tune.sampler_startup_trials", "must be >= 0")
    _check(t.prune_startup_trials >= 0, "tune.prune_startup_trials", "must be >= 0")
    _check(t.prune_warmup_steps >= 0, "tune.prune_warmup_steps", "must be >= 0")
    _check(t.min_resource >= 0, "tune.min_resource", "must be >= 0 (0 = Optuna's estimate)")
    _check(t.reduction_factor >= 2, "tune.reduction_factor", "must be >= 2")
    _check(bool(t.study_name), "tune.study_name", "must not be empty")


def _parse_params(raw, source: str) -> tuple[Param, ...]:
    if raw is None:
        raise ConfigError(f"missing config key 'tune.params' in {source}: give at least one "
                          f"distribution, e.g. train.lr = {{ log_uniform = [1e-4, 1e-2] }}")
    leaves: list[tuple[str, dict]] = []
    _flatten(raw, "", leaves)
    if not leaves:
        raise ConfigError(f"config key 'tune.params' in {source}: no distribution given")
    return tuple(_param(key, spec) for key, spec in leaves)


def _flatten(node, prefix: str, out: list) -> None:
    """`train.lr = {...}` (nested tables) and `"train.lr" = {...}` (quoted) both give 'train.lr'."""
    if not isinstance(node, dict):
        raise ConfigError(f"config key 'tune.params.{prefix}': expected a distribution table such "
                          f"as {{ log_uniform = [1e-4, 1e-2] }}, got {node!r}")
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and any(k in KINDS for k in value):
            out.append((path, value))
        else:
            _flatten(value, path, out)


def _param(key: str, spec: dict) -> Param:
    where = f"tune.params.{key}"
    section, _, name = key.partition(".")
    by_name = sections()
    hints = typing.get_type_hints(by_name[section]) if section in by_name else {}
    if name not in hints or "." in name:
        raise ConfigError(f"config key '{where}': '{key}' is not a training config key (see "
                          f"`python -m hpctrain train --help`)")
    _check(key not in NOT_TUNABLE, where, "cannot be tuned: every trial gets its own run directory")
    kinds = [k for k in spec if k in KINDS]
    extra = [k for k in spec if k not in KINDS and k != "step"]
    _check(len(kinds) == 1, where, f"give exactly one of {', '.join(KINDS)} (got {kinds})")
    _check(not extra, where, f"unknown field {extra[0] if extra else ''!r} (expected one of "
                             f"{', '.join(KINDS)}, and step with int)")
    kind, typ = kinds[0], hints[name]
    _check("step" not in spec or kind == "int", where, "step goes with int only")
    if kind == "choice":
        return _choice(key, where, spec[kind], typ)
    _check(isinstance(spec[kind], list) and len(spec[kind]) == 2, where,
           f"{kind} = [low, high]: expected two numbers, got {spec[kind]!r}")
    low, high = spec[kind]
    if kind == "int":
        return _int(key, where, low, high, spec.get("step", 1), typ)
    _check(typ is float, where, f"'{key}' takes {getattr(typ, '__name__', typ)} values: use "
                                f"{'int' if typ is int else 'choice'} for it")
    _check(all(_is_number(v) for v in (low, high)), where, f"{kind}: bounds must be numbers")
    _check(low < high, where, f"{kind}: low {low} must be < high {high}")
    _check(kind == "uniform" or low > 0, where, f"log_uniform: low {low} must be > 0")
    return Param(key, kind, float(low), float(high))


def _int(key: str, where: str, low, high, step, typ) -> Param:
    _check(typ in (int, float), where, f"'{key}' is not numeric: use choice for it")
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high, step))
    _check(ints, where, "int: bounds and step must be integers")
    _check(low < high, where, f"int: low {low} must be < high {high}")
    _check(step >= 1 and (high - low) % step == 0, where,
           f"int: step {step} must be >= 1 and divide high - low = {high - low}")
    return Param(key, "int", low, high, step=step)


def _choice(key: str, where: str, values, typ) -> Param:
    _check(isinstance(values, list) and len(values) >= 1, where,
           f"choice = [a, b, ...]: expected a non-empty list, got {values!r}")
    coerced = tuple(coerce(where, v, typ) for v in values)
    _check(len(set(coerced)) == len(coerced), where, f"choice: repeated values in {values!r}")
    return Param(key, "choice", choices=coerced)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}': {msg}")


def overrides(params: dict) -> list[str]:
    """A trial's {key: value} as `--section.key=value` arguments of `hpctrain train`."""
    out = []
    for key, value in sorted(params.items()):
        text = ("true" if value else "false") if isinstance(value, bool) else (
            repr(value) if isinstance(value, float) else str(value))
        out.append(f"--{key}={text}")
    return out


def describe() -> str:
    """The [tune] keys for `tune search --help`."""
    hints = typing.get_type_hints(TuneConfig)
    lines = []
    for f in dataclasses.fields(TuneConfig)[1:]:  # params: the table below the keys
        typ = hints[f.name]
        name = "|".join(typing.get_args(typ)) if typing.get_origin(typ) is Literal else getattr(
            typ, "__name__", "table")
        default = "" if f.default is dataclasses.MISSING else f" [{f.default!r}]"
        lines.append(f"  tune.{f.name:<24} {name}{default} {f.metadata.get('help', '')}")
    return "\n".join(lines)


def check_base(cfg, tune: TuneConfig, source: str) -> None:
    """What the search needs of the base training config: validation during training (the metric,
    reported for pruning) and USR1 among the stop signals (a pruned or preempted trial is stopped
    with it and leaves a checkpoint)."""
    _check(cfg.train.eval_interval > 0, "train.eval_interval",
           f"is 0 in {source}: tune needs validation during training (the metric)")
    from hpctrain.signals import parse

    _check("SIGUSR1" in [s.name for s in parse(cfg.slurm.signals)], "slurm.signals",
           f"'{cfg.slurm.signals}' in {source}: tune stops trials with USR1; add it")
