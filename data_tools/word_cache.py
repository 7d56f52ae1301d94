"""A per-word cache in front of the tokenizers library, for tokenizer.json files that tiktoken cannot
run (SentencePiece Unigram, WordPiece, BPE shapes fast_bpe/fast_spm refuse).

Owns: cutting a text into words (a run of white space stays with the text after it: `WORD`) and encoding
each distinct word once with the library, so a corpus costs one library call per new word plus a
dict lookup per word. Used only where encoding word by word gives exactly the ids of the whole text
(`word_cache`: checked on the probe text at load; hf_tokenizer.HFTokenizer then also compares it
with the library on the first characters of the corpus, as it does for the tiktoken engines).
"""
from __future__ import annotations

import itertools
import re

import numpy as np

WORD = re.compile(r"\S+|\s+\S*")
MAX_WORDS = 1_000_000  # cached words (a few hundred MB at most); the cache restarts when full


class WordCache:
    """`encode_words(list of words) -> list of id lists`, called once per distinct word; `pattern`
    cuts a text into the words the engine encodes independently."""

    def __init__(self, encode_words, pattern: re.Pattern = WORD):
        self.encode_words, self.pattern, self.ids = encode_words, pattern, {}

    def encode(self, text: str) -> np.ndarray:
        words = self.pattern.findall(text)
        ids = self.ids
        new = [w for w in dict.fromkeys(words) if w not in ids]
        if new:
            if len(ids) + len(new) > MAX_WORDS:
                ids.clear()
                new = list(dict.fromkeys(words))
            ids.update(zip(new, self.encode_words(new)))
        flat = itertools.chain.from_iterable(map(ids.__getitem__, words))
        return np.fromiter(flat, dtype=np.uint32)


def library_words(tok):
    """encode_words for the tokenizers library (its batch call, without offsets where it can)."""
    batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return lambda words: [e.ids for e in batch(words, add_special_tokens=False)]


def word_cache(spec: dict, tok, probe: str) -> WordCache | None:
    """A WordCache for the library tokenizer `tok` (the file's parsed JSON: `spec`), or None where
    word-by-word encoding is not exact on `probe` or the model is random (BPE dropout)."""
    if (spec.get("model") or {}).get("dropout"):
        return None
    whole = tok.encode(probe, add_special_tokens=False).ids
    by_word = [i for w in WORD.findall(probe) for i in tok.encode(w, add_special_tokens=False).ids]
    return WordCache(library_words(tok)) if whole == by_word else None
