"""The on-disk shard format: THE single definition shared by the writer and every reader.

Owns: FORMAT_VERSION, file names, the token dtype rule, the HDF5 layout of a shard (writing it
byte-deterministically and checking an opened shard against its manifest entry), reading and
atomically writing ``manifest.json``, and ``DataError``.

Must never: tokenize, walk input corpora, talk to MPI, or read token payloads in bulk (the reader
memory-maps them; ``verify`` scans them).  Anything that changes the bytes written here changes
FORMAT_VERSION.  See docs/data.md for the full description.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from data_tools.errors import UserError

FORMAT_VERSION = 1
# A chat dataset (``shard --format chat``) also stores a per-token loss mask: version 2, so a
# reader that knows only version 1 refuses it in one line instead of training on every token.
CHAT_FORMAT_VERSION = 2
READABLE_VERSIONS = (FORMAT_VERSION, CHAT_FORMAT_VERSION)
FORMAT_CHAT = "chat"  # the manifest's "format" of a version-2 dataset
FORMAT_PREFERENCE = "preference"  # version 2 too: one document per pair (data_tools/preference.py)
MASKED_FORMATS = (FORMAT_CHAT, FORMAT_PREFERENCE)
LOSS_MASK_DSET = "loss_mask"
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")
TOKENS_DSET = "tokens"
DOC_OFFSETS_DSET = "doc_offsets"
# HDF5 settings that make a shard byte-deterministic and readable by HDF5 >= 1.10 tools.
H5_LIBVER = ("earliest", "v110")
SHARD_ATTRS = ("format_version", "tokenizer", "vocab_size", "eot_id", "n_tokens", "split")
SHARD_RE = re.compile(r"^(train|val)_(\d{5,})\.h5$")
# A component shard of a blend in a node cache: "c<component>-<shard file>" (no collisions).
CACHED_SHARD_RE = re.compile(r"^(c\d+-)?(train|val)_(\d{5,})\.h5$")
TMP_PREFIX = ".tmp-"  # every temporary file the writer creates starts with this
MANIFEST_KEYS = ("format_version", "tokenizer", "dtype", "seed", "val_fraction", "shard_tokens",
                 "n_documents", "n_tokens", "shards")
SHARD_KEYS = ("file", "split", "n_tokens", "n_docs", "bytes", "sha256")
# A blend (``data_tools blend``): a manifest with "kind": "blend" and no shards of its own, naming
# component datasets.  A manifest without "kind" is a sharded dataset (kind "shards").
KIND_SHARDS, KIND_BLEND = "shards", "blend"
BLEND_KEYS = ("format_version", "kind", "seed", "tokenizer", "dtype", "period", "components")
COMPONENT_KEYS = ("path", "manifest_sha256", "weight", "parts", "n_tokens", "n_documents")


class DataError(UserError):
    """A problem with a dataset or its inputs.  ``str(e)`` is ONE line starting with the path.

    ``DataError(path, problem)`` renders as ``"{path}: {problem}"``; ``DataError(message)`` keeps
    a pre-formatted message.  Newlines are folded so the message is always a single line.
    """

    def __init__(self, path_or_message, problem: str | None = None):
        path_or_message = str(path_or_message)
        msg = path_or_message if problem is None else f"{path_or_message}: {problem}"
        msg = " ".join(msg.split("\n"))
        super().__init__(msg)
        self.path = path_or_message if problem is not None else msg.split(": ", 1)[0]
        self.collective = False  # set by the MPI writer when every rank raised the same error


def shard_filename(split: str, index: int) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (expected one of {SPLITS})")
    return f"{split}_{index:05d}.h5"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def sha256_file(path: str, bufsize: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(bufsize)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def fsync_path(path: str) -> None:
    """fsync a file or a directory (to persist a rename) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path_for(final_path: str) -> str:
    d, name = os.path.split(final_path)
    return os.path.join(d, f"{TMP_PREFIX}{os.getpid()}-{name}")


