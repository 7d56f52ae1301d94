"""Test-only fault injection at named points of the checkpoint save path (and of the load's).

Owns the list of fault points (`POINTS`) and the meaning of the `save_point` item of the one
test-fault switch, the environment variable HPCTRAIN_TEST_FAULTS (hpctrain/step_faults.py), that
arms one of them. Tests use it to kill a rank (SIGKILL: no cleanup, no flush, like a node failure) or
to make a write fail with ENOSPC at an exact moment of a save, then check that the run resumes from
an intact, committed checkpoint. Unset (production), `hit()` is a cached lookup and nothing else.

    HPCTRAIN_TEST_FAULTS=save_point=NAME[:COUNT[:RANK[:ACTION[:SECONDS]]]]

NAME is a point below (points inside DCP's file writes are `open:`, `write:` or `closed:` followed
by the file name, e.g. `write:__1_0.distcp`, `closed:.metadata.tmp`); COUNT: act on the COUNT-th time
this process reaches it (default 1); RANK: only on this global rank (default: every rank);
ACTION: `kill` (default), `enospc` (raise OSError(ENOSPC) naming the file being written), `stop`
(SIGSTOP: the rank freezes there, as on a suspended node, until a test sends SIGCONT) or `sleep`
(the rank sleeps SECONDS there, as on a busy parallel file system, and says so on stderr with one
`HPCTRAIN_TEST_FAULTS sleeps <SECONDS> s at <NAME> on rank <RANK>` line first).

It must never be armed by anything but that environment variable, and never catch what it raises.
A malformed point is a one-line error naming the variable.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import time

from hpctrain import step_faults
from hpctrain.errors import ConfigError

# In the order a save reaches them (rank 0 does the commit points; every rank the others).
POINTS = (
    "save.begin",              # a save starts (before the tmp dir exists)
    "save.tmp_created",        # rank 0 created step_N.tmp (empty)
    "save.staged",             # async: state copied to host memory, write not started
    "save.before_write",       # about to call DCP save
    # open:<file> / write:<file> (after the first chunk) / closed:<file> (written and fsynced)
    # for __<rank>_0.distcp and .metadata.tmp, from inside DCP's writer
    "save.dcp_done",           # DCP returned: shards and .metadata written
    "save.trainer_state",      # rank 0 wrote trainer_state.json
    "save.nontensor",          # rank 0 wrote state_nontensor.json
    "save.agreed",             # every rank's write succeeded (agreement done)
    "commit.marker_written",   # COMMIT.json written into step_N.tmp
    "commit.before_rename",    # tmp fsynced, not yet renamed
    "commit.renamed",          # step_N exists, root not yet fsynced
    "commit.done",             # root fsynced
    "retention.renamed",       # an old checkpoint renamed to .deleting, not yet deleted
    "save.end",                # save returned (retention done)
    # the load's, in the order a resume reaches them
    "load.scan",               # rank 0 about to scan the run's checkpoints (the manager's latest())
    "load.begin",              # rank 0 about to check a checkpoint and read its JSON files
    "load.dcp_done",           # a load's DCP read returned (the tensors written in place)
)
ACTIONS = ("kill", "enospc", "stop", "sleep")
FILE_EVENTS = ("open", "write", "closed")

_counts: dict[str, int] = {}
_spec: tuple[str, int, int | None, str, float] | None = None
_parsed: str | None = None


def _armed():
    global _spec, _parsed
    raw = step_faults.step_faults().save_point
    if raw != _parsed:  # parsed again only when the switch changes (tests in one process)
        _parsed, _spec = raw, None
        _counts.clear()
        if raw:
            _spec = _parse_point(raw)
    return _spec


def _parse_point(raw: str) -> tuple[str, int, int | None, str, float]:
    """NAME[:COUNT[:RANK[:ACTION[:SECONDS]]]] -> (name, count, rank or None, action, seconds)."""
    where = f"{step_faults.ENV}: save_point={raw}"
    parts = raw.split(":")
    if parts[0] in FILE_EVENTS and len(parts) > 1:  # "write:__1_0.distcp:2:1"
        parts = [parts[0] + ":" + parts[1]] + parts[2:]
    name = parts[0]
    try:
        count = int(parts[1]) if len(parts) > 1 and parts[1] else 1
        rank = int(parts[2]) if len(parts) > 2 and parts[2] != "" else None
    except ValueError:
        raise ConfigError(f"{where}: COUNT and RANK must be integers") from None
    action = parts[3] if len(parts) > 3 else "kill"
    if name not in POINTS and name.split(":")[0] not in FILE_EVENTS:
        raise ConfigError(f"{where}: unknown fault point {name!r}")
    if action not in ACTIONS:
        raise ConfigError(f"{where}: action must be kill, enospc, stop or sleep")
    try:
        seconds = float(parts[4]) if action == "sleep" else 0.0
    except (IndexError, ValueError):
        raise ConfigError(f"{where}: the sleep action needs SECONDS (e.g. {name}:1:0:sleep:10)") from None
    return name, count, rank, action, seconds


def _my_rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def hit(name: str, path: str | os.PathLike | None = None) -> None:
    """Called at fault point `name`; acts if HPCTRAIN_TEST_FAULTS' save_point arms it (tests only)."""
    spec = _armed()
    if spec is None or spec[0] != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] != spec[1] or (spec[2] is not None and spec[2] != _my_rank()):
        return
    if spec[3] == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path or name))
    if spec[3] == "sleep":
        print(f"{step_faults.ENV} sleeps {spec[4]:g} s at {name} on rank {_my_rank()}",
              file=sys.stderr, flush=True)
        time.sleep(spec[4])
        return
    os.kill(os.getpid(), signal.SIGSTOP if spec[3] == "stop" else signal.SIGKILL)


def file_point(event: str, path) -> None:
    hit(f"{event}:{os.path.basename(str(path))}", path)
