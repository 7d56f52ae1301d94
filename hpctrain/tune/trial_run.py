"""One trial's training: launched the way slurm/train.sbatch launches, watched, reported, pruned.

Owns: the trial's `hpctrain train` command (the worker's launch prefix, e.g. `srun --mpi=pmi2`,
then the base config, its overrides, the trial's values, its run directory), the trial's log
(<run dir>/train.log), reporting every new validation loss of <run dir>/metrics.jsonl to the trial,
stopping a pruned trial with USR1 (training commits a checkpoint at the next step and exits 75),
passing a preemption on to the training the same way, and the trial's outcome told to the study.
The training never outlives the worker (trial_process.py). It must never ask for trials, requeue,
or read Slurm's environment (search.py does).
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpctrain.errors import ConfigError
from hpctrain.tune import space, trial_process

EXIT_PREEMPTED = 75  # hpctrain/distributed/preempt.py: stopped early, checkpoint committed
POLL_S = 0.05  # reads only the bytes metrics.jsonl gained since the last poll: cheap at any length

COMPLETE, PRUNED, FAIL, PREEMPTED = "COMPLETE", "PRUNED", "FAIL", "PREEMPTED"


@dataclass
class TrialResult:
    outcome: str           # COMPLETE | PRUNED | FAIL | PREEMPTED (left RUNNING for its worker)
    value: float | None    # the metric at the last step (COMPLETE)
    steps: int             # optimizer steps in the run's metrics.jsonl
    detail: str = ""       # why it failed


@dataclass
class Launch:
    """How every trial's training starts: `prefix` (e.g. ['srun', '--mpi=pmi2']; [] = one rank
    here), the base config and the overrides given to `tune search` (no --tune.* ones)."""

    prefix: list[str]
    config: str
    overrides: list[str]

    def train_overrides(self, params: dict, run_dir: Path) -> list[str]:
        return [*self.overrides, *space.overrides(params), f"--run.dir={run_dir}",
                "--slurm.requeue=false"]  # a stopped trial exits 75: the worker decides on requeue

    def command(self, overrides: list[str]) -> list[str]:
        return [*self.prefix, sys.executable, "-m", "hpctrain", "train", "--config", self.config,
                *overrides]


def run_trial(trial, launch: Launch, run_dir: Path, stop_requested) -> TrialResult:
    """Train the trial to its end, its pruning or a preemption (`stop_requested()` turns true)."""
    from hpctrain import config

    overrides = launch.train_overrides(trial.params, run_dir)
    try:  # a point whose values break a config rule fails here, without a launch
        config.load(launch.config, overrides)
    except ConfigError as e:
        return TrialResult(FAIL, None, 0, str(e))
    if stop_requested():  # preempted before the launch: a process signalled while it starts dies
        return TrialResult(PREEMPTED, None, last_step(run_dir / "metrics.jsonl"))
    run_dir.mkdir(parents=True, exist_ok=True)
    trial_process.end_orphan(run_dir, str(run_dir))  # a killed worker's training, still running
    trial.set_user_attr("run_dir", str(run_dir))
    trial.set_user_attr("launches", int(trial.user_attrs.get("launches", 0)) + 1)
    args = launch.command(overrides)
    with open(run_dir / "train.log", "ab") as log:
        log.write(f"[tune] trial {trial.number}: {' '.join(args)}\n".encode())
        log.flush()
        proc = trial_process.start(args, log, str(run_dir))  # ends when this worker dies
        try:
            rc, asked = _watch(proc, trial, run_dir / "metrics.jsonl", stop_requested)
        finally:
            _stop_if_running(proc)  # the worker failed (journal unreadable, ...): no orphan
    return _outcome(rc, asked, run_dir / "metrics.jsonl")


def _stop_if_running(proc, grace_s: float = 60.0) -> None:
    """TERM (training checkpoints and exits, like a preemption), then KILL after grace_s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _watch(proc, trial, metrics: Path, stop_requested) -> tuple[int, str | None]:
    """Report new validation losses while the training runs; USR1 to it when the trial is pruned
    or the worker is preempted. (exit status, what we asked: None | 'prune' | 'preempt')."""
    reported = set(trial.storage.get_trial(trial._trial_id).intermediate_values)  # resumed: kept
    asked, signalled, tail = None, False, MetricsTail(metrics)
    while True:
        rc = proc.poll()
        new = _report_new(trial, tail.val_losses(), reported)
        if rc is not None:
            return rc, asked
        if asked is None and stop_requested():
            asked = "preempt"
        elif asked is None and new and trial.should_prune():
            asked = "prune"
        if asked is not None and not signalled:
            proc.send_signal(signal.SIGUSR1)  # srun / mpiexec pass it on to every rank
            signalled = True
        time.sleep(POLL_S)


