"""Peer snapshots' files on a node and on the wire: listing a node's snapshot folder, moving files
between ranks over a gloo group, and choosing the snapshot a relaunch resumes from.

Owns: what a node's snapshot folder looks like (`step_NNNNNNNN[.tmp]/`, the checkpoint disk format
of disk_format.py; COMMIT.json is the snapshot's COMPLETE marker and lists the files of the WHOLE
snapshot, while one node holds only its own ranks' files, its buddies' and rank 0's metadata), the
node listing every rank contributes to the resume's one allgather (`list_node`), the choice of
the newest complete snapshot the surviving nodes cover (`choose`), and the point-to-point file
transfers (`send_files` / `recv_files`: a length header, then one uint8 tensor).

It must never decide when to snapshot (snapshot.py does), run a collective of its own choosing
(every transfer here is one half of a pair both ranks derive from the same gathered data), follow
a symlink in a snapshot folder, or unpickle anything.
"""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import torch
import torch.distributed as dist

from hpctrain.checkpoint import disk_format
from hpctrain.distributed.run_lock import stop_if_taken_over

COMMIT = disk_format.COMMIT_FILE
_DATA_NAME = re.compile(r"__\d+_\d+\.distcp")  # DCP's data files: __<rank>_<n>.distcp


def _regular_files(folder: Path) -> dict[str, int]:
    """{name: size} of the regular files in `folder` (symlinks and sub-folders ignored)."""
    out = {}
    for entry in os.scandir(folder):
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            out[entry.name] = st.st_size
    return out


def list_node(root: Path | None) -> dict[int, dict]:
    """{step: {"commit": COMMIT.json's content or None, "files": {name: size}}} of the committed
    (not .tmp) snapshot folders of this node's `root` (None or absent: {})."""
    found = {}
    if root is None or not root.is_dir():
        return found
    for entry in os.scandir(root):
        parsed = disk_format.parse_dir_name(entry.name)
        if not parsed or parsed[1] != "checkpoint" or not entry.is_dir(follow_symlinks=False):
            continue
        folder = root / entry.name
        files = _regular_files(folder)
        commit = None
        if COMMIT in files:
            try:
                commit = json.loads((folder / COMMIT).read_bytes())
            except (OSError, ValueError):
                commit = None
        found[parsed[0]] = {"commit": commit, "files": files}
    return found


def choose(listings: list[tuple[int, dict]], run_key: str, damaged: dict | None = None):
    """The newest snapshot the surviving nodes can rebuild: (step, commit, {file: [nodes holding
    it]}), or (None, problems) where none can: problems names the newest incomplete one's missing
    file or marker. `listings`: one (node, list_node()) per node; `damaged`: {(step, file): "is
    damaged on node N (...)"} for the files some node's copy of failed its checksum (dropped from its
    listing), named as such in the problems."""
    damaged = damaged or {}
    steps = sorted({s for _, lst in listings for s in lst}, reverse=True)
    problems = []
    for step in steps:
        commits = [lst[step]["commit"] for _, lst in listings if step in lst and lst[step]["commit"]]
        commit = next((c for c in commits if isinstance(c, dict) and c.get("run") == run_key), None)
        name = disk_format.step_dir_name(step)
        if commit is None:
            problems.append(f"{name}/{COMMIT} is missing on every surviving node (an unfinished "
                            f"snapshot)" if not commits else f"{name}/{COMMIT} is of another run")
            continue
        holders, missing = {}, []
        for rel, entry in sorted((commit.get("files") or {}).items()):
            nodes = [n for n, lst in listings
                     if step in lst and lst[step]["files"].get(rel) == (entry or {}).get("size")]
            holders[rel] = nodes
            if not nodes:
                missing.append(rel)
        if missing:
            why = (f"{damaged[step, missing[0]]} and no other surviving node holds an intact copy"
                   if (step, missing[0]) in damaged else "is on no surviving node")
            problems.append(f"{name}/{missing[0]} {why}"
                            + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
            continue
        holders[COMMIT] = [n for n, lst in listings if step in lst and lst[step]["commit"] == commit]
        return step, commit, holders
    return None, problems


def transfers(holders: dict[str, list[int]], leaders: dict[int, int]) -> list[tuple[str, int, int]]:
    """(file, from rank, to rank) so that every node's leader ends with every file: each missing
    file comes from the leader of the first node holding it; COMMIT.json last (the marker is
    written after the files it lists)."""
    order = sorted(holders, key=lambda rel: (rel == COMMIT, rel))
    moves = []
    for node, leader in sorted(leaders.items()):
        for rel in order:
            if node not in holders[rel]:
                moves.append((rel, leaders[holders[rel][0]], leader))
    return moves


def send_file(path: Path, dst: int, group) -> None:
    """Send one file's bytes to rank `dst` (its size first)."""
    data = read_tensor(path)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst, group=group)
    if data.numel():
        dist.send(data, dst, group=group)


