"""Training-time reader of an hpctrain dataset: fixed-length windows from memory-mapped shards.

Owns: the sample space — per shard, non-overlapping windows of block_size+1 tokens
(window j of a shard covers tokens [j*T, j*T+T+1), never crossing a shard boundary), numbered
globally in manifest order — and turning sample indices into tensors (from data.path, or from the
node-local copies a ``hpctrain.data.cache.NodeCache`` hands out).

Must never: write to the dataset, read whole files into memory (tokens are np.memmap views at
the HDF5 dataset's byte offset; h5py is used only to validate attributes/layout), decide the
sample ORDER (that is hpctrain.data.sampler), or talk to MPI.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np
import torch

from data_tools.format import SPLITS, DataError, open_shard_layout, read_manifest, shards_of


SCAN = 1 << 24


def check_token_range(tokens: np.ndarray, vocab_size: int, path: str) -> None:
    """Raise DataError naming ``path`` if any id in ``tokens`` is >= vocab_size (chunked scan)."""
    for a in range(0, tokens.size, SCAN):
        chunk = tokens[a:a + SCAN]
        if chunk.size and int(chunk.max()) >= vocab_size:
            j = a + int(np.argmax(chunk >= vocab_size))
            raise DataError(path, f"token id {int(tokens[j])} at position {j} >= vocab_size "
                                  f"{vocab_size}")


class TokenShards:
    """Windows of ``block_size + 1`` tokens over one split of a dataset.

    >>> ds = TokenShards("data/shakespeare", "train", block_size=256, expected_vocab_size=50257)
    >>> len(ds), ds.window(0).shape, ds.batch([0, 5]).shape   # (N, (257,), [2, 257])
    """

    def __init__(self, path: str, split: str, block_size: int,
                 expected_vocab_size: int | None = None, max_open: int = 128, cache=None,
                 range_checked: bool = False):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.path, self.split, self.block_size = path, split, int(block_size)
        self.manifest = read_manifest(path)
        tok = self.manifest["tokenizer"]
        self.vocab_size, self.eot_id, self.tokenizer = tok["vocab_size"], tok["eot_id"], tok["name"]
        mpath = os.path.join(path, "manifest.json")
        if expected_vocab_size is not None and expected_vocab_size != self.vocab_size:
            raise DataError(mpath, f"dataset vocab_size {self.vocab_size} ({self.tokenizer}) does "
                                   f"not match the model's vocab_size {expected_vocab_size}")
        if split not in SPLITS:
            raise DataError(mpath, f"unknown split {split!r} (splits are {', '.join(SPLITS)})")
        entries = shards_of(self.manifest, split)
        if not entries:
            raise DataError(mpath, f"no shards for split '{split}' (val_fraction was "
                                   f"{self.manifest['val_fraction']})")
        # With a node cache (hpctrain.data.cache) nothing is opened on data.path here: shards are
        # read from the node-local copy, which the cache verified when it staged it.
        self.cache, self.dtype = cache, np.dtype(self.manifest["dtype"])
        self.paths = [os.path.join(path, e["file"]) for e in entries]
        pos = {e["file"]: i for i, e in enumerate(self.manifest["shards"])}
        self.shard_ids = [pos[e["file"]] for e in entries]  # index into manifest["shards"]
        self.layouts = None if cache is not None else [
            open_shard_layout(p, e, self.manifest) for p, e in zip(self.paths, entries)]
        T = self.block_size
        self.shard_tokens = np.array([e["n_tokens"] for e in entries], dtype=np.int64)
        self.samples_per_shard = (self.shard_tokens - 1) // T
        self.cum = np.concatenate([[0], np.cumsum(self.samples_per_shard)])
        self.n_samples = int(self.cum[-1])
        if self.n_samples == 0:
            raise DataError(mpath, f"split '{split}' has no window of block_size+1={T + 1} tokens "
                                   f"(largest shard has {int(self.shard_tokens.max())})")
        self.n_tokens = int(self.shard_tokens.sum())
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()
        # Shards whose token ids are known to be < vocab_size (verify's scan or the cache's).
        self._checked = set(range(len(entries))) if range_checked or cache is not None else set()
        self.max_open = max(1, int(max_open))

    def __len__(self) -> int:
        return self.n_samples

    def _map(self, s: int) -> np.memmap:
        """Memory map of shard ``s``'s tokens (LRU-bounded, so file descriptors stay bounded)."""
        m = self._maps.get(s)
        if m is None:
            if self.cache is not None:
                where, offset = self.cache.acquire(self.shard_ids[s])
            else:
                where, offset = self.layouts[s].path, self.layouts[s].offset
            try:
                m = np.memmap(where, dtype=self.dtype, mode="r", offset=offset,
                              shape=(int(self.shard_tokens[s]),))
            except (OSError, ValueError) as e:
                raise DataError(where, f"cannot memory-map tokens ({e})") from None
            self._maps[s] = m
            while len(self._maps) > self.max_open:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(s)
        return m

    def locate(self, idx: int) -> tuple[int, int]:
        """(shard number within the split, first token of the window in that shard)."""
        if not 0 <= idx < self.n_samples:
            raise IndexError(f"sample {idx} out of range [0, {self.n_samples})")
        s = int(np.searchsorted(self.cum, idx, side="right")) - 1
        return s, int(idx - self.cum[s]) * self.block_size

    def shard_ids_of(self, indices) -> np.ndarray:
        """Manifest shard index (into manifest["shards"]) of each sample index."""
        s = np.searchsorted(self.cum, np.asarray(indices, dtype=np.int64), side="right") - 1
        return np.asarray(self.shard_ids, dtype=np.int64)[s]

    def window(self, idx: int) -> np.ndarray:
        """Tokens of sample ``idx``: a read-only (block_size+1,) view into the shard's memmap."""
        s, start = self.locate(int(idx))
        w = self._map(s)[start:start + self.block_size + 1]
        if self.cache is not None:
            w = np.array(w)
            self._maps.clear()
        return w

    def batch(self, indices) -> torch.Tensor:
        """LongTensor [B, block_size+1] of the given samples (inputs = [:, :-1], targets = [:, 1:]).

        Raises DataError naming the shard if a token id >= vocab_size (checked here per window
        unless the whole shard was range-checked: by verify's scan or the node cache's)."""
        indices = np.asarray(indices, dtype=np.int64).ravel()
        if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= self.n_samples):
            bad = indices[(indices < 0) | (indices >= self.n_samples)][0]
            raise IndexError(f"sample {bad} out of range [0, {self.n_samples})")
        W = self.block_size + 1
        shard = np.searchsorted(self.cum, indices, side="right") - 1
        starts = ((indices - self.cum[shard]) * self.block_size).tolist()
        out = np.empty((indices.size, W), dtype=np.int64)
        maps = {}
        for row, (s, a) in enumerate(zip(shard.tolist(), starts)):
            m = maps.get(s)
            if m is None:  # a plain ndarray view: slicing it skips np.memmap's Python hooks
                m = maps[s] = self._map(s).view(np.ndarray)
            out[row] = m[a:a + W]
            if s not in self._checked and int(out[row].max()) >= self.vocab_size:
                j = int(np.argmax(out[row] >= self.vocab_size))
                raise DataError(self.paths[s], f"token id {int(out[row, j])} at position "
                                               f"{a + j} >= vocab_size {self.vocab_size}")
        if self.cache is not None:  # cached copies may be evicted after this step: don't hold maps
            self._maps.clear()
        return torch.from_numpy(out)

    def eval_indices(self, total: int) -> np.ndarray:
        """A fixed evaluation set: ``total`` sample indices spread evenly over the split."""
        return np.linspace(0, self.n_samples - 1, int(total)).astype(np.int64)

    def close(self) -> None:
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"TokenShards({self.path!r}, split={self.split!r}, block_size={self.block_size}, "
                f"shards={len(self.paths)}, samples={self.n_samples}, tokens={self.n_tokens})")