def write_shard(final_path: str, tokens: np.ndarray, doc_offsets: np.ndarray, *, split: str,
                tokenizer: str, vocab_size: int, eot_id: int, loss_mask=None) -> dict:
    """Write one shard atomically (temp name in the same dir, fsync, os.replace).

    ``doc_offsets`` are offsets into THIS shard's ``tokens`` of the documents that begin here.
    ``loss_mask`` (uint8, one per token; chat data) makes it a version-2 shard.  Returns the manifest entry for the shard (file, split, n_tokens, n_docs, bytes, sha256).
    """
    dtype = token_dtype(vocab_size)
    tokens = np.ascontiguousarray(tokens, dtype=dtype)
    doc_offsets = np.ascontiguousarray(doc_offsets, dtype=np.int64)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError("a shard holds a non-empty 1-D token array")
    import h5py  # local: keeps `import data_tools.format` cheap

    tmp = tmp_path_for(final_path)
    try:
        with h5py.File(tmp, "w", libver=H5_LIBVER, track_order=False) as f:
            # No chunks/compression/maxshape -> contiguous layout; track_times=False -> no clocks.
            f.create_dataset(TOKENS_DSET, data=tokens, track_times=False)
            f.create_dataset(DOC_OFFSETS_DSET, data=doc_offsets, track_times=False)
            if loss_mask is not None:
                f.create_dataset(LOSS_MASK_DSET, data=_loss_mask_of(loss_mask, tokens.size),
                                 track_times=False)
            f.attrs["format_version"] = np.int64(FORMAT_VERSION if loss_mask is None
                                                 else CHAT_FORMAT_VERSION)
            f.attrs["tokenizer"] = str(tokenizer)
            f.attrs["vocab_size"] = np.int64(vocab_size)
            f.attrs["eot_id"] = np.int64(eot_id)
            f.attrs["n_tokens"] = np.int64(tokens.size)
            f.attrs["split"] = str(split)
        # Hash the file (from the page cache) while it is flushed to disk: both release the GIL.
        with ThreadPoolExecutor(1) as pool:
            digest = pool.submit(sha256_file, tmp)
            fsync_path(tmp)
            sha256 = digest.result()
        entry = {"file": os.path.basename(final_path), "split": split,
                 "n_tokens": int(tokens.size), "n_docs": int(doc_offsets.size),
                 "bytes": os.path.getsize(tmp), "sha256": sha256}
        os.replace(tmp, final_path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):  # h5py's message has no file name and an error stack
            first = (e.strerror or str(e)).strip().splitlines()[0]
            raise DataError(final_path, f"cannot write the shard ({first.split(' (')[0]}: a full "
                                        f"or read-only disk?)") from None
        raise
    return entry


def _loss_mask_of(loss_mask, n_tokens: int) -> np.ndarray:
    mask = np.ascontiguousarray(loss_mask, dtype=np.uint8)
    if mask.shape != (n_tokens,):
        raise ValueError(f"loss_mask has shape {mask.shape}, the shard {n_tokens} tokens")
    return mask


@dataclass(frozen=True)
class ShardLayout:
    """Where a shard's tokens (and a chat shard's loss mask) live inside its file and what they
    are."""
    path: str
    offset: int
    n_tokens: int
    dtype: np.dtype
    doc_offsets: np.ndarray
    mask_offset: int | None = None  # byte offset of the uint8 loss_mask (version 2 only)


def check_shard_size(path: str, entry: dict) -> None:
    """Cheap existence/size check; run BEFORE h5py opens the file (h5py chokes on truncation)."""
    if not os.path.isfile(path):
        raise DataError(path, "missing (listed in manifest)")
    size = os.path.getsize(path)
    if size < entry["bytes"]:
        raise DataError(path, f"truncated ({size} bytes, manifest says {entry['bytes']})")
    if size != entry["bytes"]:
        raise DataError(path, f"size mismatch ({size} bytes, manifest says {entry['bytes']})")


