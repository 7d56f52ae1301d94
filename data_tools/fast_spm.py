"""A SentencePiece-style BPE tokenizer.json (Llama 2 / Mistral: '▁' for spaces, byte fallback)
encoded by tiktoken, exactly.

Owns: converting a character-level BPE with byte fallback into byte-level tiktoken ranks: the 256
bytes first (each stands for its ``<0xNN>`` token, or for its one-byte character's token), then
each multi-byte character of the vocabulary built from its UTF-8 bytes (prefixes ranked below every
merge, so characters form before any merge; a prefix left over is a character the vocabulary
lacks and stands for the ``<0xNN>`` tokens of its bytes, as byte fallback gives), then the merges
in order. The text is prepared as the library does (spaces -> '▁', a leading '▁') and cut into
pieces no token spans: at each '▁' for ``split: true`` (exactly the library's cut), else before
each run of '▁' after another character, which is exact when no token of the vocabulary holds a
'▁' after another character (checked here).

Two file shapes: a Metaspace pre-tokenizer (no normalizer), or Llama 2's normalizer
(Prepend '▁' + Replace ' ' -> '▁', no pre-tokenizer). Anything else (NFKC, Unigram, no byte
fallback, non-special added tokens, dropout) -> None: the caller uses the library, and checks
these ids against it on the corpus before trusting them (hf_tokenizer.HFTokenizer).
"""
from __future__ import annotations

import functools

import numpy as np

from .fast_bpe import encoding

SPACE = "▁"
PIECES = {True: f"{SPACE}[^{SPACE}]*|[^{SPACE}]+", False: f"{SPACE}+[^{SPACE}]*|[^{SPACE}]+"}
# '▁' is 3 UTF-8 bytes that every piece merges first; spelled as the one byte NUL instead (in the
# ranks and the text), tiktoken merges ~10% less per piece. A text holding a NUL: the plain form.
NUL = "\x00"
NUL_PIECES = {True: r"\x00[^\x00]*|[^\x00]+", False: r"\x00+[^\x00]*|[^\x00]+"}


def _text_rule(spec: dict):
    """(prepend, always_prepend, split) for the two file shapes, or None."""
    norm, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    if norm is None and pre is not None and pre.get("type") == "Metaspace":
        if pre.get("replacement", SPACE) != SPACE:
            return None
        scheme = pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never")
        return scheme in ("always", "first"), False, bool(pre.get("split", True))
    steps = (norm or {}).get("normalizers", [])
    if (pre is None and norm is not None and norm.get("type") == "Sequence" and len(steps) == 2
            and steps[0] == {"type": "Prepend", "prepend": SPACE}
            and steps[1].get("type") == "Replace" and steps[1].get("pattern") == {"String": " "}
            and steps[1].get("content") == SPACE):
        return True, True, False
    return None


def _ranks(model: dict, vocab: dict):
    """(byte ranks, rank -> ids as a list of id lists), or None when the vocabulary is not
    256 byte tokens + single characters + one token per merge."""
    byte_id = [vocab.get(f"<0x{b:02X}>") for b in range(256)]
    if None in byte_id:
        return None
    ranks, out = {bytes([b]): b for b in range(256)}, [[i] for i in byte_id]
    chars = [k for k in vocab if len(k) == 1]
    for c in chars:
        raw = c.encode("utf-8")
        for k in range(2, len(raw)):  # a prefix left alone: byte fallback of its bytes
            if raw[:k] not in ranks:
                ranks[raw[:k]] = len(out)
                out.append([byte_id[b] for b in raw[:k]])
        if len(raw) == 1:
            out[raw[0]] = [vocab[c]]
        else:
            ranks[raw] = len(out)
            out.append([vocab[c]])
    for m in model.get("merges", []):
        a, b = tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))
        raw = (a + b).encode("utf-8")
        if a + b not in vocab or raw in ranks:
            return None
        ranks[raw] = len(out)
        out.append([vocab[a + b]])
    if len(vocab) != 256 + len(chars) + len(model.get("merges", [])):
        return None  # tokens that neither a character nor a merge makes
    return ranks, out


class FastSPM:
    """tiktoken's encoder over '▁'-pieces + the rank -> ids table (a few ranks give 2-3 ids)."""

    def __init__(self, enc, rank_ids: list, rule, plain=None):
        self.enc, (self.prepend, self.always, _) = enc, rule
        self.plain = plain  # () -> the encoder with '▁' as its 3 bytes, when enc spells it NUL
        self.first_id = np.array([ids[0] for ids in rank_ids], dtype=np.uint32)
        self.lens = np.array([len(ids) for ids in rank_ids], dtype=np.int64)
        self.starts = np.cumsum(self.lens) - self.lens  # where each rank's ids begin in flat
        self.flat = np.array([i for ids in rank_ids for i in ids], dtype=np.uint32)

    def encode(self, text: str) -> np.ndarray:
        if not text:
            return np.zeros(0, np.uint32)
        enc, space = self.enc, SPACE
        if self.plain is not None:
            enc, space = (self.plain(), SPACE) if NUL in text else (enc, NUL)
            if space == NUL and SPACE in text:
                text = text.replace(SPACE, NUL)  # the library reads a '▁' in the text as a space
        text = text.replace(" ", space)
        if self.prepend and (self.always or not text.startswith(space)):
            text = space + text
        ranks = enc.encode_to_numpy(text, disallowed_special=())
        lens = self.lens[ranks]
        if int(lens.max(initial=1)) == 1:
            return self.first_id[ranks]
        ends = np.cumsum(lens)  # a character the vocabulary lacks: its bytes' ids, in order
        return self.flat[np.repeat(self.starts[ranks] - (ends - lens), lens) + np.arange(int(ends[-1]))]


def fast_spm(spec: dict):
    """A FastSPM for a SentencePiece-style BPE with byte fallback (its parsed JSON), or None."""
    model, rule = spec.get("model") or {}, _text_rule(spec)
    added = spec.get("added_tokens") or []
    if (rule is None or model.get("type") != "BPE" or not model.get("byte_fallback")
            or model.get("dropout") or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix") or not all(a.get("special") for a in added)):
        return None
    specials = {a["content"] for a in added}
    vocab = {k: v for k, v in model["vocab"].items() if k not in specials}
    if not rule[2] and any(SPACE in k.lstrip(SPACE) for k in vocab):
        return None  # a token spans a '▁' after another character: pieces would differ
    got = _ranks(model, vocab)
    if got is None:
        return None
    plain = functools.cache(lambda: encoding("hf-sentencepiece", PIECES[rule[2]], got[0]))
    nul = _nul_ranks(got[0])
    if nul is None:
        return FastSPM(plain(), got[1], rule)
    return FastSPM(encoding("hf-sentencepiece-nul", NUL_PIECES[rule[2]], nul), got[1], rule, plain)


def _nul_ranks(ranks: dict):
    """The ranks with '▁' spelled as the byte NUL (which then never stands for its <0x00>
    token: a text holding a NUL takes the plain encoder), or None where that is ambiguous."""
    space = SPACE.encode("utf-8")
    if space not in ranks or any(b"\x00" in raw for raw in ranks if raw != b"\x00"):
        return None
    return {raw.replace(space, b"\x00"): rank for raw, rank in ranks.items() if raw != b"\x00"}
