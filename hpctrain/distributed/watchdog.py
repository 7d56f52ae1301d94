"""Peer liveness: a rank that died, was stopped or became unreachable ends the job with an error naming it.

Owns the rank's side of detection. Liveness lives OUTSIDE this process's GIL: `Watchdog` starts a
beacon (hpctrain/distributed/beacon.py: a stdlib-only sidecar process) that beats over UDP to rank
- 1's beacon and watches rank + 1's (ring: O(1) traffic per rank) for as long as this process runs
and is not stopped; its UDP address goes into the rendezvous TCPStore (`hpctrain/beacon/<rank>`),
and this module tells the beacon its neighbours' as soon as they are there. A step slower than the
timeout, a long save, or a C call holding the GIL for longer is therefore no silence. A neighbour
silent for `timeout_s` is declared lost by its watcher's beacon, which floods the verdict to every
beacon; each hands it to its rank (a stdout line read by the beacon-reader thread here), and the
rank prints it as one line (`error: rank 3 on HOST lost: no heartbeat for 8 s ...`: the first-hand
rank at once, the others only if its Abort did not end them), writes forensics and ends the job
through MPI Abort (exit 3) — also when the main thread is stuck in a gloo or NCCL collective. A rank
whose main thread holds the GIL cannot do that: its beacon then prints the line and SIGKILLs it.
The first-hand verdict is also published as `hpctrain/lost` in the store (read by every rank's
watchdog thread each interval). Store calls have a deadline of `timeout_s` (a frozen rank 0 keeps
the store's socket open and never answers): a call past it only skips a round, the beacons decide
who is alive; a store that refuses (rank 0's process is gone) is a verdict on rank 0.

`watch_peers()` wraps the main thread: a collective that fails because a peer vanished ("connection
closed by peer", a timeout) waits for the verdict rather than printing a traceback, and if none
comes within the timeout becomes a one-line PeerLostError naming the failed collective.

Progress, apart from liveness (hpctrain/distributed/flight_recorder.py): when the main thread has
been inside one collective (or step phase) for longer than the stall bound (dist.stall_timeout_s,
or 4 x the median step time when longer) while every peer is alive (a rank that never entered a
collective its peers wait in), this rank writes `<run.dir>/forensics/rank_<r>.json` and publishes
`hpctrain/stall`, so that every rank writes its file. A stall only writes files and warns; before a
verdict ends the job every rank that can writes its file too. A rank that wakes after a newer launch
took the run dir over (run_lock.taken_over(): a frozen node thawed while the relaunch trains) writes
none: the files there are the newer launch's.

Bound: a dead or stopped rank is named within timeout_s + 1 interval (interval = timeout_s / 10,
clamped to [0.2, 5] s; default 8 s: ~9 s) and the job ends a grace (2 intervals + 0.5 s) later.
It must never import model, data or checkpoint code, and never run a collective.
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
from hpctrain.distributed import beacon, flight_recorder, run_lock
from hpctrain.errors import PeerLostError  # noqa: F401 - re-exported

EXIT_PEER_LOST = 3
LOST_NODES_ENV = "HPCTRAIN_LOST_NODES_FILE"
_LOST = "hpctrain/lost"
_STALL = "hpctrain/stall"
_BEACON = "hpctrain/beacon"


class Watchdog:
    def __init__(self, ctx, timeout_s: float, run_dir=None, stall_s: float = 60.0):
        self.rank, self.world = ctx.rank, ctx.world_size
        self.comm = ctx.comm
        self.timeout = float(timeout_s)
        self.stall_floor = float(stall_s)
        self.interval = max(0.2, min(5.0, self.timeout / 10))
        self._stop = threading.Event()
        self._reported = threading.Lock()
        self._forensics_lock = threading.Lock()  # one rank_<r>.json write at a time
        self.verdict: str | None = None
        self.run_dir = run_dir
        self._stall: str | None = None        # hpctrain/stall as last read from the store
        self._stall_seen: str | None = None   # the last hpctrain/stall value acted on
        self._written_at = -1                 # the recorder's events when our file was written
        self._fence_told = None               # the run lock's fence as told to the beacon
        self.hosts = tuple(getattr(ctx, "hosts", ()) or ())
        self.grace = min(3.0, 2 * self.interval + 0.5)
        self._store = dist.TCPStore(ctx.master_addr, ctx.master_port, is_master=False,
                                    timeout=datetime.timedelta(seconds=max(self.timeout, 1.0)))
        # the beacon outlives every _die's own wait for the Abort (3 places in line) before it
        # kills a rank whose main thread holds the GIL
        self._beacon_lock = threading.Lock()
        try:
            self._beacon, port = beacon.start(self.rank, self.world, self.timeout, self.interval,
                                              kill_after=3 * (self.grace + 1.5) + 3,
                                              stacks_fd=beacon.stack_dump_fd(), run_dir=run_dir)
        except OSError as e:  # the neighbours' beacons never hear from it: a warning there too
            self._beacon = None
            logs.warning(f"warning: rank {self.rank}{self._on(self.rank)}: its heartbeat beacon "
                         f"did not start ({e}); a loss of this rank is found only by dist.timeout_s")
        if self._beacon is not None:
            ip = beacon.local_ip(ctx.master_addr, ctx.master_port)
            self._store.set(f"{_BEACON}/{self.rank}", f"{ip}:{port}")
            threading.Thread(target=self._read_beacon, name="hpctrain-beacon-reader",
                             daemon=True).start()
        self._told: set = set()
        self._introduce_neighbours()
        self._thread = threading.Thread(target=self._run, name="hpctrain-watchdog", daemon=True)
        self._thread.start()

    def _introduce_neighbours(self) -> None:
        """Before training starts, wait (at most one interval x 10) until both neighbours' beacons
        are in the store and tell ours: the beats then flow before step 1, so a rank that freezes
        in its first steps is named too (the watch starts at the neighbour's first beat). A late
        neighbour is introduced by the watchdog thread when it shows up."""
        if self._beacon is None:
            return
        caller, deadline = _DeadlineCaller(), time.monotonic() + 10 * self.interval
        while len(self._told) < 2 and time.monotonic() < deadline:
            try:
                self._announce_peers(caller, self._told)
            except Exception:  # noqa: BLE001 - the watchdog thread retries and judges the store
                return
            if len(self._told) < 2:
                time.sleep(0.05)

    # -- the beacon (hpctrain/distributed/beacon.py: liveness, outside this process's GIL) ---------
    def _tell_beacon(self, line: str) -> None:
        if self._beacon is None:
            return
        with self._beacon_lock:
            try:
                self._beacon.stdin.write(line.encode() + b"\n")
                self._beacon.stdin.flush()
            except (OSError, ValueError):
                pass

    def _read_beacon(self) -> None:
        """The beacon's verdicts: `lost <rank> <speak_after> <message>`."""
        for raw in self._beacon.stdout:
            parts = raw.decode(errors="replace").rstrip("\n").split(" ", 3)
            if parts[0] == "quiet" and len(parts) == 3:
                rank = int(parts[1])
                logs.warning(f"warning: no heartbeat has reached rank {self.rank}'s beacon from rank "
                             f"{rank}{self._on(rank)} ({parts[2]}, UDP) within {self.timeout:g} s "
                             f"(dist.heartbeat_timeout_s): is UDP blocked between the nodes? Its "
                             f"loss would only be found by dist.timeout_s")
                continue
            if len(parts) < 4 or parts[0] != "lost" or self._stop.is_set():
                continue
            lost, speak_after, msg = int(parts[1]), int(parts[2]), parts[3]
            if speak_after == 0:  # first-hand: also publish it for the ranks' watchdog threads
                try:
                    _DeadlineCaller().call(lambda: self._store.set(_LOST, msg), self.interval * 2)
                except Exception:  # noqa: BLE001 - the beacons flood it anyway
                    pass
            self._die(msg, lost=lost, speak_after=speak_after)
        self._beacon_ended()

    def _beacon_ended(self) -> None:
        """The beacon's stdout closed: fine at stop(); while we train, our watcher now hears no
        beats and will name this live rank lost: say so first, with the beacon's exit status."""
        deadline = time.monotonic() + 2.0
        while self._beacon.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._stop.is_set():
            return
        logs.warning(f"warning: rank {self.rank}{self._on(self.rank)}: its heartbeat beacon (pid "
                     f"{self._beacon.pid}) ended with status {self._beacon.returncode} while this "
                     f"rank runs; its watcher will report it lost within dist.heartbeat_timeout_s")

    def _announce_peers(self, caller, told: set) -> None:
        """Tell the beacon rank - 1's beacon (beat to it) and rank + 1's (watch it) as soon as each
        is in the store: a rank that starts late delays only its own watch."""
        pred, succ = (self.rank - 1) % self.world, (self.rank + 1) % self.world
        for kind, rank in (("pred", pred), ("succ", succ)):
            key = f"{_BEACON}/{rank}"
            if kind in told or not caller.call(lambda: self._store.check([key]), self.timeout):
                continue
            addr = caller.call(lambda: self._store.get(key).decode(), self.timeout)
            host = self.hosts[rank] if rank < len(self.hosts) else ""
            self._tell_beacon(f"{kind} {addr} {rank} {host}".rstrip())
            told.add(kind)

    # -- the thread ------------------------------------------------------------------------------
    def _store_round(self):
        """One interval's store traffic: the verdict (or None); hpctrain/stall into self._stall."""
        verdict = self._store.get(_LOST).decode() if self._store.check([_LOST]) else None
        self._stall = self._store.get(_STALL).decode() if self._store.check([_STALL]) else None
        return verdict

    def _run(self) -> None:
        caller, told = _DeadlineCaller(), self._told
        while not self._stop.wait(self.interval):
            try:  # a frozen rank 0 keeps the store's socket open and never answers: the call gets
                # a deadline (the beacons decide whether rank 0 is alive)
                if len(told) < 2 and self._beacon is not None:
                    self._announce_peers(caller, told)
                self._tell_fence()
                verdict = caller.call(self._store_round, self.timeout)
            except TimeoutError:
                verdict = None
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

    def _tell_fence(self) -> None:
        """Once the run dir's lock is held: its fingerprint to the beacon, which then writes no
        forensics (its last resort) into a run dir a newer launch owns."""
        held = run_lock.fence()
        if held is not None and held != self._fence_told:
            self._fence_told = held
            self._tell_beacon(f"fence {held[0]} {held[1]}")

    def _check_stall(self, caller) -> None:
        """A stall of ours: write our file, publish it; a stall another rank published: write
        ours (once per stretch without progress of our main thread)."""
        rec = flight_recorder.RECORDER
        if rec.events == self._written_at:
            return
        bound = flight_recorder.stall_bound(rec, self.stall_floor)
        mine = flight_recorder.stalled(rec, bound)
        theirs = self._stall
        if mine is not None:
            text = (f"rank {self.rank}{self._on(self.rank)} stalled for more than {bound:.3g} s "
                    f"(dist.stall_timeout_s, or {flight_recorder.STEP_FACTOR:g} x the median "
                    f"step) in {flight_recorder.describe(mine)}")
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
        if self.verdict is not None:  # a verdict came meanwhile: its record stands, no stall line
            return
        logs.warning(f"warning: {text}; forensics: {path or 'not written'} (hpctrain doctor "
                     f"{self.run_dir})")

    def _write_forensics(self, verdict: str, kind: str, lost: int | None = None) -> str | None:
        """rank_<r>.json; a verdict's record is final: a stall found at the same moment by the
        watchdog thread (the stall and heartbeat bounds may be equal) never replaces it."""
        with self._forensics_lock:
            if kind == "stall" and self.verdict is not None:
                return None
            return self._write_forensics_now(verdict, kind, lost)

    def _write_forensics_now(self, verdict: str, kind: str, lost: int | None) -> str | None:
        newer = run_lock.taken_over()
        if newer is not None:  # a stale rank woken after the relaunch: the run dir is not ours
            logs.warning(f"warning: rank {self.rank}{self._on(self.rank)}: no forensics written into "
                         f"{self.run_dir}: a newer launch owns it ({newer})")
            return None
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
        self._tell_beacon("dying")  # it prints no line of its own, but still ends us if we hang
        self._write_forensics(msg, "verdict", lost)  # before the Abort; local I/O only
        self._record_lost_node(lost)
        grace = self.grace
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
        """Finish (cleanly, or with this rank's own error line): the beacon tells its watcher not
        to expect more beats and exits; stop the thread."""
        self._stop.set()
        self._tell_beacon("done")
        if self._beacon is not None:
            with self._beacon_lock:
                try:
                    self._beacon.stdin.close()
                except OSError:
                    pass
            try:
                self._beacon.wait(timeout=5)
            except Exception:  # noqa: BLE001 - it ends with this process anyway
                pass
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
def watch_peers(ctx, timeout_s: float, run_dir=None, stall_s: float = 60.0):
    """Run the body under a heartbeat watchdog (no-op for one rank or timeout 0). `stall_s`: the
    stall floor (dist.stall_timeout_s)."""
    if timeout_s <= 0 or ctx.world_size == 1:
        yield None
        return
    wd = Watchdog(ctx, timeout_s, run_dir, stall_s)
    try:
        yield wd
    except Exception as e:
        if _is_comm_error(e):
            wd.wait_for_verdict(e)
        wd.stop()  # this rank's own error: it is not lost (its line says why it ends)
        raise
    wd.stop()
