"""The "block" sample order: shards in a seeded order, windows shuffled inside blocks of shards.

Owns: the epoch order of ``data.shuffle = "block"`` as a pure function of (seed, epoch, windows
per shard, block_shards), computed a block at a time, and which shards a range of positions
reads (what the node cache must hold), and where the block holding a position starts and ends (what
the node cache stages a block ahead).

Epoch ``e``: the shards (positions within the split, in manifest order) are permuted by
``Generator(PCG64([seed, e, 0, 1]))`` (left in manifest order when there is only one block);
consecutive runs of ``block_shards`` of them form blocks; block ``b`` holds its shards' windows,
numbered in manifest order, and visits them in ``Generator(PCG64(key)).permutation(W_b)`` order,
``key = [seed, e]`` for block 0 and ``[seed, e, b]`` after it.  With a single block (at most
``block_shards`` shards) this is exactly the "global" order, ``PCG64([seed, e]).permutation(n)``.
``key`` (default ``(seed,)``) replaces ``seed`` in all three seeds: a blend's component ``c``
passes ``(seed, blend_seed, c)``, so its one-block order is the blend's earlier
``PCG64([seed, blend_seed, c, e]).permutation(n_c)`` (hpctrain.data.mixture).

Memory: 16 bytes x shards (window offsets, the epoch's shard order) and the window permutations
of at most ``KEPT_BLOCKS`` blocks (8 bytes x a block's windows each); at peak 24 B x shards (a new
epoch's order) or 16 B x shards + 24 B x a block's windows (a third block while two are held) —
never a permutation of the whole epoch unless the dataset is one block.

Must never: read data, depend on the number of ranks, or use global RNG state.
"""
from __future__ import annotations

import numpy as np

KEPT_BLOCKS = 2  # the block a batch is in, and the next one (a batch may straddle the two)
SHARD_ORDER_TAG = (0, 1)  # extra seed words of the shard permutation (a key no block uses)


class BlockOrder:
    """Window numbers of epoch positions, for windows numbered shard after shard."""

    def __init__(self, shard_windows, block_shards: int, seed: int, key=None):
        self.shard_windows = np.asarray(shard_windows, dtype=np.int64).ravel()
        if self.shard_windows.size == 0 or int(self.shard_windows.min()) < 0:
            raise ValueError(f"shard_windows must be non-negative counts, one per shard "
                             f"(got {self.shard_windows.size} shards)")
        if int(block_shards) < 1:
            raise ValueError(f"data.shuffle_block_shards must be >= 1, got {block_shards}")
        self.n_shards = int(self.shard_windows.size)
        self.block_shards = min(int(block_shards), self.n_shards)
        self.n_blocks = -(-self.n_shards // self.block_shards)
        self.seed = int(seed)
        self.key = [self.seed] if key is None else [int(k) for k in key]  # seed words before epoch
        self.first_window = np.concatenate([[0], np.cumsum(self.shard_windows)])
        self.n_samples = int(self.first_window[-1])
        self._epoch = -1
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    # ---- the epoch's plan: shard order and where each block starts ---------------------------
    def _plan(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        self.shard_order, self.block_start, self._epoch = None, None, -1  # free the old epoch's
        self._blocks.clear()
        if self.n_blocks == 1:
            order = np.arange(self.n_shards, dtype=np.int64)
        else:
            rng = np.random.Generator(np.random.PCG64([*self.key, epoch, *SHARD_ORDER_TAG]))
            order = rng.permutation(self.n_shards).astype(np.int64, copy=False)
        starts = np.arange(0, self.n_shards, self.block_shards)
        block_windows = np.add.reduceat(self.shard_windows[order], starts)
        self.shard_order, self._epoch = order, epoch
        self.block_start = np.concatenate([[0], np.cumsum(block_windows)])

    def shard_order_of(self, epoch: int) -> np.ndarray:
        """Shards (split positions) in the order epoch ``epoch`` visits their blocks."""
        self._plan(int(epoch))
        return self.shard_order.copy()

    def _block(self, b: int):
        """(shards sorted, first local window of each, window permutation) of block ``b``."""
        got = self._blocks.get(b)
        if got is None:
            shards = np.sort(self.shard_order[b * self.block_shards:(b + 1) * self.block_shards])
            local_first = np.concatenate([[0], np.cumsum(self.shard_windows[shards])])
            key = [*self.key, self._epoch] if b == 0 else [*self.key, self._epoch, b]
            perm = np.random.Generator(np.random.PCG64(key)).permutation(int(local_first[-1]))
            for old in [k for k in self._blocks if not 0 <= b - k < KEPT_BLOCKS]:
                del self._blocks[old]
            got = self._blocks[b] = (shards, local_first, perm.astype(np.int64, copy=False))
        return got

    def _blocks_of(self, start: int, stop: int):
        """(block, first position, stop position) of each block overlapping [start, stop)."""
        b = int(np.searchsorted(self.block_start, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.block_start[b + 1]))
            if end > start:
                yield b, start, end
            start, b = end, b + 1

    # ---- queries ---------------------------------------------------------------------------
    def positions(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Window numbers at positions [start, stop) of epoch ``epoch`` (int64)."""
        self._plan(int(epoch))
        out = np.empty(max(0, stop - start), dtype=np.int64)
        for b, a, z in self._blocks_of(start, stop):
            shards, local_first, perm = self._block(b)
            local = perm[a - int(self.block_start[b]):z - int(self.block_start[b])]
            s = np.searchsorted(local_first, local, side="right") - 1
            out[a - start:z - start] = self.first_window[shards[s]] + local - local_first[s]
        return out

    def block_at(self, epoch: int, pos: int) -> tuple[int, int, np.ndarray]:
        """(start, stop, shards): positions [start, stop) of the block of epoch ``epoch`` that
        position ``pos`` is in, and its shards (split positions, sorted)."""
        self._plan(int(epoch))
        b = int(np.searchsorted(self.block_start, int(pos), side="right")) - 1
        b = min(max(b, 0), self.n_blocks - 1)
        shards = np.sort(self.shard_order[b * self.block_shards:(b + 1) * self.block_shards])
        return int(self.block_start[b]), int(self.block_start[b + 1]), shards

    def shards_between(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Shards (split positions, sorted) of the blocks that positions [start, stop) read: a
        superset of the shards those windows are in, known without drawing them."""
        self._plan(int(epoch))
        picked = [self.shard_order[b * self.block_shards:(b + 1) * self.block_shards]
                  for b, _, _ in self._blocks_of(start, stop)]
        return np.sort(np.concatenate(picked)) if picked else np.empty(0, dtype=np.int64)
