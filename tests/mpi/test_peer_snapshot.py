"""Peer snapshots (hpctrain/checkpoint/snapshot.py) under a real mpiexec: 4 ranks as 2 pretend
nodes of 2 (HPCTRAIN_RANKS_PER_NODE=2, checkpoint.snapshot_dir with a `{node}` placeholder), a
snapshot every 2 steps, killed hard after step 7 (test fault exit_after_step). A relaunch on one
node whose partner node's memory is gone resumes from step 6's snapshot with no PFS checkpoint,
bit for bit like the same relaunch from a PFS checkpoint of step 6; a damaged snapshot falls back
to the PFS checkpoint with one warning naming the file. A copy that fails its checksum is replaced
from the other node's intact copy before anything is loaded; with no intact copy and no PFS
checkpoint the run starts from fresh weights, and a load that failed after writing into the model
is never trained on (#47).
"""
import json
import shutil
from pathlib import Path

import pytest

from hpctrain import step_faults
from hpctrain.checkpoint.snapshot import run_key
from tests.conftest import TINY_TRAIN, losses
from tests.helpers import train

pytestmark = pytest.mark.mpi
NODES_OF_2 = {"HPCTRAIN_RANKS_PER_NODE": "2"}
STEPS = 10
ARGS = ["--train.global_batch=8", "--checkpoint.snapshot_interval=2"]


def _config(tmp: Path, name: str, data) -> tuple[Path, Path]:
    run = tmp / name
    cfg = tmp / f"{name}.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=data, steps=STEPS)
                   + f'[checkpoint]\nsnapshot_dir = "{tmp}/mem_{name}/node{{node}}"\n')
    return cfg, run


def _node_dir(tmp: Path, name: str, node: int) -> Path:
    found = list((tmp / f"mem_{name}" / f"node{node}").glob("hpctrain-*/snapshots-*"))
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, dataset):
    """(tmp, data): run "killed" trained on 4 ranks (2 nodes x 2) and killed after step 7, with
    PFS checkpoints at steps 2, 4 and 6 and the peer snapshot of step 6 on both nodes."""
    tmp = tmp_path_factory.mktemp("snap")
    cfg, run = _config(tmp, "killed", dataset)
    r = train(4, cfg, *ARGS, "--checkpoint.interval=2", check=False, env={
        **NODES_OF_2, **step_faults.env(exit_after_step=7)})
    assert r.returncode != 0 and sorted(losses(run)) == list(range(1, 7)), r.stderr[-3000:]  # 7's unwritten
    return tmp, dataset


def _copy(tmp: Path, src: str, dst: str, data) -> tuple[Path, Path]:
    """Run `src`'s directory and snapshot memory under the name `dst`, the snapshots re-keyed to
    the copy's run directory (their folder name and COMMIT.json's "run": a hash of it)."""
    cfg, run = _config(tmp, dst, data)
    shutil.copytree(tmp / src, run)
    shutil.copytree(tmp / f"mem_{src}", tmp / f"mem_{dst}")
    for node in (0, 1) if (tmp / f"mem_{dst}").exists() else ():
        folder = _node_dir(tmp, dst, node)
        folder = folder.rename(folder.with_name(f"snapshots-{run_key(str(run))}"))
        for commit in folder.glob("step_*/COMMIT.json"):
            commit.write_text(json.dumps({**json.loads(commit.read_text()), "run": run_key(str(run))}))
    return cfg, run


def test_lost_node_resumes_from_peer_snapshot_bit_exact(killed):
    """Node 1 lost, no PFS checkpoint at all: 2 ranks on node 0 resume from step 6's snapshot
    (node 0 holds node 1's files as its buddy) and train steps 7.. bit for bit like the same
    relaunch from the PFS checkpoint of step 6."""
    tmp, data = killed
    cfg, run = _copy(tmp, "killed", "lost", data)
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(tmp / "mem_lost" / "node1")
    r = train(2, cfg, *ARGS, env=NODES_OF_2)
    assert "resumed from the peer snapshot of step 6 (no PFS read)" in r.stderr, r.stderr[-3000:]
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    cfg_ref, run_ref = _copy(tmp, "killed", "ref", data)
    shutil.rmtree(tmp / "mem_ref")  # no snapshots: the PFS checkpoint of step 6
    r = train(2, cfg_ref, *ARGS, env=NODES_OF_2)
    assert "resumed from" in r.stderr and "step_00000006" in r.stderr, r.stderr[-3000:]
    got, want = losses(run), losses(run_ref)
    assert [got[s] for s in range(7, STEPS + 1)] == [want[s] for s in range(7, STEPS + 1)]


def test_damaged_snapshot_falls_back_to_pfs(killed):
    """Node 1 lost and node 0's copy of rank 2's data file gone: one warning naming the file,
    then the newest PFS checkpoint older than the snapshot (step 4)."""
    tmp, data = killed
    cfg, run = _copy(tmp, "killed", "damaged", data)
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    shutil.rmtree(tmp / "mem_damaged" / "node1")
    (_node_dir(tmp, "damaged", 0) / "step_00000006" / "__2_0.distcp").unlink()
    r = train(2, cfg, *ARGS, "--train.stop_at_step=5", env=NODES_OF_2)
    warnings = [line for line in r.stderr.splitlines() if "peer snapshot" in line and "warning" in line]
    assert len(warnings) == 1 and "step_00000006/__2_0.distcp" in warnings[0], r.stderr[-3000:]
    assert "step_00000004" in r.stderr and "peer snapshot of step" not in r.stderr


