"""Preemption signals as a flag: handlers that only record which signal arrived.

Owns: installing the handlers for the configured stop signals (`slurm.signals`, USR1,TERM,INT by
default) and the list of signals received. It lives outside hpctrain/distributed (whose package imports
torch) and imports only the standard library, so `python -m hpctrain` can catch SIGUSR1 before the
seconds-long torch import: an uncaught SIGUSR1 kills a starting rank (its default action), and a
batch script forwards USR1 whenever Slurm sends it. It must never act on a signal: preemption
(hpctrain/distributed/preempt.py) reads `received()` at step boundaries.
"""
from __future__ import annotations

import signal

EARLY = "USR1"  # caught from the first line of `python -m hpctrain`, before the config is read

_received: list[int] = []  # signal numbers in arrival order (list.append is async-signal safe)
_installed: set[int] = set()


def parse(spec: str) -> list[signal.Signals]:
    """'USR1,TERM' -> [SIGUSR1, SIGTERM]; ValueError naming the bad entry."""
    out = []
    for name in (s.strip().upper() for s in spec.split(",") if s.strip()):
        full = name if name.startswith("SIG") else f"SIG{name}"
        try:
            sig = signal.Signals[full]
        except KeyError:
            raise ValueError(f"unknown signal {name!r}") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{name} cannot be caught")
        out.append(sig)
    return out


def _record(signum, frame) -> None:
    _received.append(signum)


def install(spec: str) -> None:
    """Record these signals from now on. Signals installed before (EARLY) but not in `spec` get
    their default action back, and any of them already received is forgotten."""
    wanted = set(parse(spec))
    for sig in list(_installed - wanted):
        signal.signal(sig, signal.SIG_DFL)
        _installed.discard(sig)
        _received[:] = [s for s in _received if s != sig]
    for sig in wanted - _installed:
        signal.signal(sig, _record)
        _installed.add(sig)


def received() -> list[int]:
    return list(_received)
