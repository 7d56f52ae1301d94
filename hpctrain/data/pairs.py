"""The pairs of a preference dataset (``data_tools shard --format preference``) for DPO.

Owns: finding each pair (one document of the split's token stream: chosen ids, end-of-text,
rejected ids, end-of-text; data_tools/preference.py) and turning pair numbers into a batch: the
chosen and the rejected sequence of every pair, cut or padded to ``block_size + 1`` tokens, with
the mask of their completion tokens as targets.  A pair is one sample index: it is never split
over ranks or micro-batches.

Must never: decide the order (hpctrain/data/sampler.py does), define the format
(data_tools/format.py does) or copy a shard into memory (tokens and masks are memory-mapped).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from data_tools.format import FORMAT_PREFERENCE, DataError, open_shard_layout, shards_of


@dataclass
class PairBatch:
    """``tokens`` [2B, T+1] (the B chosen rows, then the B rejected rows, padded with end-of-text),
    ``mask`` [2B, T] float: 1 where the target ``tokens[:, 1:]`` is a completion token,
    ``pairs`` [B] the pair numbers (the reference log-probs' rows)."""
    tokens: torch.Tensor
    mask: torch.Tensor
    pairs: np.ndarray

    def to(self, device: torch.device) -> "PairBatch":
        return PairBatch(self.tokens.to(device), self.mask.to(device), self.pairs)


class PreferencePairs:
    """The pairs of one split: ``len()`` pairs, ``batch(pair numbers)``."""

    def __init__(self, path: str, manifest: dict, split: str, block_size: int):
        if manifest.get("format") != FORMAT_PREFERENCE:
            raise DataError(os.path.join(path, "manifest.json"),
                            f"format {manifest.get('format', 'text')!r}, not a preference dataset: "
                            f"train.objective = \"dpo\" reads `data_tools shard --format "
                            f"preference` output (README: DPO)")
        self.block_size, self.eot = block_size, manifest["tokenizer"]["eot_id"]
        entries = shards_of(manifest, split)
        layouts = [open_shard_layout(os.path.join(path, e["file"]), e, manifest) for e in entries]
        self.tokens = [np.memmap(x.path, x.dtype, "r", x.offset, (x.n_tokens,)) for x in layouts]
        self.masks = [np.memmap(x.path, np.uint8, "r", x.mask_offset, (x.n_tokens,))
                      for x in layouts]
        base = np.cumsum([0] + [x.n_tokens for x in layouts])
        self.base = base
        starts = [b + x.doc_offsets for b, x in zip(base[:-1], layouts)]
        self.starts = np.concatenate(starts + [base[-1:]]).astype(np.int64)

    def __len__(self) -> int:
        return self.starts.size - 1

    def _read(self, arrays, a: int, b: int) -> np.ndarray:
        """Stream positions [a, b) of the split (across shard boundaries)."""
        parts, s = [], int(np.searchsorted(self.base, a, side="right") - 1)
        while a < b:
            end = min(b, int(self.base[s + 1]))
            parts.append(np.asarray(arrays[s][a - self.base[s]:end - self.base[s]]))
            a, s = end, s + 1
        return np.concatenate(parts)

    def sides(self, pair: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(chosen ids, mask), (rejected ids, mask)] of pair number ``pair``, without the
        end-of-text that closes each."""
        a, b = int(self.starts[pair]), int(self.starts[pair + 1])
        ids, mask = self._read(self.tokens, a, b).astype(np.int64), self._read(self.masks, a, b)
        cut = int(np.flatnonzero(ids == self.eot)[0])
        return [(ids[:cut], mask[:cut]), (ids[cut + 1:-1], mask[cut + 1:-1])]

    def batch(self, pairs) -> PairBatch:
        """The PairBatch of ``pairs``: each side keeps its first block_size + 1 tokens (longer
        ones are cut at the end, as TRL's default truncation), shorter ones are padded."""
        pairs = np.asarray(pairs, dtype=np.int64)
        n, width = pairs.size, self.block_size + 1
        tokens = np.full((2 * n, width), self.eot, dtype=np.int64)
        mask = np.zeros((2 * n, width), dtype=np.float32)
        for row, p in enumerate(pairs.tolist()):
            for side, (ids, m) in enumerate(self.sides(p)):
                k = min(ids.size, width)
                tokens[side * n + row, :k], mask[side * n + row, :k] = ids[:k], m[:k]
        return PairBatch(torch.from_numpy(tokens), torch.from_numpy(mask[:, 1:].copy()), pairs)
