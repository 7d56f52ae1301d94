"""The checkpoint manager: collective save / load / latest with an atomic commit protocol.

Owns: the order of operations across ranks (tmp dir -> every rank's DCP write -> agreement ->
COMMIT.json -> rename -> fsync -> retention), with tensors saved by torch.distributed.checkpoint (so
resharding to another world size or layout comes from torch) and the rest as JSON (state.py), and
turning any failure on any rank into the same one-line CheckpointError raised on every rank
(agreement.py; the load's steps are in loading.py).
`save_async` splits a save: validation, agreement and the copy to host memory on the caller's
thread; write, agreement and commit in a background thread, one save in flight at a time
(background.py). Every collective of the manager, a save's (sync or async) and a load's
(`latest`, the trainer state, DCP's read, every agreement), runs on the manager's own gloo group
with a long timeout (COMMIT_TIMEOUT_S): while rank 0 commits, or scans and reads on a slow file
system, and while ranks read and checksum their shares at different speeds, the others wait on host
sockets, never in a device (NCCL) collective whose watchdog would end the job after dist.timeout_s.
A rank that dies meanwhile is still seen at once (its sockets close) or by the heartbeat watchdog
(dist.heartbeat_timeout_s).

It does not know the model's layout, and it must never: leave a rank waiting in a collective that
another rank skipped (every rank-local failure is agreed on before the next step), touch a previously
committed checkpoint before the new one is completely written (a re-saved step's old copy is moved
aside only at commit; retention deletes only after it), list directories on ranks other than 0, or
unpickle file contents (see safe_load.py).
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
from hpctrain.checkpoint import background, directory, disk_format, faults, loading, lustre
from hpctrain.checkpoint.agreement import Agreement
from hpctrain.checkpoint.dcp_io import describe, failure, no_zip_crc32
from hpctrain.errors import CheckpointError, NoIntactCheckpoint

from hpctrain.checkpoint.state import check_json, json_part, overlay, split_state
from hpctrain.distributed.run_lock import assert_held, launch_id, stop_if_taken_over

log = logs.get_logger(__name__)
COMMIT_TIMEOUT_S = 1800.0  # at least: the save group's timeout (torch's own Gloo default)


def import_dcp() -> None:
    """torch.distributed.checkpoint and our subclasses of its classes, imported on the first save
    or load, not at start-up (DCP imports DTensor and sympy: ~0.5 s CPU per rank, before a plain
    run's first step). Called on the main thread (`_prepare`, `load`, `save_group`), so a background
    save's thread never runs an import."""
    import hpctrain.checkpoint.node_layout  # noqa: F401
    import hpctrain.checkpoint.recording_fs  # noqa: F401
    import hpctrain.checkpoint.safe_load  # noqa: F401


@dataclass
class _Job:
    """One save between its phases: where it goes, and what (tensors possibly staged copies)."""
    step: int
    final: Path
    tmp: Path
    prefix: str
    json_state: dict
    tensors: dict = field(default_factory=dict)
    values_json: str = ""


class CheckpointManager(Agreement):
    """Collective checkpointing of DCP state dicts into `root/step_NNNNNNNN/`.

    `keep`: how many committed checkpoints retention keeps (>= 1). `full_checksums` (default):
    also record an xxh3-128 of every tensor data file, hashed by the rank that writes it while it
    writes; `load` re-checks them (ranks in parallel) and fails naming the file on a mismatch.
    `writer_threads`: DCP writer threads per rank. `layout`: "rank" (DCP's file per rank) or
    "node" (one file per node of the ranks sharing `node_id`: node_layout.py); loading reads
    either. `stripe_count`/`stripe_size`: Lustre striping of `root` (lustre.py; 0 = auto).
    """

    def __init__(self, root: str | os.PathLike, keep: int, rank: int, world_size: int, *,
                 full_checksums: bool = True, writer_threads: int = 1, timeout_s: float = 300.0,
                 async_cpu_share: float = 1.0, layout: str = "rank", node_id=None,
                 stripe_count: int = 0, stripe_size: str = "4M"):
        if keep < 1:
            raise CheckpointError(f"checkpoint keep={keep}: must be >= 1")
        super().__init__(rank, world_size)
        self.root = Path(root)
        self.keep = keep
        self.full_checksums, self.writer_threads = full_checksums, writer_threads
        self.async_cpu_share = async_cpu_share  # duty cycle of the background writer (Pacer)
        self.last_save_s = self.last_load_s = self.last_write_s = self.last_hash_s = 0.0
        # a load's wait for this rank's checksums after DCP's read, and the files it hashed
        self.last_verify_s, self.last_verified = 0.0, []
        self._timeout = datetime.timedelta(seconds=max(timeout_s, COMMIT_TIMEOUT_S))
        self._save_group = None                                 # made by the first save
        # layout "node": one data file per node of ranks sharing `node_id` (node_layout.py)
        self.layout, self._node_id, self._node = layout, node_id, None
        self._striping = lustre.Striping(lustre.stripe_count(stripe_count, layout), stripe_size)
        self._inflight: background.InFlight | None = None
        self._staging: dict = {}                                # reused host buffers (async)

    # -- API ---------------------------------------------------------------------------------------
    def latest(self, skip=()) -> Path | None:
        """Newest committed and intact checkpoint not in ``skip`` (rank 0 decides, all ranks get
        the same answer); None for a run directory without checkpoints, NoIntactCheckpoint where
        every one is unusable."""
        answer = None
        if self.rank == 0:
            faults.hit("load.scan", self.root)
            try:
                path, _ = directory.find_latest(self.root, skip)
                answer = ("ok", str(path) if path else None)
            except NoIntactCheckpoint as e:
                answer = ("none intact", str(e))
            except Exception as e:  # noqa: BLE001 - must reach the broadcast
                answer = ("error", f"cannot scan checkpoints in {self.root}: {describe(e)}")
        status, value = self._bcast(answer)
        if status == "none intact":
            raise NoIntactCheckpoint(value)
        if status == "error":
            raise CheckpointError(value)
        return Path(value) if value else None

    def resume_newest(self, resume_from) -> Path | None:
        """Collective. ``resume_from(path)`` on the newest intact checkpoint; one that fails while
        loading (CheckpointError: a bad pickle, a checksum mismatch) is skipped with one warning
        line and the next older one is tried. Returns the path used, or None (no checkpoints)."""
        skipped = []
        while (path := self.latest(skip=skipped)) is not None:
            try:
                resume_from(path)
                return path
            except NoIntactCheckpoint:
                raise
            except CheckpointError as e:
                if self.rank == 0:
                    log.warning(f"warning: skipping checkpoint {path}: {e}")
                skipped.append(path)
        return None

    def save(self, step: int, state: dict, json_state: dict) -> Path:
        """Collective. Writes `state` (tensors via DCP; JSON-able leaves as JSON) and rank 0's
        `json_state` (the JSON part: trainer_state.json) as checkpoint `step`; returns its path once committed.
        An async save still in flight is finished (and its error raised) first."""
        self.wait()
        t0 = time.perf_counter()
        job = self._prepare(step, state, json_state)
        path = self._write_and_commit(job, group=self.save_group())
        self.last_save_s = self.last_write_s = time.perf_counter() - t0
        return path

    def save_async(self, step: int, state: dict, json_state: dict) -> None:
        """Collective. Like `save`, but returns once the tensors are copied to host memory; a
        background thread writes and commits them, with its collectives on a separate gloo group.
        At most one save is in flight: this first waits for the previous one (raising its error on
        every rank). Call `wait()` before exiting; `poll()` reports completion without blocking."""
        self.wait()
        t0 = time.perf_counter()
        job = self._prepare(step, state, json_state)
        # a plain tensor several ranks hold (replicated) is staged and written by one of them
        writers = background.assign_writers(self._gather(background.plain_sizes(job.tensors)))
        err = None
        try:
            mine = {path for path, rank in writers.items() if rank == self.rank}
            job.tensors = background.stage(job.tensors, self._staging, keep=mine)
            faults.hit("save.staged")
        except Exception as e:  # noqa: BLE001 - agreed below
            err = failure(e, self.rank)
        try:
            self._agree(err, job.prefix)
        except CheckpointError:
            self._discard(job.tmp)
            raise
        group = self.save_group()
        pacer = background.Pacer(self.async_cpu_share)
        self._inflight = background.InFlight(
            lambda: self._write_and_commit(job, group=group, pacer=pacer),
            name=f"checkpoint-{step}", pacer=pacer)
        self.last_save_s = time.perf_counter() - t0

    def save_group(self):
        """Collective (made by the manager's first collective on every rank: a resume's `latest`,
        or the first save). The gloo group of every collective of the manager (module docstring);
        None without torch.distributed."""
        if self._save_group is None and self._dist:
            self._save_group = dist.new_group(backend="gloo", timeout=self._timeout)
        if self.layout == "node" and self._node is None:
            from hpctrain.checkpoint.node_layout import make_node_group

            self._node = make_node_group(self.rank, self._node_id, self._timeout, self._save_group)
        return self._save_group

    def wait(self) -> Path | None:
        """Block until the in-flight async save is committed; its path, or None if there was none.
        Raises its CheckpointError (the same on every rank: agreed in the background)."""
        if self._inflight is None:
            return None
        job, self._inflight = self._inflight, None
        path = job.result()
        self.last_write_s = job.duration_s
        return path

    def poll(self) -> bool:
        """True if no async save is in flight or the in-flight one has finished (never blocks)."""
        return self._inflight is None or self._inflight.done()

    # -- Stateful objects (torch.distributed.checkpoint.stateful.Stateful) ------------------------
    def save_states(self, step: int, states: dict, background: bool = False) -> Path | None:
        """Collective. Checkpoint `step` of {name: object with state_dict()/load_state_dict()}:
        tensors to DCP as "<name>.<key>", the rest (rank 0's) to trainer_state.json under <name>.
        `background`: `save_async` (returns None once staged) instead of `save`."""
        tree = {name: obj.state_dict() for name, obj in states.items()}
        tensors, _ = split_state(tree)
        if background:
            return self.save_async(step, tensors, json_part(tree))
        return self.save(step, tensors, json_part(tree))

    def read_trainer_state(self, path: str | os.PathLike) -> dict:
        """Collective. Checkpoint `path`'s JSON state, {name: ...} (rank 0 reads, all get it);
        lets objects check that they can load it before any tensor is read."""
        answer = None
        if self.rank == 0:
            try:
                answer = ("ok", disk_format.read_trainer_state(Path(path)))
            except Exception as e:  # noqa: BLE001 - must reach the broadcast
                answer = ("error", describe(e))
        status, value = self._bcast(answer)
        if status == "error":
            raise CheckpointError(f"checkpoint load from {path} failed: {value}")
        return value

    def load_states(self, path: str | os.PathLike, states: dict) -> None:
        """Collective. Load checkpoint `path` into {name: Stateful}: each object's current
        state_dict() names the tensors to read (resharded by DCP, in place), and it gets them
        back with its saved JSON state in load_state_dict()."""
        tree = {name: obj.state_dict() for name, obj in states.items()}
        tensors, _ = split_state(tree)  # shares the tensors: loading into it loads into `tree`
        saved = disk_format.upgrade_trainer_state(self.load(path, tensors))
        for name, obj in states.items():
            obj.load_state_dict(overlay(saved.get(name), tree[name]))

    def _prepare(self, step: int, state: dict, json_state: dict) -> "_Job":
        """Phase 1 (main thread, the save group): validate on every rank, rank 0 creates a fresh
        step_N.tmp; agree before anyone writes."""
        import_dcp()
        faults.hit("save.begin")
        final = self.root / disk_format.step_dir_name(step if isinstance(step, int) else 0)
        job = _Job(step, final, disk_format.tmp_path(final, launch_id()),  # this launch's own
                   f"checkpoint save to {final}", json_state)
        err = None
        try:
            if not isinstance(step, int) or step < 0:
                raise CheckpointError(f"step must be an int >= 0, got {step!r}")
            job.tensors, values = split_state(state)
            # one [path, value] per line: readable, and identical bytes on every rank
            job.values_json = "[\n" + ",\n".join(json.dumps(v, sort_keys=True) for v in values) + "\n]\n"
            if self.rank == 0:
                assert_held()  # a job that lost its run dir's lock touches nothing there
                check_json(json_state)
                job.json_state = json.loads(json.dumps(json_state))  # a snapshot: the caller may mutate it
                self.root.mkdir(parents=True, exist_ok=True)
                self._striping.apply(self.root)  # on Lustre, once per run (lustre.py)
                if job.tmp.exists():
                    shutil.rmtree(job.tmp)
                job.tmp.mkdir()
                disk_format.fsync_dir(self.root)
                faults.hit("save.tmp_created")
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = failure(e, self.rank)
        steps = self._gather((err, step))
        self._raise_first([e for e, _ in steps], job.prefix)
        if len({s for _, s in steps}) > 1:
            raise CheckpointError(f"{job.prefix} failed: ranks disagree on the step: "
                                  f"{[s for _, s in steps]}")
        return job

    def _write_and_commit(self, job: "_Job", group, pacer: background.Pacer | None = None) -> Path:
        """Phases 2-4 (any thread; collectives on `group`): DCP write, agreement, commit, retention."""
        tmp, prefix = job.tmp, job.prefix
        # 2. every rank writes its DCP shards; rank 0 the JSON files. Agree on success.
        digest = hashlib.sha256(job.values_json.encode()).hexdigest()
        err, hashes = self._write(job, group, pacer)
        job.tensors = {}  # written: staged GPU shards go back to the pinned cache (background.py)
        try:
            results = self._gather((err, digest, hashes), group)
            self._raise_first([e for e, _, _ in results], prefix)
            if any(d != results[0][1] for _, d, _ in results):
                raise CheckpointError(f"{prefix} failed: non-tensor state entries (optimizer "
                                      f"hyper-parameters etc.) differ between ranks")
        except CheckpointError:
            self._discard(tmp)
            raise
        faults.hit("save.agreed")
        # 3. rank 0 commits; 4. retention (rank 0; a failure there is only a warning).
        self._commit(job, {k: v for _, _, h in results for k, v in h.items()}, group)
        if self.rank == 0:
            assert_held()
            try:
                directory.prune(self.root, self.keep)
            except Exception as e:  # noqa: BLE001 - the new checkpoint is committed regardless
                log.warning(f"warning: checkpoint retention in {self.root} failed: {describe(e)}")
        faults.hit("save.end")
        return job.final

    def _write(self, job: "_Job", group, pacer: background.Pacer | None):
        """Phase 2 on this rank: its DCP shards (rank 0 also the JSON files) into job.tmp.
        Returns (the failure to agree on or None, {data file: sha256} when full_checksums)."""
        import torch.distributed.checkpoint as dcp  # imported by _prepare (import_dcp)
        from torch.distributed.checkpoint.api import CheckpointException

        from hpctrain.checkpoint.node_layout import NodeLayoutWriter
        from hpctrain.checkpoint.recording_fs import RecordingFileSystem

        tmp, hashes = job.tmp, {}
        fs = RecordingFileSystem(pacer, hash_writes=self.full_checksums)
        try:
            writer = (NodeLayoutWriter(tmp, self._node, sync_files=True, thread_count=self.writer_threads)
                      if self.layout == "node" else
                      dcp.FileSystemWriter(tmp, sync_files=True, thread_count=self.writer_threads))
            writer.fs = fs
            faults.hit("save.before_write")
            with loading.quiet(self._dist), no_zip_crc32():
                dcp.save(job.tensors, storage_writer=writer, no_dist=not self._dist,
                         process_group=group)
            faults.hit("save.dcp_done")
            self.last_hash_s = fs.hash_seconds
            if self.full_checksums:  # the data files this rank wrote (DCP names each
                # `__<rank>_<n>.distcp`), hashed as written; never dcp.save's returned metadata,
                # whose storage_data torch 2.11 left None (seen on an H200)
                hashes = {f: d for f, d in fs.digests().items() if f.endswith(".distcp")}
            if self.rank == 0:
                stop_if_taken_over(tmp / disk_format.TRAINER_STATE_FILE)
                disk_format.write_json_durably(tmp / disk_format.TRAINER_STATE_FILE, job.json_state)
                faults.hit("save.trainer_state")
                stop_if_taken_over(tmp / disk_format.NONTENSOR_FILE)
                disk_format.write_bytes_durably(tmp / disk_format.NONTENSOR_FILE, job.values_json.encode())
                faults.hit("save.nontensor")
            return None, hashes
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
            return failure(e, self.rank, fs.first_error), hashes

    def _commit(self, job: "_Job", data_sha: dict, group) -> None:
        """Phase 3: rank 0 commits (COMMIT.json, fsync, rename into place, fsync root); every
        rank learns the outcome and raises the same CheckpointError on a failure."""
        err = None
        if self.rank == 0:
            assert_held()  # never commit (or discard) into a run dir another job owns now
            try:
                disk_format.write_commit(job.tmp, job.step, self.world_size, data_sha)
                faults.hit("commit.marker_written")
                disk_format.fsync_dir(job.tmp)
                faults.hit("commit.before_rename")
                stop_if_taken_over(job.final)  # before the renames
                directory.install(job.tmp, job.final)
                faults.hit("commit.done")
            except Exception as e:  # noqa: BLE001
                err = describe(e)
                self._discard(job.tmp)
        err = self._bcast(err, group)
        if err:
            raise CheckpointError(f"{job.prefix} failed: {err}")

    def load(self, path: str | os.PathLike, state: dict) -> dict:
        """Collective. Loads checkpoint `path` into `state` in place (tensors via DCP, resharded to
        this job's layout; non-tensor leaves from JSON) and returns the saved JSON state
        (trainer_state.json): loading.py."""
        import_dcp()
        t0 = time.perf_counter()
        json_state, verifier = loading.load(self, Path(path), state)
        self.last_verify_s, self.last_verified = verifier.waited_s, verifier.share
        self.last_load_s = time.perf_counter() - t0
        return json_state

    # -- helpers -----------------------------------------------------------------------------------
    def _group(self):
        """Agreement's group for a collective called without one: the save group, made here on the
        first (main thread; the background thread always passes the group it was given)."""
        return self.save_group()

    def _discard(self, tmp: Path) -> None:
        """Best-effort removal of a failed save's tmp dir (frees space after ENOSPC)."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
