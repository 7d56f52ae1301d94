"""Pinned host memory of async checkpoints and peer snapshots (shared/GPU.md second review, item 6):
a GPU state staged for an async save is handed back to torch's pinned-memory cache once written,
and the next staging (a peer snapshot's, which keeps its own buffers dict) takes the same pinned
blocks instead of pinning a second copy. Before: the manager kept its pinned buffers all run and
the snapshots another set (~12 GB per rank each at 8B on one node). Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]


def pinned(key: str) -> int:
    return torch.cuda.memory.host_memory_stats().get(key, 0)


def test_async_staging_is_given_back_once_written_and_reused(tmp_path):
    from hpctrain.checkpoint import CheckpointManager
    from hpctrain.checkpoint.background import stage

    state = {"w": torch.randn(1 << 22, device="cuda"), "b": torch.randn(4096, device="cuda")}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    mgr = CheckpointManager(tmp_path, keep=2, rank=0, world_size=1)
    mgr.save_async(1, state, {"step": 1})
    assert mgr.wait() == tmp_path / "step_00000001"
    owned = pinned("allocated_bytes.current")        # the pinned blocks of the save (cached now)
    assert owned >= nbytes
    snapshot_buffers: dict = {}                      # a second stager (the peer snapshots')
    staged = stage(state, snapshot_buffers)
    assert pinned("allocated_bytes.current") == owned  # the same pinned blocks, no second copy
    assert all(torch.equal(staged[k], state[k].cpu()) for k in state)
    assert snapshot_buffers == {}                    # GPU stagings are never kept all run
