"""Preemption and wall-time guard: every rank stops at the same step, with a checkpoint.

Owns: turning the recorded signals (hpctrain/signals.py: `slurm.signals`, USR1 and TERM by default)
and the wall-time check (rank 0 asks Slurm how much time is left every `slurm.time_check_s` seconds)
into one decision agreed by all ranks once per step (one MPI all-reduce MAX of a small int, so no
rank starts a collective that another skips), and what happens after the final checkpoint: decide
whether to requeue the Slurm job (`slurm.requeue`), requeue it once MPI is finalized, and exit with
EXIT_PREEMPTED.

It must never save checkpoints itself (the loop calls the checkpoint manager when `vote` says
so), call torch.distributed collectives, or act on a signal anywhere but at a step boundary.

A job that cannot make progress is never requeued in a loop: a time limit at or below
`slurm.time_margin_s` plus the measured time to a first checkpoint (TIMING_FILE in the run
directory, written at every stop) is refused at start-up (`time_limit_error`, also run by the sbatch
templates before they launch), and a restart that stopped without progress (at its first stop
check, one step past its resume step, or at its first wall-time check) is not requeued again.

Exit status: EXIT_PREEMPTED = 75 (EX_TEMPFAIL from sysexits.h) means "stopped early on a signal or
the wall-time guard, checkpoint committed: run the same command again to resume". It is returned
whether or not the job was requeued (after a requeue Slurm ends this run anyway).
"""
from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

from hpctrain import logs, signals
from hpctrain.distributed import slurm
from hpctrain.distributed.flight_recorder import RECORDER
from hpctrain.errors import ConfigError
from hpctrain.step_faults import hang_before_vote

EXIT_PREEMPTED = 75
TIMING_FILE = "slurm_timing.json"  # in run.dir: {"first_checkpoint_s": seconds from job start}
REQUEUED_FILE_VAR = "HPCTRAIN_REQUEUED_FILE"  # the templates read it: this stop was requeued
log = logs.get_logger(__name__)  # INFO: rank 0 of the job (the Preemption's rank 0, in PBT too)

# Agreed stop reasons; the all-reduce takes the MAX, so a higher code wins when several hit at once.
NONE, WALLTIME, SIGNAL = 0, 1, 2


def install_signal_handlers(spec: str) -> None:
    """Catch these signals from now on (see hpctrain/signals.py)."""
    signals.install(spec)


