"""Parameters held in MPI one-sided windows on server ranks (passive target RMA, MPI-3).

Owns: the windows (the flat fp32 parameter vector, split evenly over the server ranks, and a
per-worker step clock plus a stop flag on the first server), and the operations on them: pull
(`MPI_Get_accumulate` with `MPI_NO_OP`: an element-wise atomic read, so a pull never sees half an
element of a concurrent update), push (`MPI_Accumulate` with `MPI_SUM`: element-wise atomic, so
concurrent pushes from many workers all land), the step clock, the bounded-staleness wait, and
the stop flag (raised by any rank with MPI_MAX, so the highest stop reason wins; a worker waiting
for a straggler sees it too, so a stop never leaves a worker waiting on one that has stopped).
There is no server-side loop: server ranks only keep the MPI progress engine turning (they wait
in a barrier) while workers read and write their memory.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI


class ParameterServer:
    """Collective constructor over `comm`: the last `n_servers` ranks are servers."""

    def __init__(self, comm, initial: np.ndarray, n_servers: int):
        self.comm, self.n = comm, int(initial.size)
        self.servers = list(range(comm.size - n_servers, comm.size))
        self.n_workers = comm.size - n_servers
        self.is_server = comm.rank in self.servers
        self.bounds = [(self.n * s // n_servers, self.n * (s + 1) // n_servers) for s in range(n_servers)]
        # MPI_Win_allocate (not MPI_Win_create on our own array): on one node MPICH serves the
        # one-sided operations from shared memory, without the server's progress engine
        mine = 0
        if self.is_server:
            lo, hi = self.bounds[self.servers.index(comm.rank)]
            mine = hi - lo
        self.win = MPI.Win.Allocate(4 * mine, disp_unit=4, comm=comm)
        self.memory = np.frombuffer(self.win.tomemory(), dtype=np.float32) if mine else None
        if mine:
            self.memory[:] = initial[lo:hi]
        # [clock of worker 0, ..., clock of worker n-1, stop flag]
        first = comm.rank == self.servers[0]
        words = self.n_workers + 1
        self.clock_win = MPI.Win.Allocate(8 * words if first else 0, disp_unit=8, comm=comm)
        self.clock_memory = np.frombuffer(self.clock_win.tomemory(), dtype=np.int64) if first else None
        if first:
            self.clock_memory[:] = 0
        comm.Barrier()  # initialized before anyone reads
        self.bytes_moved = 0  # by this worker: pulled + pushed parameter bytes
        self._scratch = np.empty(max(hi - lo for lo, hi in self.bounds), dtype=np.float32)

    def pull(self, out: np.ndarray) -> None:
        """Read the whole parameter vector into `out` (float32, length n)."""
        self.win.Lock_all()
        for server, (lo, hi) in zip(self.servers, self.bounds):
            # NO_OP ignores the origin buffer; MPI still wants one that does not alias the result
            self.win.Get_accumulate(self._scratch[:hi - lo], out[lo:hi], server,
                                    target=(0, hi - lo, MPI.FLOAT), op=MPI.NO_OP)
        self.win.Unlock_all()  # completes the reads
        self.bytes_moved += 4 * self.n

    def push(self, delta: np.ndarray) -> None:
        """Add `delta` (float32, length n) to the parameters, atomically per element."""
        self.win.Lock_all()
        for server, (lo, hi) in zip(self.servers, self.bounds):
            self.win.Accumulate(delta[lo:hi], server, target=(0, hi - lo, MPI.FLOAT), op=MPI.SUM)
        self.win.Unlock_all()  # the update is complete at the target when this returns
        self.bytes_moved += 4 * self.n

    def set_clock(self, worker: int, steps_done: int) -> None:
        value = np.array([steps_done], dtype=np.int64)
        self.clock_win.Lock(self.servers[0], MPI.LOCK_SHARED)
        self.clock_win.Accumulate([value, MPI.INT64_T], self.servers[0], target=(worker, 1, MPI.INT64_T), op=MPI.REPLACE)
        self.clock_win.Unlock(self.servers[0])

    def _read_clocks(self) -> np.ndarray:
        """[every worker's clock..., the stop flag], read atomically per element."""
        out = np.empty(self.n_workers + 1, dtype=np.int64)
        self.clock_win.Lock(self.servers[0], MPI.LOCK_SHARED)
        self.clock_win.Get_accumulate([np.empty_like(out), MPI.INT64_T], [out, MPI.INT64_T], self.servers[0],
                                      target=(0, out.size, MPI.INT64_T), op=MPI.NO_OP)
        self.clock_win.Unlock(self.servers[0])
        return out

    def stop_flag(self) -> int:
        return int(self._read_clocks()[-1])

    def raise_stop(self, reason: int) -> None:
        """Any rank: ask every worker to stop (the flag keeps the highest reason raised)."""
        value = np.array([reason], dtype=np.int64)
        self.clock_win.Lock(self.servers[0], MPI.LOCK_SHARED)
        self.clock_win.Accumulate([value, MPI.INT64_T], self.servers[0],
                                  target=(self.n_workers, 1, MPI.INT64_T), op=MPI.MAX)
        self.clock_win.Unlock(self.servers[0])

    def reset_clocks(self, steps_done: int) -> None:
        """First server, on resume: every worker at ``steps_done``, no stop raised."""
        self.clock_memory[:-1] = steps_done
        self.clock_memory[-1] = 0

    def wait_within(self, steps_done: int, bound: int, stop_aware: bool = False,
                    poll_s: float = 0.0005) -> tuple[int, int]:
        """Block until the slowest worker is at most `bound` steps behind `steps_done` (bound < 0:
        never block), or (``stop_aware``) until the stop flag is raised. Returns (the lag seen
        when it went on: this worker's staleness, the stop flag)."""
        while True:
            state = self._read_clocks()
            lag, stop = steps_done - int(state[:-1].min()), int(state[-1]) if stop_aware else 0
            if bound < 0 or lag <= bound or stop:
                return max(0, lag), stop
            time.sleep(poll_s)

    def free(self) -> None:
        self.win.Free()
        self.clock_win.Free()
