"""Lustre striping of the checkpoint directory (hpctrain/checkpoint/lustre.py), with a stand-in
`lfs` on PATH (a script that records its arguments) and HPCTRAIN_FSTYPE pretending the file
system: set once per run before the first save writes, by the layout's default or
checkpoint.stripe_count; a failing `lfs` is one warning line and the saves still commit; not on
Lustre, `lfs` is never run."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from hpctrain.checkpoint import CheckpointManager, lustre

STAND_IN = """#!/bin/sh
echo "$*" >> "{log}"
{tail}
"""


def stand_in_lfs(tmp_path, monkeypatch, fail: bool = False):
    """A recording `lfs` first on PATH; returns the file it appends its arguments to."""
    bin_dir, log = tmp_path / "bin", tmp_path / "lfs.log"
    bin_dir.mkdir()
    script = bin_dir / "lfs"
    tail = 'echo "lfs setstripe: Operation not permitted" >&2; exit 1' if fail else "exit 0"
    script.write_text(STAND_IN.format(log=log, tail=tail))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def two_saves(root, **kw) -> None:
    mgr = CheckpointManager(root, keep=2, rank=0, world_size=1, **kw)
    for step in (1, 2):
        mgr.save(step, {"w": torch.arange(8.0)}, {"step": step})
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]


@pytest.mark.parametrize("layout, count, expect", [("node", 0, "4"), ("rank", 0, "1"),
                                                   ("rank", -1, "-1")])
def test_setstripe_once_per_run_on_lustre(tmp_path, monkeypatch, layout, count, expect):
    log = stand_in_lfs(tmp_path, monkeypatch)
    monkeypatch.setenv(lustre.FSTYPE_ENV, "lustre")
    root = tmp_path / "ckpt"
    two_saves(root, layout=layout, stripe_count=count, stripe_size="8M")
    assert log.read_text().splitlines() == [f"setstripe -c {expect} -S 8M {root}"]


def test_failing_lfs_is_one_warning(tmp_path, monkeypatch, capfd):
    log = stand_in_lfs(tmp_path, monkeypatch, fail=True)
    monkeypatch.setenv(lustre.FSTYPE_ENV, "lustre")
    two_saves(tmp_path / "ckpt", layout="node")
    assert len(log.read_text().splitlines()) == 1
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "setstripe" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "exit 1" in lines[0], lines
    assert "Operation not permitted" in lines[0]


def test_not_lustre_runs_no_lfs(tmp_path, monkeypatch):
    log = stand_in_lfs(tmp_path, monkeypatch)
    monkeypatch.delenv(lustre.FSTYPE_ENV, raising=False)
    assert lustre.fs_type(tmp_path / "ckpt" / "not_yet") not in ("", "lustre")  # from /proc/mounts
    two_saves(tmp_path / "ckpt")
    assert not log.exists()
