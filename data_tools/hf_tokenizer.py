"""Any Hugging Face ``tokenizers`` file (tokenizer.json) as a sharding tokenizer.

Owns: loading a tokenizer.json (byte-level BPE as GPT-2 / Llama 3 / Qwen2, SentencePiece-style
Metaspace / Unigram / BPE with byte fallback as Llama 2 / Mistral, WordLevel, ...), finding its
end-of-text id (a flag, else tokenizer_config.json's ``eos_token`` beside the file, else a
well-known special token of the file), and encoding fast: a byte-level BPE whose vocabulary is
exactly 256 bytes + its merges (fast_bpe.py), or a SentencePiece-style BPE with byte fallback as
Llama 2's / Mistral's (fast_spm.py), runs on tiktoken (the engine gpt2 uses, 3-10x faster per core
than the tokenizers library), checked against the library on a probe text at load and on the
corpus's first SAMPLE_CHARS characters at the first encode (any difference: one warning line,
then the library); anything else (Unigram, NFKC, WordLevel, ...) runs on the library, once per
distinct word where the file's structure makes that exact (word_cache.py), else on its batch
encoder, its Rust threads limited to the rank's share of the cores (RAYON_NUM_THREADS).

Must never: touch the network, or encode special-token text found inside a document as the
special id (as for gpt2, ``<|endoftext|>`` in a document is ordinary text).
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import logs
from .fast_bpe import fast_bpe
from .fast_spm import fast_spm
from .word_cache import chunks_are_exact, word_cache
from .format import DataError, sha256_file

CONFIG_FILE = "tokenizer_config.json"
# Special tokens that end a document in well-known tokenizers, in order of preference.
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
EOT_HELP = ("give --eot-token TEXT or --eot-id N, or put a tokenizer_config.json with "
            "\"eos_token\" beside it")
# Encoded both ways at load: the tiktoken fast path is used only if it agrees exactly.
PROBE_TEXT = ("Hello world! It's 2024: naïve café, ünïcode — 日本語のテキスト, emoji 🎉🎉.\n\n"
              "def f(x):\n    return x**2  # comment\t\ttabs   spaces\n"
              "I'll we've they're DON'T 12345678 3.14159 <|endoftext|> end.  \n \n")


# The corpus's first characters (per rank) are encoded both ways before the tiktoken engine is trusted.
SAMPLE_CHARS = 100_000  # ~0.35 s per rank at the library's speed
CHUNK_CHARS = 8192  # piece size for libraries slow on long inputs (see HFTokenizer._chunked_ids)


def space_cuts(text: str, n: int) -> list[str]:
    """``text`` in pieces of at least ``n`` characters, each cut just before a run of spaces that
    follows a printable ASCII character (the run stays whole with the text after it; the cut
    `chunks_are_exact` reasons about); "".join(pieces) == text."""
    out, a = [], 0
    while a < len(text):
        b = text.find(" ", a + n)
        while b > 0:
            run = b
            while run > a and text[run - 1] == " ":
                run -= 1  # inside a run of spaces: cut before the run
            if run > a and "!" <= text[run - 1] <= "~":
                b = run
                break
            while b < len(text) and text[b] == " ":
                b += 1
            b = text.find(" ", b)  # the next run
        b = len(text) if b <= a else b
        out.append(text[a:b])
        a = b
    return out


def _eos_from_config(path: str):
    """tokenizer_config.json's eos_token beside ``path`` (a string or {"content": ...})."""
    cfg = os.path.join(os.path.dirname(os.path.abspath(path)), CONFIG_FILE)
    if not os.path.isfile(cfg):
        return None, None
    try:
        with open(cfg, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError) as e:
        raise DataError(cfg, f"unreadable ({e})") from None
    except RecursionError:
        raise DataError(cfg, "unreadable (JSON nested too deeply to parse)") from None
    return (eos.get("content") if isinstance(eos, dict) else eos), cfg


