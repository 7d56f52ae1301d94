"""The global sample order: which samples each optimizer step consumes, independent of DP size.

Owns: the epoch order (``data.shuffle``: "global" = ``PCG64([seed, epoch]).permutation(n)``,
materialized, 8 B x windows; "block" = hpctrain.data.block_order, shards in a seeded order and
windows shuffled inside blocks of ``data.shuffle_block_shards`` shards, 8 B x shards + two
blocks' windows), the position within it, its checkpointable state (which records the order),
which shards the coming steps read and which steps read the same block (for the node cache), and ``split_for_rank`` (the contiguous
slice of a global batch that a data-parallel rank turns into micro-batches).

Must never: read data, depend on the number of ranks for the ORDER (only split_for_rank sees
dp_size), use global numpy/torch RNG state, or hold anything that is not in state_dict().
"""
from __future__ import annotations

import numpy as np

from hpctrain.checkpoint.disk_format import TRAINER_STATE_FILE
from hpctrain.errors import CheckpointError, ConfigError

from .block_order import BlockOrder

SHUFFLES = ("global", "block")
STATE_KEYS = ("seed", "epoch", "position", "n_samples", "global_batch")
BLEND_STATE_KEYS = ("kind", *STATE_KEYS, "blend_seed", "sizes", "parts")  # hpctrain.data.mixture's
KINDS = ("shards", "blend")  # "kind" of a state; absent: "shards" (a plain sharded dataset)