def open_shard_layout(path: str, entry: dict, manifest: dict) -> ShardLayout:
    """Open a shard with h5py read-only, check attrs/layout against the manifest, return layout.

    Never modifies the file.  Raises DataError naming ``path``.
    """
    import h5py

    check_shard_size(path, entry)
    tok = manifest["tokenizer"]
    want_dtype = np.dtype(manifest["dtype"])
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DataError(path, f"not a readable HDF5 file ({e})") from None
    with f:
        for name in (TOKENS_DSET, DOC_OFFSETS_DSET):
            if name not in f or not isinstance(f[name], h5py.Dataset):
                raise DataError(path, f"no dataset '{name}'")
        version = manifest.get("format_version", FORMAT_VERSION)  # a blend's flat view has none
        want = {"format_version": version, "tokenizer": tok["name"],
                "vocab_size": tok["vocab_size"], "eot_id": tok["eot_id"],
                "n_tokens": entry["n_tokens"], "split": entry["split"]}
        for key, val in want.items():
            if key not in f.attrs:
                raise DataError(path, f"attribute '{key}' missing")
            got = f.attrs[key]
            got = got.decode() if isinstance(got, bytes) else got
            got = int(got) if isinstance(val, int) else str(got)
            if got != val:
                raise DataError(path, f"attribute {key}={got!r} but manifest says {val!r}")
        d = f[TOKENS_DSET]
        if d.ndim != 1 or d.dtype != want_dtype:
            raise DataError(path, f"tokens is {d.dtype}{list(d.shape)}, manifest says {want_dtype} 1-D")
        if d.shape[0] != entry["n_tokens"]:
            raise DataError(path, f"tokens has {d.shape[0]} entries, manifest says {entry['n_tokens']}")
        if d.id.get_create_plist().get_layout() != h5py.h5d.CONTIGUOUS or d.compression or d.chunks:
            raise DataError(path, "tokens is not a contiguous uncompressed dataset")
        offset = d.id.get_offset()
        if offset is None:
            raise DataError(path, "tokens has no storage allocated")
        end = offset + entry["n_tokens"] * want_dtype.itemsize
        if end > os.path.getsize(path):
            raise DataError(path, f"truncated (tokens end at byte {end}, file has {os.path.getsize(path)})")
        o = f[DOC_OFFSETS_DSET]
        if o.ndim != 1 or o.dtype != np.int64:
            raise DataError(path, f"doc_offsets is {o.dtype}{list(o.shape)}, expected int64 1-D")
        if o.shape[0] != entry["n_docs"]:
            raise DataError(path, f"doc_offsets has {o.shape[0]} entries, manifest says {entry['n_docs']}")
        doc_offsets = o[()]
        mask_offset = (loss_mask_offset(f, path, entry["n_tokens"])
                       if version == CHAT_FORMAT_VERSION else None)
    return ShardLayout(path, int(offset), int(entry["n_tokens"]), want_dtype, doc_offsets,
                       mask_offset)


def loss_mask_offset(f, path: str, n_tokens: int) -> int:
    """Byte offset in the open h5py file ``f`` of its loss_mask: uint8, 1-D, one per token,
    contiguous and inside the file.  Raises DataError naming ``path``."""
    import h5py

    d = f.get(LOSS_MASK_DSET)
    if not isinstance(d, h5py.Dataset):
        raise DataError(path, f"no dataset '{LOSS_MASK_DSET}' (a chat dataset, format_version "
                              f"{CHAT_FORMAT_VERSION})")
    if d.ndim != 1 or d.dtype != np.uint8 or d.shape[0] != n_tokens:
        raise DataError(path, f"loss_mask is {d.dtype}{list(d.shape)}, expected uint8 "
                              f"[{n_tokens}] (one per token)")
    offset = d.id.get_offset()
    if d.id.get_create_plist().get_layout() != h5py.h5d.CONTIGUOUS or offset is None:
        raise DataError(path, "loss_mask is not a contiguous uncompressed dataset")
    if offset + n_tokens > os.path.getsize(path):
        raise DataError(path, f"truncated (loss_mask ends at byte {offset + n_tokens}, file has "
                              f"{os.path.getsize(path)})")
    return int(offset)


