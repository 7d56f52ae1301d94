"""Loading DCP checkpoints without unpickling arbitrary objects.

Owns the project rule "loading never unpickles arbitrary objects" for checkpoints. torch 2.13's DCP
reads `.metadata` with plain `pickle.load` (FileSystemReader.read_metadata) and non-tensor items with
`torch.load(weights_only=False)` (DefaultLoadPlanner.load_bytes). Here:

  read_metadata(path)        a restricted Unpickler that resolves only the classes DCP metadata
                             contains (found by saving real model + AdamW state, plain, DDP and FSDP2),
                             and raises UnsafeCheckpointError naming the file for anything else;
  SafeFileSystemReader       a FileSystemReader whose read_metadata is the one above (or returns
                             metadata already read safely by rank 0); tensor data itself is read by
                             DCP with torch.load(weights_only=True);
  TensorOnlyLoadPlanner      refuses BYTE_IO (pickled non-tensor) items before any is read.

It must never call pickle.load / torch.load(weights_only=False) on file contents, and never widen
the allow-list to a callable that can do more than build plain data (no builtins.eval/getattr,
no os/subprocess, no functools.partial, no torch._utils rebuild functions).
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType

from hpctrain.checkpoint.metadata_scan import ALLOWED as _ALLOWED, read_checked, refusal
from hpctrain.errors import CheckpointError, UnsafeCheckpointError  # noqa: F401 - re-exported


# torch.float32, torch.bfloat16, torch.strided, ...: pickled as globals of module `torch`. Listed
# up front (no getattr on attacker-chosen names: torch's module __getattr__ imports submodules).
_TORCH_CONSTANTS: frozenset[str] = frozenset(
    name for name, v in vars(torch).items()
    if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)))


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name in _TORCH_CONSTANTS:
            return vars(torch)[name]
        raise refusal(self._source, module, name)

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self._source}: refusing a persistent id in DCP metadata")


def restricted_loads(data: bytes, source: str):
    """Unpickle bytes allowing only DCP metadata classes; `source` names the file in errors."""
    import io

    return _RestrictedUnpickler(io.BytesIO(data), source).load()


def read_metadata(path: str | os.PathLike) -> Metadata:
    """Read a DCP `.metadata` file safely. Raises CheckpointError naming the file on any problem."""
    return read_checked(path, restricted_loads, lambda md: isinstance(md, Metadata))


class SafeFileSystemReader(FileSystemReader):
    """DCP FileSystemReader that never uses plain pickle. Pass `metadata` (read with
    `read_metadata` on one rank and broadcast) to spare the file system one read per rank."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: rank-local DCP metadata is not supported")
        md = self._metadata if self._metadata is not None else read_metadata(
            Path(self.path) / ".metadata")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that refuses pickled (BYTE_IO) items, naming them, before reading any."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        pickled = sorted({item.dest_index.fqn for item in plan.items
                          if item.type == LoadItemType.BYTE_IO})
        if pickled:
            shown = ", ".join(pickled[:3]) + (f" (+{len(pickled) - 3} more)" if len(pickled) > 3 else "")
            raise UnsafeCheckpointError(
                f"checkpoint stores {shown} as pickled objects; refusing to unpickle them "
                f"(hpctrain checkpoints hold tensors in DCP and everything else in JSON)")
        return plan

    def load_bytes(self, read_item, value) -> None:
        raise UnsafeCheckpointError(
            f"refusing to unpickle non-tensor checkpoint item {read_item.dest_index.fqn}")
