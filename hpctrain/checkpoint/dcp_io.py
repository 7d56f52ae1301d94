"""How a checkpoint failure becomes one line, and the zip CRC32 switched off while DCP writes.

Owns: the one-line description of any checkpoint failure (DCP's CheckpointException unwrapped),
the zip CRC32 switched off while DCP writes (COMMIT.json carries the checksums). Must never import
torch.distributed.checkpoint: it imports DTensor and sympy (~0.5 s CPU per rank), and every rank
imports this at start-up (recording_fs.py, DCP's FileSystem subclass, is imported on the first save).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

from hpctrain.checkpoint.disk_format import CheckpointError


def _dcp_failures(exc: BaseException) -> dict | None:
    """exc.failures ({rank: (error, traceback)}) if `exc` is DCP's CheckpointException (which
    cannot exist before torch.distributed.checkpoint is imported), else None."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return exc.failures if api is not None and isinstance(exc, api.CheckpointException) else None


def describe(exc: BaseException) -> str:
    """One line for an exception; unwraps DCP's CheckpointException to the first rank's error."""
    failures = _dcp_failures(exc)
    if failures:
        rank, (inner, _) = sorted(failures.items())[0]
        return describe(inner)
    text = str(exc) if isinstance(exc, (OSError, CheckpointError)) else f"{type(exc).__name__}: {exc}"
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def failure(exc: BaseException, rank: int, io_error: OSError | None = None) -> tuple[int, str]:
    """(priority, one line) for the agreement step. 0: this rank's own error; 1: DCP relaying
    another rank's error (DCP pickles exceptions between ranks and loses their causes, so the rank
    where it happened reports it best, e.g. the OSError torch.save turned into a RuntimeError)."""
    if io_error is not None:
        return 0, describe(io_error)
    failures = _dcp_failures(exc)
    relayed = bool(failures) and rank not in failures
    return (1 if relayed else 0), describe(exc)


@contextmanager
def no_zip_crc32():
    """DCP writes each tensor with torch.save, whose zip records carry a CRC32 computed at ~100 MB/s
    per core: 6x slower than the disk here. Our COMMIT.json has sizes and sha256 (full_checksums),
    so the CRC is redundant; files without it load the same (torch.load does not require it)."""
    import torch.serialization as ser

    if not hasattr(ser, "set_crc32_options"):
        yield
        return
    before = ser.get_crc32_options()
    ser.set_crc32_options(False)
    try:
        yield
    finally:
        ser.set_crc32_options(before)
