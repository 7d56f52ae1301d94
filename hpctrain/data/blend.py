"""Training-time reader of a blend (``data_tools blend``): its components' windows as one space.

Owns: ``BlendShards`` (one ``TokenShards`` per component; sample index = the component's sample
index plus the samples of the components before it; shard ids = the flattened shard list of
``data_tools.blend.data_manifest``, which the node cache stages under collision-free names),
and ``open_split`` / ``make_sampler``, which pick the plain or the blended reader and sampler for
``data.path``.

Must never: decide the sample order (hpctrain.data.mixture does), copy or write data, or map a
blend sample to anything but the component window it names (windows read through a blend are
the component's windows, bit for bit).
"""
from __future__ import annotations

import numpy as np
import torch

from data_tools.blend import is_blend, resolve_blend, shard_bases
from data_tools.format import KIND_BLEND, KIND_SHARDS, SPLITS, DataError, manifest_path, shards_of

from .mixture import MixtureSampler
from .sampler import GlobalSampler
from .shards import TokenShards


class _ComponentCache:
    """A node cache seen by one component's TokenShards: its shard i is flattened shard base+i."""

    def __init__(self, cache, base: int):
        self.cache, self.base = cache, base

    def acquire(self, i: int):
        return self.cache.acquire(self.base + int(i))


class BlendShards:
    """Windows of ``block_size + 1`` tokens over one split of every component of a blend.

    ``optional=True`` (validation) leaves out components with no window in ``split`` (listed
    in ``notes``) instead of failing; the remaining weights keep their ratios."""

    has_loss_mask = False  # `blend` refuses a chat dataset: no component has a loss mask

    def __init__(self, path: str, split: str, block_size: int,
                 expected_vocab_size: int | None = None, max_open: int = 128, cache=None,
                 range_checked: bool = False, optional: bool = False, loaded: dict | None = None):
        self.path, self.split, self.block_size = path, split, int(block_size)
        if split not in SPLITS:
            raise DataError(manifest_path(path), f"unknown split {split!r} (splits are "
                                                 f"{', '.join(SPLITS)})")
        self.manifest, comps = resolve_blend(path, loaded)  # loaded: manifest.json already read
        self.seed = int(self.manifest["seed"])
        tok = self.manifest["tokenizer"]
        self.vocab_size, self.eot_id, self.tokenizer = tok["vocab_size"], tok["eot_id"], tok["name"]
        bases = shard_bases(comps)
        self.components, self.parts, self.bases, self.notes = [], [], [], []
        T = self.block_size
        for c, base in zip(comps, bases):
            windows = sum((e["n_tokens"] - 1) // T for e in shards_of(c.manifest, split))
            if windows == 0 and optional:
                self.notes.append(f"{c.path}: split '{split}' has no window of {T + 1} tokens; "
                                  f"left out of the blend's {split} mixture")
                continue
            ccache = None if cache is None else _ComponentCache(cache, base)
            self.components.append(TokenShards(
                c.path, split, T, expected_vocab_size=expected_vocab_size,
                max_open=max(1, max_open // len(comps)), cache=ccache, range_checked=range_checked))
            self.parts.append(c.parts)
            self.bases.append(base)
        if not self.components:
            raise DataError(manifest_path(path), f"no component has a window of {T + 1} tokens "
                                                 f"in split '{split}'")
        self.sizes = np.array([len(c) for c in self.components], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.n_samples = int(self.offsets[-1])
        self.n_tokens = sum(c.n_tokens for c in self.components)

    def __len__(self) -> int:
        return self.n_samples

    def _split(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(component position, index within the component) of global sample indices."""
        idx = np.asarray(indices, dtype=np.int64).ravel()
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.n_samples):
            bad = idx[(idx < 0) | (idx >= self.n_samples)][0]
            raise IndexError(f"sample {bad} out of range [0, {self.n_samples})")
        comp = np.searchsorted(self.offsets, idx, side="right") - 1
        return comp, idx - self.offsets[comp]

    def locate(self, idx: int) -> tuple[int, int]:
        """(component position, sample index within that component)."""
        comp, local = self._split([idx])
        return int(comp[0]), int(local[0])

    def window(self, idx: int) -> np.ndarray:
        c, j = self.locate(idx)
        return self.components[c].window(j)

    def batch(self, indices) -> torch.Tensor:
        """LongTensor [B, block_size+1], row r = the component window that indices[r] names."""
        comp, local = self._split(indices)
        out = torch.empty((comp.size, self.block_size + 1), dtype=torch.int64)
        for c in np.unique(comp).tolist():
            rows = np.flatnonzero(comp == c)
            out[torch.from_numpy(rows)] = self.components[c].batch(local[rows])
        return out

    def document_ids(self, indices) -> np.ndarray:
        """int64 [B, block_size+1]: each token's document number in the window indices[r] names."""
        comp, local = self._split(indices)
        out = np.empty((comp.size, self.block_size + 1), dtype=np.int64)
        for c in np.unique(comp).tolist():
            rows = np.flatnonzero(comp == c)
            out[rows] = self.components[c].document_ids(local[rows])
        return out

    def shard_ids_of(self, indices) -> np.ndarray:
        """Flattened shard index (data_tools.blend.data_manifest order) of each sample index."""
        comp, local = self._split(indices)
        out = np.empty(comp.size, dtype=np.int64)
        for c in np.unique(comp).tolist():
            m = comp == c
            out[m] = self.bases[c] + self.components[c].shard_ids_of(local[m])
        return out

    def sampler(self, global_batch: int, seed: int, shuffle: str = "global",
                block_shards: int = 64) -> MixtureSampler:
        """The blend's sample order; ``shuffle``/``block_shards`` apply to each component's
        epochs over its own shards (``data.shuffle``, ``data.shuffle_block_shards``)."""
        return MixtureSampler(self.sizes, self.parts, global_batch, seed, self.seed,
                              [c.samples_per_shard for c in self.components], shuffle,
                              block_shards)

    def eval_indices(self, total: int) -> np.ndarray:
        """The fixed evaluation set: ``total`` samples mixed by the blend's weights."""
        return self.sampler(1, 0).eval_indices(total)

    def close(self) -> None:
        for c in self.components:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"BlendShards({self.path!r}, split={self.split!r}, block_size={self.block_size}, "
                f"components={[c.path for c in self.components]}, parts={self.parts}, "
                f"samples={self.n_samples})")


def open_split(path: str, split: str, block_size: int, optional: bool = False,
               loaded: dict | None = None, **kw):
    """The reader of ``split`` of ``path``: a TokenShards, or a BlendShards for a blend.
    ``loaded``: path's manifest.json as already read (hpctrain.data.dataset.Dataset), else read."""
    blend = is_blend(path) if loaded is None else loaded.get("kind", KIND_SHARDS) == KIND_BLEND
    if blend:
        return BlendShards(path, split, block_size, optional=optional, loaded=loaded, **kw)
    return TokenShards(path, split, block_size, loaded=loaded, **kw)


def make_sampler(reader, global_batch: int, seed: int, shuffle: str = "global",
                 block_shards: int = 64):
    """GlobalSampler for a sharded dataset, MixtureSampler for a blend (same interface; each
    component's epochs are ordered over its own shards), both ordered by ``data.shuffle`` and
    ``data.shuffle_block_shards``."""
    if isinstance(reader, BlendShards):
        return reader.sampler(global_batch, seed, shuffle, block_shards)
    return GlobalSampler(len(reader), global_batch, seed, reader.samples_per_shard, shuffle,
                         block_shards)
