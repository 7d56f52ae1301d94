"""What an offline W&B run holds: the history rows of its `run-<id>.wandb` file (what `wandb sync`
uploads), read back so that a resumed run logs exactly the steps W&B does not have yet.

Owns reading W&B's transaction log, a LevelDB-style log: a 7-byte file header (":W&B", magic 0xBEE1,
version 0), then 32 KiB blocks of chunks, each a 7-byte header (CRC-32, length, type: 1 full,
2 first, 3 middle, 4 last) and its bytes, a block's last < 7 bytes zero padding; each whole record
a wandb.proto `Record`. wandb 0.31 has no Python reader of it (its reader is in wandb-core). A file
cut short by a kill ends at its last whole record. A file in another format (a later wandb) raises
ValueError: the caller falls back (wandb_log.py).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
FILE_HEADER = (b":W&B", 0xBEE1, 0)


def records(path: str | Path):
    """The wandb.proto Records of one `run-<id>.wandb` file, in order (up to a torn end)."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if len(data) < HEADER or struct.unpack("<4sHB", data[:HEADER]) != FILE_HEADER:
        raise ValueError(f"{path}: not a W&B transaction log of format version 0")
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # padding at the end of a block
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind not in (FULL, FIRST, MIDDLE, LAST) or pos + HEADER + length > len(data):
            return  # zeros past the end of what was written, or a chunk cut short
        parts.append(data[pos + HEADER:pos + HEADER + length])
        pos += HEADER + length
        if kind in (FULL, LAST):
            rec = pb.Record()
            try:
                rec.ParseFromString(b"".join(parts))
            except DecodeError:
                return
            parts = []
            yield rec


def history(path: str | Path) -> list[dict]:
    """The history rows of one run file: {"_step": N, tag: value, ...}, in the order logged."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def run_files(root: str | Path, run_id: str) -> list[Path]:
    """The transaction logs of W&B run `run_id` under `root` (a WANDB_DIR: `root/wandb/...`), one
    per start of the run, oldest first."""
    found = Path(root).glob(f"wandb/*run-*-{run_id}/run-{run_id}.wandb")
    return sorted(found, key=lambda p: p.parent.name.split("run-", 1)[1])


def last_step(files: list[Path]) -> int | None:
    """The last step the files' history holds (None: no row)."""
    steps = [row["_step"] for f in files for row in history(f) if "_step" in row]
    return max(steps, default=None)
