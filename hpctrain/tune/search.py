"""The search worker: `python -m hpctrain tune search CONFIG.toml`, one per Slurm array task.

Owns: the worker's name (`<array job>_<task>` in a Slurm array, the job id in a plain job, `local`
or --worker outside Slurm) and its loop: take back the trial this worker claimed before it was
preempted, else a new one from the study, else (the budget spent) one whose worker's Slurm job
has ended; train it (trial_run.py); tell the outcome; stop when there is none. On a preemption (a stop signal to this worker, or a trial's
training exiting 75) the trial stays RUNNING and claimed, this worker requeues its own array task
(`slurm.requeue`, as training does) and exits 75; requeued, it resumes that same trial from its
checkpoint. It must never sample values itself (study.py) or watch a training (trial_run.py).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from hpctrain import logs, signals
from hpctrain.tune import space, study as study_mod
from hpctrain.tune.trial_run import PREEMPTED, EXIT_PREEMPTED, Launch, finish, run_trial

log = logs.get_logger(__name__)
STOP_SIGNALS = "USR1,TERM,INT"  # Slurm's preemption / time-limit signals, Ctrl-C


def load(config_path: str, overrides: list[str]):
    """(training Config, TuneConfig with an absolute journal, the overrides for training)."""
    from hpctrain import config

    _, cfg, tune, source = study_mod.read(config_path, overrides, "the search space")
    space.check_base(cfg, tune, source)
    tune = dataclasses.replace(tune, journal=str(Path(tune.journal).resolve()))
    train_overrides = [f"--{section}.{key}={value}"  # every trial's; --tune.* are the study's
                       for section, values in config.parse_overrides(overrides).items()
                       if section != "tune" for key, value in values.items()]
    return cfg, tune, train_overrides


def worker_name(given: str | None) -> str:
    from hpctrain.distributed.slurm import SlurmJob

    if given:
        return given
    job = SlurmJob.from_env()
    return job.slurm_id if job is not None else "local"


def search(config_path: str, overrides: list[str], launch_prefix: list[str],
           worker: str | None = None) -> int:
    cfg, tune, train_overrides = load(config_path, overrides)
    signals.install(STOP_SIGNALS)
    worker = worker_name(worker)
    path = str(Path(config_path).resolve())
    study = study_mod.open_study(tune, {"config": path, "toml": Path(path).read_text(),
                                        "overrides": train_overrides})
    launch = Launch(launch_prefix, path, train_overrides)
    log.info(f"[tune] worker {worker}: study '{tune.study_name}' in {tune.journal}, "
             f"{tune.n_trials} trials, pruner {tune.pruner}; "
             f"space: {'; '.join(p.describe() for p in tune.params)}")
    while not signals.received():
        study_mod.check_claim_free(tune, worker)
        # its own trial; a new one; once the budget is spent, one whose worker has gone
        trial = (_claimed_trial(study, tune, worker) or study_mod.ask_new(study, tune, worker)
                 or _orphan(study, tune, worker))
        if trial is None:
            log.info(f"[tune] worker {worker}: the study has its {tune.n_trials} trials; done")
            return 0
        study_mod.write_claim(tune, worker, trial.number)
        result = run_trial(trial, launch, tune.trial_dir(trial.number),
                           lambda: bool(signals.received()))
        if result.outcome == PREEMPTED:
            log.info(f"[tune] trial {trial.number}: preempted at step {result.steps}; it stays "
                     f"with worker {worker} and resumes from its checkpoint")
            return _requeue(cfg)
        finish(study, trial, result)
        study_mod.drop_claim(tune, worker)
        value = "" if result.value is None else f" val_loss {result.value:.4f}"
        error = f" ({result.detail})" if result.detail else ""
        log.info(f"[tune] trial {trial.number}: {result.outcome}{value} after {result.steps} "
                 f"steps {' '.join(space.overrides(trial.params))}{error}")
    return _requeue(cfg)


def _claimed_trial(study, tune, worker: str):
    """The trial this worker was training when it was preempted, if it is still RUNNING."""
    from optuna.trial import TrialState

    number = study_mod.read_claim(tune, worker)
    if number is None:
        return None
    frozen = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
    if frozen is None or frozen.state != TrialState.RUNNING:
        study_mod.drop_claim(tune, worker)  # told already (the worker stopped right after)
        return None
    log.info(f"[tune] worker {worker}: resuming its trial {number} "
             f"({' '.join(space.overrides(frozen.params))})")
    return study_mod.trial_by_number(study, number)


def _orphan(study, tune, worker: str):
    """A RUNNING trial whose worker is gone (a Slurm job that has ended: a task stopped with exit
    75 and not requeued, then the array submitted again; a worker outside Slurm whose process on
    this host has exited), or that no worker claims and whose training has ended (its outcome's
    journal record was torn by a kill): this worker resumes it from its checkpoint, and its
    outcome is told again (a finished training ends at once with its last validation loss)."""
    adopted = study_mod.adopt_orphan(study, tune, worker, lambda name: _worker_gone(tune, name))
    if adopted is None:
        return None
    number, why = adopted
    log.info(f"[tune] worker {worker}: taking over trial {number}, still RUNNING: {why}")
    return study_mod.trial_by_number(study, number)


def _worker_gone(tune, name: str) -> bool:
    """A Slurm worker (`<job>` or `<array job>_<task>`) when its job has ended (a requeued one
    comes back to its claim); any other when its claim names a process on this host that has exited."""
    if re.fullmatch(r"\d+(_\d+)?", name):
        from hpctrain.distributed import slurm

        return slurm.job_ended(name) is True
    return study_mod.claim_process_gone(tune, name)


def _requeue(cfg) -> int:
    """After a preemption: requeue this Slurm job (an array task alone) per slurm.requeue; 75."""
    from hpctrain.distributed import slurm

    job = slurm.SlurmJob.from_env()
    ok, why = slurm.requeue_decision(cfg.slurm.requeue, job)
    if ok:
        log.info(f"[tune] requeueing Slurm job {job.slurm_id}")
        ok, why = slurm.requeue(job)
    if not ok:
        log.info(f"[tune] not requeued ({why}): the trial stays RUNNING; run the same command "
                 f"again, or submit the array again: a worker takes over the trial of a task that "
                 f"has ended (exit status {EXIT_PREEMPTED})")
    return EXIT_PREEMPTED
