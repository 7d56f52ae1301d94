"""A per-word cache: a text's ids are its words' ids joined, each distinct word encoded once.

Owns: `WordCache` (a batch of texts cut into words by numpy on their UTF-8 bytes, the words
counted by pyarrow's C++ hash table, each distinct word's ids kept as one uint32 bytes blob and
gathered per occurrence by numpy: Python touches each distinct word of a batch once; the new
words go through the library in one call (a Unigram model: our exact numpy Viterbi,
unigram_viterbi.py); without pyarrow, one regex pass and one dict lookup
per word), and deciding from a tokenizer.json alone where encoding word by word
gives exactly the whole text's ids (`word_cuts`), for the tokenizers library's engine
(`word_cache`: SentencePiece Unigram, WordPiece, WordLevel, BPE behind a whitespace-splitting
pre-tokenizer), and, more widely, where a long text cut into pieces before spaces does
(`chunks_are_exact`, for the library's own long-document path).

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

import json
import re
from array import array

import numpy as np

SPACE = "▁"
MAX_WORDS = 1_000_000  # cached words (~150 MB at most); the cache restarts when full
LEFT = "!-~"  # printable ASCII: no normalizer accepted here joins one to the space after it
LEFT_BYTES = (np.arange(256) >= ord("!")) & (np.arange(256) <= ord("~"))  # LEFT as bytes
ACCEPTED_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Nmt", "Lowercase", "Replace"}
SPACE_PATTERNS = ({"String": " "}, {"Regex": " {2,}"}, {"Regex": " +"})
NEW_CHUNK = 16384  # new words encoded per call of the engine
SEP = "\ue000"  # private use: no accepted normalizer changes it or joins it to a neighbour


def cut_pattern(white: str) -> re.Pattern:
    """Words: cut just before each run of ``white`` characters that follows a LEFT character."""
    w = re.escape(white)
    return re.compile(f"(?:[{w}]+[^{w}]*|[^{w}]+)(?:(?<![{LEFT}])[{w}]+[^{w}]*)*")


class WordCache:
    """`encode(text)` / `encode_many(texts)`: the ids of the words `pattern` finds, joined;
    `encode_new(list of new words) -> list of uint32 bytes blobs` runs once per distinct word.
    With pyarrow, `encode_many` cuts, counts and joins a whole batch in C (`_arrow_many`):
    Python touches each distinct word of the batch once, never each word; the cache's keys are
    then the words' UTF-8 bytes, else the words."""

    parallel = False  # pure Python between lookups: the sharder's threads would only wait

    def __init__(self, pattern: re.Pattern, encode_new, white: str = " "):
        self.findall, self.encode_new, self.blobs = pattern.findall, encode_new, {}
        self.white = np.zeros(256, bool)  # the cut's white characters, all ASCII, as bytes
        self.white[[ord(c) for c in white]] = True
        self.arrow = _arrow()

    def encode(self, text: str) -> np.ndarray:
        return self.encode_many([text])[0]

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        if self.arrow is not None and texts:
            return self._arrow_many([t.encode("utf-8") for t in texts])
        return [np.frombuffer(b"".join(self._blobs(self.findall(t), str)), dtype=np.uint32)
                for t in texts]

    def clear(self) -> None:
        """Forget every word (and the engine's own per-piece cache, if it keeps one)."""
        self.blobs.clear()
        getattr(self.encode_new, "pieces", {}).clear()

    def _blobs(self, words: list, decode) -> list[bytes]:
        """Each word's blob (`decode`: a key -> the word as text), the new ones encoded first."""
        got = list(map(self.blobs.get, words))
        if None not in got:
            return got
        new = list(set(words).difference(self.blobs))
        if len(self.blobs) + len(new) > MAX_WORDS:
            self.blobs.clear()
            new = list(set(words))
        self.blobs.update(zip(new, self.encode_new(list(map(decode, new)))))
        return list(map(self.blobs.__getitem__, words))

    def _arrow_many(self, raw: list[bytes]) -> list[np.ndarray]:
        """The texts' words cut and counted in C (`_cut_and_count`), each occurrence's ids
        gathered from the distinct words' blobs with numpy, cut back into texts."""
        first, ends, index, distinct = self._cut_and_count(raw)
        blobs = self._blobs(distinct, _utf8)
        flat = np.frombuffer(b"".join(blobs), dtype=np.uint32)
        lens = np.fromiter(map(len, blobs), np.int64, len(blobs)) >> 2
        each = lens[index]  # ids per word occurrence
        done = np.cumsum(each)
        total = int(done[-1]) if done.size else 0
        ids = flat[np.repeat(np.cumsum(lens)[index] - done, each) + np.arange(total)]
        words_in = np.searchsorted(first, ends)  # words that start before each text's end
        cuts = np.concatenate([[0], done])[words_in]
        return np.split(ids, cuts[:-1])

    def _cut_and_count(self, raw: list[bytes]):
        """(each word's first byte, each text's end byte, each word's index into the distinct
        words, the distinct words as bytes): the texts' UTF-8 bytes cut where `pattern` cuts
        (before a white byte after a LEFT byte; ASCII bytes never occur inside a multi-byte
        character) and at each text's start, the words counted by pyarrow's hash table."""
        pa, pc = self.arrow
        data = b"".join(raw)
        ends = np.cumsum([len(r) for r in raw], dtype=np.int64)
        a = np.frombuffer(data, dtype=np.uint8)
        starts = np.zeros(a.size, bool)
        starts[1:] = self.white[a[1:]] & LEFT_BYTES[a[:-1]]
        text_starts = ends - [len(r) for r in raw]
        starts[text_starts[text_starts < a.size]] = True
        first = np.flatnonzero(starts)
        offsets = np.append(first, a.size).astype(np.int64)
        words = pa.LargeBinaryArray.from_buffers(pa.large_binary(), first.size, [
            None, pa.py_buffer(offsets), pa.py_buffer(data)])
        coded = pc.dictionary_encode(words)
        return (first, ends, coded.indices.to_numpy(zero_copy_only=False),
                coded.dictionary.to_pylist())


