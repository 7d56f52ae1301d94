"""``verify`` and ``inspect``: check a dataset against its manifest; summarise it.

Owns: every integrity check of a finished dataset — manifest schema and cross-totals, each
shard's presence, size, sha256, HDF5 layout and attributes, token ids < vocab_size, document
offsets (monotonic, in range, each preceded by end-of-text), and per-split end-of-text counts.
``verify_dataset(path, shard_indices=...)`` lets the trainer spread the checksum work over ranks.

Must never: modify, create, or delete any file (everything is opened read-only), or stop at
the first bad shard when asked for all problems (the CLI then prints only the first).
"""
from __future__ import annotations

import os

import numpy as np

from .format import (FORMAT_PREFERENCE, KIND_BLEND, KIND_SHARDS, SHARD_RE, SPLITS, DataError, check_shard_size,
                     load_manifest_json, manifest_kind, manifest_path, open_shard_layout,
                     read_manifest, sha256_file, shards_of)

SCAN_TOKENS = 1 << 24  # tokens per chunk when scanning a shard


def check_manifest(root: str, m: dict) -> list[str]:
    """Cross-checks inside the manifest (schema itself is checked by read_manifest)."""
    mp = manifest_path(root)
    problems = []
    for split in SPLITS:
        shards = shards_of(m, split)
        names = [s["file"] for s in shards]
        want = [f"{split}_{k:05d}.h5" for k in range(len(shards))]
        if names != want:
            problems.append(f"{mp}: {split} shards are {names[:3]}…, expected {want[:3]}…")
        n_docs = sum(s["n_docs"] for s in shards)
        if m["n_documents"].get(split, 0) != n_docs:
            problems.append(f"{mp}: n_documents[{split}]={m['n_documents'].get(split)} but "
                            f"shards begin {n_docs} documents")
        for s in shards[:-1]:
            if s["n_tokens"] != m["shard_tokens"]:
                problems.append(f"{mp}: {s['file']} has {s['n_tokens']} tokens; every shard but "
                                f"the last of a split must have shard_tokens={m['shard_tokens']}")
        if shards and shards[-1]["n_tokens"] > m["shard_tokens"]:
            problems.append(f"{mp}: {shards[-1]['file']} exceeds shard_tokens")
    tok_file = m["tokenizer"].get("file")  # a trained tokenizer saved beside the shards
    if tok_file:
        tp = os.path.join(root, os.path.basename(str(tok_file)))
        if not os.path.isfile(tp):
            problems.append(f"{tp}: missing (listed in manifest as the tokenizer)")
        elif sha256_file(tp) != m["tokenizer"].get("sha256"):
            problems.append(f"{tp}: sha256 does not match the manifest's tokenizer.sha256")
    return problems


def check_shard(root: str, m: dict, entry: dict, checksums: bool = True) -> tuple[str | None, int]:
    """All checks of one shard.  Returns (problem or None, number of end-of-text tokens).
    ``checksums=False`` skips the two full-file passes (sha256, token-id range scan)."""
    path = os.path.join(root, entry["file"])
    vocab, eot = m["tokenizer"]["vocab_size"], m["tokenizer"]["eot_id"]
    try:
        check_shard_size(path, entry)
        digest = sha256_file(path) if checksums else entry["sha256"]
        if digest != entry["sha256"]:
            return (f"{path}: sha256 mismatch (manifest {entry['sha256'][:12]}…, "
                    f"file {digest[:12]}…)"), 0
        lay = open_shard_layout(path, entry, m)
    except DataError as e:
        return str(e), 0
    except OSError as e:
        return f"{path}: unreadable ({e.strerror or e})", 0
    toks = np.memmap(path, dtype=lay.dtype, mode="r", offset=lay.offset, shape=(lay.n_tokens,))
    n_eot = 0
    try:
        for a in range(0, lay.n_tokens if checksums else 0, SCAN_TOKENS):
            chunk = toks[a:a + SCAN_TOKENS]
            top = int(chunk.max())
            if top >= vocab:
                pos = a + int(np.argmax(chunk >= vocab))
                return (f"{path}: token id {int(toks[pos])} at position {pos} >= vocab_size "
                        f"{vocab}"), 0
            n_eot += int(np.count_nonzero(chunk == eot))
        if checksums and lay.mask_offset is not None:
            problem = _mask_problem(path, lay)
            if problem:
                return problem, 0
        offs = lay.doc_offsets
        if offs.size:
            if offs[0] < 0 or offs[-1] >= lay.n_tokens:
                return f"{path}: doc_offsets outside [0, {lay.n_tokens})", 0
            if np.any(np.diff(offs) <= 0):
                return f"{path}: doc_offsets not strictly increasing", 0
            inner = offs[offs > 0]
            if inner.size and np.any(toks[inner - 1] != eot):
                bad = int(inner[np.argmax(toks[inner - 1] != eot)])
                return f"{path}: document at offset {bad} does not follow an end-of-text token", 0
        split_shards = shards_of(m, entry["split"])
        if entry is split_shards[0] and (offs.size == 0 or offs[0] != 0):
            return f"{path}: first shard of {entry['split']} must start a document at offset 0", 0
        if entry is split_shards[-1] and int(toks[-1]) != eot:
            return f"{path}: last shard of {entry['split']} does not end with end-of-text", 0
    finally:
        del toks
    return None, n_eot


