"""Preemption and wall-time guard: every rank stops at the same step, with a checkpoint.

Owns: turning the recorded signals (hpctrain/signals.py: `slurm.signals`, USR1 and TERM by default)
and the wall-time check (rank 0 asks Slurm how much time is left every `slurm.time_check_s` seconds)
into one decision agreed by all ranks once per step (one MPI all-reduce MAX of a small int, so no
rank starts a collective that another skips), and what happens after the final checkpoint: decide
whether to requeue the Slurm job (`slurm.requeue`), requeue it once MPI is finalized, and exit with
EXIT_PREEMPTED.

It must never save checkpoints itself (the loop calls the checkpoint manager when `vote` says
so), call torch.distributed collectives, or act on a signal anywhere but at a step boundary.

Exit status: EXIT_PREEMPTED = 75 (EX_TEMPFAIL from sysexits.h) means "stopped early on a signal or
the wall-time guard, checkpoint committed: run the same command again to resume". It is returned
whether or not the job was requeued (after a requeue Slurm ends this run anyway).
"""
from __future__ import annotations

import signal
import sys
import time

from hpctrain import signals
from hpctrain.distributed import slurm

EXIT_PREEMPTED = 75

# Agreed stop reasons; the all-reduce takes the MAX, so a higher code wins when several hit at once.
NONE, WALLTIME, SIGNAL = 0, 1, 2


def install_signal_handlers(spec: str) -> None:
    """Catch these signals from now on (see hpctrain/signals.py)."""
    signals.install(spec)


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


class Preemption:
    """`vote(step)` once per step on every rank (or the ps stop flag: hpctrain/sync/ps_strategy.py);
    `finish(step)` after the final checkpoint.

    cfg: the `slurm` config section; comm: the mpi4py world communicator (all ranks call both)."""

    def __init__(self, cfg, comm, rank: int, step_sleep_s: float = 0.0):
        self.cfg, self.comm, self.rank = cfg, comm, rank
        self.step_sleep_s = step_sleep_s  # debug.step_sleep_s (tests)
        self.job = slurm.SlurmJob.from_env()
        self.reason = NONE
        self.detail = ""
        install_signal_handlers(cfg.signals)
        self._next_time_check = 0.0
        self._time_guard = cfg.time_margin_s > 0 and self.job is not None
        if self.job is not None and rank == 0:
            left = slurm.remaining_seconds(self.job)
            left_txt = "unlimited" if left is None else _hms(left)
            _log(rank, f"{self.job.describe()}, time left {left_txt}, stop on "
                       f"{cfg.signals or 'no signal'}"
                       + (f" or < {cfg.time_margin_s:.0f}s left" if self._time_guard else ""))

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

        reason = self.comm.allreduce(self.local_reason(), op=MPI.MAX)
        self.agreed(reason, step)
        return reason


    def debug_sleep(self) -> None:
        if self.step_sleep_s > 0:  # tests: slow steps down so a signal lands mid-run
            time.sleep(self.step_sleep_s)

    def agreed(self, reason: int, step: int) -> bool:
        """Record a reason every rank agreed on (by any means) and log it; True if it says stop."""
        if reason != NONE:
            self.reason = reason
            if not self.detail:
                self.detail = "signal on another rank" if reason == SIGNAL else "wall time"
            _log(self.rank, f"stopping at step {step}: {self.detail}; saving a checkpoint")
        return reason != NONE

    @property
    def stopped(self) -> bool:
        return self.reason != NONE

    # ---- after the final checkpoint ---------------------------------------------------------
    def finish(self, step: int) -> int:
        """All ranks, after the final checkpoint: decide (rank 0) whether to requeue; EXIT_PREEMPTED.

        The requeue itself waits for `requeue_if_requested`, after teardown: `scontrol requeue`
        kills the job's processes, and MPI ranks killed before MPI_Finalize leave shared-memory
        segments behind that break the next run of the same job step (MPICH over srun/PMI2)."""
        why = ""
        if self.rank == 0:
            ok, why = slurm.requeue_decision(self.cfg.requeue, self.job)
        ok, why = self.comm.bcast((ok, why) if self.rank == 0 else None, root=0)
        if ok:
            _pending_requeue.append(self.job)
            _log(self.rank, f"requeueing Slurm job {self.job.slurm_id} once all ranks have exited: "
                            f"its next run resumes from step {step}")
        else:
            _log(self.rank, f"stopped at step {step} with a committed checkpoint; not requeued "
                            f"({why}): run the same command again to resume (exit status "
                            f"{EXIT_PREEMPTED})")
        return EXIT_PREEMPTED


_pending_requeue: list = []


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
    ok, err = slurm.requeue(_pending_requeue[0])
    if ok:
        _log(0, f"requeued Slurm job {_pending_requeue[0].slurm_id}")
    else:
        _log(0, f"error: scontrol requeue {_pending_requeue[0].slurm_id} failed ({err}): the "
                f"checkpoint is committed, submit the job again to resume")


def _hms(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
