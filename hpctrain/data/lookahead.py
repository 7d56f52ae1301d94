"""Block look-ahead of the node cache: stage the next block's shards while the node reads this one.

With ``data.shuffle = "block"`` the first steps of a block read windows from up to
``data.shuffle_block_shards`` shards that the per-step prefetch (``data.prefetch`` steps ahead)
has not staged, so without look-ahead the node waits on the parallel file system at every block
boundary.  The leader's cache thread asks this planner, once the per-step needs are staged, for
the next shard of the next ``data.prefetch_blocks`` blocks to stage.

Owns: the decision to stage ahead (only when the shards still needed by the current block, the
steps in the prefetch window, the pinned validation shards and the next blocks' shards all fit
``data.cache_bytes`` together, so staging them never evicts anything the node still needs: two
blocks must fit, as ``DataFeed.budget_warning`` says at start; otherwise nothing is staged ahead,
which is the per-step behaviour), the order (the step that first reads each shard), and the
shards it holds: each planned shard is protected from eviction until the slowest local rank has
passed the last step that reads it.

The plans come from the caller (``plan(k)``: a pure function of the step, computed from the
sampler's order and the node's dp ranks by hpctrain.data.prefetch): this module never decides the
order, reads data, or calls MPI.  It runs on the leader's cache thread only.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np


class BlockPlan(NamedTuple):
    """The shards a node's ranks read in the steps [start, stop) of one block of the order:
    ``shards[j]`` is first read at step ``first[j]`` and last at ``last[j]`` (sorted by first)."""
    start: int
    stop: int
    shards: np.ndarray
    first: np.ndarray
    last: np.ndarray

    @classmethod
    def of_steps(cls, start: int, shard_ids, only=None) -> "BlockPlan":
        """From the shard of each sample the node reads, one row per step from ``start`` on;
        ``only``: keep these shards (the block's own), not a neighbour's in a straddling batch."""
        ids = np.asarray(shard_ids, dtype=np.int64)
        ids = ids.reshape(ids.shape[0], -1)
        steps = np.repeat(np.arange(start, start + ids.shape[0], dtype=np.int64), ids.shape[1])
        flat = ids.ravel()
        if only is not None:
            keep = np.isin(flat, np.asarray(only, dtype=np.int64))
            flat, steps = flat[keep], steps[keep]
        shards, first_at = np.unique(flat, return_index=True)
        _, last_from_end = np.unique(flat[::-1], return_index=True)
        first, last = steps[first_at], steps[flat.size - 1 - last_from_end]
        order = np.argsort(first, kind="stable")
        return cls(int(start), int(start + ids.shape[0]), shards[order], first[order], last[order])


class BlockLookahead:
    """Which shard of the next blocks to stage next, and which shards the cache must hold."""

    def __init__(self, plan: Callable[[int], BlockPlan | None], blocks: int, end: int, sizes):
        self.plan, self.blocks, self.end = plan, max(0, int(blocks)), int(end)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.held: dict[int, int] = {}  # shard -> the last planned step that reads it
        self.current: BlockPlan | None = None  # the block the slowest local rank reads
        self.ahead: list[BlockPlan] = []
        self.pending: list[tuple[int, int]] = []  # (shard, first step) still to stage, in order
        self.decided, self.checked_at = False, None

    def held_from(self, pmin: int) -> set[int]:
        """Shards planned for a step >= ``pmin`` (never to be evicted); forgets the read ones."""
        for i in [i for i, last in self.held.items() if last < pmin]:
            del self.held[i]
        return set(self.held)

    def _enter(self, pmin: int) -> None:
        """The slowest rank is in another block: plan it and the ``blocks`` blocks after it."""
        self.current, self.ahead, self.pending = self.plan(pmin), [], []
        self.decided, self.checked_at = False, None
        z = self.current.stop if self.current is not None else self.end
        while len(self.ahead) < self.blocks and z < self.end:
            nxt = self.plan(z)
            if nxt is None or nxt.stop <= z:
                break
            self.ahead.append(nxt)
            z = nxt.stop

    def _decide(self, pmin: int, needed: set[int], budget: int) -> None:
        """Stage the next blocks only if they fit with everything the node still needs."""
        cur = self.current
        left = {int(i): int(last) for i, last in zip(cur.shards, cur.last) if last >= pmin}
        want = set(left) | set(needed)
        for p in self.ahead:
            want.update(int(i) for i in p.shards)
        if int(self.sizes[sorted(want)].sum()) > budget:
            return  # checked again when the slowest rank moves on
        self.decided = True
        for i, last in left.items():
            self.held[i] = max(self.held.get(i, -1), last)
        for p in self.ahead:
            for i, first, last in zip(p.shards.tolist(), p.first.tolist(), p.last.tolist()):
                self.held[i] = max(self.held.get(i, -1), last)
                self.pending.append((i, first))

    def next_shard(self, pmin: int, needed: set[int], budget: int,
                   is_ready: Callable[[int], bool]) -> tuple[int, int] | None:
        """(shard, first step reading it) to stage ahead now, or None.  ``needed``: the shards
        the cache must keep besides the blocks (pinned ones, the steps being prefetched)."""
        if self.blocks == 0:
            return None
        cur = self.current
        if cur is None or not cur.start <= pmin < cur.stop:
            self._enter(pmin)
            if self.current is None:  # an order without blocks: per-step staging only
                self.blocks = 0
                return None
        if not self.decided and self.ahead and self.checked_at != pmin:
            self.checked_at = pmin
            self._decide(pmin, needed, budget)
        while self.pending and is_ready(self.pending[0][0]):
            self.pending.pop(0)
        return self.pending[0] if self.pending else None
