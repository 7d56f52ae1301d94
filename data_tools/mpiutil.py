"""The little MPI the data tools need: detecting a multi-rank launch, a serial stand-in, and
``agree`` (turn a per-rank failure into the SAME DataError on every rank, so no rank hangs).

Owns: importing mpi4py (only when launched under an MPI launcher), ranks-per-node.

Must never: initialise torch.distributed, choose which data a rank processes, or call a
collective that not every rank reaches.
"""
from __future__ import annotations

import os
import sys
import traceback

from .errors import out_of_memory
from .format import DataError

# Variables set by mpiexec/srun launchers (MPICH hydra, PMI-2, PMIx, Open MPI).  Without one of
# them we never import mpi4py, so a plain `python -m data_tools` never initialises MPI.
MPI_ENV_HINTS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


class SerialComm:
    """The subset of mpi4py.Comm used here, for one process (no MPI initialised)."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]

    def gather(self, obj, root=0):
        return [obj]

    def barrier(self) -> None:
        pass

    Barrier = barrier  # mpi4py spells the buffer-style collectives with a capital

    def Abort(self, code=1):  # noqa: N802 (mpi4py spelling)
        os._exit(code)


def get_comm():
    """mpi4py's COMM_WORLD when launched with more than one rank, else a SerialComm."""
    if os.environ.get("HPCTRAIN_NO_MPI") or not any(k in os.environ for k in MPI_ENV_HINTS):
        return SerialComm()
    try:
        from mpi4py import MPI
    except ImportError:
        return SerialComm()
    comm = MPI.COMM_WORLD
    return comm if comm.Get_size() > 1 else SerialComm()


def local_size(comm) -> int:
    """Number of ranks on this node (1 for SerialComm)."""
    if isinstance(comm, SerialComm):
        return 1
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def threads_per_rank(comm) -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // local_size(comm))


def _describe(exc: BaseException, rank: int) -> str:
    if isinstance(exc, DataError):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror or exc}"
    if out_of_memory(exc):  # where no reader named the file itself
        return f"rank {rank}: out of memory: give each rank more memory (docs/data.md: memory bound)"
    traceback.print_exc(file=sys.stderr)
    return f"rank {rank}: internal error {type(exc).__name__}: {exc}"


def agree(comm, fn, *args, **kwargs):
    """Run ``fn`` on every rank; if it failed on any rank, raise the first (by rank) failure's
    message as a DataError on ALL ranks (marked ``collective``).  Every rank must call this."""
    err, result = None, None
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - converted, never swallowed
        err = _describe(exc, comm.Get_rank())
    errors = comm.allgather(err)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        exc = DataError(first)
        exc.collective = True
        raise exc
    return result


def root_then_bcast(comm, fn, *args, **kwargs):
    """Run ``fn`` on rank 0 only and broadcast its result (or its failure) to every rank."""
    def on_root():
        return fn(*args, **kwargs) if comm.Get_rank() == 0 else None
    return comm.bcast(agree(comm, on_root), root=0)