def recv_file(path: Path, src: int, group) -> None:
    """Receive a file sent by `send_file` from rank `src` into `path` (written then renamed)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    if data.numel():
        dist.recv(data, src, group=group)
    write_tensor(path, data)


def pack(folder: Path, names: list[str]) -> tuple[bytes, bytes]:
    """(header: JSON [[name, size], ...], body: the files' bytes back to back)."""
    blobs = [(name, (folder / name).read_bytes()) for name in names]
    header = json.dumps([[name, len(b)] for name, b in blobs]).encode()
    return header, b"".join(b for _, b in blobs)


def unpack(folder: Path, header: bytes, body: bytes) -> list[str]:
    """Write the files of a `pack` into `folder`; their names."""
    offset, names = 0, []
    for name, size in json.loads(header):
        if not (_DATA_NAME.fullmatch(name) or name in disk_format.SMALL_FILES):
            raise ValueError(f"refusing the file name {name!r} from a peer")
        stop_if_taken_over(folder / name)
        (folder / name).write_bytes(body[offset:offset + size])
        offset += size
        names.append(name)
    return names


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def read_tensor(path: Path) -> torch.Tensor:
    """A file's bytes as a uint8 tensor (one copy: read into its buffer)."""
    buf = bytearray(path.stat().st_size)
    with open(path, "rb", buffering=0) as f:
        view, done = memoryview(buf), 0
        while done < len(buf):
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"{path}: shorter than its size while read")
            done += n
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


def write_tensor(path: Path, data: torch.Tensor) -> None:
    """A uint8 tensor's bytes into `path` (written as `<name>.part`, then renamed). A rank of a launch
    that a newer one took over (frozen past its relaunch) ends here instead (run_lock.stop_if_taken_over):
    the node's snapshot folder is the run's, and the newer launch writes into it."""
    stop_if_taken_over(path)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(memoryview(data.numpy()))
    os.replace(tmp, path)


def _wait_all(works) -> None:
    for w in works:
        w.wait()


def exchange(folder: Path, names: list[str], dst: int | None, sources: list[int], group) -> list[str]:
    """Send the files `names` of `folder` to rank `dst` (None: no buddy) while receiving into
    `folder` the files each of `sources` sends (non-blocking on both sides, so a ring of
    buddies cannot deadlock; one tensor per file, no concatenation). The names received."""
    header = json.dumps([[n, (folder / n).stat().st_size] for n in names]).encode() if dst is not None else b""
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in sources]
    works = [dist.irecv(t, src, group=group) for t, src in zip(lengths, sources)]
    if dst is not None:
        works.append(dist.isend(torch.tensor([len(header)], dtype=torch.int64), dst, group=group))
    _wait_all(works)
    headers = [torch.empty(int(n.item()), dtype=torch.uint8) for n in lengths]
    works = [dist.irecv(h, src, group=group) for h, src in zip(headers, sources) if h.numel()]
    if header:
        works.append(dist.isend(_as_tensor(header), dst, group=group))
    _wait_all(works)
    incoming, works = [], []
    for h, src in zip(headers, sources):
        for name, size in json.loads(h.numpy().tobytes() or b"[]"):
            if not (_DATA_NAME.fullmatch(name) or name in disk_format.SMALL_FILES):
                raise ValueError(f"refusing the file name {name!r} from rank {src}")
            buf = torch.empty(size, dtype=torch.uint8)
            incoming.append((name, buf))
            if size:
                works.append(dist.irecv(buf, src, group=group))
    outgoing = [read_tensor(folder / n) for n in names] if dst is not None else []
    works += [dist.isend(t, dst, group=group) for t in outgoing if t.numel()]
    _wait_all(works)
    for name, buf in incoming:
        write_tensor(folder / name, buf)
    return [name for name, _ in incoming]
