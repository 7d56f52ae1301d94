"""CheckpointManager in one process (a real 1-rank gloo group from init_distributed): round trip,
retention, interrupted and corrupted checkpoints, failing saves, re-saves.

Owns only checkpoint behaviour; it must never mock torch.distributed or DCP itself (failures are
injected at the file-stream level, below DCP).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpctrain.checkpoint import (CheckpointError, CheckpointManager, directory, list_checkpoints,
                                 verify_checkpoint)
from hpctrain.errors import NoIntactCheckpoint


def make(seed: int, steps: int = 3):
    """A small GPT-ish model + AdamW after `steps` optimizer steps (0: fresh)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(64, 32), nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(),
                          nn.Linear(32, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 16))
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def state_of(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def assert_same_state(a: dict, b: dict):
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
    for k, sub in a["optim"]["state"].items():
        for name, t in sub.items():
            assert torch.equal(t, b["optim"]["state"][k][name]), (k, name)


def tree_sha(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def mgr(world, root, keep=3, **kw) -> CheckpointManager:
    return CheckpointManager(root, keep=keep, rank=world[0], world_size=world[1], **kw)


def save_model(m: CheckpointManager, step: int, seed: int = 0) -> dict:
    model, opt = make(seed)
    state = state_of(model, opt)
    m.save(step, state, {"step": step, "seed": seed})
    return state


def load_fresh(m: CheckpointManager, path: Path):
    model, opt = make(seed=99, steps=0)
    state = state_of(model, opt)
    extra = m.load(path, state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt, extra


def test_round_trip_bit_exact_and_resume_identical(world, tmp_path):
    m = mgr(world, tmp_path)
    model, opt = make(0)
    saved = state_of(model, opt)
    extra = {"step": 3, "sampler": {"epoch": 1, "position": 1234}, "rng": [[1, 2], [3, 4]],
             "lr": 2.5e-4, "config": {"name": "demo", "tied": True, "none": None}}
    path = m.save(3, saved, extra)
    assert path == tmp_path / "step_00000003" and m.latest() == path
    assert sorted(p.name for p in path.iterdir()) == [
        ".metadata", "COMMIT.json", "__0_0.distcp", "state_nontensor.json", "trainer_state.json"]

    model2, opt2, got = load_fresh(m, path)
    assert got == extra
    assert_same_state(saved, state_of(model2, opt2))
    assert isinstance(opt2.param_groups[0]["betas"], tuple)
    # one more identical step from both gives identical parameters (optimizer state incl. `step`)
    for mm, oo in ((model, opt), (model2, opt2)):
        torch.manual_seed(7)
        x = torch.randint(0, 64, (4, 16))
        nn.functional.cross_entropy(mm(x).flatten(0, 1), x.flatten()).backward()
        oo.step()
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)


def test_retention_keeps_exactly_keep(world, tmp_path):
    m = mgr(world, tmp_path, keep=2)
    for step in (10, 20, 30, 40, 50):
        save_model(m, step)
    assert sorted(os.listdir(tmp_path)) == ["step_00000040", "step_00000050"]
    assert [i.step for i in list_checkpoints(tmp_path)] == [50, 40]


def test_interrupted_saves_are_ignored(world, tmp_path, capsys):
    m = mgr(world, tmp_path)
    save_model(m, 10)
    good = tmp_path / "step_00000010"
    # a save killed mid-write (tmp dir), and a step dir that never got its commit marker
    tmp = tmp_path / "step_00000030.tmp"
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "step_00000005.deleting").mkdir()  # retention killed mid-delete
    nocommit = tmp_path / "step_00000020"
    nocommit.mkdir()
    for f in good.iterdir():
        if f.name != "COMMIT.json":
            (nocommit / f.name).write_bytes(f.read_bytes())
    assert m.latest() == good
    err = capsys.readouterr().err
    assert f"warning: skipping checkpoint {nocommit}: no COMMIT.json" in err
    assert "step_00000030.tmp" not in err
    status = {i.path.name: (i.kind, i.status) for i in list_checkpoints(tmp_path)}
    assert status == {"step_00000030.tmp": ("tmp", "incomplete"),
                      "step_00000020": ("checkpoint", "incomplete"),
                      "step_00000010": ("checkpoint", "committed"),
                      "step_00000005.deleting": ("trash", "incomplete")}
    # the next save removes stale tmp and trash dirs, but leaves the marker-less dir for a human
    save_model(m, 40)
    assert sorted(os.listdir(tmp_path)) == ["step_00000010", "step_00000020", "step_00000040"]


def _truncate(p: Path):
    d = p / "__0_0.distcp"
    d.write_bytes(d.read_bytes()[:-100])


def _delete(p: Path):
    (p / "__0_0.distcp").unlink()


def _edit_trainer_state(p: Path):  # same size: only the checksum can tell
    f = p / "trainer_state.json"
    f.write_text(f.read_text().replace('"step": 20', '"step": 99'))


@pytest.mark.parametrize("corrupt,reason", [
    (_truncate, "__0_0.distcp has"), (_delete, "__0_0.distcp is missing"),
    (_edit_trainer_state, "trainer_state.json does not match its sha256")])
def test_corrupt_newest_is_skipped_with_warning(world, tmp_path, capsys, corrupt, reason):
    m = mgr(world, tmp_path)
    older = save_model(m, 10, seed=1)
    save_model(m, 20, seed=2)
    newest = tmp_path / "step_00000020"
    corrupt(newest)
    assert m.latest() == tmp_path / "step_00000010"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: skipping checkpoint {newest}: {reason}")
    assert verify_checkpoint(newest) and not verify_checkpoint(tmp_path / "step_00000010")
    model, opt, extra = load_fresh(m, m.latest())
    assert extra["step"] == 10
    assert_same_state(older, state_of(model, opt))
    with pytest.raises(CheckpointError, match=f"checkpoint load from {newest} failed: {reason}"):
        load_fresh(m, newest)


def test_default_checksums_are_hashed_while_writing_and_catch_a_flipped_byte(world, tmp_path, capsys):
    import xxhash

    from hpctrain.checkpoint.cli import main as ckpt_main

    m = mgr(world, tmp_path)  # full checksums are the default
    save_model(m, 5)
    p = tmp_path / "step_00000005"
    commit = json.loads((p / "COMMIT.json").read_text())
    entry = commit["files"]["__0_0.distcp"]
    assert commit["checksums"] == "full"
    # the digest computed from the bytes as they were written is the file's digest
    assert entry["xxh3_128"] == xxhash.xxh3_128((p / "__0_0.distcp").read_bytes()).hexdigest()
    assert ckpt_main(["verify", str(p)]) == 0
    data = bytearray((p / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (p / "__0_0.distcp").write_bytes(bytes(data))
    assert verify_checkpoint(p) == []  # quick check: sizes only for data files
    assert verify_checkpoint(p, full=True) == ["__0_0.distcp does not match its xxh3_128 in COMMIT.json"]
    capsys.readouterr()
    assert ckpt_main(["verify", str(p)]) == 1
    assert capsys.readouterr().out == f"{p}: __0_0.distcp does not match its xxh3_128 in COMMIT.json\n"
    assert ckpt_main(["verify", "--quick", str(p)]) == 0
    with pytest.raises(CheckpointError, match=r"failed: __0_0\.distcp does not match its xxh3_128"):
        load_fresh(m, p)


def _flip_middle_byte(p: Path) -> None:
    data = bytearray((p / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (p / "__0_0.distcp").write_bytes(bytes(data))


def test_every_checkpoint_unusable_refuses_instead_of_starting_over(world, tmp_path, capsys):
    m = mgr(world, tmp_path)
    for step in (10, 20):
        save_model(m, step)
        (tmp_path / f"step_{step:08d}" / ".metadata").unlink()
    with pytest.raises(NoIntactCheckpoint) as info:
        m.latest()
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path}: 2 checkpoint(s) (step_00000020, step_00000010), none intact")
    assert "new run.dir" in msg and "\n" not in msg
    assert sorted(os.listdir(tmp_path)) == ["step_00000010", "step_00000020"]  # nothing removed
    assert mgr(world, tmp_path / "fresh").latest() is None  # an empty run dir starts at step 0


def test_a_checkpoint_that_fails_while_loading_falls_back_to_the_previous(world, tmp_path, capsys):
    """Sizes and small files intact, a flipped byte in the tensor data: the quick scan passes,
    the load's checksum check fails, the manager goes on to the previous checkpoint."""
    m = mgr(world, tmp_path)
    older = save_model(m, 10, seed=1)
    save_model(m, 20, seed=2)
    newest = tmp_path / "step_00000020"
    _flip_middle_byte(newest)
    loaded = {}

    def resume_from(path):
        loaded[path] = load_fresh(m, path)

    assert m.resume_newest(resume_from) == tmp_path / "step_00000010"
    assert list(loaded) == [tmp_path / "step_00000010"]
    model, opt, extra = loaded[tmp_path / "step_00000010"]
    assert extra["step"] == 10
    assert_same_state(older, state_of(model, opt))
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning:")]
    assert len(err) == 1 and err[0].startswith(f"warning: skipping checkpoint {newest}: "), err


class _FullDisk:
    """A DCP output stream that accepts `budget` bytes, then fails like a full file system."""

    def __init__(self, stream, path, budget):
        self._s, self._path, self._budget = stream, path, budget

    def write(self, b):
        if len(b) > self._budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._path))
        self._budget -= len(b)
        return self._s.write(b)

    def __getattr__(self, name):
        return getattr(self._s, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._s.close()


def fill_disk_after(monkeypatch, budget: int):
    real = dcp_fs.FileSystem.create_stream

    def create_stream(self, path, mode):
        cm = real(self, path, mode)
        if "w" not in mode:
            return cm

        class _Ctx:
            def __enter__(_):
                return _FullDisk(cm.__enter__(), path, budget)

            def __exit__(_, *exc):
                return cm.__exit__(*exc)
        return _Ctx()

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", create_stream)


def test_failed_save_leaves_previous_untouched(world, tmp_path, monkeypatch):
    m = mgr(world, tmp_path, keep=1)
    older = save_model(m, 10, seed=1)
    prev = tmp_path / "step_00000010"
    before = tree_sha(prev)
    fill_disk_after(monkeypatch, budget=4096)
    with pytest.raises(CheckpointError) as info:
        save_model(m, 20, seed=2)
    msg = str(info.value)
    assert msg.startswith(f"checkpoint save to {tmp_path / 'step_00000020'} failed: "
                          f"[Errno 28] No space left on device: '{tmp_path / 'step_00000020.tmp'}")
    assert "\n" not in msg
    monkeypatch.undo()
    assert tree_sha(prev) == before
    assert sorted(os.listdir(tmp_path)) == ["step_00000010"]  # failed tmp dir cleaned up
    assert m.latest() == prev
    model, opt, extra = load_fresh(m, prev)
    assert extra["step"] == 10
    assert_same_state(older, state_of(model, opt))


def test_resave_same_step_replaces_it(world, tmp_path):
    m = mgr(world, tmp_path)
    save_model(m, 10, seed=1)
    newer = save_model(m, 10, seed=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000010"]
    model, opt, _ = load_fresh(m, m.latest())
    assert_same_state(newer, state_of(model, opt))


def test_aside_copy_from_a_crashed_resave_is_found(world, tmp_path):
    """A crash between 'rename old aside' and 'rename new into place' leaves step_N.old only."""
    m = mgr(world, tmp_path)
    save_model(m, 10, seed=1)
    saved = save_model(m, 20, seed=2)
    os.rename(tmp_path / "step_00000020", tmp_path / "step_00000020.old")
    assert m.latest() == tmp_path / "step_00000020.old"
    model, opt, _ = load_fresh(m, m.latest())
    assert_same_state(saved, state_of(model, opt))
    save_model(m, 20, seed=3)  # the resumed job re-saves step 20; the aside copy goes away
    assert sorted(os.listdir(tmp_path)) == ["step_00000010", "step_00000020"]


def test_bad_state_and_json_state_are_refused_before_writing(world, tmp_path):
    m = mgr(world, tmp_path)
    model, opt = make(0, steps=1)
    state = state_of(model, opt)
    state["optim"]["param_groups"][0]["sched"] = object()
    with pytest.raises(CheckpointError, match=r"state entry optim\.param_groups\.0\.sched is a "
                                              r"object: checkpoint state may hold only tensors"):
        m.save(1, state, {})
    del state["optim"]["param_groups"][0]["sched"]
    with pytest.raises(CheckpointError, match=r"trainer state\['rng'\] is a Tensor, not JSON-able"):
        m.save(1, state, {"rng": torch.get_rng_state()})
    assert os.listdir(tmp_path) == []


def test_load_requires_every_entry(world, tmp_path):
    m = mgr(world, tmp_path)
    path = m.save(1, {"model": {"w": torch.ones(3)}}, {})
    with pytest.raises(CheckpointError, match=f"checkpoint load from {path} failed: RuntimeError: Missing key in checkpoint state_dict: model.b"):
        m.load(path, {"model": {"w": torch.zeros(3), "b": torch.zeros(2)}})
    with pytest.raises(CheckpointError, match="has no entry model.lr"):
        m.load(path, {"model": {"w": torch.zeros(3), "lr": 0.1}})


def test_latest_on_missing_root_is_none(world, tmp_path):
    assert mgr(world, tmp_path / "nope").latest() is None


# ---- a checkpoint from Stateful objects ------------------------------------------------------------
class _Counter:
    """A JSON-only Stateful (like the trainer's step, the sampler, the RNG states)."""

    def __init__(self, n=0, history=None):
        self.n, self.history = n, history or []

    def state_dict(self):
        return {"n": self.n, "history": self.history}

    def load_state_dict(self, state):
        self.n, self.history = state["n"], state["history"]


def test_save_states_round_trip_and_file_format(world, tmp_path):
    """Tensors go to DCP under "<name>.", everything else (rank 0's) to trainer_state.json under
    <name>; load_states hands each object its own tensors (loaded in place) and JSON back."""
    from hpctrain.train.states import ModelState, OptimState

    model, opt = make(1)
    counter = _Counter(7, [{"rank": 0, "cpu": "abc"}, {"rank": 1, "cpu": "def"}])
    mgr = CheckpointManager(tmp_path, keep=2, rank=0, world_size=1)
    path = mgr.save_states(5, {"model": ModelState(model), "optim": OptimState(model, opt),
                               "counter": counter})
    saved = json.loads((path / "trainer_state.json").read_text())
    assert saved == {"counter": {"n": 7, "history": counter.history}}  # no empty model/optim
    model2, opt2 = make(2)
    counter2 = _Counter()
    assert not torch.equal(model2[0].weight, model[0].weight)
    mgr.load_states(path, {"model": ModelState(model2), "optim": OptimState(model2, opt2),
                           "counter": counter2})
    assert (counter2.n, counter2.history) == (7, counter.history)
    assert_same_state(state_of(model, opt), state_of(model2, opt2))


def test_checkpoints_written_before_stateful_objects_read_the_same(tmp_path):
    """trainer_state.json of older checkpoints kept the trainer's entries at the top level."""
    from hpctrain.checkpoint import disk_format

    old = {"step": 3, "world_size": 2, "config": {"model": {"n_layer": 2}}, "tokenizer": {"name": "bytes"},
           "sampler": {"epoch": 0}, "rng": [], "sync": {"mode": "sync"}}
    (tmp_path / "trainer_state.json").write_text(json.dumps(old))
    assert disk_format.read_trainer_state(tmp_path) == {
        "trainer": {"step": 3, "world_size": 2, "config": {"model": {"n_layer": 2}},
                    "tokenizer": {"name": "bytes"}},
        "sampler": {"epoch": 0}, "rng": [], "sync": {"mode": "sync"}}
    new = {"trainer": {"step": 3}, "sampler": {"epoch": 0}}
    assert disk_format.upgrade_trainer_state(new) == new


def test_retention_checks_each_kept_checkpoint_once_until_its_files_change(world, tmp_path, monkeypatch):
    """Every save prunes, and pruning must know which kept checkpoints are intact: a checkpoint
    that passed is not read again while its files are as they were (keep = 10, 4 saves: 4 checks,
    not 1 + 2 + 3 + 4), and one whose data file was cut since is checked again, found corrupt and
    left for a human instead of being counted (and removed) as an intact old one."""
    checked = []
    real = directory.verify_checkpoint
    monkeypatch.setattr(directory, "verify_checkpoint", lambda p, *a: checked.append(p.name) or real(p, *a))
    m = mgr(world, tmp_path, keep=10)
    for step in (10, 20, 30, 40):
        save_model(m, step)
    if world[0] == 0:  # retention runs on rank 0
        assert sorted(checked) == ["step_00000010", "step_00000020", "step_00000030", "step_00000040"], checked
    m = mgr(world, tmp_path, keep=2)
    if world[0] == 0:
        _truncate(tmp_path / "step_00000010")
    dist.barrier()
    save_model(m, 50)
    # intact: 50, 40 kept, 30 and 20 removed; 10 corrupt since its check: left for a human
    assert sorted(os.listdir(tmp_path)) == ["step_00000010", "step_00000040", "step_00000050"]
