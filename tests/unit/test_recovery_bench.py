"""bench/recovery.py's measure of kill -> the relaunch's first trained step (issue #35): the killed
launch's records past the resumed step are not the relaunch's steps."""
import json
import os
import sys
from pathlib import Path

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import recovery  # noqa: E402


def _write(run: Path, steps, replace: bool = False) -> None:
    """metrics.jsonl with one record per step; replace: atomically, as the metrics writer's resume does."""
    text = "".join(json.dumps({"step": s, "loss": 1.0, "step_time_s": 0.1}) + "\n" for s in steps)
    path = run / "metrics.jsonl"
    if replace:
        tmp = run / "metrics.jsonl.tmp"
        tmp.write_text(text)
        os.replace(tmp, path)
    else:
        with open(path, "a") as f:
            f.write(text)


def _watch(tmp_path: Path) -> recovery.Watch:
    return recovery.Watch(None, "1", tmp_path, tmp_path / "job.out")


def test_killed_launchs_records_are_not_the_relaunchs_first_step(tmp_path):
    watch = _watch(tmp_path)
    _write(tmp_path, range(1, 1704))               # the killed launch got to 1703
    stale = watch.metrics_file_id()
    first = recovery.FirstStepAfter(watch, 1700, stale)  # the relaunch resumed from 1700
    assert not first() and first.at is None        # 1701-1703 are the killed launch's
    _write(tmp_path, range(1, 1701), replace=True)  # the relaunch drops them
    assert not first()
    _write(tmp_path, [1701])                       # its first trained step
    assert first() and first.at is not None
    _write(tmp_path, range(1, 1701), replace=True)  # a later read sees less: the time stays
    assert first()


def test_nothing_to_drop_counts_the_next_record(tmp_path):
    watch = _watch(tmp_path)
    _write(tmp_path, range(1, 1701))               # killed right at the checkpoint of 1700
    first = recovery.FirstStepAfter(watch, 1700, watch.metrics_file_id())
    assert not first()
    _write(tmp_path, [1701])                       # appended to the same file
    assert first()


def test_dropped_before_the_watch_started(tmp_path):
    watch = _watch(tmp_path)
    _write(tmp_path, range(1, 1704))
    stale = watch.metrics_file_id()
    _write(tmp_path, list(range(1, 1701)) + [1701], replace=True)  # rewrite and first step came first
    first = recovery.FirstStepAfter(watch, 1700, stale)
    assert first()
