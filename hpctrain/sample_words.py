"""How much of a generated sample is real words: the fraction of its words found in the training text.

A character-level model that has learned spelling writes mostly words that exist; one that has not
writes "thake wis mathe". `real_word_fraction` counts words as runs of letters of at least
`MIN_LETTERS` (case-folded, so "Romeo" and "ROMEO" are one word) and checks each against the
vocabulary of the dataset's TRAINING split, decoded with the dataset's own tokenizer (held-out
documents do not count). Used by `hpctrain sample --real-words DATASET` and the demo.
"""
from __future__ import annotations

import os
import re

import numpy as np

MIN_LETTERS = 3
MAX_VOCAB_TOKENS = 50_000_000  # enough to collect the vocabulary of any corpus the demo uses
_WORD = re.compile(r"[^\W\d_]+")  # letters only (any script)


def words(text: str) -> list[str]:
    """The case-folded words of `text`: runs of letters, at least MIN_LETTERS long."""
    return [w.casefold() for w in _WORD.findall(text) if len(w) >= MIN_LETTERS]


def real_word_fraction(text: str, vocabulary: set[str]) -> tuple[float, int]:
    """(fraction of the words of `text` that are in `vocabulary`, how many words there were)."""
    ws = words(text)
    if not ws:
        return 0.0, 0
    return sum(w in vocabulary for w in ws) / len(ws), len(ws)


def training_vocabulary(dataset: str, max_tokens: int = MAX_VOCAB_TOKENS) -> set[str]:
    """The words of the first `max_tokens` tokens of `dataset`'s training split."""
    from data_tools.format import open_shard_layout, read_manifest, shards_of
    from data_tools.tokenizers import dataset_tokenizer

    manifest = read_manifest(dataset)
    tok = dataset_tokenizer(manifest["tokenizer"], dataset)
    eot = manifest["tokenizer"]["eot_id"]
    vocabulary: set[str] = set()
    left = max_tokens
    for entry in shards_of(manifest, "train"):
        if left <= 0:
            break
        lay = open_shard_layout(os.path.join(dataset, entry["file"]), entry, manifest)
        n = min(lay.n_tokens, left)
        ids = np.memmap(lay.path, dtype=lay.dtype, mode="r", offset=lay.offset, shape=(n,))
        left -= n
        ids = np.asarray(ids)
        for doc in np.split(ids, np.flatnonzero(ids == eot)):
            vocabulary.update(words(tok.decode(doc[doc != eot].tolist())))
    return vocabulary
