"""Checksum verification of a checkpoint's tensor data files at load, overlapping DCP's read.

Owns which data files a rank re-hashes (its share: every world_size-th of the sorted data files
with a recorded checksum, so the ranks hash in parallel and each file once) and the background
thread that hashes them while DCP reads the tensors (file reads and xxhash release the GIL).
Used by manager.py's load only; the caller agrees the outcome across ranks in one collective.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from hpctrain.checkpoint import disk_format
from hpctrain.checkpoint.dcp_io import describe

# A checksum mismatch is the most direct account of a damaged file: it wins the agreement over
# whatever DCP made of the damaged bytes on any rank (dcp_io.failure: 0 own error, 1 relayed).
MISMATCH_PRIORITY = -1


def my_share(files: dict, rank: int, world_size: int) -> list[str]:
    """This rank's data files to re-hash: every world_size-th of the sorted checksummed ones."""
    data = sorted(rel for rel, entry in files.items()
                  if rel not in disk_format.SMALL_FILES and disk_format.recorded_hash(entry))
    return data[rank::world_size]


class ShareVerifier:
    """Hashes this rank's share of `path`'s data files on a background thread, started at once.
    ``problem()`` joins it: None, or (priority, one line naming the file) for the agreement."""

    def __init__(self, path: Path, files: dict, rank: int, world_size: int):
        self.path, self.files = path, files
        self.share = my_share(files, rank, world_size)
        self.seconds = self.waited_s = 0.0  # hashing (on the thread); the load's wait for it
        self._outcome: tuple[int, str] | None = None
        self._thread = threading.Thread(target=self._run, name="ckpt-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            for rel in self.share:
                if (bad := disk_format.hash_problem(self.path, rel, self.files[rel])) is not None:
                    self._outcome = (MISMATCH_PRIORITY, bad)
                    return
        except Exception as e:  # noqa: BLE001 - unreadable (an OSError names the file): agreed
            self._outcome = (0, describe(e))
        finally:
            self.seconds = time.perf_counter() - t0

    def problem(self) -> tuple[int, str] | None:
        """Joins the thread; ``waited_s``: how long that took, the checksums' cost to the load."""
        t0 = time.perf_counter()
        self._thread.join()
        self.waited_s = time.perf_counter() - t0
        return self._outcome