def _utf8(word: bytes) -> str:
    return word.decode("utf-8")


def _arrow():
    """(pyarrow, pyarrow.compute), or None without pyarrow (an optional dependency)."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
    except ImportError:
        return None
    return pa, pc


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


CHUNK_NORMALIZERS = ACCEPTED_NORMALIZERS | {"StripAccents", "BertNormalizer"}
SPLIT_AT_WHITE = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "Metaspace", "ByteLevel"}
CHUNK_PRE = SPLIT_AT_WHITE | {"Digits", "Punctuation"}  # split, never join across white space


def _pre_steps(pre) -> list:
    return pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]


def chunks_are_exact(spec: dict) -> bool:
    """Whether a text cut just before a run of spaces that follows a LEFT character (the
    library's long-document pieces, hf_tokenizer.space_cuts) encodes to the whole text's ids, by
    the file's structure: per-character or Unicode-normal-form normalizers (Replace only of
    spaces before a Metaspace; no Prepend / Strip / Precompiled / ByteLevel: those act at a
    text's ends, across characters or on the spaces the pre-tokenizer splits at),
    a pre-tokenizer that splits at white space (Metaspace with ``split``, ByteLevel with its
    regex; Digits / Punctuation beside one), a model that works per pre-token (no dropout),
    added tokens that cannot match across the cut."""
    steps, pre = _normalizer_steps(spec.get("normalizer")), _pre_steps(spec.get("pre_tokenizer") or {})
    kinds = [p.get("type") for p in pre]
    added_ok = all(a.get("special") or not (a.get("normalized") or a.get("lstrip") or a.get("rstrip")
                                            or any(c.isspace() for c in a.get("content", " ")))
                   for a in spec.get("added_tokens") or [])
    return bool(
        steps is not None and added_ok and not (spec.get("model") or {}).get("dropout")
        and not spec.get("truncation") and not spec.get("padding")
        and all(s.get("type") in CHUNK_NORMALIZERS for s in steps)
        and all(s.get("type") != "Replace" or (s.get("pattern") in SPACE_PATTERNS and kinds
                                               == ["Metaspace"] and s.get("content") in (" ", SPACE))
                for s in steps)
        and set(kinds) <= CHUNK_PRE and set(kinds) & SPLIT_AT_WHITE
        and all(p.get("split", True) and p.get("use_regex", True) for p in pre)
        and ("ByteLevel" not in kinds or len(pre) == 1))


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


def piece_tokenizer(spec: dict, prepend: bool):
    """The file's model alone behind the file's Metaspace: its encode of a list of normalized
    words (``is_pretokenized``: each word on its own, its index as the tokens' word id) runs the
    model on exactly the pieces the whole file gives each word (no normalizer, no added tokens:
    special-token text is plain text, as the sharder encodes it)."""
    from tokenizers import Tokenizer, pre_tokenizers

    helper = Tokenizer.from_str(json.dumps(dict(
        spec, normalizer=None, pre_tokenizer=None, post_processor=None, added_tokens=[],
        truncation=None, padding=None)))
    helper.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="always" if prepend else "never", split=True)
    return helper


def metaspace_words(tok, spec: dict, prepend: bool):
    """encode_new for a Metaspace (split) file: the new words through the file's normalizer in
    one call, then the distinct results of a Unigram model through our exact numpy Viterbi
    (unigram_viterbi.py: the words it covers), the others through `piece_tokenizer` in one call."""
    from data_tools.unigram_viterbi import UnigramViterbi

    normalize = tok.normalizer.normalize_str if tok.normalizer is not None else str
    helper = piece_tokenizer(spec, prepend)
    fast = UnigramViterbi.from_tokenizer(helper, prepend)

    def encode_new(words: list[str]) -> list[bytes]:
        if len(words) > NEW_CHUNK:  # smaller temporaries, reused: fewer page faults
            return [b for i in range(0, len(words), NEW_CHUNK)
                    for b in encode_new(words[i:i + NEW_CHUNK])]
        norm = normalized(normalize, words)
        if fast is None:
            return _pieces_blobs(helper, norm)
        mine = list(dict.fromkeys(w for w in norm if fast.covers(w)))
        got = dict(zip(mine, _cut(*fast.encode_words(mine)))) if mine else {}
        rest = [w for w in norm if w not in got]
        got.update(zip(rest, _pieces_blobs(helper, rest) if rest else []))
        return [got[w] for w in norm]

    return encode_new


def _cut(ids: np.ndarray, bounds: np.ndarray) -> list[bytes]:
    """uint32 ids cut into one blob per word at `bounds` (len(words) + 1 id indices)."""
    raw, at = ids.astype(np.uint32).tobytes(), (4 * bounds).tolist()
    return [raw[a:b] for a, b in zip(at[:-1], at[1:])]


def _pieces_blobs(helper, norm: list[str]) -> list[bytes]:
    """Each normalized word's blob through `piece_tokenizer` (one call, cut by word ids)."""
    got = helper.encode(norm, is_pretokenized=True, add_special_tokens=False)
    return _cut(np.asarray(got.ids, dtype=np.uint32),
                np.searchsorted(np.asarray(got.word_ids, dtype=np.int64), np.arange(len(norm) + 1)))


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
    encode_new = metaspace_words(tok, spec, prepend) if prepend is not None else library_words(tok)
    cache = WordCache(cut_pattern(white), encode_new, white)
    whole = tok.encode(probe, add_special_tokens=False).ids
    return cache if cache.encode(probe).tolist() == whole else None
