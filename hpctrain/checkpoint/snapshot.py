"""Peer snapshots: every `checkpoint.snapshot_interval` steps each rank's checkpoint state goes into
node-local memory on its own node AND on a buddy node, so that a relaunch after losing any one
node resumes from the survivors' memory instead of the parallel file system.

Owns the snapshot's protocol. `save` (main thread, every rank at the same step): the Stateful
objects' state dicts (the PFS checkpoint's own: model, optimizer, sampler, RNG, trainer, sync),
staged into host memory (background.stage: each replicated tensor by one rank; GPU shards into
pinned blocks given back once written, shared with async checkpoints); then a
background thread, one in flight: (1) every rank writes its DCP shard into `step_N.tmp-<launch id>/` of ITS
node's snapshot folder (rank 0 also the JSON files), (2) sends its data files to its buddy (the
same local rank on node (n+1) mod nodes) and receives its sources' files; rank 0's metadata files
reach every node, (3) an agreement, (4) each node's leader writes COMMIT.json (the COMPLETE
marker: every file of the whole snapshot, sizes and checksums) and renames the folder to
`step_N/`, removing older steps. All of it on a gloo group of its own (never the training group,
never NCCL). A failed snapshot never stops training: one warning line, and the PFS checkpoint
stays the fallback. `resume` (collective, before the PFS checkpoint is looked at): one allgather
of what every node holds, the newest snapshot the survivors cover (snapshot_io.choose), the
missing files copied node to node, and the path of this node's complete copy, which the trainer
loads like a PFS checkpoint (DCP reshards it to the new layout).

The node folder: `checkpoint.snapshot_dir` ("auto": $SLURM_TMPDIR, else /dev/shm; `{node}` is
replaced by the node's index, and HPCTRAIN_RANKS_PER_NODE's pretend nodes get `node<i>/` each, as
data.cache_dir does), then `hpctrain-<uid>/snapshots-<hash of run.dir>/`, opened like the data
cache's private folders (hpctrain/data/private_dir.py). A relaunch on the same nodes finds it with
nothing to configure; a clean end of the run removes it.

It must never write into the PFS checkpoint directory, block training on a snapshot's failure, or
run a collective on the training group. The node folder belongs to the run, so a relaunch writes
into the same one: like the PFS checkpoint's writes, every file, mkdir, rename and removal here
first checks the run lock's fence (run_lock.stop_if_taken_over; DCP's through RecordingFileSystem):
a rank of an older launch frozen past the relaunch ends with exit 2 instead of committing its old
step over the newer launch's snapshot and pruning the newer steps.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from hpctrain import logs
from hpctrain.checkpoint import background, disk_format, snapshot_io
from hpctrain.checkpoint.dcp_io import describe, no_zip_crc32
from hpctrain.checkpoint.snapshot_resume import SnapshotResume
from hpctrain.checkpoint.state import json_part, split_state
from hpctrain.data.private_dir import open_private_dir, resolve_cache_dir, user_root_name
from hpctrain.distributed.run_lock import launch_id, stop_if_taken_over

log = logs.get_logger(__name__)
SMALL = disk_format.SMALL_FILES


@dataclass
class _Snap:
    """One snapshot between the main thread and the background thread."""
    step: int
    tensors: dict
    json_state: dict
    values_json: str
    error: str | None = None                 # the main thread's (staging) failure, agreed first
    files: dict = field(default_factory=dict)  # this rank's files: {name: COMMIT.json entry}


ROOM_RESERVE = 0.10  # of the snapshot folder's file system, and of node memory for tmpfs, kept free


def _nbytes(tree) -> int:
    """Bytes of the tensors in a (nested) state tree (a DTensor: its local shard)."""
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(v) for v in tree)
    local = tree.to_local() if hasattr(tree, "to_local") else tree
    return local.numel() * local.element_size() if hasattr(local, "element_size") else 0


def _fs_type(path: Path) -> str:
    """The file-system type of the mount that holds `path` (/proc/mounts; '' when unknown)."""
    real, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and (real == fields[1] or real.startswith(fields[1].rstrip("/") + "/")) \
                        and len(fields[1]) >= len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


def _mem_available() -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes from /proc/meminfo ((0, 0) when unknown)."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return info.get("MemAvailable", 0), info.get("MemTotal", 0)


def room_problem(folder: Path, need: int) -> str | None:
    """Why `need` more bytes under `folder` would leave its file system, or node memory when the
    folder is in memory (tmpfs: /dev/shm), under ROOM_RESERVE free (None: they fit)."""
    base = Path(folder)
    while not base.exists():
        base = base.parent
    usage = shutil.disk_usage(base)
    free, total, what = usage.free, usage.total, str(base)
    if _fs_type(base) in ("tmpfs", "ramfs"):
        avail, mem = _mem_available()
        if mem and avail - need < free - need:  # node memory is the tighter bound
            free, total, what = avail, mem, f"node memory (for {base})"
    if free - need >= ROOM_RESERVE * total:
        return None
    return (f"{what} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB; a snapshot there "
            f"needs ~{need / 2**30:.1f} GiB and must leave {ROOM_RESERVE:.0%} free (set "
            f"checkpoint.snapshot_dir elsewhere, or checkpoint.snapshot_interval = 0)")


def node_root_path(setting: str, run_dir: str, node_rank: int) -> Path | None:
    """This node's snapshot folder for `checkpoint.snapshot_dir` (None: no base folder)."""
    base = (os.environ.get("SLURM_TMPDIR") or "/dev/shm") if setting == "auto" else setting
    base = resolve_cache_dir(base, node_rank) if base else None
    return Path(base, user_root_name(), f"snapshots-{run_key(run_dir)}") if base else None