def test_snapshot_data_damaged_in_memory_fails_its_checksum_and_falls_back(killed):
    """Node 1 lost and one byte of node 0's copy of rank 2's data file flipped (same size: the
    snapshot is still chosen): its xxh3-128 in COMMIT.json fails the load's check, one warning, then
    the newest PFS checkpoint older than the snapshot (step 4)."""
    tmp, data = killed
    cfg, run = _copy(tmp, "killed", "flipped", data)
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    shutil.rmtree(tmp / "mem_flipped" / "node1")
    step6 = _node_dir(tmp, "flipped", 0) / "step_00000006"
    commit = json.loads((step6 / "COMMIT.json").read_text())
    assert commit["checksums"] == "full" and "xxh3_128" in commit["files"]["__2_0.distcp"], commit
    blob = bytearray((step6 / "__2_0.distcp").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (step6 / "__2_0.distcp").write_bytes(bytes(blob))
    r = train(2, cfg, *ARGS, "--train.stop_at_step=5", env=NODES_OF_2)
    warnings = [line for line in r.stderr.splitlines() if "peer snapshot" in line and "not used" in line]
    assert len(warnings) == 1 and "__2_0.distcp" in warnings[0], r.stderr[-3000:]
    assert "step_00000004" in r.stderr and "(no PFS read)" not in r.stderr, r.stderr[-3000:]


def _flip(path: Path) -> bytes:
    """Flip one byte in the middle of `path` (same size: the snapshot is still chosen); its old bytes."""
    blob = bytearray(path.read_bytes())
    original = bytes(blob)
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    return original


def test_damaged_copy_is_replaced_from_the_other_nodes_intact_copy(killed):
    """No PFS checkpoint; one byte of node 0's copy of rank 0's data file flipped, node 1's copy
    (its buddy's) intact: both nodes relaunched resume from step 6's snapshot with node 1's copy
    (one line naming the file and node 1), and step 7 equals the relaunch from the PFS checkpoint
    of step 6."""
    tmp, data = killed
    cfg, run = _copy(tmp, "killed", "healed", data)
    shutil.rmtree(run / "checkpoints")
    rel = "step_00000006/__0_0.distcp"
    intact = _flip(_node_dir(tmp, "healed", 0) / rel)
    assert (_node_dir(tmp, "healed", 1) / rel).read_bytes() == intact
    r = train(4, cfg, *ARGS, "--train.stop_at_step=7", env=NODES_OF_2)
    assert "resumed from the peer snapshot of step 6 (no PFS read)" in r.stderr, r.stderr[-3000:]
    named = [line for line in r.stderr.splitlines() if "__0_0.distcp" in line]
    assert len(named) == 1 and "node 0" in named[0] and "node 1" in named[0], r.stderr[-3000:]
    cfg_ref, run_ref = _copy(tmp, "killed", "ref4", data)
    shutil.rmtree(tmp / "mem_ref4")
    train(4, cfg_ref, *ARGS, "--train.stop_at_step=7", env=NODES_OF_2)
    assert losses(run)[7] == losses(run_ref)[7]


def test_damaged_everywhere_without_pfs_starts_from_fresh_weights(killed):
    """Node 1 lost, node 0's copy of rank 0's data file damaged, no PFS checkpoint: one warning
    naming the file, one saying training starts from step 0, and step 1's loss is a fresh model's
    (the damaged snapshot's trained weights give ~3.5 nats against ~5.5)."""
    tmp, data = killed
    cfg, run = _copy(tmp, "killed", "fresh", data)
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(tmp / "mem_fresh" / "node1")
    _flip(_node_dir(tmp, "fresh", 0) / "step_00000006" / "__0_0.distcp")
    r = train(2, cfg, *ARGS, "--train.stop_at_step=1", env=NODES_OF_2)
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning")]
    assert any("__0_0.distcp" in w and "node 0" in w for w in warnings), r.stderr[-3000:]
    assert any("step 0" in w for w in warnings), r.stderr[-3000:]
    assert "resumed from" not in r.stderr
    assert losses(run)[1] == pytest.approx(losses(tmp / "killed")[1], abs=1e-5)


def test_a_load_that_failed_after_writing_into_the_model_is_never_trained_on(killed):
    """The snapshot's load fails after DCP wrote into the model (test fault) and there is no PFS
    checkpoint: one error line naming the snapshot, exit != 0, no step trained, the run's metrics
    left as they were."""
    tmp, data = killed
    cfg, run = _copy(tmp, "killed", "written", data)
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(tmp / "mem_written" / "node1")
    r = train(2, cfg, *ARGS, check=False, env={
        **NODES_OF_2, **step_faults.env(save_point="load.dcp_done:1::enospc")})
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert r.returncode != 0 and errors and "step_00000006" in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert sorted(losses(run)) == list(range(1, 7))