def resolve_eot(tok, path: str, eot_token=None, eot_id=None) -> int:
    """The end-of-text id: --eot-id, --eot-token, tokenizer_config.json, or a known token."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if eot_id is not None:
        if not 0 <= int(eot_id) < vocab:
            raise DataError("--eot-id", f"{eot_id} is outside the vocabulary 0..{vocab - 1} of {path}")
        return int(eot_id)
    if eot_token is not None:
        found = tok.token_to_id(eot_token)
        if found is None:
            raise DataError("--eot-token", f"{eot_token!r} is not a token of {path}")
        return int(found)
    eos, cfg = _eos_from_config(path)
    if eos is not None:
        found = tok.token_to_id(eos)
        if found is None:
            raise DataError(cfg, f"eos_token {eos!r} is not a token of {path}")
        return int(found)
    for name in EOT_CANDIDATES:
        found = tok.token_to_id(name)
        if found is not None:
            return int(found)
    raise DataError(path, f"no end-of-text token found (none of {', '.join(EOT_CANDIDATES)}); "
                          f"{EOT_HELP}")


class HFTokenizer:
    """A tokenizer.json; ``name`` = ``<model type>-<first 12 hex of the file's sha256>``
    (``bpe-...`` for BPE, as `train-tokenizer` files have always been named)."""

    def __init__(self, path: str, eot_token=None, eot_id=None):
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise DataError("tokenizers", "package not installed: pip install tokenizers") from None
        try:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
            self.tok = _HF.from_str(json.dumps(spec))
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad input file
            raise DataError(path, f"not a tokenizers JSON file ({str(e).splitlines()[0][:200]})") from None
        self.tok.encode_special_tokens = True  # special-token text in a document is plain text
        self.path, self.sha256 = path, sha256_file(path)
        kind = str((spec.get("model") or {}).get("type", "hf")).lower()
        self.name = f"{kind}-{self.sha256[:12]}"
        # ids may leave holes: the vocabulary (embedding rows) is the largest id + 1
        ids = self.tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(int(self.tok.get_vocab_size(with_added_tokens=True)), max(ids, default=-1) + 1)
        self.eot_id = resolve_eot(self.tok, path, eot_token, eot_id)
        self.fast = fast_bpe(spec) or fast_spm(spec)
        if self.fast is not None and not (self._merges_build_every_token(spec) and np.array_equal(
                self.fast.encode(PROBE_TEXT), self._one_ids(PROBE_TEXT))):
            self.fast = None  # the tiktoken engine must give exactly the file's ids
        self.engine = "tiktoken"
        if self.fast is None:  # Unigram, WordPiece, ...: the library, once per distinct word
            self.fast, self.engine = word_cache(spec, self.tok, PROBE_TEXT * 3), "tokenizers, per-word cache"
        self.unchecked_chars = SAMPLE_CHARS  # of the corpus, compared with the library first
        self.chunks_exact = chunks_are_exact(spec)
        self.chunk_chars = 0 if self.fast is not None else self._chunking_is_exact()
        if self.fast is None:
            self.engine = "tokenizers, long documents in pieces" if self.chunk_chars else "tokenizers"

    def _merges_build_every_token(self, spec: dict) -> bool:
        """tiktoken takes a piece that is a whole token as that token; the library (without
        ``ignore_merges``) runs the merges over it: the same ids only if the merges build every
        token of the vocabulary whole (~0.6 s per 50k tokens, at load)."""
        model = spec["model"]
        if model.get("ignore_merges"):
            return True
        skip = {a["content"] for a in spec.get("added_tokens") or []}
        if model.get("byte_fallback"):
            skip.update(f"<0x{b:02X}>" for b in range(256))
        tokenize = self.tok.model.tokenize
        return all(len(got := tokenize(k)) == 1 and got[0].value == k
                   for k in model["vocab"] if k not in skip)

    def _chunking_is_exact(self) -> int:
        """CHUNK_CHARS where the file's structure makes a text cut before spaces (space_cuts)
        encode to the whole text's ids (word_cache.chunks_are_exact) and the probe, cut every
        few characters, agrees; else 0. Long documents then go through the library ~2x faster."""
        if not self.chunks_exact:
            return 0
        probe = PROBE_TEXT * 3
        whole = self._one_ids(probe)
        pieces = np.concatenate([self._one_ids(p) for p in space_cuts(probe, 5)])
        return CHUNK_CHARS if np.array_equal(whole, pieces) else 0

    def _fast_ids(self, text: str) -> np.ndarray:
        return self.fast.encode(text)

    def _check_sample(self, texts: list[str]) -> None:
        """Compare the tiktoken engine with the library on the first SAMPLE_CHARS of the corpus
        (each text's head); on any difference use the library from now on, with one warning."""
        for t in texts:
            if self.unchecked_chars <= 0 or self.fast is None:
                return
            head = t[:self.unchecked_chars]
            self.unchecked_chars -= len(head)
            if not np.array_equal(self._fast_ids(head), self._one_ids(head)):
                self.fast, self.engine = None, "tokenizers"
                self.chunk_chars = self._chunking_is_exact()
                logs.get_logger(__name__).warning(
                    f"warning: {self.path}: the tiktoken engine's ids differ from the tokenizers "
                    f"library's on this corpus; encoding with the library (slower)")

    def _one_ids(self, text: str) -> np.ndarray:
        """One text, no thread pool (the batch call starts Rust's pool, sized at its first use)."""
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def _slow_ids(self, texts: list[str]) -> list[np.ndarray]:
        batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # no offsets: faster
        return [np.asarray(e.ids, dtype=np.uint32) for e in batch(texts, add_special_tokens=False)]

    def _chunked_ids(self, texts: list[str]) -> list[np.ndarray]:
        """Each text cut into ~chunk_chars pieces (one batch for all), ids joined back per text."""
        pieces, count = [], []
        for t in texts:
            cut = space_cuts(t, self.chunk_chars)
            pieces.extend(cut)
            count.append(len(cut))
        ids, out, k = self._slow_ids(pieces), [], 0
        for n in count:
            out.append(np.concatenate(ids[k:k + n]) if n else np.zeros(0, np.uint32))
            k += n
        return out

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0].astype(np.int64)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[np.ndarray]:
        self._check_sample(texts)
        if self.fast is None:
            # Rust's pool starts at the first parallel call: size it to this rank's cores.
            os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, num_threads)))
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
            return self._chunked_ids(texts) if self.chunk_chars else self._slow_ids(texts)
        if hasattr(self.fast, "encode_many"):  # the per-word cache: a whole batch at once
            return self.fast.encode_many(texts)
        if num_threads <= 1 or len(texts) <= 1 or not getattr(self.fast, "parallel", True):
            return [self._fast_ids(t) for t in texts]
        with ThreadPoolExecutor(num_threads) as pool:  # tiktoken releases the GIL while encoding
            return list(pool.map(self._fast_ids, texts))

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"<HFTokenizer {self.name} vocab={self.vocab_size} eot={self.eot_id} ({self.engine})>"