class Preemption:
    """`vote(step)` once per step on every rank (or the ps stop flag: hpctrain/sync/ps_strategy.py);
    `finish(step)` after the final checkpoint.

    cfg: the `slurm` config section; comm: the mpi4py world communicator (all ranks call both);
    run_dir: where TIMING_FILE is read and written (None: no measured time to a first checkpoint)."""

    def __init__(self, cfg, comm, rank: int, step_sleep_s: float = 0.0, run_dir=None):
        self.cfg, self.comm, self.rank = cfg, comm, rank
        self.step_sleep_s = step_sleep_s  # debug.step_sleep_s (tests)
        self.job = slurm.SlurmJob.from_env()
        self.reason = NONE
        self.detail = ""
        install_signal_handlers(cfg.signals)
        self._next_time_check = 0.0
        self._time_guard = cfg.time_margin_s > 0 and self.job is not None
        self.run_dir = run_dir
        self.limit_s = None        # the job's time limit (rank 0)
        self._time_checks = 0      # wall-time checks so far (rank 0)
        self._startup_s = None     # job start -> first wall-time check (rank 0)
        self._stop_at = None       # time.monotonic() when the stop was agreed
        if self.job is not None:
            self._refuse_short_time_limit()

    def _refuse_short_time_limit(self) -> None:
        """All ranks: log the job (rank 0) and raise ConfigError when its time limit leaves no
        time to train (`time_limit_error`): requeued, it would stop at once, again and again."""
        err = None
        if self.rank == 0:
            left = slurm.remaining_seconds(self.job)
            left_txt = "unlimited" if left is None else _hms(left)
            log.info(f"{self.job.describe()}, time left {left_txt}, stop on "
                     f"{self.cfg.signals or 'no signal'}"
                     + (f" or < {self.cfg.time_margin_s:.0f}s left" if self._time_guard else ""))
            self.limit_s = slurm.time_limit_seconds(self.job) if self._time_guard else None
            err = time_limit_error(self.job, self.limit_s, self.cfg.time_margin_s, self.run_dir)
        err = self.comm.bcast(err, root=0)
        if err:
            raise ConfigError(err)

    # ---- per step ---------------------------------------------------------------------------
    def local_reason(self) -> int:
        """This rank's own reason to stop (SIGNAL, WALLTIME on rank 0, or NONE); not agreed."""
        got = signals.received()
        if got:
            self.detail = f"signal {signal.Signals(got[0]).name}"
            return SIGNAL
        if self.rank == 0 and self._time_guard and time.monotonic() >= self._next_time_check:
            self._next_time_check = time.monotonic() + self.cfg.time_check_s
            left = slurm.remaining_seconds(self.job)
            self._time_checks += 1
            if self._time_checks == 1 and left is not None and self.limit_s is not None:
                self._startup_s = max(0.0, self.limit_s - left)
            if left is not None and left < self.cfg.time_margin_s:
                self.detail = (f"wall time: {_hms(left)} left < slurm.time_margin_s="
                               f"{self.cfg.time_margin_s:g}")
                return WALLTIME
        return NONE

    def vote(self, step: int) -> int:
        """The stop reason every rank gets, at the same step, once any rank got a signal or rank 0
        saw the wall time run short (NONE: go on). One small MPI all-reduce per call."""
        self.debug_sleep()
        from mpi4py import MPI

        RECORDER.step = step
        hang_before_vote(self.rank, step)  # test-only (HPCTRAIN_TEST_FAULTS); off in production
        local = self.local_reason()
        with RECORDER.collective("stop_vote", f"world({self.comm.Get_size()})"):
            reason = self.comm.allreduce(local, op=MPI.MAX)
        self.agreed(reason, step)
        return reason


    def debug_sleep(self) -> None:
        if self.step_sleep_s > 0:  # tests: slow steps down so a signal lands mid-run
            time.sleep(self.step_sleep_s)

    def agreed(self, reason: int, step: int) -> bool:
        """Record a reason every rank agreed on (by any means) and log it; True if it says stop."""
        if reason != NONE:
            self.reason = reason
            if self._stop_at is None:
                self._stop_at = time.monotonic()
            if not self.detail:
                self.detail = "signal on another rank" if reason == SIGNAL else "wall time"
            log.info(f"stopping at step {step}: {self.detail}; saving a checkpoint")
        return reason != NONE

    @property
    def stopped(self) -> bool:
        return self.reason != NONE

    # ---- after the final checkpoint ---------------------------------------------------------
    def finish(self, step: int, resumed_at: int | None = None) -> int:
        """All ranks, after the final checkpoint: decide (rank 0) whether to requeue; EXIT_PREEMPTED.
        `resumed_at`: the step this run started from (a restart that did not pass it stalls).

        The requeue itself waits for `requeue_if_requested`, after teardown: `scontrol requeue`
        kills the job's processes, and MPI ranks killed before MPI_Finalize leave shared-memory
        segments behind that break the next run of the same job step (MPICH over srun/PMI2)."""
        why = stalled = ""
        if self.rank == 0:
            self._save_timing()
            ok, why = slurm.requeue_decision(self.cfg.requeue, self.job)
            stalled = self._no_progress(step, resumed_at) if ok else ""
            ok, why = (False, stalled) if stalled else (ok, why)
        ok, why = self.comm.bcast((ok, why) if self.rank == 0 else None, root=0)
        if ok:
            _pending_requeue.append((self.job, step))
            log.info(f"requeueing Slurm job {self.job.slurm_id} once all ranks have exited: "
                     f"its next run resumes from step {step}")
        else:
            then = "" if stalled else ": run the same command again to resume"
            log.info(f"stopped at step {step} with a committed checkpoint; not requeued "
                     f"({why}){then} (exit status {EXIT_PREEMPTED})")
        return EXIT_PREEMPTED

    def _no_progress(self, step: int, resumed_at: int | None) -> str:
        """Why requeueing this restart again would loop ("" when it made progress): it stopped at
        its first stop check (one step past its resume step; a signal that comes at once, as
        `--signal=B:USR1@300` does under a shorter --time, included) or at its first wall-time
        check (the time left was short from the start)."""
        n = self.job.restart_count if self.job is not None else 0
        if n == 0:
            return ""
        if resumed_at is not None and step <= resumed_at + 1:
            what = f"stopped at step {step}, resumed at step {resumed_at}"
        elif self.reason == WALLTIME and self._time_checks == 1:
            what = f"stopped at its first wall-time check (step {step}, resumed at {resumed_at})"
        else:
            return ""
        return (f"restart {n} {what}: no progress, requeued again it would loop; resubmit with "
                f"a longer --time (or a smaller slurm.time_margin_s / --signal offset) to resume")

    def _save_timing(self) -> None:
        """Rank 0: TIMING_FILE <- job start to the first time check + the stop's checkpoint."""
        if self.run_dir is None or self._startup_s is None or self._stop_at is None:
            return
        seconds = self._startup_s + (time.monotonic() - self._stop_at)
        path = Path(self.run_dir) / TIMING_FILE
        try:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"first_checkpoint_s": round(seconds, 1)}) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            log.warning(f"warning: {path}: cannot record the time to a first checkpoint ({e})")


