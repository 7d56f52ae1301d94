"""Abort-on-error for MPI jobs: an exception on any rank ends every rank within seconds.

Without this, one rank raising leaves the others blocked in a collective until its timeout
(PLATFORM.md). `run_or_abort(fn)` runs the entry point; on an exception it prints one line (user
errors) or a rank-tagged traceback (bugs) and calls MPI Abort, which the launcher (mpiexec, srun)
turns into the end of the whole job. It must never swallow an error.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from hpctrain import logs
from hpctrain.errors import UserError

EXIT_USER_ERROR = 2
EXIT_BUG = 1
QUIET_RANK_EXIT_DELAY_S = 3.0  # a silent rank's exit waits for rank 0's line
LINE_OUT_DELAY_S = 1.0  # a launched rank 0 waits after its line: srun may see the exit first


LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def _world():
    """(rank, size, comm) from mpi4py if it is initialized (never initializes MPI); before that, the
    rank the launcher put in the environment, so an error in the config is printed once, not N times."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        rank = next((int(os.environ[v]) for v in LAUNCHER_RANK_VARS if os.environ.get(v, "").isdigit()), 0)
        return rank, 1, None
    comm = mpi.COMM_WORLD
    return comm.Get_rank(), comm.Get_size(), comm


def _environment_error(exc: BaseException) -> str | None:
    """One line for an OSError that names a file (a full, read-only or missing disk: the user's
    environment, not a bug); None for anything else."""
    if not isinstance(exc, OSError) or not exc.filename or os.environ.get("HPCTRAIN_DEBUG"):
        return None
    return (f"{exc.filename}: {exc.strerror or exc} (check free space, permissions and the path; "
            f"HPCTRAIN_DEBUG=1 shows the traceback)")


def _report_and_abort(exc: BaseException) -> None:
    rank, size, comm = _world()
    env_line = _environment_error(exc)
    if env_line is not None:
        exc = UserError(env_line)
    user = isinstance(exc, UserError)
    code = EXIT_USER_ERROR if user else EXIT_BUG
    if comm is None and rank != 0 and user:
        # Before MPI starts every rank sees the same input: rank 0 reports it. Exit well after
        # it: `srun --kill-on-bad-exit` (or mpiexec) ends the step at the first bad exit.
        time.sleep(QUIET_RANK_EXIT_DELAY_S)
        os._exit(code)
    if size > 1 and rank != 0:
        # Let rank 0 speak first: errors from bad input are usually raised on every rank alike, and
        # one line is what the user should see. If rank 0 is fine, it is killed by our Abort below.
        time.sleep(1.0)
    if user:
        logs.error(f"error: {exc}")  # "[rank N] " before it on a rank other than 0
    else:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        sys.stderr.write("".join(f"[rank {rank}] {ln}" for ln in "".join(lines).splitlines(True)))
        sys.stderr.flush()
    if comm is None and any(v in os.environ for v in LAUNCHER_RANK_VARS):
        # srun forwards our stderr apart from the news of our exit; with --kill-on-bad-exit it
        # ends the step on the exit, and a line still in flight was lost (1 job of 5 on 2 nodes)
        time.sleep(LINE_OUT_DELAY_S)
    if comm is not None and size > 1:
        # The launcher forwards our stderr asynchronously (hydra/srun proxies) and stops forwarding
        # when Abort tears the job down: give the line a moment to get out, or it is lost.
        time.sleep(0.5)
        comm.Abort(code)
    os._exit(code)


def stop_job(exc: BaseException) -> None:
    """Report `exc` as `run_or_abort` does and end the whole job now, from any thread (for a fault
    after which this process must not write anything more: a lost run-directory lock)."""
    _report_and_abort(exc)


def _thread_hook(args) -> None:
    if args.exc_type is SystemExit:
        return
    _report_and_abort(args.exc_value)


def run_or_abort(fn, *args, **kwargs) -> int:
    """Run an entry point; any exception (on any thread) aborts the whole MPI job."""
    threading.excepthook = _thread_hook
    try:
        return fn(*args, **kwargs) or 0
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        _report_and_abort(exc)
    except BaseException as exc:  # noqa: BLE001 - reported with traceback, then the job is aborted
        _report_and_abort(exc)
    return EXIT_BUG
