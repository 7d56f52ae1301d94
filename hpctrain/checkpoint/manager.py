"""The checkpoint manager: collective save / load / latest with an atomic commit protocol.

Owns: the order of operations across ranks (tmp dir -> every rank's DCP write -> agreement ->
COMMIT.json -> rename -> fsync -> retention), with tensors saved by torch.distributed.checkpoint (so
resharding to another world size or layout comes from torch) and the rest as JSON (state.py), and
turning any failure on any rank into the same one-line CheckpointError raised on every rank.

It does not know the model's layout, and it must never: leave a rank waiting in a collective that
another rank skipped (every rank-local failure is agreed on before the next step), touch a previously
committed checkpoint while saving a new one (only retention deletes, after the commit), list
directories on ranks other than 0, or unpickle file contents (see safe_load.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from hpctrain.checkpoint import layout
from hpctrain.checkpoint.layout import CheckpointError
from hpctrain.checkpoint.safe_load import SafeFileSystemReader, TensorOnlyLoadPlanner
from hpctrain.checkpoint.state import check_json, merge_values, split_state

# ----------------------------------------------------------------------------------------------
# Collectives (torch.distributed, any backend); identity when there is one process and no group
# ----------------------------------------------------------------------------------------------

def _describe(exc: BaseException) -> str:
    """One line for an exception; unwraps DCP's CheckpointException to the first rank's error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (inner, _) = sorted(exc.failures.items())[0]
        return _describe(inner)
    text = str(exc) if isinstance(exc, (OSError, CheckpointError)) else f"{type(exc).__name__}: {exc}"
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def _failure(exc: BaseException, rank: int, io_error: OSError | None = None) -> tuple[int, str]:
    """(priority, one line) for the agreement step. 0: this rank's own error; 1: DCP relaying
    another rank's error (DCP pickles exceptions between ranks and loses their causes, so the rank
    where it happened reports it best, e.g. the OSError torch.save turned into a RuntimeError)."""
    if io_error is not None:
        return 0, _describe(io_error)
    relayed = isinstance(exc, CheckpointException) and exc.failures and rank not in exc.failures
    return (1 if relayed else 0), _describe(exc)


class _RecordingFileSystem(FileSystem):
    """DCP's local FileSystem, remembering the first OSError a write stream raised on this rank."""

    def __init__(self):
        super().__init__()
        self.first_error: OSError | None = None

    @contextmanager
    def create_stream(self, path, mode):
        try:
            with super().create_stream(path, mode) as stream:
                yield _RecordingStream(stream, self, path) if "w" in mode else stream
        except OSError as e:
            self._record(e, path)
            raise

    def _record(self, e: OSError, path) -> None:
        if self.first_error is None:
            if e.filename is None:
                e = OSError(e.errno, e.strerror, str(path))
            self.first_error = e


class _RecordingStream:
    def __init__(self, stream, fs: _RecordingFileSystem, path):
        self._stream, self._fs, self._path = stream, fs, path

    def write(self, data):
        try:
            return self._stream.write(data)
        except OSError as e:
            self._fs._record(e, self._path)
            raise

    def __getattr__(self, name):
        return getattr(self._stream, name)


