"""``stats``: documents, tokens and the document-length histogram of a finished dataset.

Owns: recovering every document's length in tokens (end-of-text included) from the shards'
``doc_offsets`` (documents may span shards) and summarising them per split.

Must never: modify the dataset or read token payloads (only the small doc_offsets datasets).
"""
from __future__ import annotations

import os

import numpy as np

from .format import DOC_OFFSETS_DSET, SPLITS, DataError, check_shard_size, read_manifest, shards_of


def doc_lengths(path: str, split: str) -> np.ndarray:
    """Length in tokens (incl. end-of-text) of each document of ``split``, in order."""
    import h5py

    m = read_manifest(path)
    starts, base = [], 0
    for e in shards_of(m, split):
        shard = os.path.join(path, e["file"])
        check_shard_size(shard, e)  # missing or truncated: named, before h5py's error stack
        try:
            with h5py.File(shard, "r") as f:
                starts.append(f[DOC_OFFSETS_DSET][()] + base)
        except (OSError, KeyError) as err:
            raise DataError(shard, f"not a readable shard ({str(err).splitlines()[0]}); "
                                   f"`python -m data_tools verify {path}` checks every file") from None
        base += e["n_tokens"]
    if not starts:
        return np.zeros(0, np.int64)
    starts = np.concatenate(starts)
    return np.diff(np.append(starts, base))


def dataset_stats(path: str) -> dict:
    """{split: {documents, tokens, mean, median, max, histogram: [[lo, hi, count], ...]}} with
    power-of-two length buckets [2^k, 2^(k+1))."""
    out = {}
    for split in SPLITS:
        lens = doc_lengths(path, split)
        if lens.size == 0:
            out[split] = {"documents": 0, "tokens": 0, "histogram": []}
            continue
        k = np.floor(np.log2(np.maximum(lens, 1))).astype(np.int64)
        hist = [[int(2 ** b), int(2 ** (b + 1)), int((k == b).sum())]
                for b in range(int(k.min()), int(k.max()) + 1)]
        out[split] = {"documents": int(lens.size), "tokens": int(lens.sum()),
                      "mean": float(lens.mean()), "median": float(np.median(lens)),
                      "max": int(lens.max()), "histogram": hist}
    return out


def describe_stats(path: str, stats: dict) -> str:
    lines = [f"dataset {path} (document lengths in tokens, end-of-text included)"]
    for split, st in stats.items():
        if not st["documents"]:
            lines.append(f"  {split}: no documents")
            continue
        lines.append(f"  {split}: {st['documents']:,} documents, {st['tokens']:,} tokens; length "
                     f"mean {st['mean']:,.1f}, median {st['median']:,.0f}, max {st['max']:,}")
        top = max(c for _, _, c in st["histogram"])
        for lo, hi, c in st["histogram"]:
            bar = "#" * (0 if not c else max(1, round(40 * c / top)))
            lines.append(f"    [{lo:>9,}, {hi:>9,})  {c:8,}  {bar}")
    return "\n".join(lines)
