"""A per-word cache: a text's ids are its words' ids joined, each distinct word encoded once.

Owns: `WordCache` (words found by one C-level regex pass over the whole text; each word's ids
kept as one uint32 bytes blob, so a cached text costs a dict lookup per word, one ``b"".join``
and one ``np.frombuffer``), and deciding from a tokenizer.json alone where encoding word by word
gives exactly the whole text's ids (`word_cuts`), for the tokenizers library's engine
(`word_cache`: SentencePiece Unigram, WordPiece, WordLevel, BPE behind a whitespace-splitting
pre-tokenizer). fast_spm.py puts the same cache in front of tiktoken.

Exactness: a text is cut only just before a run of white space that follows a printable ASCII
character (`cut_pattern`). The pre-tokenizer splits there (Metaspace with ``split: true``, after
the normalizer has made the run spaces; WhitespaceSplit; Whitespace), the normalizer changes
neither side across the cut (only NFC/NFD/NFKC/NFKD, Nmt, Lowercase, and Replace of spaces by
a space / '▁' are accepted: none joins an ASCII character to the space after it), and no added
token can match across it (special tokens only, encoded as text). Anything else -> None and the
caller encodes whole texts. hf_tokenizer.HFTokenizer still compares the cache with the library
on a probe at load and on the corpus's first characters.
"""
from __future__ import annotations

import re
from array import array

import numpy as np

SPACE = "▁"
MAX_WORDS = 1_000_000  # cached words (~150 MB at most); the cache restarts when full
LEFT = "!-~"  # printable ASCII: no normalizer accepted here joins one to the space after it
ACCEPTED_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Nmt", "Lowercase", "Replace"}
SPACE_PATTERNS = ({"String": " "}, {"Regex": " {2,}"}, {"Regex": " +"})
SEP = "\ue000"  # private use: no accepted normalizer changes it or joins it to a neighbour


def cut_pattern(white: str) -> re.Pattern:
    """Words: cut just before each run of ``white`` characters that follows a LEFT character."""
    w = re.escape(white)
    return re.compile(f"(?:[{w}]+[^{w}]*|[^{w}]+)(?:(?<![{LEFT}])[{w}]+[^{w}]*)*")


class WordCache:
    """`encode(text)`: the ids of the words `pattern` finds, joined; `encode_new(list of new
    words) -> list of uint32 bytes blobs` runs once per distinct word."""

    parallel = False  # pure Python between lookups: the sharder's threads would only wait

    def __init__(self, pattern: re.Pattern, encode_new):
        self.findall, self.encode_new, self.blobs = pattern.findall, encode_new, {}

    def encode(self, text: str) -> np.ndarray:
        words = self.findall(text)
        try:
            joined = b"".join(map(self.blobs.__getitem__, words))
        except KeyError:
            self._add(words)
            joined = b"".join(map(self.blobs.__getitem__, words))
        return np.frombuffer(joined, dtype=np.uint32)

    def clear(self) -> None:
        """Forget every word (and the engine's own per-piece cache, if it keeps one)."""
        self.blobs.clear()
        getattr(self.encode_new, "pieces", {}).clear()

    def _add(self, words: list[str]) -> None:
        blobs = self.blobs
        new = [w for w in dict.fromkeys(words) if w not in blobs]
        if len(blobs) + len(new) > MAX_WORDS:
            blobs.clear()
            new = list(dict.fromkeys(words))
        blobs.update(zip(new, self.encode_new(new)))


def _normalizer_steps(norm) -> list | None:
    if norm is None:
        return []
    if norm.get("type") == "Sequence":
        steps = [_normalizer_steps(n) for n in norm.get("normalizers", [])]
        return None if None in steps else [s for part in steps for s in part]
    return [norm]


