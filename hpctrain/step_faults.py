"""Test-only faults in the training step: stragglers, slow replicas, NaN losses and sleeps on cue.

Owns the one switch that arms them, the environment variable

    HPCTRAIN_TEST_FAULTS="key=value,key=value"    e.g. "delay_rank=1,delay_s=0.5"

with the keys of `StepFaults` below. Unset (production and every user run) every fault is off; they
are never part of the config a user writes, of config.toml or of a checkpoint. The variable reaches
every rank through mpiexec/srun's environment. The item `save_point=NAME[:COUNT[:RANK[:ACTION]]]`
arms one of the checkpoint save path's named fault points (their list and meaning:
hpctrain/checkpoint/faults.py). `skip_vote_rank=R,skip_vote_step=S,skip_vote_s=T` makes rank R sleep T s
instead of entering step S's stop vote (a hung collective for the flight recorder's tests). `exit_after_step=N`
makes every rank exit hard (137) after step N once its peer snapshot in flight is written.

It must never be armed by anything but that variable. A malformed value is a one-line error naming
the variable and the key. `nan_trial=N` confines inject_nan_at_step to trial N of a `hpctrain tune
search` study (the one whose HPCTRAIN_TUNE_TRIAL marker, its run directory, is named trial_N), so
that one trial of a study crashes on cue while the others train normally. `HPCTRAIN_TEST_FAULTS=@/path/file`
reads the items from that file, once per process: a requeued Slurm job keeps its environment, and a
test that rewrites the file gives the job's next start other faults.
"""
from __future__ import annotations

import dataclasses
import os
import time

from hpctrain.errors import ConfigError

ENV = "HPCTRAIN_TEST_FAULTS"
TRIAL_MARKER_ENV = "HPCTRAIN_TUNE_TRIAL"  # set by hpctrain/tune/trial_process.py for a trial's ranks


@dataclasses.dataclass(frozen=True)
class StepFaults:
    delay_rank: int = -1            # this rank sleeps delay_s every step (a straggler); -1: none
    delay_s: float = 0.0
    inject_nan_at_step: int = 0     # the last rank's loss is NaN at this step (0: never)
    slow_factor: float = 1.0        # delay_rank computes this many times slower (sleeps
                                    # (factor - 1) x its measured step time every step)
    compute_sleep_s: float = 0.0    # every rank sleeps this long inside each step, counted as compute
    step_sleep_s: float = 0.0       # every rank sleeps this long every step (long enough to preempt)
    nan_trial: int = -1             # inject_nan_at_step only in this tune trial (the one whose
                                    # HPCTRAIN_TUNE_TRIAL is named trial_N); -1: in every run
    save_point: str = ""            # a checkpoint fault point (hpctrain/checkpoint/faults.py)
    skip_vote_rank: int = -1        # this rank sleeps skip_vote_s instead of entering the stop
    skip_vote_step: int = 0         # vote of this step (a hung collective; then it votes late)
    skip_vote_s: float = 0.0
    gil_hold_rank: int = -1         # this rank holds the GIL in C for gil_hold_s whole seconds
    gil_hold_step: int = 0          # before this step's stop vote (libc sleep through ctypes.PyDLL:
    gil_hold_s: int = 0             # no Python thread of the process runs meanwhile)
    exit_after_step: int = 0        # every rank exits hard (os._exit(137)) after this step, once
                                    # its peer snapshot in flight is written (a killed job); 0: never


_cache: tuple[tuple[str, str], StepFaults] | None = None


def step_faults() -> StepFaults:
    """The armed step faults (all off when HPCTRAIN_TEST_FAULTS is unset or empty)."""
    global _cache
    key = (os.environ.get(ENV, ""), os.environ.get(TRIAL_MARKER_ENV, ""))
    if _cache is None or _cache[0] != key:
        faults = parse(_read(key[0][1:]) if key[0].startswith("@") else key[0])
        if faults.nan_trial >= 0 and os.path.basename(key[1]) != f"trial_{faults.nan_trial}":
            faults = dataclasses.replace(faults, inject_nan_at_step=0)
        _cache = (key, faults)
    return _cache[1]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise ConfigError(f"{ENV}=@{path}: cannot read it ({e.strerror})") from None


def parse(raw: str) -> StepFaults:
    fields = {f.name: f.type for f in dataclasses.fields(StepFaults)}
    values: dict[str, int | float] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ConfigError(f"{ENV}: unknown item '{item}' (keys: {', '.join(fields)})")
        if fields[key] == "str":
            values[key] = value.strip()
            continue
        try:
            values[key] = int(value) if fields[key] == "int" else float(value)
        except ValueError:
            raise ConfigError(f"{ENV}: {key}={value!r} is not a number") from None
    faults = StepFaults(**values)
    if faults.slow_factor < 1 or min(faults.delay_s, faults.compute_sleep_s, faults.step_sleep_s,
                                     faults.inject_nan_at_step, faults.skip_vote_s) < 0:
        raise ConfigError(f"{ENV}: slow_factor must be >= 1 and the other values >= 0 ({raw})")
    return faults


def hang_before_vote(rank: int, step: int) -> None:
    """skip_vote_*: the peers wait in the stop vote of `step` that this rank has not entered."""
    faults = step_faults()
    if faults.skip_vote_rank == rank and faults.skip_vote_step == step:
        time.sleep(faults.skip_vote_s)
    if faults.gil_hold_rank == rank and faults.gil_hold_step == step:
        import ctypes
        ctypes.PyDLL(None).sleep(faults.gil_hold_s)  # PyDLL: the GIL stays held during the call


def env(**faults) -> dict[str, str]:
    """{HPCTRAIN_TEST_FAULTS: "k=v,..."} for a test's subprocess environment."""
    return {ENV: ",".join(f"{k}={v}" for k, v in faults.items())}
