"""`resolve_checkpoint`: the one function sample, export and `ckpt` use to turn a run dir, a
checkpoint root or a step dir into the checkpoint to load (newest committed and intact)."""
from __future__ import annotations

import pytest
import torch

from hpctrain.checkpoint import CheckpointManager
from hpctrain.checkpoint.cli import resolve_checkpoint
from hpctrain.errors import CheckpointError, NoIntactCheckpoint
from tests.conftest import run_cmd


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run dir with committed checkpoints at steps 10 and 20 (one process, no group)."""
    run = tmp_path_factory.mktemp("run")
    mgr = CheckpointManager(run / "checkpoints", keep=3, rank=0, world_size=1)
    for step in (10, 20):
        mgr.save(step, {"model": {"w": torch.full((4,), float(step))}}, {"step": step})
    return run


def test_run_dir_checkpoints_dir_and_step_dir(run_dir):
    ckpts = run_dir / "checkpoints"
    assert resolve_checkpoint(run_dir).name == "step_00000020"
    assert resolve_checkpoint(str(ckpts)).name == "step_00000020"
    assert resolve_checkpoint(ckpts / "step_00000010") == ckpts / "step_00000010"  # as given


def test_damaged_newest_falls_back_with_a_warning(run_dir, tmp_path, capfd):
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shard = next((copy / "checkpoints" / "step_00000020").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    assert resolve_checkpoint(copy).name == "step_00000010"
    err = capfd.readouterr().err
    assert "skipping checkpoint" in err and "step_00000020" in err
    shard = next((copy / "checkpoints" / "step_00000010").glob("*.distcp"))
    shard.write_bytes(b"")
    with pytest.raises(NoIntactCheckpoint, match="2 checkpoint"):
        resolve_checkpoint(copy)


def test_nothing_there_is_one_error_naming_the_path(tmp_path):
    with pytest.raises(CheckpointError, match=f"^{tmp_path}: no committed checkpoint found$"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'nope'}: no such directory$"):
        resolve_checkpoint(tmp_path / "nope")
    for command in (["sample", "--checkpoint"], ["export", "--format", "hf", "--output",
                                                  str(tmp_path / "out"), "--checkpoint"]):
        r = run_cmd(["python", "-m", "hpctrain", *command, str(tmp_path)], timeout=120)
        assert r.returncode != 0 and r.stderr.strip().splitlines() == [
            f"error: {tmp_path}: no committed checkpoint found"], (command, r.stderr)
