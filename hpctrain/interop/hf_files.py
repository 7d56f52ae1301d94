"""The files of a Hugging Face model folder, as `save_pretrained` lays them out: weights in one
model.safetensors, or above a size in model-0000k-of-0000n.safetensors shards with a
model.safetensors.index.json (weight_map: name -> file), for `hpctrain export --format hf`.

Owns: the size parsing (`--max-shard-size`, "5GB" = 5 * 10**9 bytes as transformers counts), the
split into shards (in the given order; a tensor is never split; a tensor larger than the limit is a
shard of its own, as transformers does), their names and the index. Must never import transformers
or write anything but these files.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.errors import UserError

if TYPE_CHECKING:
    import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int, key: str = "--max-shard-size") -> int:
    """Bytes of "5GB", "200MB", "1.5GiB", "4096" (decimal units as transformers: 1GB = 10**9)."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
        if m is None:
            raise UserError(f"{key} {text!r}: expected a size such as 5GB, 500MB, 2GiB or bytes")
        size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if size <= 0:
        raise UserError(f"{key} {text!r}: must be more than 0 bytes")
    return size


def split_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in order, cut into groups of at most max_bytes (a bigger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def old_weight_files(out: Path) -> list[Path]:
    """Weight files a previous export left in `out` (replaced by --force)."""
    if not out.is_dir():
        return []
    return [p for p in out.iterdir() if p.name in (SINGLE, INDEX) or SHARD_RE.fullmatch(p.name)]


def save_weights(tensors: dict[str, torch.Tensor], out: Path, max_bytes: int) -> list[str]:
    """Write the weights into `out` (one file, or shards + index); returns the names written."""
    from safetensors.torch import save_file

    for old in old_weight_files(out):
        old.unlink()
    shards = split_shards(tensors, max_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    names, weight_map = [], {}
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update({t: name for t in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names + [INDEX]
