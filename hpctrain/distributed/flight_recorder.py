"""Flight recorder: the last collectives this rank entered and left, and the forensics file of a hang.

Owns two things:

* `RECORDER`, one per process: a ring buffer of the last `SIZE` collectives (and step phases) the
  main thread ENTERED, each with whether it LEFT: operation, group ("dp(2)", "world(3)"), a
  per-group sequence number (the Nth collective of that group on this rank: ranks that agree on a
  hang agree on the number), the step, monotonic enter/leave times. Recording is O(1), no I/O, no
  lock (one list slot write; readers on the watchdog thread only read). hpctrain records where it
  calls collectives itself (the runner's dp reductions, the stop vote, checkpoint barriers,
  DiLoCo's round all-reduce); DDP's and FSDP's internal collectives cannot be wrapped, so the
  forward/backward of a step is recorded as a phase ("forward_backward ... DDP/FSDP all-reduce
  inside"): a hang inside them is still located. Only the main thread records (a collective of a
  background thread, e.g. an async checkpoint's agreement, is a no-op scope).
* `write_forensics(run_dir, ...)`: `<run_dir>/forensics/rank_<r>.json` (tmp + rename, opened
  relative to the folder's descriptor with O_NOFOLLOW: nothing planted there is written through)
  with every thread's Python stack, the recorder's entries (the open one marked), step, host, pid
  and the verdict. Called by the watchdog thread (hpctrain/distributed/watchdog.py) before it
  aborts the job, or on a stall (`stall_bound`: the floor dist.stall_timeout_s, or STEP_FACTOR x
  the median of the last step times, which the recorder keeps as the loop reports steps); it never
  blocks on a peer or the store. `hpctrain doctor RUN`
  (hpctrain/doctor.py) reads the files.

It must never run a collective, take a lock, or import model, data or checkpoint code.
"""
from __future__ import annotations

import collections
import json
import os
import socket
import sys
import threading
import time
import traceback

SIZE = 64
STEP_FACTOR = 4.0   # a stall: inside one collective longer than this x the median step (or the floor)
STEP_WINDOW = 33    # the step times the median is taken over
FORENSICS_DIR = "forensics"
# one entry: [op, group, seq, step, t_enter, t_leave (None while open)]
_OP, _GROUP, _SEQ, _STEP, _T_ENTER, _T_LEAVE = range(6)


class _NoScope:
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_SCOPE = _NoScope()


class _Scope:
    __slots__ = ("rec", "op", "group", "entry")

    def __init__(self, rec: "FlightRecorder", op: str, group: str):
        self.rec, self.op, self.group = rec, op, group

    def __enter__(self):
        self.entry = self.rec.enter(self.op, self.group)
        return self.entry

    def __exit__(self, *exc):
        self.rec.leave(self.entry)
        return False


class FlightRecorder:
    """The ring buffer (see the module docstring). `step`: the last step the loop reported (each
    new step also records the time since the previous one: `step_times`)."""

    def __init__(self, size: int = SIZE):
        self.size = size
        self.ring: list = [None] * size
        self.count = 0           # entries ever recorded
        self.events = 0          # enters + leaves: the main thread's progress
        self._step, self._step_at = 0, None
        self.step_times: collections.deque = collections.deque(maxlen=STEP_WINDOW)
        self._seqs: dict[str, int] = {}
        self._main = threading.main_thread().ident

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if value == self._step and self._step_at is not None:
            return
        now = time.monotonic()
        if self._step_at is not None and value == self._step + 1:
            self.step_times.append(now - self._step_at)
        self._step, self._step_at = value, now

    def enter(self, op: str, group: str) -> list:
        seq = self._seqs.get(group, 0) + 1
        self._seqs[group] = seq
        entry = [op, group, seq, self._step, time.monotonic(), None]
        self.ring[self.count % self.size] = entry
        self.count += 1
        self.events += 1
        return entry

    def leave(self, entry: list) -> None:
        entry[_T_LEAVE] = time.monotonic()
        self.events += 1

    def collective(self, op: str, group: str) -> _Scope:
        """`with RECORDER.collective("all_reduce", "dp(4)"): dist.all_reduce(...)` (main thread;
        elsewhere it records nothing)."""
        if threading.get_ident() != self._main:
            return _NO_SCOPE
        return _Scope(self, op, group)

    def entries(self) -> list[list]:
        """The recorded entries, oldest first (copies: safe to read from another thread)."""
        n = min(self.count, self.size)
        start = self.count - n
        return [list(e) for e in (self.ring[(start + i) % self.size] for i in range(n)) if e]

    def open_entry(self) -> list | None:
        """The innermost collective or phase the main thread is in (None: in none)."""
        for e in reversed(self.entries()):
            if e[_T_LEAVE] is None:
                return e
        return None


