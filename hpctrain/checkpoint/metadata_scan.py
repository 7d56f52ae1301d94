"""Reading a DCP `.metadata` file without importing torch, for the integrity check alone.

Owns the allow-list of what a DCP `.metadata` pickle may name (ALLOWED; safe_load.py resolves it to
the real torch classes for loading) and the checks every read of the file makes (read_checked).
`read_records(path)` unpickles the file under the same allow-list with every torch class replaced by
an inert record (its pickled fields as attributes): nothing is constructed but plain data, nothing
of torch is imported, and a global outside the list is refused naming the file, as in safe_load.
disk_format's check (`hpctrain ckpt list|verify`, which never load tensors) uses it when torch is
not loaded yet, so listing a folder does not cost ~2 s of CPU for importing torch and DCP.
"""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

from hpctrain.errors import CheckpointError, UnsafeCheckpointError

_DCP_META = "torch.distributed.checkpoint.metadata"
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_DCP_META, "Metadata"),
    (_DCP_META, "TensorStorageMetadata"),
    (_DCP_META, "BytesStorageMetadata"),    # parsed so the planner can refuse it by name
    (_DCP_META, "ChunkStorageMetadata"),
    (_DCP_META, "TensorProperties"),
    (_DCP_META, "MetadataIndex"),
    (_DCP_META, "StorageMeta"),
    (_DCP_META, "_MEM_FORMAT_ENCODING"),    # an Enum: calling it looks a value up
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a dict lookup of torch.strided & co by name
    ("pathlib", "PosixPath"),               # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),        # Python >= 3.13 spells it so
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
})


def refusal(source: str, module: str, name: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{source}: refusing to unpickle {module}.{name} (only DCP metadata classes are allowed; "
        f"this file was not written by torch.distributed.checkpoint, or was tampered with)")


def read_checked(path: str | os.PathLike, loads, is_metadata):
    """`loads(bytes, source)` of the file, checked to be DCP Metadata with its two tables.
    CheckpointError (UnsafeCheckpointError) naming the file on any problem."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read DCP metadata ({e.strerror or e})") from None
    try:
        md = loads(data, str(path))
    except CheckpointError:
        raise
    except Exception as e:  # truncated / garbled: EOFError, UnpicklingError, TypeError, ...
        raise CheckpointError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    if not is_metadata(md):
        raise UnsafeCheckpointError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(getattr(md, "state_dict_metadata", None), dict) or \
            not isinstance(getattr(md, "storage_data", None), dict):
        raise CheckpointError(f"{path}: DCP metadata lacks state_dict_metadata or storage_data")
    return md


class _Record:
    """An inert stand-in for one allowed torch class: REDUCE's arguments, BUILD's fields."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


class _Constant:
    """An inert stand-in for `torch.<name>` (a dtype, layout or memory format); never callable."""

    def __init__(self, name: str):
        self.name = name


_RECORDS = {key: type(key[1], (_Record,), {}) for key in ALLOWED if key[0].startswith("torch")}


class _RecordUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str):
        if (module, name) in _RECORDS:
            return _RECORDS[module, name]
        if (module, name) in ALLOWED:  # pathlib, collections, builtins: plain data
            return super().find_class(module, name)
        if module == "torch" and name.isidentifier() and not name.startswith("_"):
            return _Constant(name)
        raise refusal(self._source, module, name)

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self._source}: refusing a persistent id in DCP metadata")


def _record_loads(data: bytes, source: str):
    return _RecordUnpickler(io.BytesIO(data), source).load()


def read_records(path: str | os.PathLike):
    """The `.metadata` file as inert records (`.storage_data` values have relative_path, offset and
    length); the same errors as safe_load.read_metadata."""
    return read_checked(path, _record_loads,
                        lambda md: type(md) is _RECORDS[_DCP_META, "Metadata"])
