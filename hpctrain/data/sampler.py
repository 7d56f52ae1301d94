"""The global sample order: which samples each optimizer step consumes, independent of DP size.

Owns: the epoch permutation (``PCG64([seed, epoch])``), the position within it, its
checkpointable state, and ``split_for_rank`` (the contiguous slice of a global batch that a
data-parallel rank turns into micro-batches).

Must never: read data, depend on the number of ranks for the ORDER (only split_for_rank sees
dp_size), use global numpy/torch RNG state, or hold anything that is not in state_dict().
"""
from __future__ import annotations

import numpy as np

STATE_KEYS = ("seed", "epoch", "position", "n_samples", "global_batch")


class GlobalSampler:
    """Epoch ``e`` visits ``permutation(n_samples)`` of ``Generator(PCG64([seed, e]))``; every
    step takes the next ``global_batch`` entries; a remainder < global_batch is dropped and the
    next epoch starts.  The order depends only on (n_samples, global_batch, seed)."""

    def __init__(self, n_samples: int, global_batch: int, seed: int):
        n_samples, global_batch, seed = int(n_samples), int(global_batch), int(seed)
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if n_samples < global_batch:
            raise ValueError(f"global_batch {global_batch} is larger than the dataset's "
                             f"{n_samples} samples: 0 optimizer steps per epoch (use a smaller "
                             f"batch or block_size, or more data)")
        self.n_samples, self.global_batch, self.seed = n_samples, global_batch, seed
        self.epoch, self.position = 0, 0
        self._order, self._order_epoch = None, -1

    @property
    def steps_per_epoch(self) -> int:
        return self.n_samples // self.global_batch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The full permutation of epoch ``epoch`` (int64)."""
        rng = np.random.Generator(np.random.PCG64([self.seed, int(epoch)]))
        return rng.permutation(self.n_samples).astype(np.int64)

    def _current(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order, self._order_epoch = self.epoch_order(self.epoch), self.epoch
        return self._order

    def next_indices(self) -> np.ndarray:
        """Global sample indices (global_batch,) of the next optimizer step; advances state."""
        if self.position + self.global_batch > self.n_samples:
            self.epoch, self.position = self.epoch + 1, 0
        out = self._current()[self.position:self.position + self.global_batch].copy()
        self.position += self.global_batch
        return out

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken since epoch 0 (the index ``k`` of the next step's batch)."""
        return self.epoch * self.steps_per_epoch + self.position // self.global_batch

    def indices_at(self, k: int) -> np.ndarray:
        """The global batch of step ``k`` (a pure function of k: what ``next_indices`` returns as
        the k-th call from a fresh sampler).  Lets the cache prefetch what the sampler needs next."""
        epoch, pos = divmod(int(k), self.steps_per_epoch)
        pos *= self.global_batch
        if self._order_epoch != epoch:
            self._order, self._order_epoch = self.epoch_order(epoch), epoch
        return self._order[pos:pos + self.global_batch].copy()

    def seek(self, k: int) -> None:
        """Position the sampler before step ``k``'s batch (what ``k`` calls of next_indices from a
        fresh sampler leave), e.g. where batches are claimed out of order by asynchronous replicas."""
        epoch, pos = divmod(int(k), self.steps_per_epoch)
        if pos == 0 and epoch > 0:  # next_indices moves to the next epoch lazily
            epoch, pos = epoch - 1, self.steps_per_epoch
        self.epoch, self.position = epoch, pos * self.global_batch

    def copy(self) -> "GlobalSampler":
        """A fresh sampler with the same order (for another thread, e.g. the cache planner)."""
        return GlobalSampler(self.n_samples, self.global_batch, self.seed)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "n_samples": self.n_samples, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind", "shards") != "shards":
            raise ValueError(f"sampler state was saved for a {state.get('kind')} dataset but "
                             f"data.path is now a plain sharded dataset: the sample order cannot "
                             f"be resumed")
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"sampler state is missing {missing}")
        if int(state["n_samples"]) != self.n_samples:
            raise ValueError(f"sampler state was saved for {state['n_samples']} samples but the "
                             f"dataset now has {self.n_samples}: the dataset (or block_size) "
                             f"changed, so the sample order cannot be resumed")
        if int(state["global_batch"]) != self.global_batch:
            raise ValueError(f"sampler state was saved with global_batch {state['global_batch']}, "
                             f"now {self.global_batch}: refusing to resume a different schedule")
        position = int(state["position"])
        if not 0 <= position <= self.n_samples or int(state["epoch"]) < 0:
            raise ValueError(f"sampler state has invalid epoch/position {state}")
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), position
        self._order, self._order_epoch = None, -1


def split_for_rank(indices, dp_rank: int, dp_size: int, micro_batch: int,
                   grad_accum: int) -> list[np.ndarray]:
    """Rank ``dp_rank`` takes indices[r*mb*accum : (r+1)*mb*accum] and cuts it into
    ``grad_accum`` micro-batches of ``micro_batch``.  Requires len(indices) ==
    dp_size * micro_batch * grad_accum.  The union over ranks is exactly ``indices``."""
    indices = np.asarray(indices)
    per_rank = int(micro_batch) * int(grad_accum)
    if micro_batch < 1 or grad_accum < 1 or dp_size < 1:
        raise ValueError(f"micro_batch, grad_accum, dp_size must be >= 1 "
                         f"(got {micro_batch}, {grad_accum}, {dp_size})")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    if indices.ndim != 1 or indices.size != dp_size * per_rank:
        raise ValueError(f"global batch of {indices.size} indices != dp_size {dp_size} x "
                         f"micro_batch {micro_batch} x grad_accum {grad_accum}")
    mine = indices[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [mine[i * micro_batch:(i + 1) * micro_batch] for i in range(grad_accum)]
