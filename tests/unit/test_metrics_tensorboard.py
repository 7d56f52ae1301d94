"""TensorBoard event files written by MetricsLog (optional `tensorboard` dependency), and the ETA format."""
from __future__ import annotations

import json
import math
import sys
import time

import pytest

from hpctrain.metrics import MetricsLog, format_eta
from hpctrain.metrics import tensorboard as tb


def step_rec(step: int, loss: float, **extra) -> dict:
    rec = {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0 * step,
           "mfu": 0.25, "step_time_s": 0.1, "epoch": 0, "data_time_s": 0.01, "data_wait_s": 0.002,
           "rank_busy_s": [0.1, 0.3, 0.2], "rank_step_s_max": 0.3}
    rec.update(extra)
    return rec


def write_run(run, recs, resume_step=0):
    m = MetricsLog(run / "metrics.jsonl", True, resume_step=resume_step)
    for r in recs:
        m.write(r)
    m.close()


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard shows it (restarts purged)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


# ---- tags (no tensorboard needed) -----------------------------------------------------------------

def test_tags_and_scalars():
    rec = step_rec(7, 2.5, val_loss=2.75, skipped=True, bad_steps=1, cache_hits=3, straggler=1,
                   comm_bytes=4096)
    got = dict(tb.scalars(rec))
    assert got == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "train/epoch": 0.0,
        "train/skipped": 1.0, "train/bad_steps": 1.0, "val/loss": 2.75,
        "perf/tokens_per_s": 7000.0, "perf/mfu": 0.25, "perf/step_time_s": 0.1,
        "perf/rank_step_s_max": 0.3, "perf/straggler": 1.0, "perf/comm_bytes": 4096.0,
        "perf/rank_busy_s/min": 0.1, "perf/rank_busy_s/median": 0.2, "perf/rank_busy_s/max": 0.3,
        "data/data_time_s": 0.01, "data/data_wait_s": 0.002, "data/cache_hits": 3.0,
    }
    assert "step" not in {t.split("/")[-1] for t in got}
    assert tb.scalars({"step": 1, "note": "text", "nested": {"a": 1}, "loss": float("nan")})[0][0] == "train/loss"


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("off", False),
                                      ("False", False), ("no", False)])
def test_env_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(tb.ENV, raising=False)
    else:
        monkeypatch.setenv(tb.ENV, value)
    assert tb.enabled_by_env() is on