class GlobalSampler:
    """Epoch ``e`` visits the ``n_samples`` windows in the order ``shuffle`` names (see the module
    doc); every step takes the next ``global_batch`` entries; a remainder < global_batch is
    dropped and the next epoch starts.  The order depends only on (n_samples, global_batch, seed)
    and, for "block", the windows per shard and ``block_shards`` — never on the number of ranks.
    ``shard_windows`` (windows per shard, in window-number order) is needed for "block" and for
    ``shards_between``; without it the dataset is one shard."""

    def __init__(self, n_samples: int, global_batch: int, seed: int, shard_windows=None,
                 shuffle: str = "global", block_shards: int = 64):
        n_samples, global_batch, seed = int(n_samples), int(global_batch), int(seed)
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if n_samples < global_batch:
            raise ConfigError(f"config key 'train.micro_batch_size': the global batch "
                              f"(micro_batch_size x grad_accum x dp) of {global_batch} sequences "
                              f"is larger than the dataset's {n_samples} windows of "
                              f"model.block_size + 1 tokens: not one optimizer step per epoch; use "
                              f"a smaller batch or block_size, or more data")
        windows = [n_samples] if shard_windows is None else shard_windows
        self.shard_windows = np.asarray(windows, dtype=np.int64).ravel()
        if int(self.shard_windows.sum()) != n_samples:
            raise ValueError(f"shard_windows sum to {int(self.shard_windows.sum())}, "
                             f"not n_samples {n_samples}")
        self.n_samples, self.global_batch, self.seed = n_samples, global_batch, seed
        self.epoch, self.position = 0, 0
        self._set_order(shuffle, block_shards)

    def _set_order(self, shuffle: str, block_shards: int) -> None:
        if shuffle not in SHUFFLES:
            raise ValueError(f"data.shuffle must be one of {SHUFFLES}, got {shuffle!r}")
        self.shuffle, self.block_shards = shuffle, int(block_shards)
        # "global" is the one-block case of BlockOrder (same order), used for shards_between
        blocks = self.block_shards if shuffle == "block" else self.shard_windows.size
        self._blocks = BlockOrder(self.shard_windows, blocks, self.seed)
        self._order, self._order_epoch = None, -1

    @property
    def steps_per_epoch(self) -> int:
        return self.n_samples // self.global_batch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The full order of epoch ``epoch`` (int64; materializes it: for tests and tools)."""
        if self.shuffle == "block":
            return self._blocks.positions(int(epoch), 0, self.n_samples)
        rng = np.random.Generator(np.random.PCG64([self.seed, int(epoch)]))
        return rng.permutation(self.n_samples).astype(np.int64)

    def _slice(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Window numbers at positions [start, stop) of epoch ``epoch`` (a fresh array)."""
        if self.shuffle == "block":
            return self._blocks.positions(epoch, start, stop)
        if self._order_epoch != epoch:
            self._order, self._order_epoch = self.epoch_order(epoch), epoch
        return self._order[start:stop].copy()

    def next_indices(self) -> np.ndarray:
        """Global sample indices (global_batch,) of the next optimizer step; advances state."""
        if self.position + self.global_batch > self.n_samples:
            self.epoch, self.position = self.epoch + 1, 0
        out = self._slice(self.epoch, self.position, self.position + self.global_batch)
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
        return self._slice(epoch, pos, pos + self.global_batch)

    def shards_between(self, k0: int, k1: int) -> np.ndarray:
        """Shards (positions in ``shard_windows``, sorted, unique) that steps [k0, k1) may read,
        without drawing their samples: the blocks those steps are in ("block"; every shard for
        "global").  What a node cache must hold to serve those steps."""
        k0, k1 = int(k0), int(k1)
        out, k = [], k0
        while k < k1:
            epoch, pos = divmod(k, self.steps_per_epoch)
            last = min(k1, (epoch + 1) * self.steps_per_epoch)
            start, stop = pos * self.global_batch, (last - epoch * self.steps_per_epoch) * self.global_batch
            out.append(self._blocks.shards_between(epoch, start, stop))
            k = last
        return np.unique(np.concatenate(out)) if out else np.empty(0, dtype=np.int64)

    def indices_between(self, k0: int, k1: int) -> np.ndarray:
        """The global batches of steps [k0, k1), one row per step ((k1 - k0, global_batch) int64):
        ``indices_at`` of each step, drawn a slice of an epoch at a time."""
        k0, k1, gb = int(k0), int(k1), self.global_batch
        rows, k = [], k0
        while k < k1:
            epoch, pos = divmod(k, self.steps_per_epoch)
            last = min(k1, (epoch + 1) * self.steps_per_epoch)
            rows.append(self._slice(epoch, pos * gb, (last - epoch * self.steps_per_epoch) * gb))
            k = last
        flat = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
        return flat.reshape(max(0, k1 - k0), gb)

    def block_steps(self, k: int) -> tuple[int, int, np.ndarray]:
        """(a, z, shards): the steps [a, z) whose batches read the block that step ``k``'s batch
        starts in (a batch that straddles two blocks belongs to both; "global": the steps of
        ``k``'s epoch) and that block's shards (positions in ``shard_windows``, sorted).  The next
        block is ``block_steps(z)``, across epochs too (an epoch's remainder is never read)."""
        epoch, pos = divmod(int(k), self.steps_per_epoch)
        start, stop, shards = self._blocks.block_at(epoch, pos * self.global_batch)
        base = epoch * self.steps_per_epoch
        return (base + start // self.global_batch,
                base + min(self.steps_per_epoch, -(-stop // self.global_batch)), shards)

    def blocks(self, epoch: int) -> list[np.ndarray]:
        """The shards (positions in ``shard_windows``) of each block of epoch ``epoch``, in the
        order the epoch reads them ("global": one block of every shard)."""
        order, size = self._blocks.shard_order_of(epoch), self._blocks.block_shards
        return [order[a:a + size] for a in range(0, order.size, size)]

    def seek(self, k: int) -> None:
        """Position the sampler before step ``k``'s batch (what ``k`` calls of next_indices from a
        fresh sampler leave), e.g. where batches are claimed out of order by asynchronous replicas."""
        epoch, pos = divmod(int(k), self.steps_per_epoch)
        if pos == 0 and epoch > 0:  # next_indices moves to the next epoch lazily
            epoch, pos = epoch - 1, self.steps_per_epoch
        self.epoch, self.position = epoch, pos * self.global_batch

    def copy(self) -> "GlobalSampler":
        """A fresh sampler with the same order (for another thread, e.g. the cache planner)."""
        return GlobalSampler(self.n_samples, self.global_batch, self.seed, self.shard_windows,
                             self.shuffle, self.block_shards)

    def state_dict(self) -> dict:
        state = {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                 "n_samples": self.n_samples, "global_batch": self.global_batch}
        if self.shuffle == "block":  # "global" states stay as they were before "block" existed
            state.update(shuffle="block", block_shards=self.block_shards)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved position in the saved order: the saved seed and ``shuffle`` win
        over the constructor's (a checkpoint without ``shuffle`` was saved by the "global" order).
        CheckpointError for a state no dataset can resume (``state_problem``), ConfigError for
        one saved on another dataset or global batch."""
        problem = state_problem(state)
        if problem:
            raise CheckpointError(problem)
        if state.get("kind", "shards") != "shards":
            raise ConfigError(f"sampler state was saved for a {state['kind']} dataset but "
                              f"data.path is now a plain sharded dataset: the sample order cannot "
                              f"be resumed")
        if state["n_samples"] != self.n_samples:
            raise ConfigError(f"sampler state was saved for {state['n_samples']} samples but the "
                              f"dataset now has {self.n_samples}: the dataset (or block_size) "
                              f"changed, so the sample order cannot be resumed")
        refuse_other_batch(state, self.global_batch)
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._set_order(state.get("shuffle", "global"), state.get("block_shards", self.block_shards))


def refuse_other_batch(state: dict, global_batch: int) -> None:
    """ConfigError when a sampler state was saved with another global batch than ``global_batch``."""
    if state["global_batch"] != global_batch:
        raise ConfigError(f"sampler state was saved with global_batch {state['global_batch']}, "
                          f"now {global_batch}: refusing to resume a different schedule")


def _is_count(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _problem_of_value(state: dict) -> str | None:
    """The first key of ``state`` whose value no sampler takes, as "'sampler.KEY' is V, not ..."."""
    for key in ("seed", "epoch", "position", "n_samples", "global_batch", "blend_seed"):
        if key in state and not _is_count(state[key], 0):
            return f"'sampler.{key}' is {state[key]!r}, not an integer >= 0"
    if state.get("shuffle", "global") not in SHUFFLES:
        return f"'sampler.shuffle' is {state['shuffle']!r}, not one of {', '.join(SHUFFLES)}"
    if "block_shards" in state and not _is_count(state["block_shards"], 1):
        return f"'sampler.block_shards' is {state['block_shards']!r}, not an integer >= 1"
    for key in ("sizes", "parts"):
        value = state.get(key, [1])
        if not isinstance(value, list) or not value or not all(_is_count(v, 1) for v in value):
            return f"'sampler.{key}' is {value!r}, not a list of integers >= 1"
    if len(state.get("sizes", ())) != len(state.get("parts", ())):
        return "'sampler.sizes' and 'sampler.parts' differ in length"
    if sum(state.get("sizes", [state["n_samples"]])) != state["n_samples"]:
        return f"'sampler.n_samples' is {state['n_samples']}, not the sum of 'sampler.sizes'"
    last = state["n_samples"] - (state.get("kind") == "blend")  # a blend's position wraps at n
    if state["position"] > last:
        return f"'sampler.position' {state['position']} is past {last}, the last of its samples"
    return None


def state_problem(state) -> str | None:
    """What makes a checkpoint's sampler entry unusable on any dataset, or None: not a JSON
    object, an unknown kind, a key of its kind missing, a value of the wrong type or range, a
    position past its samples (a damaged or hand-edited checkpoint, not another dataset)."""
    if not isinstance(state, dict):
        return "'sampler' is not a JSON object"
    kind = state.get("kind", "shards")
    if kind not in KINDS:
        return f"'sampler.kind' is {kind!r}, not one of {', '.join(KINDS)}"
    need = BLEND_STATE_KEYS if kind == "blend" else STATE_KEYS
    if state.get("shuffle") == "block":
        need = (*need, "block_shards")
    missing = [k for k in need if k not in state]
    if missing:
        return f"'sampler.{missing[0]}' is missing" + (f" (+{len(missing) - 1} more)" if missing[1:] else "")
    return _problem_of_value(state)


def saved_sampler_state(saved: dict, where) -> dict:
    """Checkpoint ``where``'s sampler entry (``saved``: its JSON state), checked by
    ``state_problem``: a CheckpointError naming the file and the key where it is damaged (the
    checkpoint manager then tries an older checkpoint)."""
    state = saved.get("sampler")
    problem = state_problem(state)
    if problem:
        raise CheckpointError(f"{where}/{TRAINER_STATE_FILE}: {problem} (a damaged or hand-edited "
                              f"checkpoint; resume from an older one)")
    return state


def check_same_dataset(sampler, saved: dict, data_path: str, where) -> None:
    """A ConfigError naming data.path when checkpoint ``where``'s sample order (``saved``: its JSON
    state) cannot continue on the configured dataset (another dataset, a re-sharded one, a blend
    instead of a plain one), a CheckpointError naming the file and key when its sampler entry is
    damaged (``saved_sampler_state``); what the sampler's load_state_dict would refuse, before any
    tensor is loaded."""
    state = saved_sampler_state(saved, where)
    try:
        sampler.copy().load_state_dict(state)
    except ConfigError as e:
        was = saved.get("trainer", {}).get("config", {}).get("data", {}).get("path")
        hint = (f"the dataset changed since {where} was saved" if was in (None, data_path) else
                f"{where} was trained on {was}: set data.path = \"{was}\" to resume it")
        raise ConfigError(f"config key 'data.path': {data_path} cannot continue the sample order "
                          f"of checkpoint {where} ({e}); {hint}, or use a new run.dir to train on "
                          f"{data_path}") from None


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