# ----------------------------------------------------------------------------- manifest
def manifest_path(root: str) -> str:
    return os.path.join(root, MANIFEST_NAME)


def write_manifest(root: str, manifest: dict) -> None:
    """Write manifest.json atomically: temp file, fsync, os.replace, fsync dir. Deterministic."""
    final = manifest_path(root)
    tmp = tmp_path_for(final)
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(root)


def _load_manifest_json(root: str) -> dict:
    """manifest.json as a dict with a supported format_version (schema not checked yet)."""
    return load_manifest_json(root)[0]


def load_manifest_json(root: str) -> tuple[dict, bytes]:
    """(manifest.json as a dict with a supported format_version and kind, its bytes), read once by
    a caller that passes the dict on as ``loaded`` (read_manifest, read_blend_manifest,
    data_manifest, verify_dataset) and the bytes to what hashes them (the node cache's key)."""
    path = manifest_path(root)
    if not os.path.isfile(path):
        where = "" if os.path.isabs(root) else f" (a relative path: resolved from the current directory {os.getcwd()})"
        what = "missing" if os.path.isdir(root) else f"missing: {root} does not exist"
        raise DataError(path, f"{what} — not an hpctrain dataset or an incomplete shard run{where}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        m = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(path, f"unreadable ({e})") from None
    except RecursionError:
        raise DataError(path, "unreadable (JSON nested too deeply to parse): not a manifest "
                              "`shard` or `blend` wrote") from None
    if not isinstance(m, dict):
        raise DataError(path, "not a JSON object")
    if m.get("format_version") not in READABLE_VERSIONS:
        raise DataError(path, f"format_version {m.get('format_version')!r} unsupported "
                              f"(this code reads {', '.join(map(str, READABLE_VERSIONS))})")
    kind = m.get("kind", KIND_SHARDS)
    if kind not in (KIND_SHARDS, KIND_BLEND):
        raise DataError(path, f"unknown kind {kind!r} (this code reads {KIND_SHARDS!r}, "
                              f"{KIND_BLEND!r})")
    return m, raw


def manifest_kind(root: str) -> str:
    """The manifest's kind: KIND_SHARDS (a sharded dataset) or KIND_BLEND (a mixture)."""
    return _load_manifest_json(root).get("kind", KIND_SHARDS)


def _check_tokenizer(path: str, tok) -> None:
    if not (isinstance(tok, dict) and all(isinstance(tok.get(k), t) for k, t in
                                          (("name", str), ("vocab_size", int), ("eot_id", int)))):
        raise DataError(path, "tokenizer must be {name: str, vocab_size: int, eot_id: int}")
    if not 0 <= tok["eot_id"] < tok["vocab_size"]:
        raise DataError(path, f"eot_id {tok['eot_id']} outside vocab_size {tok['vocab_size']}")


def read_manifest(root: str, loaded: dict | None = None) -> dict:
    """Load and validate the manifest.json of a SHARDED dataset; raises DataError naming the
    manifest on any problem (including when ``root`` is a blend: see read_blend_manifest).
    ``loaded``: root's manifest.json as load_manifest_json returned it (not read again)."""
    path = manifest_path(root)
    m = _load_manifest_json(root) if loaded is None else loaded
    if m.get("kind", KIND_SHARDS) == KIND_BLEND:
        names = ", ".join(str(c.get("path")) for c in m.get("components", [])
                          if isinstance(c, dict))
        raise DataError(path, f"a blend of datasets (kind 'blend'; components: {names}), not a "
                              f"sharded dataset: use this command on its components")
    missing = [k for k in MANIFEST_KEYS if k not in m]
    if missing:
        raise DataError(path, f"missing keys {missing}")
    if (m["format_version"] == CHAT_FORMAT_VERSION) != (m.get("format") in MASKED_FORMATS):
        raise DataError(path, f"format_version {m['format_version']} with format "
                              f"{m.get('format')!r} (a chat or preference dataset is version "
                              f"{CHAT_FORMAT_VERSION} with format {FORMAT_CHAT!r} or "
                              f"{FORMAT_PREFERENCE!r})")
    tok = m["tokenizer"]
    _check_tokenizer(path, tok)
    if m["dtype"] != token_dtype(tok["vocab_size"]).name:
        raise DataError(path, f"dtype {m['dtype']!r} wrong for vocab_size {tok['vocab_size']}")
    for key in ("n_documents", "n_tokens"):
        d = m[key]
        if not (isinstance(d, dict) and all(isinstance(d.get(sp, 0), int) for sp in SPLITS)):
            raise DataError(path, f"{key} must map each split to an int")
    if not (isinstance(m["shard_tokens"], int) and m["shard_tokens"] > 0
            and isinstance(m["seed"], int) and isinstance(m["shards"], list)):
        raise DataError(path, "shard_tokens/seed must be ints and shards a list")
    seen = set()
    for i, s in enumerate(m["shards"]):
        if not isinstance(s, dict) or any(k not in s for k in SHARD_KEYS):
            raise DataError(path, f"shards[{i}] must have keys {list(SHARD_KEYS)}")
        match = SHARD_RE.match(str(s["file"]))
        if not match or match.group(1) != s["split"] or s["file"] in seen:
            raise DataError(path, f"shards[{i}] has a bad or duplicate file name {s['file']!r}")
        if not (isinstance(s["n_tokens"], int) and s["n_tokens"] > 0 and isinstance(s["n_docs"], int)
                and isinstance(s["bytes"], int) and isinstance(s["sha256"], str)):
            raise DataError(path, f"shards[{i}] needs positive int n_tokens, int n_docs/bytes, "
                                  f"str sha256")
        seen.add(s["file"])
    for split in SPLITS:
        got = sum(s["n_tokens"] for s in m["shards"] if s["split"] == split)
        if m["n_tokens"].get(split, 0) != got:
            raise DataError(path, f"n_tokens[{split}]={m['n_tokens'].get(split)} but shards sum to {got}")
    return m


def read_blend_manifest(root: str, loaded: dict | None = None) -> dict:
    """Load and validate the manifest.json of a BLEND (schema only: the components are resolved
    and checked against their recorded sha256 by data_tools.blend.resolve_blend). ``loaded`` as
    in read_manifest."""
    path = manifest_path(root)
    m = _load_manifest_json(root) if loaded is None else loaded
    if m.get("kind", KIND_SHARDS) != KIND_BLEND:
        raise DataError(path, "a sharded dataset, not a blend (kind 'blend')")
    missing = [k for k in BLEND_KEYS if k not in m]
    if missing:
        raise DataError(path, f"missing keys {missing}")
    _check_tokenizer(path, m["tokenizer"])
    if m["dtype"] != token_dtype(m["tokenizer"]["vocab_size"]).name:
        raise DataError(path, f"dtype {m['dtype']!r} wrong for vocab_size "
                              f"{m['tokenizer']['vocab_size']}")
    comps = m["components"]
    if not (isinstance(m["seed"], int) and m["seed"] >= 0 and isinstance(comps, list) and comps):
        raise DataError(path, "seed must be an int >= 0 and components a non-empty list")
    for i, c in enumerate(comps):
        if not isinstance(c, dict) or any(k not in c for k in COMPONENT_KEYS):
            raise DataError(path, f"components[{i}] must have keys {list(COMPONENT_KEYS)}")
        if not (isinstance(c["path"], str) and c["path"] and isinstance(c["manifest_sha256"], str)
                and isinstance(c["parts"], int) and c["parts"] > 0
                and isinstance(c["weight"], (int, float)) and c["weight"] > 0):
            raise DataError(path, f"components[{i}] needs a str path and manifest_sha256, "
                                  f"int parts > 0 and weight > 0")
    if m["period"] != sum(c["parts"] for c in comps):
        raise DataError(path, f"period {m['period']} != sum of the components' parts")
    return m


def shards_of(manifest: dict, split: str) -> list[dict]:
    """The manifest's shard entries for ``split``, in manifest (= token stream) order."""
    return [s for s in manifest["shards"] if s["split"] == split]