class CheckpointManager:
    """Collective checkpointing of DCP state dicts into `root/step_NNNNNNNN/`.

    `keep`: how many committed checkpoints retention keeps (>= 1). `full_checksums`: also record
    (and let `verify_checkpoint(full=True)` check) sha256 of the tensor data files; the ranks hash
    their share in parallel after writing. `writer_threads`: DCP writer threads per rank.
    """

    def __init__(self, root: str | os.PathLike, keep: int, rank: int, world_size: int, *,
                 full_checksums: bool = False, writer_threads: int = 1):
        if keep < 1:
            raise CheckpointError(f"checkpoint keep={keep}: must be >= 1")
        self.root = Path(root)
        self.keep, self.rank, self.world_size = keep, rank, world_size
        self.full_checksums, self.writer_threads = full_checksums, writer_threads
        self._dist = dist.is_available() and dist.is_initialized()
        if self._dist and (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(f"CheckpointManager(rank={rank}, world_size={world_size}) but "
                             f"torch.distributed says {dist.get_rank()}/{dist.get_world_size()}")
        if not self._dist and world_size != 1:
            raise ValueError("CheckpointManager with world_size > 1 needs torch.distributed initialized")
        self.last_save_s = self.last_load_s = 0.0

    # -- collectives -----------------------------------------------------------------------------
    def _gather(self, obj) -> list:
        if not self._dist:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _bcast(self, obj):
        if not self._dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _raise_first(self, errs: list, prefix: str) -> None:
        """errs: per rank, None or (priority, text). Raise the most direct one, lowest rank first."""
        failed = sorted((e[0], r, e[1]) for r, e in enumerate(errs) if e)
        if failed:
            _, r, text = failed[0]
            where = f"rank {r}: " if self.world_size > 1 else ""
            raise CheckpointError(f"{prefix} failed: {where}{text}")

    def _agree(self, err: tuple[int, str] | None, prefix: str) -> None:
        """All ranks learn whether any rank failed; all raise the same one-line error if so."""
        self._raise_first(self._gather(err), prefix)

    # -- API ---------------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """Newest committed and intact checkpoint (rank 0 decides, all ranks get the same answer)."""
        answer = None
        if self.rank == 0:
            try:
                path, _ = layout.find_latest(self.root)
                answer = ("ok", str(path) if path else None)
            except Exception as e:  # noqa: BLE001 - must reach the broadcast
                answer = ("error", f"cannot scan checkpoints in {self.root}: {_describe(e)}")
        status, value = self._bcast(answer)
        if status == "error":
            raise CheckpointError(value)
        return Path(value) if value else None

    def save(self, step: int, state: dict, extra: dict) -> Path:
        """Collective. Writes `state` (tensors via DCP; JSON-able leaves as JSON) and rank 0's
        `extra` (JSON trainer state) as checkpoint `step`; returns its path once committed."""
        t0 = time.perf_counter()
        final = self.root / layout.step_dir_name(step if isinstance(step, int) else 0)
        tmp = layout.tmp_path(final)
        prefix = f"checkpoint save to {final}"

        # 1. validate on every rank; rank 0 clears a stale tmp for this step. Agree before writing.
        err = None
        try:
            if not isinstance(step, int) or step < 0:
                raise CheckpointError(f"step must be an int >= 0, got {step!r}")
            tensors, values = split_state(state)
            # one [path, value] per line: readable, and identical bytes on every rank
            values_json = "[\n" + ",\n".join(json.dumps(v, sort_keys=True) for v in values) + "\n]\n"
            if self.rank == 0:
                check_json(extra)
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
                layout.fsync_dir(self.root)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = _failure(e, self.rank)
        steps = self._gather((err, step))
        self._raise_first([e for e, _ in steps], prefix)
        if len({s for _, s in steps}) > 1:
            raise CheckpointError(f"{prefix} failed: ranks disagree on the step: "
                                  f"{[s for _, s in steps]}")

        # 2. every rank writes its DCP shards; rank 0 the JSON files. Agree on success.
        digest, hashes = hashlib.sha256(values_json.encode()).hexdigest(), {}
        fs = _RecordingFileSystem()
        try:
            writer = dcp.FileSystemWriter(tmp, sync_files=True, thread_count=self.writer_threads)
            writer.fs = fs
            with self._quiet():
                metadata = dcp.save(tensors, storage_writer=writer, no_dist=not self._dist)
            if self.full_checksums:
                hashes = self._hash_my_share(tmp, metadata)
            if self.rank == 0:
                layout.write_json_durably(tmp / layout.TRAINER_STATE_FILE, extra)
                layout.write_bytes_durably(tmp / layout.NONTENSOR_FILE, values_json.encode())
            err = None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
            err = _failure(e, self.rank, fs.first_error)
        try:
            results = self._gather((err, digest, hashes))
            self._raise_first([e for e, _, _ in results], prefix)
            if any(d != results[0][1] for _, d, _ in results):
                raise CheckpointError(f"{prefix} failed: non-tensor state entries (optimizer "
                                      f"hyper-parameters etc.) differ between ranks")
        except CheckpointError:
            self._discard(tmp)
            raise

        # 3. rank 0 commits: COMMIT.json, fsync, rename into place, fsync root. Everyone learns.
        err = None
        if self.rank == 0:
            try:
                data_sha = {k: v for _, _, h in results for k, v in h.items()}
                layout.write_commit(tmp, step, self.world_size, data_sha)
                layout.fsync_dir(tmp)
                layout.install(tmp, final)
            except Exception as e:  # noqa: BLE001
                err = _describe(e)
                self._discard(tmp)
        err = self._bcast(err)
        if err:
            raise CheckpointError(f"{prefix} failed: {err}")

        # 4. retention (rank 0; a failure here is a warning: the new checkpoint is committed).
        if self.rank == 0:
            try:
                layout.prune(self.root, self.keep)
            except Exception as e:  # noqa: BLE001 - the new checkpoint is committed regardless
                layout.warn(f"checkpoint retention in {self.root} failed: {_describe(e)}")
        self.last_save_s = time.perf_counter() - t0
        return final

    def load(self, path: str | os.PathLike, state: dict) -> dict:
        """Collective. Loads checkpoint `path` into `state` in place (tensors via DCP, resharded to
        this job's layout; non-tensor leaves from JSON) and returns the saved `extra` dict."""
        t0 = time.perf_counter()
        path = Path(path)
        prefix = f"checkpoint load from {path}"
        payload = None
        if self.rank == 0:
            try:
                problems, _, metadata = layout.check_checkpoint(path)
                if problems:
                    raise CheckpointError("; ".join(problems))
                extra = json.loads((path / layout.TRAINER_STATE_FILE).read_bytes())
                values = json.loads((path / layout.NONTENSOR_FILE).read_bytes())
                payload = ("ok", (metadata, extra, values))
            except Exception as e:  # noqa: BLE001
                payload = ("error", _describe(e))
        status, value = self._bcast(payload)
        if status == "error":
            raise CheckpointError(f"{prefix} failed: {value}")
        metadata, extra, values = value

        err = None
        try:  # agree on the target state before entering DCP's collectives
            tensors, _ = split_state(state)
        except Exception as e:  # noqa: BLE001
            err = _failure(e, self.rank)
        self._agree(err, prefix)
        try:
            reader = SafeFileSystemReader(path, metadata=metadata)
            with self._quiet():
                dcp.load(tensors, storage_reader=reader, planner=TensorOnlyLoadPlanner(),
                         no_dist=not self._dist)
            merge_values(state, values, str(path))
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            err = _failure(e, self.rank)
        self._agree(err, prefix)
        self.last_load_s = time.perf_counter() - t0
        return extra

    # -- helpers -----------------------------------------------------------------------------------
    def _hash_my_share(self, tmp: Path, metadata) -> dict[str, str]:
        """sha256 of every world_size-th data file, so the ranks checksum in parallel."""
        files = sorted({str(info.relative_path) for info in metadata.storage_data.values()})
        mine = files[self.rank::self.world_size]
        return {f: layout.sha256_file(tmp / f) for f in mine}

    @contextmanager
    def _quiet(self):
        """Without a process group DCP warns that it assumes one process: that is our intent."""
        with warnings.catch_warnings():
            if not self._dist:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield

    def _discard(self, tmp: Path) -> None:
        """Best-effort removal of a failed save's tmp dir (frees space after ENOSPC)."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
