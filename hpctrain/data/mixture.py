"""The sample order of a blend: a fixed weighted interleaving of components, each shuffled.

Owns: ``interleave`` (which component every position of the mixture stream takes: a periodic,
exactly proportional sequence), ``MixtureSampler`` (the GlobalSampler interface over a blend's
sample space: components' samples numbered one after another, as hpctrain.data.blend numbers
them), its checkpointable state, and the fixed evaluation set of a blended split.

Stream position ``s`` takes component ``c = pattern[s % period]``; it is that component's
``j``-th draw, ``j = (s // period) * parts[c] + (draws of c earlier in the period)``; draw ``j``
is sample ``order_e[j % n_c]`` of the component, ``e = j // n_c``, where ``order_e`` is a
hpctrain.data.block_order.BlockOrder over the component's shards keyed ``(seed, blend_seed, c)``:
``data.shuffle = "block"`` shuffles windows inside blocks of ``block_shards`` of the component's
shards (shards in a seeded order), computed a block at a time; ``"global"`` (and any component
of at most ``block_shards`` shards) is one block, exactly
``Generator(PCG64([seed, blend_seed, c, e])).permutation(n_c)``, the order blends had before
#21.  So every component cycles through its own epochs (a small one is repeated, a large one only
partly seen) and a step's indices are a pure function of (step, global_batch, seeds, windows per
shard, parts, shuffle, block_shards).

Memory: per component 16 B x shards and at most two blocks' window permutations (8 B x a block's
windows each); "global" holds a component's whole permutation (8 B x its windows).

Must never: read data, depend on the number of ranks, use global RNG state, or hold anything
that state_dict() does not determine.
"""
from __future__ import annotations

import numpy as np

from hpctrain.errors import CheckpointError, ConfigError

from .block_order import BlockOrder
from .sampler import SHUFFLES, refuse_other_batch, state_problem


def interleave(parts, seed: int) -> np.ndarray:
    """Component of each position of one period (``sum(parts)`` positions; component ``i``
    appears ``parts[i]`` times).  Tijdeman's chairman-assignment rule, in exact integers: at
    position n (1-based) among the components whose lag ``n*w_i - c_i >= 1/(2k-2)`` pick the
    earliest deadline ``(c_i + 1 - 1/(2k-2)) / w_i``; ties go to a seeded order of components.
    Every prefix of n positions then holds component i ``n*w_i`` times rounded up or down
    (``|c_i - n*w_i| <= 1 - 1/(2k-2)``), and the period repeats exactly."""
    parts = [int(p) for p in parts]
    if not parts or min(parts) < 1:
        raise ValueError(f"parts must be positive ints, got {parts}")
    k, P = len(parts), sum(parts)
    prio = np.random.Generator(np.random.PCG64([int(seed)])).permutation(k).tolist()
    D = max(2 * k - 2, 1)
    counts, out = [0] * k, np.empty(P, dtype=np.int32)
    for n in range(1, P + 1):
        best = -1
        for i in prio:
            if D * (n * parts[i] - P * counts[i]) < P:
                continue  # not yet due
            # deadline_i < deadline_best, cross-multiplied
            if best < 0 or ((D - 1 + D * counts[i]) * parts[best]
                            < (D - 1 + D * counts[best]) * parts[i]):
                best = i
        out[n - 1] = best
        counts[best] += 1
    if counts != parts:  # the theorem guarantees this; never hand out a wrong mixture silently
        raise AssertionError(f"interleave({parts}) produced counts {counts}")
    return out


