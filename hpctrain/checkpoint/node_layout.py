"""The per-node checkpoint layout (`checkpoint.layout = "node"`): one tensor data file per node.

Owns: the node groups (one gloo group per node, made collectively next to the manager's save
group), and `NodeLayoutWriter`, DCP's FileSystemWriter whose `write_data` serializes this rank's
items in memory exactly as DCP would write them to `__<rank>_<n>.distcp`, then hands the bytes to
the node's leader (its lowest rank) over the node group; the leader writes them back to back into
one `__node<k>.distcp` (through the manager's RecordingFileSystem: hashed while written, faults,
pacing) and every rank's WriteResults point into it (relative path, offset + where its bytes
start). DCP's reader reads by that metadata, so a load (and resharding) does not care which layout
wrote a checkpoint. On a parallel filesystem this divides the files (and metadata operations) of a
save by the ranks per node.

It must never leave a node peer waiting: every rank of a node takes part in the size exchange, and
a leader that fails to write still receives every member's bytes before it raises. A rank whose
serialization failed raises (DCP agrees it across ranks); its peers then write nothing.
"""
from __future__ import annotations

import dataclasses
import io
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.futures import Future

WRITE_CHUNK = 8 << 20  # bytes per write call of the node file


@dataclasses.dataclass
class NodeGroup:
    """This rank's node: its index, the node's global ranks (leader first), and its gloo group
    (None with one process)."""
    index: int
    ranks: list
    group: object = None

    @property
    def leader(self) -> int:
        return self.ranks[0]


def make_node_group(rank: int, node_id, timeout, group=None) -> NodeGroup:
    """Collective over the world (every rank calls it, once; the ids gathered on `group`, e.g. the
    manager's gloo save group): group ranks by `node_id` (anything comparable the ranks of a node
    share, e.g. DistContext.node_rank) into one gloo group per node, nodes ordered by their lowest
    rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return NodeGroup(0, [rank])
    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, node_id, group=group)
    nodes: dict = {}
    for r, nid in enumerate(ids):
        nodes.setdefault(nid, []).append(r)
    mine = None
    for index, ranks in enumerate(sorted(nodes.values())):
        group = dist.new_group(ranks, backend="gloo", timeout=timeout)  # every rank, every node
        if rank in ranks:
            mine = NodeGroup(index, ranks, group)
    return mine


class _MemoryStream(io.BytesIO):
    """What DCP writes one file into; DCP closes it at the end: the bytes stay."""

    def close(self):
        pass


class _MemoryFileSystem(FileSystem):
    """DCP's FileSystem for write_data, keeping each file's bytes in memory by name."""

    def __init__(self):
        super().__init__()
        self.files: dict[str, _MemoryStream] = {}

    def concat_path(self, path, suffix):
        return suffix

    @contextmanager
    def create_stream(self, path, mode):
        stream = self.files.setdefault(str(path), _MemoryStream())
        yield stream


class NodeLayoutWriter(FileSystemWriter):
    """FileSystemWriter writing one data file per node (module docstring). `fs` is set by the
    caller (the manager's RecordingFileSystem) like for FileSystemWriter."""

    def __init__(self, path, node: NodeGroup, **kwargs):
        super().__init__(path, **kwargs)
        self.node = node

    def node_file(self) -> str:
        return f"__node{self.node.index}.distcp"

    def write_data(self, plan, planner):
        real_fs, sync = self.fs, self.sync_files
        self.fs, self.sync_files = _MemoryFileSystem(), False
        blob = None
        try:
            results = super().write_data(plan, planner).wait()
            blob, starts = _concatenate(self.fs.files)
        finally:  # a rank that failed still tells its node (size None): nobody waits for it
            self.fs, self.sync_files = real_fs, sync
            sizes = self._exchange_sizes(None if blob is None else len(blob))
        if None in sizes:  # a peer's serialization failed: it raises, DCP fails the save
            return _done(results)
        base = sum(sizes[:self.node.ranks.index(_rank(self.node))])
        name = self.node_file()
        results = [dataclasses.replace(r, storage_data=dataclasses.replace(
            r.storage_data, relative_path=name,
            offset=base + starts[r.storage_data.relative_path] + r.storage_data.offset))
            for r in results]
        if _rank(self.node) == self.node.leader:
            self._write_node_file(blob, sizes)
        elif blob:
            dist.send(torch.frombuffer(blob, dtype=torch.uint8), self.node.leader,
                      group=self.node.group)
        return _done(results)

    def _exchange_sizes(self, size) -> list:
        if self.node.group is None or len(self.node.ranks) == 1:
            return [size]
        out = [None] * len(self.node.ranks)
        dist.all_gather_object(out, size, group=self.node.group)
        return out

    def _write_node_file(self, blob, sizes: list) -> None:
        """The leader: its bytes, then each member's, into the node's one file; the next member's
        bytes arrive while the previous ones are written (at most two members' in memory). After a
        failure it still receives the remaining members' bytes (they wait in send)."""
        incoming = _Incoming(list(zip(self.node.ranks[1:], sizes[1:])), self.node.group)
        try:
            with self.fs.create_stream(self.fs.concat_path(self.path, self.node_file()), "wb") as stream:
                _write_chunks(stream, blob)
                for data in incoming:
                    _write_chunks(stream, data)
                if self.sync_files:
                    stream.flush()
                    _fsync(stream)
        finally:
            for _ in incoming:  # drained after a failure
                pass


class _Incoming:
    """The members' bytes in order, each receive posted while the previous bytes are written."""

    def __init__(self, members: list, group):
        self.members, self.group = members, group
        self.pending = self._post(0)

    def _post(self, i: int):
        if i >= len(self.members):
            return None
        member, size = self.members[i]
        buf = torch.empty(size, dtype=torch.uint8)
        work = dist.irecv(buf, member, group=self.group) if size else None
        return i, buf, work

    def __iter__(self):
        return self

    def __next__(self) -> memoryview:
        if self.pending is None:
            raise StopIteration
        i, buf, work = self.pending
        if work is not None:
            work.wait()
        self.pending = self._post(i + 1)
        return memoryview(buf.numpy())


def _write_chunks(stream, data) -> None:
    """In WRITE_CHUNK pieces: a background save's pacer sleeps between them (background.py)."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), WRITE_CHUNK):
        stream.write(view[start:start + WRITE_CHUNK])


def _fsync(stream) -> None:
    try:
        os.fsync(stream.fileno())
    except (AttributeError, io.UnsupportedOperation):
        os.sync()


def _rank(node: NodeGroup) -> int:
    return dist.get_rank() if node.group is not None else node.ranks[0]


def _concatenate(files: dict) -> tuple[bytearray | memoryview, dict]:
    """This rank's in-memory files back to back (sorted by name): (bytes, {name: start}); one
    file (one writer thread) is handed over as it is, without a copy."""
    if len(files) == 1:
        (name, stream), = files.items()
        return stream.getbuffer(), {name: 0}
    blob, starts = bytearray(), {}
    for name in sorted(files):
        starts[name] = len(blob)
        blob += files[name].getbuffer()
    return blob, starts


def _done(results) -> Future:
    fut = Future()
    fut.set_result(results)
    return fut
