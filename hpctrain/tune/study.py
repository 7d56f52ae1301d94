"""The study on the shared file system: an Optuna journal file, trials claimed under a lock, and
each worker's claim on the trial it trains.

Owns: opening (or creating) the study in `tune.journal` (JournalStorage + JournalFileBackend:
append-only, locked with an O_EXCL file: locks.py, a torn append survived: journal.py; no
database server), the sampler and pruner
built from [tune], handing out trials so that the study holds exactly `tune.n_trials` of them
whatever the number of concurrent workers (an ask lock beside the journal), and the worker's claim
file `<study dir>/workers/<worker>.json` that brings a requeued worker back to its own trial (or
hands the trial of a worker that is gone to a new one). It must never launch training, ask Slurm
anything, or decide a trial's outcome (trial_run.py does).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import warnings
from pathlib import Path

from hpctrain import config
from hpctrain.distributed.run_lock import holder_gone
from hpctrain.errors import ConfigError, UserError
from hpctrain.tune import locks, space
from hpctrain.tune.space import TuneConfig


def read(config_path: str, overrides: list[str], needs: str):
    """(raw sections, training Config, TuneConfig, source) of a training TOML with a [tune]
    section; `needs` says what that section must give when it is missing (one ConfigError)."""
    raw, source, cli_keys = config.read_raw(config_path, overrides)
    if "tune" not in raw:
        raise ConfigError(f"missing config section 'tune' in {source}: give {needs} (docs/tuning.md)")
    raw["tune"] = space.fold_pbt_overrides(raw["tune"])
    cfg = config.from_dict(raw, source, cli_keys)
    return raw, cfg, space.parse(raw["tune"], source, run_dir=cfg.run.dir), source


def import_optuna():
    try:
        import optuna
    except ImportError:
        raise UserError("hpctrain tune needs optuna: pip install 'hpctrain[tune]' (the tested "
                        "pin is in requirements/constraints.txt)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own one line per trial instead
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # constant_liar
    return optuna


def storage(journal: str | Path):
    optuna = import_optuna()
    from hpctrain.tune import journal as journal_file

    # Optuna's own lock file, with our takeover of a lock left by a killed worker (Optuna 4.1
    # would wait for it for ever); a torn append skipped and cut (journal.py)
    return optuna.storages.JournalStorage(journal_file.backend(journal))


def sampler(tune: TuneConfig, seed: int):
    """TPE; constant_liar: trials still running count as bad guesses, so concurrent workers do
    not all sample the same promising point."""
    optuna = import_optuna()
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=tune.sampler_startup_trials,
                                      constant_liar=True)


def pruner(tune: TuneConfig):
    optuna = import_optuna()
    if tune.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=tune.prune_startup_trials,
                                           n_warmup_steps=tune.prune_warmup_steps)
    if tune.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=tune.min_resource or "auto", reduction_factor=tune.reduction_factor)
    return optuna.pruners.NopPruner()


def open_study(tune: TuneConfig, base: dict | None = None):
    """The study in tune.journal, created on first use (by whichever worker comes first). `base`
    (the base config's path, text and overrides) is stored with it for `tune status`."""
    optuna = import_optuna()
    journal = Path(tune.journal)
    journal.parent.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(study_name=tune.study_name, storage=storage(journal),
                                direction="minimize", sampler=sampler(tune, tune.seed),
                                pruner=pruner(tune), load_if_exists=True)
    if base is not None and "base" not in study.user_attrs:
        study.set_user_attr("base", base)
    return study


def load_study(journal: str | Path, study_name: str | None = None):
    """An existing study (read-only use: `tune status`), or one error naming the journal."""
    optuna = import_optuna()
    if not Path(journal).is_file():
        raise UserError(f"{journal}: no study journal there (the [tune] journal of a search)")
    from hpctrain.tune.journal import check_is_journal

    check_is_journal(Path(journal))
    st = storage(journal)
    names = [s.study_name for s in optuna.get_all_study_summaries(st)]
    if not names or (study_name is not None and study_name not in names):
        raise UserError(f"{journal}: no study {study_name or ''} in it (studies: {names})")
    return optuna.load_study(study_name=study_name or names[0], storage=st)


def trial_by_number(study, number: int):
    """A live Trial object for a trial that already exists (a requeued worker's own trial): its
    reports, pruning decisions and final value go to the same trial number."""
    optuna = import_optuna()
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    return optuna.trial.Trial(study, trial_id)


def ask_new(study, tune: TuneConfig, worker: str | None = None):
    """The next trial with its parameters sampled, or None when the study has its n_trials. Under
    the ask lock, so concurrent workers never make more than n_trials (enqueued WAITING ones are
    handed out first and count once started); `worker`'s claim on it is written under the lock
    too, so a RUNNING trial without a claim is one no worker holds (adopt_orphan)."""
    optuna = import_optuna()
    with ask_lock(Path(tune.journal)):
        started = [t for t in study.get_trials(deepcopy=False)
                   if t.state != optuna.trial.TrialState.WAITING]
        if len(started) >= tune.n_trials:
            return None
        study.sampler = sampler(tune, tune.seed + len(started))  # reproducible per trial number
        trial = study.ask()
        for p in tune.params:
            p.suggest(trial)
        if worker is not None:
            write_claim(tune, worker, trial.number)
        return trial


def ask_lock(journal: Path):
    """Held while a trial is created or a claim taken over: `<journal>.ask.lock`."""
    return locks.held(journal.with_name(journal.name + ".ask.lock"), locks.ASK_STALE_S)


# ---- the worker's claim on its trial ------------------------------------------------------------
def claim_path(tune: TuneConfig, worker: str) -> Path:
    return tune.study_dir / "workers" / f"{worker}.json"


def write_claim(tune: TuneConfig, worker: str, number: int) -> None:
    path = claim_path(tune, worker)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"trial": number, "worker": worker, "since": time.time(),
                               "host": socket.gethostname(), "pid": os.getpid()}) + "\n")
    os.replace(tmp, path)