def _mask_problem(path: str, lay) -> str | None:
    """A chat shard's loss_mask (its length is checked by open_shard_layout) holds only 0/1."""
    mask = np.memmap(path, dtype=np.uint8, mode="r", offset=lay.mask_offset, shape=(lay.n_tokens,))
    try:
        bad = np.flatnonzero(mask > 1)
        return f"{path}: loss_mask value {int(mask[bad[0]])} at position {int(bad[0])} (0 or 1)" \
            if bad.size else None
    finally:
        del mask


def verify_dataset(path: str, shard_indices=None, checksums: bool = True,
                   loaded: dict | None = None) -> list[str]:
    """Problems found in the dataset at ``path`` (empty list = OK).  Each is one line starting
    with the offending file.  ``shard_indices`` (indices into manifest["shards"]) restricts the
    per-shard checks, e.g. ``range(rank, n, world)``; per-split end-of-text totals are only
    checked when all shards are verified with checksums.  ``checksums=False`` keeps the cheap
    checks (manifest, presence, size, HDF5 layout/attrs, doc offsets) and skips reading every
    byte (sha256 and the token-id range scan).  Read-only.  For a blend, the components are
    resolved and checked (data_tools.blend.resolve_blend) and ``shard_indices`` index the
    flattened shard list of ``data_tools.blend.data_manifest`` (every component's shards).
    ``loaded``: path's manifest.json as already read (format.load_manifest_json)."""
    try:
        loaded = load_manifest_json(path)[0] if loaded is None else loaded
        if loaded.get("kind", KIND_SHARDS) == KIND_BLEND:
            return verify_blend(path, shard_indices, checksums, loaded)
        m = read_manifest(path, loaded)
    except DataError as e:
        return [str(e)]
    problems = check_manifest(path, m)
    shards = m["shards"]
    indices = range(len(shards)) if shard_indices is None else list(shard_indices)
    eots = {s: 0 for s in SPLITS}
    for i in indices:
        if not 0 <= i < len(shards):
            problems.append(f"{manifest_path(path)}: no shard index {i} (has {len(shards)})")
            continue
        problem, n_eot = check_shard(path, m, shards[i], checksums)
        if problem:
            problems.append(problem)
        eots[shards[i]["split"]] += n_eot
    per_doc = 2 if m.get("format") == FORMAT_PREFERENCE else 1  # a pair: chosen, rejected
    if shard_indices is None and checksums and not problems:
        for s in SPLITS:
            if eots[s] != per_doc * m["n_documents"].get(s, 0):
                problems.append(f"{manifest_path(path)}: {s} has {eots[s]} end-of-text tokens but "
                                f"n_documents[{s}]={m['n_documents'].get(s, 0)}"
                                f"{' pairs' if per_doc == 2 else ''}")
    return problems


def verify_blend(path: str, shard_indices=None, checksums: bool = True,
                 loaded: dict | None = None) -> list[str]:
    """verify_dataset for a blend: the blend manifest and its components (present, unchanged
    since blending, one tokenizer), then each component exactly as verify_dataset checks it."""
    from .blend import resolve_blend, shard_bases

    try:
        _, comps = resolve_blend(path, loaded)
    except DataError as e:
        return [str(e)]
    bases = shard_bases(comps)
    total = bases[-1] + len(comps[-1].manifest["shards"])
    wanted = range(total) if shard_indices is None else list(shard_indices)
    problems = [f"{manifest_path(path)}: no shard index {i} (has {total})"
                for i in wanted if not 0 <= i < total]
    for c, base in zip(comps, bases):
        n = len(c.manifest["shards"])
        mine = [i - base for i in wanted if base <= i < base + n]
        problems += verify_dataset(c.path, None if shard_indices is None else mine, checksums)
    return list(dict.fromkeys(problems))


def stray_files(path: str, m: dict) -> list[str]:
    """Shard-named files in the directory that the manifest does not list (informational)."""
    listed = {s["file"] for s in m["shards"]}
    return sorted(f for f in os.listdir(path) if SHARD_RE.match(f) and f not in listed)


def describe_dataset(path: str) -> str:
    """Human-readable summary for ``inspect`` (reads only the manifest(s))."""
    if manifest_kind(path) == KIND_BLEND:
        from .blend import describe_blend

        return describe_blend(path)
    m = read_manifest(path)
    tok = m["tokenizer"]
    lines = [f"dataset {path}",
             f"  format_version {m['format_version']}, tokenizer {tok['name']} "
             f"(vocab_size {tok['vocab_size']}, eot_id {tok['eot_id']}), dtype {m['dtype']}",
             f"  seed {m['seed']}, val_fraction {m['val_fraction']}, "
             f"shard_tokens {m['shard_tokens']:,}"]
    for split in SPLITS:
        shards = shards_of(m, split)
        size = sum(s["bytes"] for s in shards)
        lines.append(f"  {split:5s}: {m['n_documents'].get(split, 0):,} documents, "
                     f"{m['n_tokens'].get(split, 0):,} tokens, {len(shards)} shards, "
                     f"{size / 1e6:.1f} MB")
    extra = stray_files(path, m)
    if extra:
        lines.append(f"  note: {len(extra)} shard files not in the manifest, e.g. {extra[0]}")
    return "\n".join(lines)
