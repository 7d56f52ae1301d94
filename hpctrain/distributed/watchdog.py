"""Peer liveness: a rank that died, hangs or became unreachable ends the job with an error naming it.

Owns the heartbeat protocol. Every rank runs one daemon thread that, every `interval` seconds, bumps
its counter `hpctrain/hb/<rank>` in the rendezvous TCPStore (its own client connection, not the
process group's), watches ONE neighbour's counter (rank + 1 mod world: O(1) store traffic per rank),
and reads one verdict key. A neighbour whose counter has not moved for `timeout_s` (seconds of this
rank's own clock: no clock sync needed) is declared lost: the watcher publishes the verdict and
prints it as one line (`error: rank 3 lost: no heartbeat for 10 s ...`), every rank learns it within
one interval, and the job ends through MPI Abort (non-zero exit) — also when the main thread is stuck in a gloo or
NCCL collective that would otherwise wait for `dist.timeout_s`. The store is hosted by rank 0, so
losing contact with the store means losing rank 0, and is reported as such: every store call has a
deadline of `timeout_s` (a frozen rank 0 keeps its socket open and never answers).

`watch_peers()` wraps the main thread: a collective that fails because a peer vanished ("connection
closed by peer", a timeout) waits for the verdict rather than printing a traceback, and if none
comes within the timeout becomes a one-line PeerLostError naming the failed collective.

Forensics (hpctrain/distributed/flight_recorder.py): before a verdict ends the job, and when the
main thread has been inside one collective (or step phase) for longer than `timeout_s` while every
peer still beats (a stall: a rank that never entered a collective its peers wait in), this rank
writes `<run.dir>/forensics/rank_<r>.json`; a stalled rank also publishes `hpctrain/stall`, so that
every rank writes its file, also the one that is elsewhere. A stall only writes files and warns.

Bound: a lost rank ends the job within timeout_s + 3 intervals (interval = timeout_s / 10, clamped to
[0.2, 5] s). It must never import model, data or checkpoint code, and never run a collective.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

from hpctrain import logs
from hpctrain.distributed import flight_recorder
from hpctrain.errors import PeerLostError  # noqa: F401 - re-exported

EXIT_PEER_LOST = 3
LOST_NODES_ENV = "HPCTRAIN_LOST_NODES_FILE"
_LOST = "hpctrain/lost"
_STALL = "hpctrain/stall"


class Watchdog:
    def __init__(self, ctx, timeout_s: float, run_dir=None):
        self.rank, self.world = ctx.rank, ctx.world_size
        self.comm = ctx.comm
        self.timeout = float(timeout_s)
        self.interval = max(0.2, min(5.0, self.timeout / 10))
        self._stop = threading.Event()
        self._reported = threading.Lock()
        self.verdict: str | None = None
        self.run_dir = run_dir
        self._stall: str | None = None        # hpctrain/stall as last read from the store
        self._stall_seen: str | None = None   # the last hpctrain/stall value acted on
        self._written_at = -1                 # the recorder's events when our file was written
        self.hosts = tuple(getattr(ctx, "hosts", ()) or ())
        self._store = dist.TCPStore(ctx.master_addr, ctx.master_port, is_master=False,
                                    timeout=datetime.timedelta(seconds=max(self.timeout, 1.0)))
        self._store.add(f"hpctrain/hb/{self.rank}", 1)
        self._thread = threading.Thread(target=self._run, name="hpctrain-watchdog", daemon=True)
        self._thread.start()

    # -- the thread ------------------------------------------------------------------------------
    def _store_round(self, nbr: int):
        """One interval's store traffic: bump my counter; (verdict or None, neighbour's counter or
        None when it finished cleanly)."""
        self._store.add(f"hpctrain/hb/{self.rank}", 1)
        verdict = self._store.get(_LOST).decode() if self._store.check([_LOST]) else None
        self._stall = self._store.get(_STALL).decode() if self._store.check([_STALL]) else None
        if self._store.check([f"hpctrain/done/{nbr}"]):
            return verdict, None
        return verdict, self._store.add(f"hpctrain/hb/{nbr}", 0)

    def _run(self) -> None:
        nbr = (self.rank + 1) % self.world
        seen, since = None, time.monotonic()
        caller = _DeadlineCaller()
        while not self._stop.wait(self.interval):
            try:  # a frozen rank 0 (SIGSTOP, a hung node) keeps the store's socket open and never
                # answers: the call gets a deadline instead of waiting forever
                verdict, value = caller.call(lambda: self._store_round(nbr), self.timeout)
            except TimeoutError:
                if self._stop.is_set():
                    return
                self._die(f"rank 0{self._on(0)} lost: its rendezvous store has not answered for "
                          f"{self.timeout:g} s (dist.heartbeat_timeout_s): rank 0 hangs, was "
                          f"stopped, or its node is unreachable",
                          lost=0, speak_after=min(self.rank - 1, 2))  # rank 1 speaks first
            except Exception as e:  # noqa: BLE001 - the store (on rank 0) is unreachable
                if self._stop.is_set():
                    return
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self._die(f"rank 0{self._on(0)} lost: its rendezvous store is unreachable "
                          f"({first[:200]})", lost=0, speak_after=min(self.rank - 1, 2))
            if verdict is not None:
                lost = int(verdict.split()[1]) if verdict.startswith("rank ") else None
                self._die(verdict, lost=lost, speak_after=1)  # its publisher speaks first
            self._check_stall(caller)
            if value is None:
                continue  # the neighbour finished cleanly
            now = time.monotonic()
            if value != seen:
                seen, since = value, now
            elif now - since > self.timeout:
                msg = (f"rank {nbr}{self._on(nbr)} lost: no heartbeat for {now - since:.0f} s "
                       f"(dist.heartbeat_timeout_s={self.timeout:g}): it died, hangs, or its node "
                       f"is unreachable")
                try:
                    caller.call(lambda: self._store.set(_LOST, msg), self.interval * 2)
                except Exception:  # noqa: BLE001 - we report it ourselves regardless
                    pass
                self._die(msg, lost=nbr)

    def _check_stall(self, caller) -> None:
        """A stall of ours: write our file, publish it; a stall another rank published: write
        ours (once per stretch without progress of our main thread)."""
        rec = flight_recorder.RECORDER
        if rec.events == self._written_at:
            return
        mine = flight_recorder.stalled(rec, self.timeout)
        theirs = self._stall
        if mine is not None:
            text = (f"rank {self.rank}{self._on(self.rank)} stalled for more than {self.timeout:g} s "
                    f"(dist.heartbeat_timeout_s) in {flight_recorder.describe(mine)}")
            try:
                caller.call(lambda: self._store.set(_STALL, text), self.interval * 2)
            except Exception:  # noqa: BLE001 - the file is written regardless
                pass
        elif theirs is not None and theirs != self._stall_seen:
            text = f"stall seen by another rank: {theirs}"
        else:
            return
        self._stall_seen = theirs if mine is None else text
        self._written_at = rec.events
        path = self._write_forensics(text, "stall")
        logs.warning(f"warning: {text}; forensics: {path or 'not written'} (hpctrain doctor "
                     f"{self.run_dir})")

    def _write_forensics(self, verdict: str, kind: str, lost: int | None = None) -> str | None:
        try:
            record = flight_recorder.forensics(self.rank, self.world, verdict, kind, lost)
        except Exception:  # noqa: BLE001 - forensics must never stop the verdict
            return None
        return flight_recorder.write_forensics(self.run_dir, record)

    def _on(self, rank: int) -> str:
        return f" on {self.hosts[rank]}" if rank < len(self.hosts) else ""

    def _record_lost_node(self, rank: int | None) -> None:
        """Name the lost rank's node in $HPCTRAIN_LOST_NODES_FILE (set by slurm/train.sbatch, which
        relaunches the training without that node). Every survivor writes the same line."""
        path = os.environ.get(LOST_NODES_ENV)
        if not path or rank is None or rank >= len(self.hosts):
            return
        try:
            tmp = f"{path}.{self.rank}.tmp"
            with open(tmp, "w") as f:
                f.write(self.hosts[rank] + "\n")
            os.replace(tmp, path)
        except OSError:
            pass

    def _die(self, msg: str, lost: int | None = None, speak_after: int = 0) -> None:
        """Print the verdict, then end the job. The rank that saw the loss first-hand speaks at once
        and aborts the job after a grace for its line to get out; the others (`speak_after` > 0:
        their place in line) wait longer than that grace first, so the user reads one line; they
        print theirs only if that Abort did not end them."""
        if not self._reported.acquire(blocking=False):
            return
        self.verdict = msg
        self._write_forensics(msg, "verdict", lost)  # before the Abort; local I/O only
        self._record_lost_node(lost)
        grace = min(3.0, 2 * self.interval + 0.5)
        time.sleep(speak_after * (grace + 1.5))
        logs.error(f"error: {msg}")  # "[rank N] " before it on a rank other than 0
        time.sleep(grace)
        try:
            if self.comm is not None:
                self.comm.Abort(EXIT_PEER_LOST)
        finally:
            os._exit(EXIT_PEER_LOST)

    # -- main thread -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Clean finish: tell the watcher not to expect more beats, stop the thread."""
        try:
            self._store.set(f"hpctrain/done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the thread would report a lost store
            pass
        self._stop.set()
        self._thread.join(timeout=self.timeout + 5)

    def wait_for_verdict(self, exc: BaseException) -> None:
        """A collective failed on the main thread: let the watchdog name the lost rank (it ends
        the process); if it does not within the bound, raise a one-line PeerLostError."""
        deadline = time.monotonic() + self.timeout + 3 * self.interval
        while self._thread.is_alive() and (time.monotonic() < deadline or self.verdict is not None):
            time.sleep(0.1)  # once the thread has a verdict, it ends the process itself
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PeerLostError(f"collective failed ({type(exc).__name__}: {first[:300]}); no peer "
                            f"was found silent for dist.heartbeat_timeout_s={self.timeout:g}") from None


class _DeadlineCaller:
    """Runs blocking calls on one daemon thread and gives up waiting after a deadline (the call
    itself may stay stuck: a process that gives up ends soon after)."""

    def __init__(self):
        self._thread: threading.Thread | None = None

    def call(self, fn, timeout: float):
        if self._thread is not None and self._thread.is_alive():
            raise TimeoutError("the previous call has not returned")
        box: dict = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e

        self._thread = threading.Thread(target=run, name="hpctrain-watchdog-store", daemon=True)
        self._thread.start()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"no answer within {timeout:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]


def _is_comm_error(exc: BaseException) -> bool:
    """A collective that failed because a peer may be gone: torch.distributed's errors, gloo /
    NCCL runtime errors, and MPI's (the CPU gradient all-reduce and the data metrics are MPI
    calls: MPICH reports a killed peer there, often before its heartbeat is overdue)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(exc, mpi.Exception):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        w in text for w in ("gloo", "nccl", "connection closed", "connection reset", "timed out",
                            "broken pipe", "peer"))


@contextmanager
def watch_peers(ctx, timeout_s: float, run_dir=None):
    """Run the body under a heartbeat watchdog (no-op for one rank or timeout 0)."""
    if timeout_s <= 0 or ctx.world_size == 1:
        yield None
        return
    wd = Watchdog(ctx, timeout_s, run_dir)
    try:
        yield wd
    except Exception as e:
        if _is_comm_error(e):
            wd.wait_for_verdict(e)
        raise
    wd.stop()