def check_claim_free(tune: TuneConfig, worker: str) -> None:
    """Refuse a worker name that a live process on this host is using (two `tune search` without
    --worker outside Slurm would both be 'local' and train the same claimed trial)."""
    pid = _claim_pid_here(tune, worker)
    if pid is None or _exited(pid):
        return  # no claim, another host's or ours; or the previous worker of this name is gone
    raise UserError(f"{claim_path(tune, worker)}: worker name '{worker}' is in use by process "
                    f"{pid} on this host: give each concurrent worker its own --worker NAME")


def claim_process_gone(tune: TuneConfig, worker: str) -> bool:
    """The worker's claim names a process on this host that has exited (the worker was killed)."""
    pid = _claim_pid_here(tune, worker)
    return pid is not None and _exited(pid)


def _claim_pid_here(tune: TuneConfig, worker: str) -> int | None:
    """The pid a worker's claim names when that is another process on this host."""
    try:
        claim = json.loads(claim_path(tune, worker).read_text())
        host, pid = claim["host"], int(claim["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if host == socket.gethostname() and pid != os.getpid() else None


def _exited(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def read_claim(tune: TuneConfig, worker: str) -> int | None:
    path = claim_path(tune, worker)
    try:
        return int(json.loads(path.read_text())["trial"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path}: damaged worker claim (expected {{\"trial\": N}}): remove it "
                        f"to let this worker ask for a new trial") from None


def adopt_orphan(study, tune: TuneConfig, worker: str, gone) -> tuple[int, str] | None:
    """(number, why) of a RUNNING trial this worker takes over, or None: one whose worker is gone
    for good (`gone(name)` is True: e.g. its Slurm task ended with exit 75 under --no-requeue and
    the array was submitted again; its claim becomes this worker's), or one that no worker claims
    and whose training has ended (its outcome record was lost: the worker was killed while telling
    it, which tears the journal's last record; else it stayed RUNNING for ever). Under the ask
    lock, so one worker adopts each orphan."""
    from optuna.trial import TrialState

    running = {t.number for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING}
    with ask_lock(Path(tune.journal)):
        claims = []  # (worker, trial) of every readable claim
        for path in sorted(claim_path(tune, worker).parent.glob("*.json")):
            with contextlib.suppress(UserError):
                claims.append((path.stem, read_claim(tune, path.stem)))
        for name, number in claims:
            if name != worker and number in running and gone(name):
                os.replace(claim_path(tune, name), claim_path(tune, worker))
                return number, f"its worker {name} is gone"
        for number in sorted(running - {number for _, number in claims}):
            ended = holder_gone(tune.trial_dir(number))
            if ended is not None:
                write_claim(tune, worker, number)
                return number, f"no worker claims it and its training has ended ({ended})"
    return None


def drop_claim(tune: TuneConfig, worker: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        claim_path(tune, worker).unlink()
