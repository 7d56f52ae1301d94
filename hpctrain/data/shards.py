"""Training-time reader of an hpctrain dataset: fixed-length windows from memory-mapped shards.

Owns: the sample space — per shard, non-overlapping windows of block_size+1 tokens
(window j of a shard covers tokens [j*T, j*T+T+1), never crossing a shard boundary), numbered
globally in manifest order — and turning sample indices into tensors.

Must never: write to the dataset, read whole files into memory (tokens are np.memmap views at
the HDF5 dataset's byte offset; h5py is used only to validate attributes/layout), decide the
sample ORDER (that is hpctrain.data.sampler), or talk to MPI.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np
import torch

from data_tools.format import DataError, open_shard_layout, read_manifest, shards_of


class TokenShards:
    """Windows of ``block_size + 1`` tokens over one split of a dataset.

    >>> ds = TokenShards("data/shakespeare", "train", block_size=256, expected_vocab_size=50257)
    >>> len(ds), ds.window(0).shape, ds.batch([0, 5]).shape   # (N, (257,), [2, 257])
    """

    def __init__(self, path: str, split: str, block_size: int,
                 expected_vocab_size: int | None = None, max_open: int = 128):
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
        entries = shards_of(self.manifest, split)
        if not entries:
            raise DataError(mpath, f"no shards for split '{split}' (val_fraction was "
                                   f"{self.manifest['val_fraction']})")
        self.layouts = [open_shard_layout(os.path.join(path, e["file"]), e, self.manifest)
                        for e in entries]
        T = self.block_size
        self.samples_per_shard = np.array([(lay.n_tokens - 1) // T for lay in self.layouts],
                                          dtype=np.int64)
        self.cum = np.concatenate([[0], np.cumsum(self.samples_per_shard)])
        self.n_samples = int(self.cum[-1])
        if self.n_samples == 0:
            raise DataError(mpath, f"split '{split}' has no window of block_size+1={T + 1} tokens "
                                   f"(largest shard has {max(lay.n_tokens for lay in self.layouts)})")
        self.n_tokens = sum(lay.n_tokens for lay in self.layouts)
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()
        self.max_open = max(1, int(max_open))

    def __len__(self) -> int:
        return self.n_samples

    def _map(self, s: int) -> np.memmap:
        """Memory map of shard ``s``'s tokens (LRU-bounded, so file descriptors stay bounded)."""
        m = self._maps.get(s)
        if m is None:
            lay = self.layouts[s]
            try:
                m = np.memmap(lay.path, dtype=lay.dtype, mode="r", offset=lay.offset,
                              shape=(lay.n_tokens,))
            except (OSError, ValueError) as e:
                raise DataError(lay.path, f"cannot memory-map tokens ({e})") from None
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

    def window(self, idx: int) -> np.ndarray:
        """Tokens of sample ``idx``: a read-only (block_size+1,) view into the shard's memmap."""
        s, start = self.locate(int(idx))
        return self._map(s)[start:start + self.block_size + 1]

    def batch(self, indices) -> torch.Tensor:
        """LongTensor [B, block_size+1] of the given samples (inputs = [:, :-1], targets = [:, 1:]).

        Raises DataError naming the shard if any token id >= vocab_size."""
        indices = np.asarray(indices, dtype=np.int64).ravel()
        out = np.empty((indices.size, self.block_size + 1), dtype=np.int64)
        for row, idx in enumerate(indices.tolist()):
            s, start = self.locate(idx)
            w = self._map(s)[start:start + self.block_size + 1]
            out[row] = w
            if int(w.max()) >= self.vocab_size:
                j = int(np.argmax(w >= self.vocab_size))
                raise DataError(self.layouts[s].path, f"token id {int(w[j])} at position "
                                                      f"{start + j} >= vocab_size {self.vocab_size}")
        return torch.from_numpy(out)

    def close(self) -> None:
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"TokenShards({self.path!r}, split={self.split!r}, block_size={self.block_size}, "
                f"shards={len(self.layouts)}, samples={self.n_samples}, tokens={self.n_tokens})")
