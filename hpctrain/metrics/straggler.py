"""Per-rank step timing and straggler detection.

Each step every rank contributes two numbers: its step time and its *busy* time (step time minus the
time it spent waiting for its peers, hpctrain/metrics/wait_clock.py: DDP's gradient reduction with
any comm hook, from the last bucket handed over to the end of backward; blocking reductions such as
the loss mean, which is where DiLoCo's replicas wait for each other between rounds). A slow rank
(thermal throttling, a noisy neighbour, a bad node) makes every other rank wait for it, so their
busy time drops while its own stays high: the rank with the highest busy time, consistently, is the
straggler. Where the layout's collectives run inside forward/backward (FSDP, TP, PP) the waiting
cannot be told apart on the host: busy time is then the step's wall time, the same on every rank
(they all wait for the slowest), the record says `"rank_busy_measure": "wall"` and nobody is
flagged. Owns: gathering those numbers (one small MPI allgather per step; under DiLoCo too, next to
the per-step loss all-reduce), the compact record that goes into metrics.jsonl, and the warning.
Never changes training.
"""
from __future__ import annotations

import statistics
from collections import deque

from hpctrain.distributed.flight_recorder import RECORDER


class StragglerDetector:
    def __init__(self, comm, window: int = 10, ratio: float = 1.25):
        self.comm, self.window, self.ratio = comm, window, ratio
        self.history: deque[list[float]] = deque(maxlen=window)
        self.flagged: int | None = None
        size = comm.Get_size() if hasattr(comm, "Get_size") else "?"
        self._group = f"world({size})"  # the flight recorder's group name

    def observe(self, step_s: float, busy_s: float, wall: bool = False) -> dict:
        """Collective. Returns the compact per-rank record for this step (same on every rank).
        `wall`: busy_s is the step's wall time (waits not measurable on this layout)."""
        with RECORDER.collective("straggler_allgather", self._group):
            rows = self.comm.allgather((round(step_s, 5), round(busy_s, 5)))
        busy = [b for _, b in rows]
        rec = {"rank_busy_s": busy, "rank_step_s_max": max(s for s, _ in rows)}
        if wall:  # every rank's wall time: nothing to tell a straggler by
            rec["rank_busy_measure"] = "wall"
            return rec
        self.history.append(busy)
        slow = self._straggler()
        if slow is not None:
            rec["straggler"] = slow
        return rec

    def _straggler(self) -> int | None:
        """A rank whose busy time exceeded `ratio` x the median of all ranks in each of the last
        `window` steps."""
        if len(self.history) < self.window or len(self.history[0]) < 2:
            return None
        candidates = None
        for busy in self.history:
            med = statistics.median(busy)
            slow = {r for r, b in enumerate(busy) if b > self.ratio * med and b - med > 1e-3}
            candidates = slow if candidates is None else candidates & slow
            if not candidates:
                return None
        return min(candidates)

    def warning(self, step: int, rec: dict) -> str | None:
        """One warning per newly flagged rank (rank 0 prints it)."""
        slow = rec.get("straggler")
        if slow is None or slow == self.flagged:
            return None
        self.flagged = slow
        busy = rec["rank_busy_s"]
        return (f"warning: rank {slow} is a straggler: busy {busy[slow]:.3f}s per step vs median "
                f"{statistics.median(busy):.3f}s over the last {self.window} steps (step {step}); "
                f"the other ranks wait for it at every step's reduction")