def word_cuts(spec: dict):
    """(white characters of the cut, Metaspace prepend or None) where word-by-word encoding is
    exact by the file's structure (module docstring), else None."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    steps = _normalizer_steps(spec.get("normalizer"))
    if (steps is None or model.get("dropout") or spec.get("truncation") or spec.get("padding")
            or not all(a.get("special") for a in spec.get("added_tokens") or [])
            or any(s.get("type") not in ACCEPTED_NORMALIZERS for s in steps)
            or any(s.get("type") == "Replace" and (s.get("pattern") not in SPACE_PATTERNS
                                                  or s.get("content") not in (" ", SPACE))
                   for s in steps)):
        return None
    nmt = any(s.get("type") == "Nmt" for s in steps)  # makes tab, LF, FF, CR spaces
    if pre.get("type") == "Metaspace" and pre.get("split", True) \
            and pre.get("replacement", SPACE) == SPACE:
        scheme = pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never")
        return (" \t\n\f\r" if nmt else " "), scheme in ("always", "first")
    if pre.get("type") in ("WhitespaceSplit", "Whitespace") and not any(
            s.get("type") == "Replace" for s in steps):
        return " \t\n\f\r", None
    return None


def _blob(ids) -> bytes:
    return array("I", ids).tobytes()


def normalized(normalize, words: list[str]) -> list[str]:
    """Each word through ``normalize``: those ending in a LEFT character (all but a text's last
    word) in one call, joined by SEP (so cut apart as they are cut in the text), the others alone."""
    one = [w for w in words if w[-1:] < "!" or w[-1:] > "~" or SEP in w]
    batch = [w for w in words if "!" <= w[-1:] <= "~" and SEP not in w] if one else words
    done = normalize(SEP.join(batch)).split(SEP) if batch else []
    if len(done) != len(batch):  # never seen: a SEP changed
        done = [normalize(w) for w in batch]
    got = dict(zip(batch, done))
    got.update((w, normalize(w)) for w in one)
    return [got[w] for w in words]


def metaspace_words(tok, prepend: bool):
    """encode_new for a Metaspace (split) file: the new words through the file's normalizer, cut
    at '▁' as Metaspace cuts them, each distinct piece through the model once."""
    normalize = tok.normalizer.normalize_str if tok.normalizer is not None else str
    tokenize, pieces = tok.model.tokenize, {}

    def piece(p: str) -> bytes:
        got = pieces.get(p)
        if got is None:
            got = pieces[p] = _blob([t.id for t in tokenize(p)])
        return got

    def encode_new(words: list[str]) -> list[bytes]:
        out = []
        for s in normalized(normalize, words):
            s = s.replace(" ", SPACE)
            if prepend and s and not s.startswith(SPACE):
                s = SPACE + s
            if s.find(SPACE, 1) < 0:  # one piece (almost every word)
                out.append(piece(s) if s else b"")
                continue
            parts = s.split(SPACE)
            out.append(b"".join([piece(parts[0])] if parts[0] else [])
                       + b"".join(piece(SPACE + p) for p in parts[1:]))
        if len(pieces) > MAX_WORDS:
            pieces.clear()
        return out

    encode_new.pieces = pieces
    return encode_new


def library_words(tok):
    """encode_new through the library's whole pipeline (its batch call, without offsets)."""
    batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return lambda words: [_blob(e.ids) for e in batch(words, add_special_tokens=False)]


def word_cache(spec: dict, tok, probe: str) -> WordCache | None:
    """A WordCache for the library tokenizer `tok` (the file's parsed JSON: `spec`), or None
    where the file's structure does not make word-by-word encoding exact, or `probe` disagrees."""
    cuts = word_cuts(spec)
    if cuts is None:
        return None
    white, prepend = cuts
    encode_new = metaspace_words(tok, prepend) if prepend is not None else library_words(tok)
    cache = WordCache(cut_pattern(white), encode_new)
    whole = tok.encode(probe, add_special_tokens=False).ids
    return cache if cache.encode(probe).tolist() == whole else None
