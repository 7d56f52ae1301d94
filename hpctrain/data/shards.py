"""Training-time reader of an hpctrain dataset: fixed-length windows read from the shards.

Owns: the sample space — per shard, non-overlapping windows of block_size+1 tokens
(window j of a shard covers tokens [j*T, j*T+T+1), never crossing a shard boundary), numbered
globally in manifest order — and turning sample indices into tensors (from data.path, or from the
node-local copies a ``hpctrain.data.cache.NodeCache`` hands out).

Must never: write to the dataset, read whole files into memory (each window is one os.preadv at
the HDF5 dataset's byte offset; h5py is used only to validate attributes/layout), memory-map a
shard (a file that shrinks under a memory map kills the process with SIGBUS, naming nothing: a
short read here is a DataError naming the shard), decide the sample ORDER (that is
hpctrain.data.sampler), or talk to MPI.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np
import torch

from data_tools.format import (DOC_OFFSETS_DSET, SPLITS, DataError, loss_mask_offset,
                               open_shard_layout, read_manifest, shards_of)

from .documents import window_doc_ids


SCAN = 1 << 24


def check_token_range(tokens: np.ndarray, vocab_size: int, path: str, first: int = 0) -> None:
    """Raise DataError naming ``path`` if any id in ``tokens`` (positions ``first``, ``first``+1,
    ... of the shard) is >= vocab_size (chunked scan)."""
    for a in range(0, tokens.size, SCAN):
        chunk = tokens[a:a + SCAN]
        if chunk.size and int(chunk.max()) >= vocab_size:
            j = a + int(np.argmax(chunk >= vocab_size))
            raise DataError(path, f"token id {int(tokens[j])} at position {first + j} >= "
                                  f"vocab_size {vocab_size}")


def pread_exact(fd: int, out: np.ndarray, at: int, path: str) -> None:
    """Fill the contiguous array ``out`` from byte ``at`` of ``fd``; a file that ends early (cut
    after it was verified) is a DataError naming ``path``, never a SIGBUS."""
    view, done = memoryview(out).cast("B"), 0
    while done < view.nbytes:
        try:
            got = os.preadv(fd, [view[done:]], at + done)
        except OSError as e:
            raise DataError(path, f"read failed at byte {at + done} ({e.strerror or e})") from None
        if got == 0:
            size = os.fstat(fd).st_size
            raise DataError(path, f"ends at byte {size}, but a window needs bytes up to "
                                  f"{at + view.nbytes}: the file shrank after it was verified; "
                                  f"restore it and resume (a node-cache copy is checked again "
                                  f"and fetched anew at the next start)")
        done += got


def check_file_token_range(path: str, offset: int, n_tokens: int, dtype, vocab_size: int,
                           name: str) -> None:
    """check_token_range over ``n_tokens`` tokens at byte ``offset`` of ``path``, read in chunks
    (errors name ``name``)."""
    dtype = np.dtype(dtype)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for a in range(0, n_tokens, SCAN):
            chunk = np.empty(min(SCAN, n_tokens - a), dtype=dtype)
            pread_exact(fd, chunk, offset + a * dtype.itemsize, name)
            check_token_range(chunk, vocab_size, name, first=a)
    finally:
        os.close(fd)


class TokenShards:
    """Windows of ``block_size + 1`` tokens over one split of a dataset.

    >>> ds = TokenShards("data/shakespeare", "train", block_size=256, expected_vocab_size=50257)
    >>> len(ds), ds.window(0).shape, ds.batch([0, 5]).shape   # (N, (257,), [2, 257])
    """

    def __init__(self, path: str, split: str, block_size: int,
                 expected_vocab_size: int | None = None, max_open: int = 128, cache=None,
                 range_checked: bool = False, loaded: dict | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.path, self.split, self.block_size = path, split, int(block_size)
        self.manifest = read_manifest(path, loaded)  # loaded: manifest.json already read
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
        self._files: OrderedDict[int, tuple[int, int, str]] = OrderedDict()  # fd, offset, path
        # Shards whose token ids are known to be < vocab_size (verify's scan or the cache's).
        self._checked = set(range(len(entries))) if range_checked or cache is not None else set()
        self.max_open = max(1, int(max_open))
        self._offsets_read: dict[int, np.ndarray] = {}  # shard -> doc_offsets, read from a cache copy
        self._mask_offsets: dict[int, int] = {}  # shard -> loss_mask byte offset in a cache copy

    def __len__(self) -> int:
        return self.n_samples

    def _open(self, s: int) -> tuple[int, int, str]:
        """(fd, tokens' byte offset, path) of shard ``s`` (LRU-bounded open files)."""
        got = self._files.get(s)
        if got is None:
            if self.cache is not None:
                where, offset = self.cache.acquire(self.shard_ids[s])
            else:
                where, offset = self.layouts[s].path, self.layouts[s].offset
            try:
                fd = os.open(where, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise DataError(where, f"cannot open ({e.strerror or e})") from None
            got = self._files[s] = (fd, int(offset), where)
            while len(self._files) > self.max_open:
                os.close(self._files.popitem(last=False)[1][0])
        else:
            self._files.move_to_end(s)
        return got

    def _read(self, s: int, start: int, out: np.ndarray) -> None:
        """Tokens ``start``, ``start``+1, ... of shard ``s`` into the contiguous array ``out``."""
        fd, offset, where = self._open(s)
        pread_exact(fd, out, offset + start * self.dtype.itemsize, where)

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
        """Tokens of sample ``idx``: a (block_size+1,) array of the shard's dtype."""
        s, start = self.locate(int(idx))
        w = np.empty(self.block_size + 1, dtype=self.dtype)
        self._read(s, start, w)
        if self.cache is not None:
            self.close()
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
        raw = np.empty((indices.size, W), dtype=self.dtype)
        shards = shard.tolist()
        at = (indices - self.cum[shard]) * (self.block_size * self.dtype.itemsize)
        try:
            self._read_rows(raw, shards, at.tolist())
        finally:
            if self.cache is not None:  # cached copies may be evicted after this step
                self.close()
        if raw.size and not self._checked.issuperset(shards) and int(raw.max()) >= self.vocab_size:
            self._range_error(raw, shard, indices)
        return torch.from_numpy(raw.astype(np.int64))

    def document_ids(self, indices) -> np.ndarray:
        """int64 [B, block_size+1]: each token's document number in its window (0 = the document
        the window starts in), from the shard's doc_offsets (two searchsorted per window)."""
        indices = np.asarray(indices, dtype=np.int64).ravel()
        shard = np.searchsorted(self.cum, indices, side="right") - 1
        starts = (indices - self.cum[shard]) * self.block_size
        out = np.empty((indices.size, self.block_size + 1), dtype=np.int64)
        for row, s, a in zip(range(indices.size), shard.tolist(), starts.tolist()):
            window_doc_ids(self._doc_offsets(s), a, self.block_size + 1, out[row])
        return out

    @property
    def has_loss_mask(self) -> bool:
        """True for a chat dataset (`shard --format chat`): loss_mask() reads its mask."""
        return self.manifest.get("format") == "chat"

    def loss_mask(self, indices) -> torch.Tensor:
        """uint8 tensor [B, block_size+1] aligned with ``batch(indices)``: 1 where the token is
        part of an assistant turn (what SFT trains on: a target ``batch[:, 1:]`` counts where
        ``loss_mask[:, 1:]`` is 1).  Only for a chat dataset (see has_loss_mask)."""
        if not self.has_loss_mask:
            raise DataError(os.path.join(self.path, "manifest.json"),
                            "no loss mask: not a chat dataset (shard it with --format chat)")
        indices = np.asarray(indices, dtype=np.int64).ravel()
        shard = np.searchsorted(self.cum, indices, side="right") - 1
        starts = (indices - self.cum[shard]) * self.block_size
        out = np.empty((indices.size, self.block_size + 1), dtype=np.uint8)
        try:
            for row, s, a in zip(range(indices.size), shard.tolist(), starts.tolist()):
                fd, _, where = self._open(s)
                pread_exact(fd, out[row], self._mask_offset(s, where) + a, where)
        finally:
            if self.cache is not None:
                self.close()
        return torch.from_numpy(out)

    def _mask_offset(self, s: int, where: str) -> int:
        """Byte offset of shard ``s``'s loss_mask: from its layout, or once from the cached copy."""
        if self.layouts is not None:
            return self.layouts[s].mask_offset
        got = self._mask_offsets.get(s)
        if got is None:
            import h5py

            with h5py.File(where, "r") as f:
                got = self._mask_offsets[s] = loss_mask_offset(f, where, int(self.shard_tokens[s]))
        return got

    def _doc_offsets(self, s: int) -> np.ndarray:
        """Shard ``s``'s doc_offsets: from its layout, or once from the node cache's checked copy."""
        if self.layouts is not None:
            return self.layouts[s].doc_offsets
        got = self._offsets_read.get(s)
        if got is None:
            import h5py

            with h5py.File(self.cache.acquire(self.shard_ids[s])[0], "r") as f:
                got = self._offsets_read[s] = f[DOC_OFFSETS_DSET][()]
        return got

    def _range_error(self, raw: np.ndarray, shard: np.ndarray, indices: np.ndarray) -> None:
        """The DataError of the first row of an unchecked shard with an id >= vocab_size."""
        for row, s in enumerate(shard.tolist()):
            if s not in self._checked:
                a = int(indices[row] - self.cum[s]) * self.block_size
                check_token_range(raw[row], self.vocab_size, self.paths[s], first=a)

    def _read_rows(self, raw: np.ndarray, shards: list, at: list) -> None:
        """Row r of ``raw`` <- shard ``shards[r]`` from byte ``at[r]`` of its tokens: one preadv
        per row (the hot loop: nothing else per row, a short read takes the slow path)."""
        files, preadv, want = {}, os.preadv, raw.shape[1] * self.dtype.itemsize
        for row, s, a in zip(range(len(shards)), shards, at):
            f = files.get(s)
            if f is None:
                f = files[s] = self._open(s)
            if preadv(f[0], [raw[row]], f[1] + a) != want:
                pread_exact(f[0], raw[row], f[1] + a, f[2])

    def eval_indices(self, total: int) -> np.ndarray:
        """A fixed evaluation set: ``total`` sample indices spread evenly over the split."""
        return np.linspace(0, self.n_samples - 1, int(total)).astype(np.int64)

    def close(self) -> None:
        while self._files:
            os.close(self._files.popitem()[1][0])

    def __del__(self):
        try:
            self.close()
        except (AttributeError, OSError):  # half-built, or at interpreter exit
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"TokenShards({self.path!r}, split={self.split!r}, block_size={self.block_size}, "
                f"shards={len(self.paths)}, samples={self.n_samples}, tokens={self.n_tokens})")
