"""checkpoint.layout = "node" across real MPI ranks: 4 ranks as 2 pretend nodes x 2
(HPCTRAIN_RANKS_PER_NODE=2) write exactly one data file per node, a training run resumes from it
bit for bit, the checkpoint loads resharded on 2 bit-exact (DCP reads by metadata,
in the rank layout's manager), and COMMIT.json's checksum names a node file with a flipped byte.

Real mpiexec, real gloo, real files (tests/mpi/scripts/ckpt_worker.py with CKPT_LAYOUT=node, and
`hpctrain train`); nothing is mocked.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import TINY_SECTIONS, losses
from tests.helpers import train, write_config
from tests.mpi.test_checkpoint_mpi import WORKER, mpirun

pytestmark = pytest.mark.mpi
TWO_NODES = {"HPCTRAIN_RANKS_PER_NODE": "2"}
NODE_FILES = ["__node0.distcp", "__node1.distcp"]

# The 1-layer TINY_SECTIONS model, 6 steps, a checkpoint every 3 (steps 3 and 6 are kept).
NODE_GPT = TINY_SECTIONS + """[train]
steps = 6
micro_batch_size = 2
warmup_steps = 0
eval_interval = 0
log_interval = 1
[checkpoint]
interval = 3
keep = 2
layout = "node"
"""


def _worker():
    spec = importlib.util.spec_from_file_location("ckpt_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker


def data_files(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".distcp"))


@pytest.fixture(scope="module")
def saved_by_2_nodes(tmp_path_factory) -> Path:
    """ckpt_worker's DDP state saved at step 3 by 4 ranks on 2 pretend nodes, layout node."""
    root = tmp_path_factory.mktemp("node_layout")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in dict(TWO_NODES, CKPT_LAYOUT="node").items():
            mp.setenv(key, value)
        mpirun(4, "save", root, timeout=180)
    return root


def test_one_file_per_node_loads_resharded_on_2_ranks(saved_by_2_nodes):
    ckpt = saved_by_2_nodes / "step_00000003"
    assert data_files(ckpt) == NODE_FILES
    commit = json.loads((ckpt / "COMMIT.json").read_text())
    assert all(len(commit["files"][f]["xxh3_128"]) == 32 for f in NODE_FILES)
    # the rank layout's manager reads it, 4 -> 2 ranks, every tensor bit-exact (load_and_compare);
    # each rank re-hashes one node file
    out = mpirun(2, "load", saved_by_2_nodes, timeout=180)
    assert sorted(re.findall(r"^LOAD_S (\d) \S+ saved_by=4$", out, re.M)) == ["0", "1"], out
    verified = dict(re.findall(r"^VERIFIED (\d) (.*)$", out, re.M))
    assert verified == {"0": "__node0.distcp", "1": "__node1.distcp"}, out


def test_flipped_byte_in_a_node_file_is_named(saved_by_2_nodes, tmp_path):
    """One process, no launch: COMMIT.json's xxh3 of the node file catches the flip."""
    root = tmp_path / "damaged"
    shutil.copytree(saved_by_2_nodes, root)
    victim = root / "step_00000003" / "__node1.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    from hpctrain.checkpoint import CheckpointError, CheckpointManager

    ckpt_worker = _worker()
    mgr = CheckpointManager(root, keep=2, rank=0, world_size=1)
    model, opt = ckpt_worker.build(1, 0, 0)
    with pytest.raises(CheckpointError, match=r"__node1\.distcp does not match its xxh3_128"):
        mgr.load(root / "step_00000003", ckpt_worker.state_of(model, opt))


def test_full_disk_on_the_node_leader_fails_everywhere_without_hanging(tmp_path):
    """ENOSPC when rank 0 (the leader of the one node of 2 ranks) opens the node file: it still
    receives rank 1's bytes, and both ranks raise the same line naming rank 0 and the file."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CKPT_LAYOUT", "node")
        mp.setenv("CKPT_FAIL_RANK", "0")
        out = mpirun(2, "fail", tmp_path, timeout=120)
    errs = dict(re.findall(r"^ERR (\d+) (.*)$", out, re.M))
    node_file = tmp_path / "step_00000002.tmp" / "__node0.distcp"
    assert set(errs) == {"0", "1"} and len(set(errs.values())) == 1, out
    assert "rank 0: [Errno 28]" in errs["0"] and f"'{node_file}'" in errs["0"], out
    assert "LISTING ['step_00000001']" in out


def test_training_resumes_bit_exact_from_node_files(tmp_path, dataset):
    """4 ranks, 2 pretend nodes, async saves: steps 4-6 after a resume from step 3 are the
    uninterrupted run's, bit for bit."""
    cfg, run = write_config(tmp_path, dataset, "node", NODE_GPT)
    train(4, cfg, "--checkpoint.async=true", env=TWO_NODES, timeout=300)
    ckpts = run / "checkpoints"
    assert [data_files(ckpts / s) for s in ("step_00000003", "step_00000006")] == [NODE_FILES] * 2
    straight = losses(run)
    shutil.rmtree(ckpts / "step_00000006")
    os.remove(run / "metrics.jsonl")
    r = train(4, cfg, env=TWO_NODES, timeout=300)
    assert "step_00000003" in r.stderr, r.stderr[-2000:]
    resumed = losses(run)
    assert sorted(resumed) == [4, 5, 6], resumed
    assert all(resumed[s] == straight[s] for s in (4, 5, 6)), (straight, resumed)
