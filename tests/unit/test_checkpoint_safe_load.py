"""Safe loading: the restricted unpickler for DCP `.metadata`, and the planner that refuses pickled
(BYTE_IO) items. Each malicious file carries a live payload (it creates a marker file when unpickled
the ordinary way: checked as a control) and the test asserts the payload never ran on our path.

Owns only safe-load behaviour; it must never unpickle an untrusted file outside a control check.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

from hpctrain.checkpoint import CheckpointError, CheckpointManager, UnsafeCheckpointError
from hpctrain.checkpoint import disk_format
from hpctrain.checkpoint.safe_load import (SafeFileSystemReader, TensorOnlyLoadPlanner,
                                           read_metadata)


class Payload:
    """Unpickling this runs `touch <marker>` (os.system)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def small_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8).to(torch.bfloat16))
    model.register_buffer("count", torch.arange(3, dtype=torch.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model[0](torch.arange(4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def test_allow_list_reads_real_metadata(world, tmp_path):
    m = CheckpointManager(tmp_path, keep=1, rank=world[0], world_size=world[1])
    path = m.save(1, small_state(), {})
    md = read_metadata(path / ".metadata")
    dtypes = {v.properties.dtype for v in md.state_dict_metadata.values()}
    assert {torch.float32, torch.bfloat16, torch.int64} <= dtypes
    assert "optim.state.0.weight.exp_avg" in md.state_dict_metadata


def _commit_again(path: Path):
    """An attacker who can write the files can also rewrite COMMIT.json to match."""
    commit = json.loads((path / "COMMIT.json").read_text())
    disk_format.write_commit(path, commit["step"], commit["world_size"], {})


def test_crafted_metadata_is_refused_and_never_runs(world, tmp_path, capsys):
    m = CheckpointManager(tmp_path / "ck", keep=3, rank=world[0], world_size=world[1])
    good = m.save(1, small_state(), {"step": 1})
    evil = m.save(2, small_state(), {"step": 2})
    marker = tmp_path / "pwned"
    (evil / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _commit_again(evil)

    with pytest.raises(UnsafeCheckpointError) as info:
        read_metadata(evil / ".metadata")
    msg = str(info.value)
    assert msg.startswith(f"{evil / '.metadata'}: refusing to unpickle posix.system") and "\n" not in msg

    assert m.latest() == good
    assert f"warning: skipping checkpoint {evil}: {evil / '.metadata'}: refusing to unpickle" \
        in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=f"checkpoint load from {evil} failed: .*refusing"):
        m.load(evil, small_state())
    with pytest.raises(BaseException, match="refusing to unpickle posix.system"):
        dcp.load(small_state(), storage_reader=SafeFileSystemReader(evil))
    assert not marker.exists()

    # control: the payload is live when unpickled the ordinary way (in a throw-away process)
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(evil / '.metadata')!r}, 'rb'))"],
                   check=True)
    assert marker.exists()


def test_truncated_metadata_is_a_clear_error(tmp_path):
    p = tmp_path / ".metadata"
    p.write_bytes(pickle.dumps({"a": 1})[:-3])
    with pytest.raises(CheckpointError, match=rf"^{p}: unreadable DCP metadata \("):
        read_metadata(p)
    p.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(UnsafeCheckpointError, match=rf"^{p}: holds a dict, not DCP Metadata"):
        read_metadata(p)


def test_planner_refuses_pickled_items_before_reading(world, tmp_path):
    """A checkpoint written by plain DCP with a non-tensor object stores it with torch.save;
    DefaultLoadPlanner would torch.load(weights_only=False) it."""
    marker = tmp_path / "pwned"
    ck = tmp_path / "plain_dcp"
    dcp.save({"w": torch.ones(4), "obj": Payload(marker)}, storage_writer=dcp.FileSystemWriter(ck))
    with pytest.raises(BaseException, match="checkpoint stores obj as pickled objects"):
        dcp.load({"w": torch.zeros(4), "obj": None}, storage_reader=SafeFileSystemReader(ck),
                 planner=TensorOnlyLoadPlanner())
    assert not marker.exists()
    # control: stock DCP runs it
    dcp.load({"w": torch.zeros(4), "obj": None}, storage_reader=SafeFileSystemReader(ck),
             planner=DefaultLoadPlanner())
    assert marker.exists()


def test_manager_never_writes_pickled_items(world, tmp_path):
    m = CheckpointManager(tmp_path, keep=1, rank=world[0], world_size=world[1])
    path = m.save(1, small_state(), {})
    md = read_metadata(path / ".metadata")
    kinds = {type(v).__name__ for v in md.state_dict_metadata.values()}
    assert kinds == {"TensorStorageMetadata"}
    values = json.loads((path / "state_nontensor.json").read_text())
    assert [["optim", "param_groups", 0, "lr"], 0.001] in values


def test_fsdp2_dtensor_state_round_trips(world, tmp_path):
    """DTensor leaves (FSDP2 on a 1-rank mesh) go through the same safe path."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        return model, opt

    m = CheckpointManager(tmp_path, keep=1, rank=world[0], world_size=world[1])
    model, opt = build(0)
    msd, osd = get_state_dict(model, opt)
    assert isinstance(msd["0.weight"], DTensor)
    path = m.save(1, {"model": msd, "optim": osd}, {})
    model2, opt2 = build(1)
    state = dict(zip(("model", "optim"), get_state_dict(model2, opt2)))
    m.load(path, state)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got, got_o = get_state_dict(model2, opt2)
    for k in msd:
        assert torch.equal(msd[k].full_tensor(), got[k].full_tensor())
    for k in osd["state"]:
        for n in osd["state"][k]:
            a, b = osd["state"][k][n], got_o["state"][k][n]
            a, b = (a.full_tensor() if isinstance(a, DTensor) else a), (b.full_tensor() if isinstance(b, DTensor) else b)
            assert torch.equal(a, b), (k, n)
