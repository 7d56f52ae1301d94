"""``blend``: a weighted mixture of sharded datasets, described by a manifest (no token copies).

Owns: parsing ``DIR:WEIGHT`` inputs, turning weights into the integer ``parts`` the trainer's
mixture sampler interleaves (exact ratios up to a period of MAX_PERIOD samples), writing a blend
directory (only ``manifest.json``), resolving a blend back into its components (paths relative
to the blend, each component manifest checked against the sha256 recorded at blend time, one
shared tokenizer), the flattened shard list that verify / the node cache / the trainer index
(every component's shards in component order, cache names ``c<i>-<file>``), and ``inspect``'s
summary of a blend.  Refuses, before writing anything, weights its reader could not read back (a
float must hold each weight and each weight's share of the sum); holds the output's lock
(output_lock.py) while writing.

Must never: read or copy token data, decide the sample order (hpctrain.data.mixture does), or
accept a component that is itself a blend.  See docs/data.md ("Blends").
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from fractions import Fraction

from .format import (KIND_BLEND, KIND_SHARDS, MANIFEST_NAME, SPLITS, TMP_PREFIX, DataError,
                     FORMAT_CHAT, FORMAT_VERSION, load_manifest_json, manifest_kind, manifest_path,
                     read_blend_manifest, read_manifest, write_manifest)
from .output_lock import OutputLock

MAX_PERIOD = 1 << 16  # largest sum of parts: weights are exact up to this resolution
DEFAULT_BLEND_SEED = 0


@dataclass(frozen=True)
class Component:
    """One resolved component of a blend."""
    index: int
    path: str          # as usable from the current directory
    manifest: dict     # its validated (sharded) manifest
    weight: float      # normalized weight requested at blend time
    parts: int         # integer share of every period of the interleaving


def parse_weight(text: str, where: str) -> Fraction:
    """A positive number a float can hold ("0.7", "3", "1/3", "2e-3") as an exact fraction;
    DataError naming the weight for anything else (inf, nan, 0, 1e400, 1e-400)."""
    text = text.strip()
    try:  # each side as a float first: Fraction("1e999999999") would build a 10**999999999
        sides = [float(side) for side in text.split("/", 1)]
        if any(math.isnan(x) for x in sides):
            raise ValueError(text)
        w = Fraction(text) if all(math.isfinite(x) for x in sides) else None
    except (ValueError, ZeroDivisionError):
        raise DataError(where, f"weight {text!r} is not a number") from None
    if w is not None and w <= 0:
        raise DataError(where, f"weight {text!r} must be > 0")
    if w is None or not 0 < abs(_as_float(w)) < math.inf:
        raise DataError(where, f"weight {text!r} is outside what a float can hold "
                               f"(a positive float: ~5e-324 to ~1.8e308); scale the weights into that range")
    return w


def _as_float(w: Fraction) -> float:
    try:
        return float(w)
    except OverflowError:
        return math.inf


def _check_normalised(paths, weights) -> None:
    """Every weight / the sum must be a float > 0 (else the manifest's reader rejects it)."""
    total = sum(weights)
    for p, w in zip(paths, weights):
        if _as_float(w / total) == 0.0:
            raise DataError(p, f"weight {float(w):g} is too small next to the sum of all weights "
                               f"({float(total):g}): its share underflows to 0; raise it or "
                               f"leave the dataset out")


def parse_input(spec: str) -> tuple[str, Fraction]:
    """``DIR:WEIGHT`` -> (DIR, weight); the last ':' separates them (DIR may contain ':')."""
    if ":" not in spec:
        raise DataError(spec, "expected DIR:WEIGHT (e.g. data/web:0.7)")
    path, weight = spec.rsplit(":", 1)
    if not path:
        raise DataError(spec, "empty dataset directory before ':'")
    return path, parse_weight(weight, path)


def apportion(weights) -> list[int]:
    """Smallest integers with exactly the ratios of ``weights`` (Fractions) when their sum is <=
    MAX_PERIOD; else each weight rounded to a share of MAX_PERIOD (>= 1), then reduced."""
    lcm = math.lcm(*(w.denominator for w in weights))
    ints = [int(w * lcm) for w in weights]
    g = math.gcd(*ints)
    parts = [i // g for i in ints]
    if sum(parts) > MAX_PERIOD:
        total = sum(weights)
        parts = [max(1, round(w / total * MAX_PERIOD)) for w in weights]
        while sum(parts) > MAX_PERIOD:  # the >= 1 floors pushed it over: take from the largest
            parts[parts.index(max(parts))] -= 1
        g = math.gcd(*parts)
        parts = [p // g for p in parts]
    return parts


def sha256_bytes_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _tokenizer_key(tok: dict) -> tuple:
    return tok["name"], tok["vocab_size"], tok["eot_id"], tok.get("sha256")


def _describe_tok(tok: dict) -> str:
    return f"{tok['name']} (vocab_size {tok['vocab_size']}, eot_id {tok['eot_id']})"


def _read_component(path: str) -> dict:
    if os.path.isfile(manifest_path(path)) and manifest_kind(path) == KIND_BLEND:
        raise DataError(path, "is itself a blend; blends of blends are not supported (list its "
                              "components instead)")
    m = read_manifest(path)
    if m.get("format") == FORMAT_CHAT:  # a blend's reader would train on every token
        raise DataError(manifest_path(path), "a chat dataset (format 'chat', with loss masks): "
                                             "blends do not carry loss masks; train on it directly")
    return m


def _prepare_output(out: str, inputs: list[str]) -> None:
    """``out`` must be new, empty, or a previous blend (its manifest is replaced)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(out, "exists and is not a directory")
    real_out = os.path.realpath(out)
    for p in inputs:
        if os.path.realpath(p) == real_out:
            raise DataError(out, "is also an input; write the blend to a new directory")
    os.makedirs(out, exist_ok=True)
    entries = sorted(e for e in os.listdir(out) if not e.startswith(TMP_PREFIX))
    if entries and (entries != [MANIFEST_NAME] or manifest_kind(out) != KIND_BLEND):
        raise DataError(out, f"not empty and not a blend (found {entries[0]!r}); refusing to "
                             f"overwrite — use a new or empty directory")


def blend_datasets(inputs, output: str, seed: int = DEFAULT_BLEND_SEED) -> dict:
    """Write ``output/manifest.json`` describing the mixture ``inputs`` = [(DIR, weight), ...]
    (weights: numbers or strings, any positive scale).  Returns the manifest."""
    if not inputs:
        raise DataError(output, "blend needs at least one --input DIR:WEIGHT")
    if not isinstance(seed, int) or seed < 0:
        raise DataError(output, f"seed must be an int >= 0, got {seed!r}")
    paths = [str(p) for p, _ in inputs]
    weights = [w if isinstance(w, Fraction) else parse_weight(str(w), str(p)) for p, w in inputs]
    seen = {}
    for p in paths:
        real = os.path.realpath(p)
        if real in seen:
            raise DataError(p, f"listed twice (also as {seen[real]}); give it one weight")
        seen[real] = p
    manifests = [_read_component(p) for p in paths]
    tok = manifests[0]["tokenizer"]
    for p, m in zip(paths, manifests):
        if _tokenizer_key(m["tokenizer"]) != _tokenizer_key(tok):
            raise DataError(manifest_path(p), f"tokenizer {_describe_tok(m['tokenizer'])} differs "
                                              f"from {paths[0]}'s {_describe_tok(tok)}; all blend "
                                              f"components must share one tokenizer")
        if not m["n_tokens"].get("train", 0):
            raise DataError(manifest_path(p), "has no train tokens; it cannot be blended")
    _check_normalised(paths, weights)
    with OutputLock(output):
        return _write_blend(output, paths, weights, manifests, tok, seed)


def _write_blend(output, paths, weights, manifests, tok, seed) -> dict:
    _prepare_output(output, paths)
    parts, total = apportion(weights), sum(weights)
    out_abs = os.path.abspath(output)
    components = []
    for p, w, m, k in zip(paths, weights, manifests, parts):
        try:
            rel = os.path.relpath(os.path.abspath(p), out_abs)
        except ValueError:  # another drive (Windows): keep it absolute
            rel = os.path.abspath(p)
        components.append({"path": rel, "manifest_sha256": sha256_bytes_of(manifest_path(p)),
                           "weight": float(w / total), "parts": k,
                           "n_tokens": {s: m["n_tokens"].get(s, 0) for s in SPLITS},
                           "n_documents": {s: m["n_documents"].get(s, 0) for s in SPLITS}})
    manifest = {"format_version": FORMAT_VERSION, "kind": KIND_BLEND, "seed": int(seed),
                "tokenizer": {k: v for k, v in tok.items() if k != "file"},
                "dtype": manifests[0]["dtype"], "period": sum(parts), "components": components}
    write_manifest(output, manifest)
    return manifest


def is_blend(path: str) -> bool:
    return manifest_kind(path) == KIND_BLEND


def resolve_blend(root: str, loaded: dict | None = None) -> tuple[dict, list[Component]]:
    """The blend manifest and its components, each checked: manifest present and unchanged
    (sha256 as recorded), a sharded dataset, the blend's tokenizer.  DataError names the file."""
    m = read_blend_manifest(root, loaded)  # loaded: root's manifest.json, already read
    out = []
    for i, c in enumerate(m["components"]):
        path = c["path"] if os.path.isabs(c["path"]) else os.path.normpath(
            os.path.join(root, c["path"]))
        mp = manifest_path(path)
        if not os.path.isfile(mp):
            raise DataError(mp, f"missing (component {i} of the blend {manifest_path(root)})")
        digest = sha256_bytes_of(mp)
        if digest != c["manifest_sha256"]:
            raise DataError(mp, f"changed since the blend was made (sha256 {digest[:12]}…, blend "
                                f"{manifest_path(root)} recorded {c['manifest_sha256'][:12]}…); "
                                f"re-run `python -m data_tools blend`")
        cm = _read_component(path)
        if _tokenizer_key(cm["tokenizer"]) != _tokenizer_key(m["tokenizer"]):
            raise DataError(mp, f"tokenizer {_describe_tok(cm['tokenizer'])} differs from the "
                                f"blend's {_describe_tok(m['tokenizer'])}")
        out.append(Component(i, path, cm, float(c["weight"]), int(c["parts"])))
    return m, out


def cache_name(index: int, file: str) -> str:
    """Name of component ``index``'s shard ``file`` in a node cache (format.CACHED_SHARD_RE)."""
    return f"c{index}-{file}"


def shard_bases(components: list[Component]) -> list[int]:
    """Index of each component's first shard in the flattened shard list."""
    bases, n = [], 0
    for c in components:
        bases.append(n)
        n += len(c.manifest["shards"])
    return bases


def data_manifest(path: str, loaded: dict | None = None) -> dict:
    """What the trainer, verify and the node cache index: a sharded dataset's manifest as is, or
    for a blend a manifest-like dict whose ``shards`` are all components' shards in component
    order, each with ``file`` = its cache name, ``src`` = its path and ``component`` = its index
    (plus the blend's tokenizer, dtype, ``kind`` and ``components``). manifest.json is read once
    (not at all when given as ``loaded``)."""
    loaded = load_manifest_json(path)[0] if loaded is None else loaded
    if loaded.get("kind", KIND_SHARDS) != KIND_BLEND:
        return read_manifest(path, loaded)
    m, comps = resolve_blend(path, loaded)
    shards = [dict(e, file=cache_name(c.index, e["file"]), src=os.path.join(c.path, e["file"]),
                   component=c.index) for c in comps for e in c.manifest["shards"]]
    n_tokens = {s: sum(c.manifest["n_tokens"].get(s, 0) for c in comps) for s in SPLITS}
    return {"kind": KIND_BLEND, "tokenizer": m["tokenizer"], "dtype": m["dtype"],
            "seed": m["seed"], "period": m["period"], "shards": shards, "n_tokens": n_tokens,
            "components": [c.path for c in comps]}


def describe_blend(path: str, tokens: int | None = None) -> str:
    """Summary for ``blend`` and ``inspect``: per component its weight, tokens per split and how
    many passes over its train split the mixture makes (per ``tokens`` of training if given,
    else how many mixture tokens one pass takes)."""
    m, comps = resolve_blend(path)
    tok = m["tokenizer"]
    lines = [f"blend {path}: {len(comps)} components, tokenizer {_describe_tok(tok)}, "
             f"seed {m['seed']}, period {m['period']} samples"]
    for c in comps:
        eff = c.parts / m["period"]
        w = f"weight {c.weight:.4f}" + (f" (effective {eff:.6f})" if abs(eff - c.weight) > 1e-9
                                         else "")
        train = c.manifest["n_tokens"].get("train", 0)
        if tokens:
            passes = f"{tokens * eff / train:,.2f} epochs of its train split in {tokens:,} tokens"
        else:
            passes = f"one epoch of its train split per {train / eff:,.0f} mixture tokens"
        lines.append(f"  [{c.index}] {c.path}: {w}, train {train:,} tokens, val "
                     f"{c.manifest['n_tokens'].get('val', 0):,} tokens; {passes}")
    return "\n".join(lines)


__all__ = ["MAX_PERIOD", "Component", "apportion", "blend_datasets", "data_manifest",
           "describe_blend", "is_blend", "parse_input", "resolve_blend", "shard_bases"]
