"""Checkpoints: atomic, collective save/load of torch.distributed.checkpoint (DCP) state dicts.

Public API (everything else in this package is internal):
  CheckpointManager(root, keep, rank, world_size)  .latest() .save(step, state, extra) .load(path, state)
                                                    .save_async(step, state, extra) .wait() .poll()
  list_checkpoints(root) -> [CheckpointInfo]        verify_checkpoint(path) -> [problem, ...]
  CheckpointError                                   (a UserError: shown as one line)

This package must never import model, data or training code, and never unpickle file contents
(safe_load.py). Format and protocol: docs/checkpoints.md. `python -m hpctrain ckpt list|verify` is
cli.py; test-only fault injection points are faults.py.
"""
from hpctrain.checkpoint.layout import (CheckpointError, CheckpointInfo, list_checkpoints,
                                        verify_checkpoint)
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.safe_load import UnsafeCheckpointError

__all__ = ["CheckpointManager", "CheckpointError", "UnsafeCheckpointError", "CheckpointInfo",
           "list_checkpoints", "verify_checkpoint"]
