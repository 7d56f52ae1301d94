"""Checkpoints: atomic, collective save/load of torch.distributed.checkpoint (DCP) state dicts.

Public API (everything else in this package is internal):
  CheckpointManager(root, keep, rank, world_size)  .save_states(step, {name: Stateful}) .load_states(path, ...)
      .latest() .resume_newest(fn) .read_trainer_state(path) .wait() .poll()
      .save(step, tensors, json_state) .save_async(...) .load(path, tensors)   (the layer underneath)
  list_checkpoints(root) -> [CheckpointInfo]        verify_checkpoint(path) -> [problem, ...]
  CheckpointError                                   (a UserError: shown as one line)

This package must never import model, data or training code, and never unpickle file contents
(safe_load.py). Format and protocol: docs/checkpoints.md. `python -m hpctrain ckpt list|verify` is
cli.py; test-only fault injection points are faults.py.

The torch-backed names (CheckpointManager: DCP) load on first use (PEP 562): `ckpt list|verify`
read files only and must not pay ~2 s of CPU for importing torch and DCP.
"""
from hpctrain.checkpoint.directory import CheckpointInfo, list_checkpoints
from hpctrain.checkpoint.disk_format import verify_checkpoint
from hpctrain.errors import CheckpointError, UnsafeCheckpointError

__all__ = ["CheckpointManager", "CheckpointError", "UnsafeCheckpointError", "CheckpointInfo",
           "list_checkpoints", "verify_checkpoint"]


def __getattr__(name: str):
    if name == "CheckpointManager":
        from hpctrain.checkpoint.manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module 'hpctrain.checkpoint' has no attribute {name!r}")