RECORDER = FlightRecorder()


def describe(entry: list | None) -> str:
    if entry is None:
        return "no collective"
    return f"{entry[_OP]} {entry[_GROUP]} seq {entry[_SEQ]} (step {entry[_STEP]})"


def stall_bound(rec: FlightRecorder, floor_s: float) -> float:
    """How long the main thread may stay inside one collective before it is a stall: the floor,
    or STEP_FACTOR x the median step time so far when that is longer (a slow step is no stall)."""
    times = sorted(rec.step_times)
    return max(floor_s, STEP_FACTOR * times[(len(times) - 1) // 2]) if times else floor_s


def stalled(rec: FlightRecorder, bound_s: float) -> list | None:
    """The open entry if the main thread has been inside it for longer than `bound_s`."""
    e = rec.open_entry()
    if e is not None and time.monotonic() - e[_T_ENTER] > bound_s:
        return e
    return None


def _entry_json(e: list, now: float, is_open: bool) -> dict:
    left = e[_T_LEAVE]
    return {"op": e[_OP], "group": e[_GROUP], "seq": e[_SEQ], "step": e[_STEP],
            "entered_s_ago": round(now - e[_T_ENTER], 3), "left": left is not None,
            "duration_s": round((left if left is not None else now) - e[_T_ENTER], 3),
            "open": is_open}


def _stacks() -> tuple[dict[str, list[str]], str | None]:
    """Every thread's stack (name -> lines) and the main thread's innermost hpctrain frame."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    stacks, innermost = {}, None
    for ident, frame in sys._current_frames().items():
        summary = traceback.extract_stack(frame)
        stacks[f"{names.get(ident, 'thread')} ({ident})"] = traceback.format_list(summary)
        if ident == main_id:
            for fs in reversed(summary):
                if "hpctrain" in fs.filename and "flight_recorder" not in fs.filename:
                    innermost = f"{_short(fs.filename)}:{fs.lineno} in {fs.name}"
                    break
    return stacks, innermost


def _short(path: str) -> str:
    i = path.rfind("hpctrain" + os.sep)
    return path[i:] if i >= 0 else path


def forensics(rank: int, world: int, verdict: str, kind: str, lost: int | None = None,
              rec: FlightRecorder = RECORDER) -> dict:
    """This rank's forensics record (see the module docstring)."""
    now = time.monotonic()
    open_e = rec.open_entry()
    stacks, innermost = _stacks()
    return {"rank": rank, "world": world, "host": socket.gethostname(), "pid": os.getpid(),
            "kind": kind, "verdict": verdict, "lost": lost, "step": rec.step,
            "time": time.time(), "innermost_frame": innermost,
            "open": _entry_json(open_e, now, True) if open_e is not None else None,
            "collectives": [_entry_json(e, now, e == open_e)
                            for e in rec.entries()],
            "stacks": stacks}


def write_forensics(run_dir, record: dict) -> str | None:
    """Write `<run_dir>/forensics/rank_<r>.json` atomically; its path, or None (never raises)."""
    if not run_dir:
        return None
    folder = os.path.join(os.fspath(run_dir), FORENSICS_DIR)
    name = f"rank_{record['rank']}.json"
    try:
        os.makedirs(folder, mode=0o755, exist_ok=True)
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            tmp = f".{name}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=dir_fd)
            with os.fdopen(fd, "w") as f:
                json.dump(record, f, indent=1)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except (OSError, TypeError, ValueError):
        return None
    return os.path.join(folder, name)