def test_env_off_writes_no_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(tb.ENV, "0")
    write_run(tmp_path, [step_rec(1, 3.0), step_rec(2, 2.9)])
    assert not (tmp_path / "tensorboard").exists()
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_without_tensorboard_installed_jsonl_unchanged(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv(tb.ENV, raising=False)
    recs = [{"step": 0, "val_loss": 3.5}, step_rec(1, 3.0), step_rec(2, 2.9)]
    monkeypatch.setenv(tb.ENV, "0")
    write_run(tmp_path / "off", recs)
    monkeypatch.delenv(tb.ENV)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import -> ImportError
    write_run(tmp_path / "missing", recs)
    assert not (tmp_path / "missing" / "tensorboard").exists()
    assert (tmp_path / "missing" / "metrics.jsonl").read_bytes() == (tmp_path / "off" / "metrics.jsonl").read_bytes()
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_not_main_rank_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(tb.ENV, raising=False)
    m = MetricsLog(tmp_path / "run" / "metrics.jsonl", False)
    m.write(step_rec(1, 3.0))
    m.close()
    assert not (tmp_path / "run").exists()


# ---- read back (needs tensorboard) -----------------------------------------------------------------

def test_scalars_read_back(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.delenv(tb.ENV, raising=False)
    write_run(tmp_path, [{"step": 0, "val_loss": 3.5}, step_rec(1, 3.0), step_rec(2, 2.75, val_loss=2.8),
                         step_rec(3, 2.5)])
    s = read_scalars(tmp_path / "tensorboard")
    assert s["train/loss"] == [(1, 3.0), (2, 2.75), (3, 2.5)]
    assert s["val/loss"] == [(0, 3.5), (2, pytest.approx(2.8))]
    assert s["perf/tokens_per_s"] == [(1, 1000.0), (2, 2000.0), (3, 3000.0)]
    assert s["perf/mfu"] == [(i, 0.25) for i in (1, 2, 3)]
    assert [st for st, _ in s["data/data_wait_s"]] == [1, 2, 3]
    assert s["perf/rank_busy_s/max"] == [(i, pytest.approx(0.3)) for i in (1, 2, 3)]
    assert len(s["train/lr"]) == 3 and s["train/lr"][0][1] == pytest.approx(1e-3)
    # the JSONL is the same as ever
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


def test_resume_purges_rerun_steps(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.delenv(tb.ENV, raising=False)
    # first run: steps 1..5 (val at 5), killed after the checkpoint at step 3
    write_run(tmp_path, [step_rec(i, 10.0 + i, **({"val_loss": 9.0} if i == 5 else {})) for i in range(1, 6)])
    time.sleep(1.1)  # event file names sort by their creation second: the resumed run's file sorts last
    # resumed from step 3: steps 4..6 again, with new values and no val at 5
    write_run(tmp_path, [step_rec(i, 20.0 + i) for i in range(4, 7)], resume_step=3)
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2
    s = read_scalars(tmp_path / "tensorboard")
    assert s["train/loss"] == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0)]
    assert [st for st, _ in s["perf/tokens_per_s"]] == [1, 2, 3, 4, 5, 6]
    assert "val/loss" not in s or s["val/loss"] == []  # step 5 of the killed run is hidden
    recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in recs] == s["train/loss"]


def test_write_error_turns_tensorboard_off(tmp_path, monkeypatch, capfd):
    pytest.importorskip("tensorboard")
    monkeypatch.delenv(tb.ENV, raising=False)
    m = MetricsLog(tmp_path / "metrics.jsonl", True)

    def boom(record):
        raise OSError("disk full")

    monkeypatch.setattr(m._views["TensorBoard"], "write", boom)
    m.write(step_rec(1, 3.0))
    m.write(step_rec(2, 2.9))
    m.close()
    err = capfd.readouterr().err
    assert err.count("TensorBoard logging off") == 1 and "disk full" in err
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


# ---- ETA ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seconds,text", [
    (0, "0:00:00"), (0.4, "0:00:00"), (59.6, "0:01:00"), (75, "0:01:15"), (3599, "0:59:59"),
    (3600, "1:00:00"), (3723, "1:02:03"), (86399, "23:59:59"), (86400 + 3723, "1d 01:02:03"),
    (10 * 86400, "10d 00:00:00"), (-1, "?"), (math.nan, "?"), (math.inf, "?"), (None, "?"),
])
def test_format_eta(seconds, text):
    assert format_eta(seconds) == text


def test_torn_lines_and_non_utf8_bytes_never_block_resume_or_plot(tmp_path):
    """A kill -9 mid-write tears the last line; a damaged block puts bytes that are not UTF-8 in the
    log: resume keeps every intact record up to the checkpoint's step, `read` (plot) skips the rest."""
    from hpctrain.metrics.jsonl import MetricsLog, read

    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss": 5.0 - s}) for s in (1, 2, 3, 4)]
    path.write_bytes("\n".join(good[:2]).encode() + b"\n\xff\xfe garbage \x80\n"
                     + "\n".join(good[2:]).encode() + b'\n{"step": 5, "lo')
    assert [r["step"] for r in read(path)] == [1, 2, 3, 4]
    log = MetricsLog(path, enabled=True, resume_step=3)
    log.write({"step": 4, "loss": 0.5})
    log.close()
    assert [(r["step"], r["loss"]) for r in read(path)] == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 0.5)]
    assert path.read_bytes().decode("utf-8")  # the rewrite dropped the bad bytes
