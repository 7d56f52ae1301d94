"""The named hook points of the one training loop (Trainer.fit, hpctrain/train/loop.py).

A mode or a driver that needs more than the plain loop registers callables here instead of
copying the loop (PBT: tune/pbt_loop.py; the sync strategies' save hooks):

    resumed        after the resume (or the fresh start), before anything is written
    start          after config.toml, metrics.jsonl and the start-up line; before the first span
    after_step     fn(record): each step's metrics record, before it is written (a hook may add keys)
    at_meeting     at the end of every span, where every rank has stopped at the same step (after
                   the strategy's meet), before the save decision
    before_save / after_save   around every checkpoint
    end_of_run     after the last checkpoint is committed, before the strategy closes

and span boundaries: `add_boundary(fn)`, fn(step) -> the next step after `step` where a span must
end (a meeting, but a checkpoint only where a checkpoint step or a stop falls there).

Owns the hook registry and its order (registration order). It must never decide when the loop
calls a point (the loop does) nor hold training state.
"""
from __future__ import annotations

from typing import Callable

POINTS = ("resumed", "start", "after_step", "at_meeting", "before_save", "after_save", "end_of_run")


class LoopHooks:
    def __init__(self):
        self._hooks: dict[str, list[Callable]] = {point: [] for point in POINTS}
        self._boundaries: list[Callable[[int], int]] = []
        self.validate_at_start = False  # a validation at step 0 even without train.eval_interval

    def add(self, point: str, fn: Callable) -> None:
        if point not in self._hooks:
            raise ValueError(f"unknown loop hook point {point!r} (points: {', '.join(POINTS)})")
        self._hooks[point].append(fn)

    def add_boundary(self, fn: Callable[[int], int]) -> None:
        self._boundaries.append(fn)

    def run(self, point: str, *args) -> None:
        for fn in self._hooks[point]:
            fn(*args)

    def next_boundary(self, step: int, default: int) -> int:
        """The first step after `step` where a span ends: `default` or a hook's earlier boundary."""
        return min([default, *(fn(step) for fn in self._boundaries)])
