"""DCP's local FileSystem wrapped for our saves (manager.py, snapshot.py import it on the first save).

Owns: remembering the first OSError a write stream raised (the rank where a disk fills reports it,
not DCP's relayed copy), pacing a background save's writes, hosting the file-level fault-injection
points, checksumming (xxh3-128) every byte a stream writes as it goes, and ending a stale rank
(frozen past its job's relaunch) before it creates, renames, removes or writes more of any file
(run_lock.stop_if_taken_over: at the open, mkdir, rename, rm_file, and a write >= 1 s after the
last check). Imports torch.distributed.checkpoint (DTensor, sympy: ~0.5 s CPU), so nothing
imports this at start-up.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystem

from hpctrain.checkpoint import background, faults
from hpctrain.checkpoint.disk_format import DATA_HASH, new_hasher
from hpctrain.distributed.run_lock import stop_if_taken_over

FENCE_EVERY_S = 1.0  # a write stream re-checks the run lock's fence at most this often: a freeze
# past a job's relaunch lasts far longer, so the first write after the thaw always checks


class RecordingFileSystem(FileSystem):
    """DCP's local FileSystem, remembering the first OSError a write stream raised on this rank
    (and pacing the writes of a background save)."""

    def __init__(self, pacer: background.Pacer | None = None, hash_writes: bool = False):
        super().__init__()
        self.first_error: OSError | None = None
        self.pacer = pacer
        self.hash_writes = hash_writes
        self._hashers: dict[str, object] = {}  # file name -> checksum of what this rank wrote
        self.hash_seconds = 0.0  # time spent hashing on this rank (bench/checkpoint.py reports it)
        self._lock = threading.Lock()  # DCP may write several files from several threads

    def hasher_for(self, path):
        if not self.hash_writes:
            return None
        with self._lock:
            return self._hashers.setdefault(os.path.basename(str(path)), new_hasher(DATA_HASH))

    def digests(self) -> dict[str, str]:
        """xxh3-128 of every file this rank wrote, computed from the bytes as they were written."""
        return {name: h.hexdigest() for name, h in self._hashers.items()}

    @contextmanager
    def create_stream(self, path, mode):
        try:
            if "w" in mode:
                faults.file_point("open", path)
                stop_if_taken_over(path)  # after the fault point: a test freezes a rank there
            with super().create_stream(path, mode) as stream:
                yield _RecordingStream(stream, self, path) if "w" in mode else stream
            if "w" in mode:
                faults.file_point("closed", path)
        except OSError as e:
            self._record(e, path)
            raise

    def mkdir(self, path) -> None:
        stop_if_taken_over(path)  # DCP: every rank makes the checkpoint's folder (parents too)
        super().mkdir(path)

    def rename(self, path, new_path) -> None:
        stop_if_taken_over(new_path)  # DCP: the coordinator's .metadata.tmp -> .metadata
        super().rename(path, new_path)

    def rm_file(self, path) -> None:
        stop_if_taken_over(path)
        super().rm_file(path)

    def _record(self, e: OSError, path) -> None:
        if self.first_error is None:
            if e.filename is None:
                e = OSError(e.errno, e.strerror, str(path))
            self.first_error = e


class _RecordingStream:
    def __init__(self, stream, fs: RecordingFileSystem, path):
        self._stream, self._fs, self._path = stream, fs, path
        self._written = False
        self._hasher = fs.hasher_for(path)
        self._fenced = time.monotonic()  # create_stream checked the fence at the open

    def write(self, data):
        try:
            now = time.monotonic()
            if now - self._fenced >= FENCE_EVERY_S:  # a rank thawed mid-write checks again
                self._fenced = now
                stop_if_taken_over(self._path)
            n = self._stream.write(data)
            if self._hasher is not None:  # a buffered stream takes all of `data` (or raises)
                t0 = time.perf_counter()
                self._hasher.update(data)
                self._fs.hash_seconds += time.perf_counter() - t0
            if self._fs.pacer is not None:
                self._fs.pacer.pace()
            if not self._written:  # after the first chunk: a partial file (fault injection)
                self._written = True
                self._stream.flush()
                faults.file_point("write", self._path)
            return n
        except OSError as e:
            self._fs._record(e, self._path)
            raise

    def __getattr__(self, name):
        return getattr(self._stream, name)