class MixtureSampler:
    """GlobalSampler's interface for a blend (``sizes[c]`` samples in component ``c``, numbered
    after the components before it).  No remainder is dropped: the stream is endless; ``epoch``
    and ``position`` count nominal passes over all ``n_samples`` (for logs and resume).
    ``shard_windows[c]``: windows per shard of component ``c`` (needed for ``shuffle = "block"``;
    without it every component is one shard, i.e. one block)."""

    def __init__(self, sizes, parts, global_batch: int, seed: int, blend_seed: int = 0,
                 shard_windows=None, shuffle: str = "global", block_shards: int = 64):
        self.sizes = np.asarray([int(n) for n in sizes], dtype=np.int64)
        self.parts = np.asarray([int(p) for p in parts], dtype=np.int64)
        global_batch, seed, blend_seed = int(global_batch), int(seed), int(blend_seed)
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if seed < 0 or blend_seed < 0:
            raise ValueError(f"seeds must be >= 0, got {seed}, {blend_seed}")
        if self.sizes.size != self.parts.size or not self.sizes.size or self.sizes.min() < 1:
            raise ValueError(f"need one positive size per component (sizes {self.sizes.tolist()}, "
                             f"parts {self.parts.tolist()})")
        self.n_samples, self.global_batch = int(self.sizes.sum()), global_batch
        self.seed, self.blend_seed = seed, blend_seed
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self._set_windows(shard_windows)
        self._set_pattern()
        self.samples = 0  # stream positions consumed
        self._set_order(shuffle, block_shards)

    def _set_windows(self, shard_windows) -> None:
        windows = [[n] for n in self.sizes.tolist()] if shard_windows is None else shard_windows
        self.shard_windows = [np.asarray(w, dtype=np.int64).ravel() for w in windows]
        sums = [int(w.sum()) for w in self.shard_windows]
        if sums != self.sizes.tolist() or min(w.size for w in self.shard_windows) < 1:
            raise ValueError(f"shard_windows of the components sum to {sums}, not their sizes "
                             f"{self.sizes.tolist()}")

    def _set_order(self, shuffle: str, block_shards: int) -> None:
        """One BlockOrder per component, keyed (seed, blend_seed, c); "global" = one block."""
        if shuffle not in SHUFFLES:
            raise ValueError(f"data.shuffle must be one of {SHUFFLES}, got {shuffle!r}")
        self.shuffle, self.block_shards = shuffle, int(block_shards)
        self._orders = [BlockOrder(w, self.block_shards if shuffle == "block" else w.size,
                                   self.seed, key=(self.seed, self.blend_seed, c))
                        for c, w in enumerate(self.shard_windows)]

    def _set_pattern(self) -> None:
        self.pattern = interleave(self.parts.tolist(), self.blend_seed)
        self.period = int(self.pattern.size)
        rank = np.empty(self.period, dtype=np.int64)  # draws of the same component earlier
        for c in range(self.sizes.size):
            where = np.flatnonzero(self.pattern == c)
            rank[where] = np.arange(where.size)
        self.rank_in_period = rank

    # ---- the stream --------------------------------------------------------------------------
    def order(self, c: int, epoch: int) -> np.ndarray:
        """Component ``c``'s samples in the order of its epoch ``epoch`` (materializes the whole
        epoch: for tests and tools; the stream draws a block at a time)."""
        return self._orders[int(c)].positions(int(epoch), 0, int(self.sizes[c]))

    def draws(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(component, draw number within it) of stream positions [start, stop)."""
        s = np.arange(int(start), int(stop), dtype=np.int64)
        q, r = np.divmod(s, self.period)
        comp = self.pattern[r].astype(np.int64)
        return comp, q * self.parts[comp] + self.rank_in_period[r]

    def stream(self, start: int, stop: int) -> np.ndarray:
        """Global sample indices at stream positions [start, stop)."""
        comp, j = self.draws(start, stop)
        epoch, pos = np.divmod(j, self.sizes[comp])
        out = np.empty(comp.size, dtype=np.int64)
        for c, e in sorted(set(zip(comp.tolist(), epoch.tolist()))):
            m = (comp == c) & (epoch == e)
            p = pos[m]  # consecutive draws: a contiguous range of the component's epoch
            lo = int(p.min())
            out[m] = self.offsets[c] + self._orders[c].positions(e, lo, int(p.max()) + 1)[p - lo]
        return out

    # ---- GlobalSampler interface -------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.n_samples // self.global_batch)

    @property
    def epoch(self) -> int:
        return self.samples // self.n_samples

    @property
    def position(self) -> int:
        return self.samples % self.n_samples

    @property
    def steps_done(self) -> int:
        return self.samples // self.global_batch

    def next_indices(self) -> np.ndarray:
        out = self.stream(self.samples, self.samples + self.global_batch)
        self.samples += self.global_batch
        return out

    def indices_at(self, k: int) -> np.ndarray:
        return self.stream(int(k) * self.global_batch, (int(k) + 1) * self.global_batch)

    def seek(self, k: int) -> None:
        """Position the stream before step ``k``'s batch (see GlobalSampler.seek)."""
        self.samples = int(k) * self.global_batch

    def copy(self) -> "MixtureSampler":
        """A fresh sampler with the same order (for another thread, e.g. the cache planner)."""
        return MixtureSampler(self.sizes, self.parts, self.global_batch, self.seed, self.blend_seed,
                              self.shard_windows, self.shuffle, self.block_shards)

    def component_epochs(self) -> list[float]:
        """Passes over each component's samples made so far."""
        q, r = divmod(self.samples, self.period)
        drawn = q * self.parts + np.bincount(self.pattern[:r], minlength=self.sizes.size)
        return (drawn / self.sizes).tolist()

    def eval_indices(self, total: int) -> np.ndarray:
        """A fixed evaluation set of ``total`` samples mixed like the stream: positions [0, total)
        of the interleaving, each component's share spread evenly over its samples."""
        comp, _ = self.draws(0, int(total))
        out = np.empty(comp.size, dtype=np.int64)
        for c in range(self.sizes.size):
            m = comp == c
            spread = np.linspace(0, self.sizes[c] - 1, int(m.sum())).astype(np.int64)
            out[m] = self.offsets[c] + spread
        return out

    def state_dict(self) -> dict:
        state = {"kind": "blend", "seed": self.seed, "blend_seed": self.blend_seed,
                 "epoch": self.epoch, "position": self.position, "n_samples": self.n_samples,
                 "global_batch": self.global_batch, "sizes": self.sizes.tolist(),
                 "parts": self.parts.tolist()}
        if self.shuffle == "block":  # "global" states stay as they were before #21
            state.update(shuffle="block", block_shards=self.block_shards)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved position in the saved order: the saved seeds and ``shuffle`` win
        over the constructor's; a state without ``shuffle`` (saved before #21) continues the
        full-permutation ("global") order it was saved with.  CheckpointError for a state no
        dataset can resume (hpctrain.data.sampler.state_problem), ConfigError for one saved on
        another dataset, blend or global batch."""
        problem = state_problem(state)
        if problem:
            raise CheckpointError(problem)
        if state.get("kind") != "blend":
            raise ConfigError("sampler state was saved for a plain (unblended) dataset but "
                              "data.path is now a blend: the sample order cannot be resumed")
        if state["sizes"] != self.sizes.tolist():
            raise ConfigError(f"sampler state was saved for components of {state['sizes']} "
                              f"samples, now {self.sizes.tolist()}: a component (or block_size) "
                              f"changed, so the sample order cannot be resumed")
        if state["parts"] != self.parts.tolist():
            raise ConfigError(f"sampler state was saved with blend parts {state['parts']}, now "
                              f"{self.parts.tolist()}: the blend's weights changed, so the sample "
                              f"order cannot be resumed")
        refuse_other_batch(state, self.global_batch)
        if state["blend_seed"] != self.blend_seed:  # the saved seeds win, as in GlobalSampler
            self.blend_seed = state["blend_seed"]
            self._set_pattern()
        self.seed = state["seed"]
        self.samples = state["epoch"] * self.n_samples + state["position"]
        self._set_order(state.get("shuffle", "global"), state.get("block_shards", self.block_shards))
