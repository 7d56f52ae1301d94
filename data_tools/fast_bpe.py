"""A byte-level BPE tokenizer.json (GPT-2 / Llama 3 / Qwen2 style) encoded by tiktoken, exactly.

Owns: converting a tokenizers-library byte-level BPE (a ByteLevel pre-tokenizer, alone or after
a Split regex as Llama 3's) into a ``tiktoken.Encoding`` (mergeable ranks = the merges' order,
tokens mapped through GPT-2's byte alphabet back to bytes; the pre-tokenizer's regex as pat_str)
plus a rank -> id table, and reproducing the library's added-token handling around it: the text
is first cut at its non-special added tokens as the library cuts it (leftmost-longest; tokens
with ``normalized: false`` first, then the others in the remaining pieces), each becoming its id;
special-token text is plain text (the sharder sets ``encode_special_tokens``, as gpt2 encodes
``<|endoftext|>`` in a document), though still matched first, so that no added token is found
inside it, as the library does. This is how
Llama 3 itself ships (tiktoken), ~7-10x faster per core than the library on long documents.

Must never: return an engine for a file whose behaviour it does not reproduce (a normalizer,
dropout, byte fallback, suffixes, an added token with lstrip/rstrip/single_word, a vocabulary that
merges do not build one for one): ``fast_bpe(spec)`` is None and the caller uses the library. The
caller still checks the ids against the library (hf_tokenizer.HFTokenizer) before trusting them.
"""
from __future__ import annotations

import re

import numpy as np


# The standard GPT-2 pre-tokenisation regex (as published with GPT-2 / tiktoken's gpt2).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def data_gym_bytes() -> dict[str, str]:
    """GPT-2's byte <-> printable-character map ("data gym" encoding of encoder.json keys), as a
    str.translate table from each character to the latin-1 character of its byte."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    table = {ord(chr(b)): chr(b) for b in printable}
    table.update({256 + n: chr(b) for n, b in enumerate(others)})
    return table


def _merge_pair(m):
    return tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))


def _byte_level_regex(spec: dict):
    """The split regex of a byte-level pre-tokenizer (GPT-2's, or a Split + ByteLevel sequence
    as Llama 3's), or None for anything else."""
    if spec is None:
        return None
    if spec.get("type") == "ByteLevel":
        ok = spec.get("use_regex", True) and not spec.get("add_prefix_space", False)
        return GPT2_PAT_STR if ok else None
    if spec.get("type") != "Sequence" or len(spec.get("pretokenizers", [])) != 2:
        return None
    split, byte_level = spec["pretokenizers"]
    if (split.get("type") != "Split" or "Regex" not in split.get("pattern", {})
            or split.get("behavior") != "Isolated" or split.get("invert")
            or byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True)
            or byte_level.get("add_prefix_space", False)):
        return None
    return split["pattern"]["Regex"]


def _supported(spec: dict, model: dict) -> bool:
    added = spec.get("added_tokens") or []
    return (model.get("type") == "BPE" and spec.get("normalizer") is None
            and not model.get("dropout") and not model.get("byte_fallback")
            and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix")
            and not any(a.get("lstrip") or a.get("rstrip") or a.get("single_word") for a in added))


def _ranks(model: dict, vocab: dict):
    """(mergeable ranks, rank -> id) for a vocabulary of exactly 256 bytes + one token per merge,
    or None."""
    table = data_gym_bytes()
    try:
        as_bytes = {k: k.translate(table).encode("latin-1") for k in vocab}
    except UnicodeEncodeError:
        return None  # not GPT-2's byte alphabet
    ranks = {b: b[0] for b in as_bytes.values() if len(b) == 1}
    merges = model.get("merges", [])
    for i, m in enumerate(merges):
        a, b = _merge_pair(m)
        ranks.setdefault((a + b).translate(table).encode("latin-1"), 256 + i)
    if len(ranks) != 256 + len(merges) or len(ranks) != len(vocab):
        return None  # tokens that no merge makes, or merges that repeat a token
    rank_to_id = np.zeros(len(ranks), dtype=np.uint32)
    try:
        for k, b in as_bytes.items():
            rank_to_id[ranks[b]] = vocab[k]
    except (KeyError, IndexError):
        return None
    return ranks, rank_to_id


def encoding(name: str, pat: str, ranks: dict):
    """A tiktoken Encoding with one special token that is never allowed (so never produced): with
    none, tiktoken's special-token search is an empty regex tried at every character (~30% of
    the encode time); with one, a literal search. Special-token text stays plain text."""
    import tiktoken

    return tiktoken.Encoding(name=name, pat_str=pat, mergeable_ranks=ranks,
                             special_tokens={"<|hpctrain: never a token|>": len(ranks)})


def _cutter(tokens: list[str]):
    """A regex finding ``tokens`` leftmost-longest (longer alternatives first)."""
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


class FastBPE:
    """tiktoken's encoder + the rank -> id table + the added tokens cut out first."""

    def __init__(self, enc, rank_to_id: np.ndarray, added: list[dict]):
        self.enc, self.rank_to_id = enc, rank_to_id
        # content -> id; None for a special token: its text is plain text, but the library
        # still finds it (so no other added token matches inside it) and then leaves it in place
        self.ids = {a["content"]: (None if a.get("special") else int(a["id"])) for a in added}
        by_pass = ([a for a in added if not a.get("normalized", not a.get("special"))],
                   [a for a in added if a.get("normalized", not a.get("special"))])
        # a pass of special tokens only cuts nothing: skipped
        self.passes = [_cutter([a["content"] for a in p]) for p in by_pass
                       if any(not a.get("special") for a in p)]

    def _plain(self, text: str) -> np.ndarray:
        return self.rank_to_id[self.enc.encode_to_numpy(text, disallowed_special=())]

    def _pieces(self, text: str, k: int, out: list) -> None:
        """Cut ``text`` by pass ``k``'s added tokens; plain pieces go on to pass k + 1."""
        if k == len(self.passes):
            if text:
                out.append(self._plain(text))
            return
        at = 0
        for m in self.passes[k].finditer(text):
            tid = self.ids[m.group()]
            if tid is not None:
                self._pieces(text[at:m.start()], k + 1, out)
                out.append(np.array([tid], dtype=np.uint32))
                at = m.end()
        self._pieces(text[at:], k + 1, out)

    def encode(self, text: str) -> np.ndarray:
        if not self.passes:
            return self._plain(text)
        out = []
        self._pieces(text, 0, out)
        return np.concatenate(out) if out else np.zeros(0, np.uint32)


def fast_bpe(spec: dict):
    """A FastBPE for a byte-level BPE tokenizer.json (its parsed JSON), or None when the file is
    anything the conversion does not reproduce."""
    model = spec.get("model") or {}
    pat = _byte_level_regex(spec.get("pre_tokenizer"))
    if pat is None or not _supported(spec, model):
        return None
    added = spec.get("added_tokens") or []
    specials = {a["content"] for a in added if a.get("special")}
    vocab = {k: v for k, v in model["vocab"].items() if k not in specials}
    got = _ranks(model, vocab)
    if got is None:
        return None
    try:
        enc = encoding("hf-byte-level", pat, got[0])
    except Exception:  # noqa: BLE001 - a regex tiktoken cannot compile: use the library
        return None
    return FastBPE(enc, got[1], added)