def run_key(run_dir: str) -> str:
    """The run's snapshot identity: its run directory (a snapshot of another run is never used)."""
    return hashlib.sha256(os.path.realpath(run_dir).encode()).hexdigest()[:16]


class PeerSnapshots:
    """`interval` (0: off), `setting`: checkpoint.snapshot_dir, `ctx`: the DistContext,
    `cpu_share`: the background DCP write's duty cycle (checkpoint.async_cpu_share)."""

    def __init__(self, interval: int, setting: str, run_dir: str, ctx, *, timeout_s: float = 300.0,
                 cpu_share: float = 1.0, enabled: bool = True, full_checksums: bool = True):
        self.ctx, self.rank, self.world_size = ctx, ctx.rank, ctx.world_size
        self.enabled = enabled and interval > 0 and dist.is_available() and dist.is_initialized()
        self.interval, self.cpu_share = interval, cpu_share  # cpu_share: background.Pacer
        self.full_checksums = full_checksums  # checkpoint.full_checksums: data files' xxh3 too
        self.key = run_key(run_dir)
        self.path = node_root_path(setting, run_dir, ctx.node_rank) if self.enabled else None
        self.enabled = self.enabled and self.path is not None
        self._timeout = datetime.timedelta(seconds=max(timeout_s, 60.0))
        self._group = self._topology = self._writers = None
        self._inflight: background.InFlight | None = None
        self._staging: dict = {}
        self._warned = self._said_alone = False
        self.last_stage_s = 0.0

    # -- where ranks and files are -----------------------------------------------------------------
    def topology(self) -> dict:
        """(main thread, collective once) node of every rank, each node's leader, buddy, sources."""
        if self._topology is None:
            places = self.ctx.comm.allgather((self.ctx.node_rank, self.ctx.local_rank))
            nodes = sorted({n for n, _ in places})
            members = {n: [r for r, (m, _) in enumerate(places) if m == n] for n in nodes}
            buddy_of = {}
            for r, (n, local) in enumerate(places):
                if len(nodes) > 1:
                    nxt = members[nodes[(nodes.index(n) + 1) % len(nodes)]]
                    buddy_of[r] = nxt[local % len(nxt)]
            self._topology = {"node": [n for n, _ in places], "leaders": {n: m[0] for n, m in members.items()},
                              "buddy": buddy_of.get(self.rank),
                              "sources": sorted(r for r, b in buddy_of.items() if b == self.rank)}
        return self._topology

    def group(self):
        """(main thread, collective once) the snapshots' own gloo group."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def _open_root(self) -> Path:
        """This node's snapshot folder, created private (0700) if missing; UnsafeDir/OSError."""
        fd, _ = open_private_dir(str(self.path.parent.parent), [self.path.parent.name, self.path.name])
        os.close(fd)
        return self.path

    def _warn(self, what: str) -> None:
        if not self._warned and self.rank == 0:
            log.warning(f"warning: peer snapshot {what}; training goes on (the PFS checkpoint is the "
                        f"fallback; further snapshot failures are not reported)")
        self._warned = True

    # -- saving --------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Snapshots are taken on two nodes or more (they are for the loss of a node; on one node the
        PFS checkpoint covers a process failure and node memory is left to training); a relaunch
        on one node still resumes from the snapshots the lost nodes' buddies hold."""
        if not (self.enabled and step > 0 and step % self.interval == 0):
            return False
        if self.ctx.n_nodes < 2 and not self._said_alone:
            self._said_alone = True
            if self.rank == 0:
                log.info("peer snapshots: off on one node (they keep state through the loss of a node)")
        return self.ctx.n_nodes > 1

    def save(self, step: int, states: dict) -> None:
        """Collective (main thread): stage `states` ({name: Stateful}) and start the background
        write/replication of snapshot `step`; the previous one is finished first."""
        import hpctrain.checkpoint.recording_fs  # noqa: F401 - DCP: here, never in the writer thread
        self.wait()
        t0 = time.perf_counter()
        tree = {name: obj.state_dict() for name, obj in states.items()}
        snap = _Snap(step, {}, {}, "")
        try:
            tensors, values = split_state(tree)
            snap.values_json = "[\n" + ",\n".join(json.dumps(v, sort_keys=True) for v in values) + "\n]\n"
            snap.json_state = json.loads(json.dumps(json_part(tree))) if self.rank == 0 else {}
            if self._writers is None:  # the layout never changes within a run: assigned once
                self._writers = background.assign_writers(
                    self.ctx.comm.allgather(background.plain_sizes(tensors)))
            mine = {p for p, r in self._writers.items() if r == self.rank}
            snap.tensors = background.stage(tensors, self._staging, keep=mine)
            self._check_room(snap.tensors)
        except Exception as e:  # noqa: BLE001 - agreed in the background, never raised here
            snap.error = describe(e)
        group, pacer = self.group(), background.Pacer(self.cpu_share)
        self._inflight = background.InFlight(lambda: self._write_replicate_commit(snap, group, pacer),
                                             name=f"snapshot-{step}", pacer=pacer)
        self.last_stage_s = time.perf_counter() - t0

    def _check_room(self, staged) -> None:
        """Node memory is training's too: this node holds its ranks' shards and its sources' copies,
        and the previous snapshot until this one is complete (~2 x 2 x this rank's share)."""
        ranks_here = self.topology()["node"].count(self.ctx.node_rank)
        problem = room_problem(self.path, 4 * _nbytes(staged) * ranks_here)
        if problem:  # agreed like any staging failure: one warning, training goes on
            raise OSError(problem)

    def wait(self) -> None:
        """Finish the snapshot in flight; its failure is a warning (once), never an exception."""
        if self._inflight is None:
            return
        job, self._inflight = self._inflight, None
        try:
            job.result()
        except Exception as e:  # noqa: BLE001 - a snapshot never stops training
            self._warn(f"failed: {describe(e)}")

    def _agree(self, step: int, err: str | None, group, payload=None) -> list:
        """Every rank's (error, payload); raises the lowest rank's error on every rank."""
        out = [None] * self.world_size
        dist.all_gather_object(out, (err, payload), group=group)
        failed = [(r, e) for r, (e, _) in enumerate(out) if e]
        if failed:
            raise RuntimeError(f"of step {step}: rank {failed[0][0]}: {failed[0][1]}")
        return [p for _, p in out]

    def _write_replicate_commit(self, snap: _Snap, group, pacer: background.Pacer) -> None:
        """The background thread: write, agree, replicate, agree, mark complete (module docstring)."""
        self._agree(snap.step, snap.error, group)
        tmp = disk_format.tmp_path(self.path / disk_format.step_dir_name(snap.step), launch_id())  # ours
        err = None
        try:
            self._open_root()
            stop_if_taken_over(tmp)
            tmp.mkdir(exist_ok=True)
            snap.files = self._write(snap, tmp, group, pacer)
        except Exception as e:  # noqa: BLE001 - agreed below
            err = describe(e)
        snap.tensors = {}  # written: staged GPU shards go back to the pinned cache (background.py)
        entries = self._agree(snap.step, err, group, snap.files)
        err = None
        try:
            self._replicate(snap, tmp, group)
        except Exception as e:  # noqa: BLE001
            err = describe(e)
        self._agree(snap.step, err, group)
        if self.rank == self.topology()["leaders"][self.ctx.node_rank]:
            self._mark_complete(snap.step, tmp, {k: v for e in entries for k, v in e.items()})

    def _write(self, snap: _Snap, tmp: Path, group, pacer: background.Pacer) -> dict:
        """This rank's DCP files (rank 0: also the JSON files) in `tmp`: {name: COMMIT.json entry}
        (sizes; sha256 of the small files; with checkpoint.full_checksums the xxh3-128 of the data
        files, hashed while written, as the PFS checkpoint's: a copy damaged in memory or on its way
        to the buddy fails the load's check, which falls back to the PFS checkpoint)."""
        import torch.distributed.checkpoint as dcp  # imported by save (recording_fs)

        from hpctrain.checkpoint.recording_fs import RecordingFileSystem

        writer = dcp.FileSystemWriter(tmp, sync_files=False)
        writer.fs = fs = RecordingFileSystem(pacer, hash_writes=self.full_checksums)
        with no_zip_crc32():
            dcp.save(snap.tensors, storage_writer=writer, process_group=group)
        hashes = fs.digests()
        mine = [n for n in os.listdir(tmp) if n.startswith(f"__{self.rank}_") and n.endswith(".distcp")]
        if self.rank == 0:
            stop_if_taken_over(tmp / disk_format.TRAINER_STATE_FILE)
            disk_format.write_json_durably(tmp / disk_format.TRAINER_STATE_FILE, snap.json_state)
            disk_format.write_bytes_durably(tmp / disk_format.NONTENSOR_FILE, snap.values_json.encode())
            mine += list(SMALL)
        files = {}
        for name in mine:
            entry = {"size": os.stat(tmp / name).st_size}
            if name in SMALL:
                entry["sha256"] = disk_format.sha256_file(tmp / name)
            elif name in hashes:
                entry[disk_format.DATA_HASH] = hashes[name]
            files[name] = entry
        return files

    def _replicate(self, snap: _Snap, tmp: Path, group) -> None:
        """This rank's data files to its buddy, its sources' into `tmp`; rank 0's JSON and DCP
        metadata files to every other node's leader."""
        topo = self.topology()
        mine = sorted(n for n in snap.files if n not in SMALL)
        snapshot_io.exchange(tmp, mine, topo["buddy"], topo["sources"], group)
        box = [snapshot_io.pack(tmp, list(SMALL)) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        my_leader = topo["leaders"][self.ctx.node_rank]
        if self.rank == my_leader and topo["node"][0] != self.ctx.node_rank:
            snapshot_io.unpack(tmp, *box[0])

    def _mark_complete(self, step: int, tmp: Path, files: dict) -> None:
        """This node's leader: COMMIT.json (the whole snapshot's files), rename, drop older steps."""
        commit = {"format": disk_format.FORMAT, "version": disk_format.FORMAT_VERSION, "step": step,
                  "world_size": self.world_size, "unix_time": time.time(), "run": self.key,
                  "checksums": "full" if self.full_checksums else "small-files", "files": files}
        stop_if_taken_over(tmp / disk_format.COMMIT_FILE)
        disk_format.write_json_durably(tmp / disk_format.COMMIT_FILE, commit)
        final = self.path / disk_format.step_dir_name(step)
        stop_if_taken_over(final)  # a stale leader would otherwise replace and prune the newer launch's
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for name in os.listdir(self.path):
            parsed = disk_format.parse_dir_name(name)
            if parsed and parsed[0] != step:
                shutil.rmtree(self.path / name, ignore_errors=True)

    def finish(self) -> None:
        """At the clean end of a run (its final PFS checkpoint committed): remove this node's
        snapshot folder (its leader; a run that ended has nothing to recover)."""
        self.wait()
        if self.enabled and self._topology and self.rank == self._topology["leaders"][self.ctx.node_rank]:
            shutil.rmtree(self.path, ignore_errors=True)

    # -- resuming ------------------------------------------------------------------------------------
    def resume(self, pfs_step) -> tuple[Path | None, str | None]:
        """Collective (main thread, before any PFS checkpoint is loaded): (this rank's path of the
        newest snapshot that the surviving nodes cover, every copy checked against its checksums,
        completed on every node from intact copies, if it is newer than `pfs_step()` (the newest
        intact PFS checkpoint's step, -1 for none; called only when a snapshot qualifies), else
        None; why a snapshot found was not used, else None). snapshot_resume.py."""
        if not self.enabled:
            return None, None
        return SnapshotResume(self).run(pfs_step)
