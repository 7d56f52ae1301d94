"""The global model of sync.mode = "async_diloco" in MPI one-sided windows on the server ranks.

Owns: the windows and the operations on them. Each server holds one slice of the flat fp32 vector
three times over, [theta | momentum | accumulator] (the outer optimizer's state lives with the
model), and the first server also the control words [batches claimed, arrivals, stop flag, each
replica's step time in ns]. Operations:
  claim()            the next global batch index (MPI_Fetch_and_op: each index goes to one replica)
  arrive(g, apply)   lock every server exclusively, in server order (so arrivals apply one after
                     another, in the same order on every slice), count the arrival, read the three
                     slices, `apply` the outer update, write them back; returns the new theta
  claim_and_arrivals the next batch index and the arrivals so far (a replica that catches up)
  pull / read_all    theta (after a compressed arrival, or to catch up), and with the outer state
                     for checkpoints; restore() on resume; apply_here() a server's own update
  raise_stop / stop_flag, set_step_time / step_times
Without compression there is no server-side loop: server ranks only keep MPI's progress engine
turning (they wait in the trainer's meeting) while replicas read and write their memory; with
compression they apply the arrivals themselves (hpctrain/sync/inbox.py).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

CLAIMS, ARRIVALS, STOP, TIMES = 0, 1, 2, 3


class GlobalModelWindows:
    """Collective constructor over `comm`: the last `n_servers` ranks are servers of this rank's
    part of the model. The control words live on rank `control_host` of `control_comm` (default:
    `comm` and its first server). With tensor / pipeline parallel replicas every position in a
    replica has its own `comm` (the same position in every replica, then its servers) and all
    share one control_comm (the world)."""

    def __init__(self, comm, initial: np.ndarray, n_servers: int, n_replicas: int,
                 control_comm=None, control_host: int | None = None):
        self.comm, self.n = comm, int(initial.size)
        self.servers = list(range(comm.size - n_servers, comm.size))
        self.bounds = [(self.n * s // n_servers, self.n * (s + 1) // n_servers) for s in range(n_servers)]
        # MPI_Win_allocate, not MPI_Win_create on our own array: on one node MPICH then serves
        # Get/Put straight from shared memory, without the target's progress engine (an arrival
        # of 0.8M parameters: 5 ms instead of 2.4 s with a server that polls every 0.5 ms)
        mine = 0
        if comm.rank in self.servers:
            lo, hi = self.bounds[self.servers.index(comm.rank)]
            mine = hi - lo
        self.win = MPI.Win.Allocate(4 * 3 * mine, disp_unit=4, comm=comm)
        self.memory = np.frombuffer(self.win.tomemory(), dtype=np.float32) if mine else None
        if mine:
            self.memory[:] = 0.0
            self.memory[:mine] = initial[lo:hi]
        self.control_comm = control_comm if control_comm is not None else comm
        self.host = self.servers[0] if control_host is None else control_host
        first = self.control_comm.rank == self.host
        words = TIMES + n_replicas
        self.control = MPI.Win.Allocate(8 * words if first else 0, disp_unit=8, comm=self.control_comm)
        self.control_memory = np.frombuffer(self.control.tomemory(), dtype=np.int64) if first else None
        if first:
            self.control_memory[:] = 0
        # one word whose exclusive lock orders the arrivals of replicas made of several ranks
        self.mutex = MPI.Win.Allocate(8 if first else 0, disp_unit=8, comm=self.control_comm)
        self.control_comm.Barrier()  # initialized before anyone reads
        self.n_replicas = n_replicas
        self.bytes_moved = 0  # by this rank: model-sized reads and writes

    # ---- control words ------------------------------------------------------------------------
    def _fetch_add(self, index: int, value: int, op=MPI.SUM) -> int:
        one, old = np.array([value], dtype=np.int64), np.empty(1, dtype=np.int64)
        self.control.Lock(self.host, MPI.LOCK_SHARED)
        self.control.Fetch_and_op([one, MPI.INT64_T], [old, MPI.INT64_T], self.host, index, op)
        self.control.Unlock(self.host)
        return int(old[0])

    def read_control(self) -> np.ndarray:
        out = np.empty(TIMES + self.n_replicas, dtype=np.int64)
        self.control.Lock(self.host, MPI.LOCK_SHARED)
        self.control.Get_accumulate([np.empty_like(out), MPI.INT64_T], [out, MPI.INT64_T],
                                    self.host, target=(0, out.size, MPI.INT64_T), op=MPI.NO_OP)
        self.control.Unlock(self.host)
        return out

    def claim(self) -> int:
        return self._fetch_add(CLAIMS, 1)

    def claim_and_arrivals(self) -> tuple[int, int]:
        """claim() and the number of arrivals counted so far, in one access epoch (a replica that
        catches up reads both at every step)."""
        one, claimed, arrivals = (np.array([v], dtype=np.int64) for v in (1, 0, 0))
        self.control.Lock(self.host, MPI.LOCK_SHARED)
        self.control.Fetch_and_op([one, MPI.INT64_T], [claimed, MPI.INT64_T], self.host, CLAIMS, MPI.SUM)
        self.control.Fetch_and_op([one, MPI.INT64_T], [arrivals, MPI.INT64_T], self.host, ARRIVALS, MPI.NO_OP)
        self.control.Unlock(self.host)
        return int(claimed[0]), int(arrivals[0])

    def raise_stop(self, reason: int) -> None:
        self._fetch_add(STOP, reason, MPI.MAX)

    def stop_flag(self) -> int:
        return self._fetch_add(STOP, 0, MPI.NO_OP)

    def set_step_time(self, replica: int, seconds: float) -> None:
        self._fetch_add(TIMES + replica, int(seconds * 1e9), MPI.REPLACE)

    def step_times(self) -> np.ndarray:
        return self.read_control()[TIMES:] / 1e9

    # ---- the model ------------------------------------------------------------------------------
    def begin_arrival(self) -> int:
        """A replica's leader, when its replica has several ranks: hold the arrival lock (so every
        part of the model sees the arrivals in one order) and count the arrival; its number."""
        self.hold_arrivals()
        return self.count_arrival()

    def hold_arrivals(self) -> None:
        """Take the arrival lock of replicas made of several ranks: every arrival counted before
        is then applied to every part of the model (end_arrival() gives it back)."""
        self.mutex.Lock(self.host, MPI.LOCK_EXCLUSIVE)
        word = np.empty(1, dtype=np.int64)  # an operation in the epoch: the lock is really held
        self.mutex.Fetch_and_op([word, MPI.INT64_T], [word, MPI.INT64_T], self.host, 0, MPI.NO_OP)
        self.mutex.Flush(self.host)

    def count_arrival(self) -> int:
        """The next arrival's 1-based number (compressed arrivals: the servers apply in this order)."""
        return self._fetch_add(ARRIVALS, 1) + 1

    def end_arrival(self) -> None:
        self.mutex.Unlock(self.host)

    def arrive(self, g: np.ndarray, apply, arrival: int | None = None) -> tuple[int, np.ndarray]:
        """Apply pseudo-gradient `g` (flat fp32): `apply(theta, momentum, acc, g, arrival)` on
        every slice, under exclusive locks. (this arrival's 1-based number, the new theta).
        `arrival`: the number begin_arrival() gave the replica (else it is counted here)."""
        theta = np.empty(self.n, dtype=np.float32)
        states = []  # the Put buffers stay alive until Unlock completes the Puts
        for server in self.servers:
            self.win.Lock(server, MPI.LOCK_EXCLUSIVE)
        try:
            for server, (lo, hi) in zip(self.servers, self.bounds):
                n = hi - lo
                state = np.empty(3 * n, dtype=np.float32)
                states.append(state)
                self.win.Get([state, MPI.FLOAT], server, target=(0, 3 * n, MPI.FLOAT))
                self.win.Flush(server)
                if arrival is None:  # counted once the first server's lock is really held: a
                    # replica that sees the count and then reads theta finds this arrival in it
                    arrival = self._fetch_add(ARRIVALS, 1) + 1
                apply(state[:n], state[n:2 * n], state[2 * n:], g[lo:hi], arrival)
                self.win.Put([state, MPI.FLOAT], server, target=(0, 3 * n, MPI.FLOAT))
                theta[lo:hi] = state[:n]
        finally:
            for server in reversed(self.servers):
                self.win.Unlock(server)
        self.bytes_moved += 2 * 3 * 4 * self.n
        return arrival, theta

    def pull(self) -> np.ndarray:
        """theta alone (fp32), each slice under a shared lock: what a replica reads after its
        compressed arrival was applied by the servers (hpctrain/sync/inbox.py), or to catch up."""
        theta = np.empty(self.n, dtype=np.float32)
        for server, (lo, hi) in zip(self.servers, self.bounds):
            self.win.Lock(server, MPI.LOCK_SHARED)
            self.win.Get([theta[lo:hi], MPI.FLOAT], server, target=(0, hi - lo, MPI.FLOAT))
            self.win.Unlock(server)
        self.bytes_moved += 4 * self.n
        return theta

    def apply_here(self, update) -> None:
        """Server: `update(theta, momentum, acc)` on this rank's own slice, under an exclusive
        lock on itself (replicas reading theta meanwhile wait for the whole update)."""
        n, me = self.memory.size // 3, self.comm.rank
        self.win.Lock(me, MPI.LOCK_EXCLUSIVE)
        try:
            update(self.memory[:n], self.memory[n:2 * n], self.memory[2 * n:])
        finally:
            self.win.Unlock(me)

    def read_all(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(theta, momentum, accumulator), each flat; every replica must be between arrivals."""
        out = np.empty((3, self.n), dtype=np.float32)
        for server, (lo, hi) in zip(self.servers, self.bounds):
            n = hi - lo
            state = np.empty(3 * n, dtype=np.float32)
            self.win.Lock(server, MPI.LOCK_SHARED)
            self.win.Get([state, MPI.FLOAT], server, target=(0, 3 * n, MPI.FLOAT))
            self.win.Unlock(server)
            out[:, lo:hi] = state.reshape(3, n)
        return out[0], out[1], out[2]

    def restore(self, theta, momentum, acc, claims: int, arrivals: int, step_times_ns) -> None:
        """Server ranks, on resume (nobody accesses the windows meanwhile)."""
        if self.memory is not None:
            lo, hi = self.bounds[self.servers.index(self.comm.rank)]
            n = hi - lo
            for i, v in enumerate((theta, momentum, acc)):
                self.memory[i * n:(i + 1) * n] = v[lo:hi]
        self.set_position(claims, arrivals)
        if self.control_memory is not None:
            self.control_memory[TIMES:] = step_times_ns

    def set_position(self, claims: int, arrivals: int | None = None) -> None:
        """First server, while nobody claims: the claim counter at an agreed step."""
        if self.control_memory is not None:
            self.control_memory[CLAIMS] = claims
            if arrivals is not None:
                self.control_memory[ARRIVALS] = arrivals

    def free(self) -> None:
        self.win.Free()
        self.control.Free()
        self.mutex.Free()