def measured_first_checkpoint_s(run_dir) -> float | None:
    """Seconds from job start to a committed stop checkpoint, as measured at an earlier stop."""
    if run_dir is None:
        return None
    try:
        value = json.loads((Path(run_dir) / TIMING_FILE).read_text()).get("first_checkpoint_s")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value >= 0 else None


def time_limit_error(job, limit_s: float | None, margin_s: float, run_dir) -> str | None:
    """The one-line refusal of a time limit at or below `slurm.time_margin_s` plus the measured
    time to a first checkpoint (None: it leaves time to train, or there is no limit/margin)."""
    if job is None or limit_s is None or margin_s <= 0:
        return None
    need = measured_first_checkpoint_s(run_dir)
    if limit_s > margin_s + (need or 0.0):
        return None
    measured = (f" + {need:g} s to a first checkpoint (measured, {Path(run_dir) / TIMING_FILE})"
                if need else "")
    return (f"Slurm job {job.slurm_id}: time limit {limit_s:g} s <= slurm.time_margin_s="
            f"{margin_s:g}{measured}: every run would stop before training and be requeued "
            f"again; give --time above {math.ceil(margin_s + (need or 0.0))} s or a smaller "
            f"slurm.time_margin_s")


_pending_requeue: list = []  # (job, step) once finish() decided to requeue


def requeue_if_requested(comm) -> None:
    """Call on every rank after teardown. If `finish` decided to requeue: all ranks finalize MPI
    (a collective, cleaning up shared memory), then rank 0 runs `scontrol requeue`."""
    if not _pending_requeue:
        return
    from mpi4py import MPI

    rank = comm.Get_rank()
    comm.Barrier()
    MPI.Finalize()
    if rank != 0:
        return
    time.sleep(0.5)  # let the other ranks' MPI_Finalize finish before Slurm signals them
    job, step = _pending_requeue[0]
    marker = _mark_requeued(step)  # before the requeue: the batch script reads it when it ends
    ok, err = slurm.requeue(job)
    if ok:
        log.info(f"requeued Slurm job {job.slurm_id}")
    else:
        if marker is not None:
            marker.unlink(missing_ok=True)
        log.error(f"error: scontrol requeue {job.slurm_id} failed ({err}): the "
                  f"checkpoint is committed, submit the job again to resume")


def _mark_requeued(step: int) -> Path | None:
    """Write $HPCTRAIN_REQUEUED_FILE (set by the sbatch templates): this stop is a requeue."""
    name = os.environ.get(REQUEUED_FILE_VAR)
    if not name:
        return None
    try:
        Path(name).write_text(f"{step}\n")
    except OSError as e:
        log.warning(f"warning: {name}: cannot mark the requeue for the batch script ({e})")
        return None
    return Path(name)


def _hms(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