def _report_new(trial, val_losses: dict[int, float], reported: set) -> bool:
    """trial.report each validation loss not reported yet (a resumed trial's earlier ones were)."""
    new = False
    for step, val in val_losses.items():
        if step > 0 and step not in reported and math.isfinite(val):
            trial.report(val, step)
            reported.add(step)
            new = True
    return new


def _outcome(rc: int, asked: str | None, metrics: Path) -> TrialResult:
    steps = last_step(metrics)
    if rc == 0:
        vals = _val_losses(metrics)
        value = vals.get(steps)
        if value is None or not math.isfinite(value):
            return TrialResult(FAIL, None, steps, f"no finite val_loss at step {steps} in {metrics}")
        return TrialResult(COMPLETE, value, steps)
    if asked == "prune":  # 75 (stopped with a checkpoint), or killed by USR1 before it was caught
        return TrialResult(PRUNED, None, steps)
    if rc == EXIT_PREEMPTED or asked == "preempt":
        return TrialResult(PREEMPTED, None, steps)
    return TrialResult(FAIL, None, steps, f"training exit status {rc} (see {metrics.parent}/train.log)")


def finish(study, trial, result: TrialResult) -> None:
    """Tell the study a finished outcome (a PREEMPTED trial stays RUNNING for its worker)."""
    from optuna.trial import TrialState

    trial.set_user_attr("steps", result.steps)
    if result.detail:
        trial.set_user_attr("error", result.detail)
    if result.outcome == COMPLETE:
        study.tell(trial.number, result.value)
    elif result.outcome in (PRUNED, FAIL):
        study.tell(trial.number, state=TrialState[result.outcome])


def _parse(lines: list[bytes]) -> list[dict]:
    """The intact step records among ``lines`` (a line torn by a kill is skipped)."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def _records(metrics: Path) -> list[dict]:
    """metrics.jsonl's intact records (a line being written, or torn by a kill, is skipped)."""
    try:
        return _parse(metrics.read_bytes().splitlines())
    except FileNotFoundError:
        return []


def _val_losses(metrics: Path) -> dict[int, float]:
    return _vals_of(_records(metrics))


def _vals_of(records: list[dict]) -> dict[int, float]:
    return {r["step"]: float(r["val_loss"]) for r in records
            if isinstance(r.get("val_loss"), (int, float))}


class MetricsTail:
    """metrics.jsonl followed while training appends to it: each call reads the complete lines
    added since the last one (a line still being written waits for its newline), so a watcher can
    poll every few milliseconds at any file length. A resumed training first cuts the file back
    to its checkpoint by replacing it (metrics/jsonl.py): another file, or a shorter one, is read
    again from its start."""

    def __init__(self, path: Path):
        self.path, self.offset, self.inode, self.vals = path, 0, None, {}

    def val_losses(self) -> dict[int, float]:
        """Every validation loss so far, by step."""
        try:
            with open(self.path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self.inode or f.seek(0, 2) < self.offset:
                    self.offset, self.inode, self.vals = 0, inode, {}
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.vals
        end = data.rfind(b"\n") + 1
        self.offset += end
        self.vals.update(_vals_of(_parse(data[:end].splitlines())))
        return self.vals


def last_step(metrics: Path) -> int:
    return max((r["step"] for r in _records(metrics) if "loss" in r), default=0)
