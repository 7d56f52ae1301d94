"""metrics.jsonl never loses records (#30): a start over or a resume that drops more than one
checkpoint interval of records keeps the file as it was (metrics.<N>.jsonl, TensorBoard events in
tensorboard.<N>/) and names it; a full disk
while it is rewritten or appended to is one line naming it, no .tmp left, every record written
before the fault still there. Real `python -m hpctrain train` runs; full disks are real tmpfs."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_TRAIN, checksums, fill, run_cmd


@pytest.fixture(scope="module")
def dataset(one_play):
    return one_play


def _train(cfg: Path, *overrides, env=None):
    return run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", cfg, *overrides],
                   timeout=180, env=env)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_a_start_over_keeps_the_old_metrics_and_events_under_a_new_name(tmp_path, dataset):
    """checkpoints/ moved aside (as an error message suggests) and a rerun: it starts at step 0;
    the 40 records of the first run stay, byte for byte, in metrics.1.jsonl (events in
    tensorboard.1/), the next start over's in metrics.2.jsonl, never over an earlier one."""
    run, cfg = tmp_path / "run", tmp_path / "t.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=dataset, steps=40))
    r = _train(cfg, "--checkpoint.interval=20", env={"HPCTRAIN_TENSORBOARD": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    first, events = _sha(run / "metrics.jsonl"), checksums(run / "tensorboard")
    assert _steps(run / "metrics.jsonl") == list(range(1, 41)) and events
    os.rename(run / "checkpoints", tmp_path / "checkpoints.1")
    r = _train(cfg, "--train.steps=20", "--checkpoint.interval=20", env={"HPCTRAIN_TENSORBOARD": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert _sha(run / "metrics.1.jsonl") == first
    assert _steps(run / "metrics.jsonl") == list(range(1, 21))
    assert [line for line in r.stderr.splitlines() if str(run / "metrics.1.jsonl") in line]
    assert checksums(run / "tensorboard.1") == events
    second = _sha(run / "metrics.jsonl")
    shutil.rmtree(run / "checkpoints")
    r = _train(cfg, "--train.steps=10", "--checkpoint.interval=10", env={"HPCTRAIN_TENSORBOARD": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert (_sha(run / "metrics.1.jsonl"), _sha(run / "metrics.2.jsonl")) == (first, second)
    assert _steps(run / "metrics.jsonl") == list(range(1, 11))


def test_a_full_disk_while_appending_stops_with_every_written_record_whole(tmp_path, dataset, mounts):
    """The run dir's disk fills up with metrics: one line naming metrics.jsonl, exit 2, no
    traceback; the file ends with the last whole record (no torn line), steps 1..k in order."""
    disk = mounts.tmpfs(tmp_path / "disk", "64k")
    run, cfg = disk / "run", tmp_path / "t.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=dataset, steps=5000))
    r = _train(cfg, "--checkpoint.interval=5000", env={"HPCTRAIN_TENSORBOARD": "0"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = _errors(r.stderr)
    assert len(errors) == 1 and str(run / "metrics.jsonl") in errors[0], r.stderr[-3000:]
    steps = _steps(run / "metrics.jsonl")  # every line parses
    assert len(steps) > 100 and steps == list(range(1, len(steps) + 1))
    assert not list(run.glob("*.tmp"))


def test_a_full_disk_while_rewriting_changes_nothing(tmp_path, dataset, mounts):
    """Resume over a torn last line (a kill -9 mid-write) must rewrite metrics.jsonl; with no space
    for the rewrite: one line naming it, exit 2, the run dir byte for byte as before (but its
    config.toml), no .tmp."""
    run, cfg = tmp_path / "run", tmp_path / "t.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=dataset, steps=20))
    assert _train(cfg, "--checkpoint.interval=20", env={"HPCTRAIN_TENSORBOARD": "0"}).returncode == 0
    disk = mounts.tmpfs(tmp_path / "disk", "8m")
    shutil.copytree(run, disk / "run")
    run = disk / "run"
    cfg.write_text(TINY_TRAIN.format(run=run, data=dataset, steps=20))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "lo')
    fill(disk / "filler")
    with open(disk / "filler", "r+b") as f:  # room for the lock, not for the rewrite
        f.truncate(os.path.getsize(disk / "filler") - 4096)
    before = checksums(disk)
    before.pop("run/config.toml")  # the config of every start is written first, by design
    r = _train(cfg, "--train.steps=30", env={"HPCTRAIN_TENSORBOARD": "0"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = _errors(r.stderr)
    assert len(errors) == 1 and str(run / "metrics.jsonl") in errors[0], r.stderr[-3000:]
    after = checksums(disk)
    after.pop("run/config.toml")
    assert after == before


@pytest.mark.parametrize("resume_step, kept", [(8, False), (6, False), (5, True), (0, True)])
def test_only_a_cut_beyond_one_checkpoint_interval_keeps_a_copy(tmp_path, resume_step, kept):
    """A kill between two saves (interval 4) re-runs at most 4 steps: those records are just
    replaced; a bigger cut (an older checkpoint, a start over) keeps the log as metrics.1.jsonl."""
    from hpctrain.metrics.jsonl import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 11)))
    before = _sha(path)
    log = MetricsLog(path, True, resume_step, rerun_window=4)
    log.close()
    assert _steps(path) == list(range(1, resume_step + 1))
    assert (tmp_path / "metrics.1.jsonl").exists() == kept
    if kept:
        assert _sha(tmp_path / "metrics.1.jsonl") == before
