"""Weights & Biases logging (hpctrain/metrics/wandb_log.py) through MetricsLog, offline
(WANDB_MODE=offline: never the network), read back from the offline runs' own files; and the
one-line refusal of metrics.wandb = true without the wandb package."""
from __future__ import annotations

import json
import sys

import pytest

from hpctrain import config
from hpctrain.errors import ConfigError
from hpctrain.metrics import MetricsLog, wandb_log
from tests.conftest import run_cmd
from tests.wandb_files import offline_runs, set_offline


def make_cfg(run, **metrics):
    raw = {"run": {"dir": str(run)}, "data": {"path": "/nowhere"},
           "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 257},
           "train": {"steps": 20, "micro_batch_size": 2}, "metrics": {"wandb": True, **metrics}}
    return config.from_dict(raw)


def rec(step: int) -> dict:
    return {"step": step, "loss": 5.0 - step / 7, "lr": 1e-3 * step, "grad_norm": 0.5 + step,
            "tokens_per_s": 100.0 * step, "mfu": 0.01 * step, "rank_busy_s": [0.1, 0.2 * step]}


def attempt(run, tmp_path, n, cfg, resume_step, steps, window=5):
    """One start of the run: MetricsLog at `resume_step` writing `steps`; its W&B files go under
    tmp_path/wandb_<n> (its own WANDB_DIR: two starts within a second share no offline dir)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_DIR", str(tmp_path / f"wandb_{n}"))
    (tmp_path / f"wandb_{n}").mkdir()
    try:
        m = MetricsLog(run / "metrics.jsonl", True, resume_step, window, cfg)
        assert "W&B" in m._views
        for s in steps:
            m.write(rec(s))
        m.close()
    finally:
        mp.undo()
    (run_id, rows), = offline_runs(tmp_path / f"wandb_{n}")
    return run_id, rows


@pytest.fixture
def offline(monkeypatch):
    pytest.importorskip("wandb")
    set_offline(monkeypatch)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4242")


def test_records_are_logged_with_the_tensorboard_tags_at_their_step(tmp_path, offline):
    run = tmp_path / "run"
    run_id, rows = attempt(run, tmp_path, 1, make_cfg(run), 0, [1, 2, 3])
    assert [r["_step"] for r in rows] == [1, 2, 3]
    for r in rows:
        s = r["_step"]
        assert (r["train/loss"], r["train/lr"], r["train/grad_norm"]) == (5.0 - s / 7, 1e-3 * s, 0.5 + s)
        assert (r["perf/tokens_per_s"], r["perf/mfu"]) == (100.0 * s, 0.01 * s)
        assert (r["perf/rank_busy_s/min"], r["perf/rank_busy_s/max"]) == (min(0.1, 0.2 * s), max(0.1, 0.2 * s))
    stored = json.loads((run / wandb_log.ID_FILE).read_text())
    assert stored == {"id": run_id, "group": "4242", "dirs": [str(tmp_path / "wandb_1")]}  # auto: the array's id


def test_a_resume_continues_the_run_and_logs_no_step_twice(tmp_path, offline):
    """Attempt 1 logs 1..7 (checkpoint at 5, killed after 7); attempt 2 resumes at 5, re-runs 6 and
    7 (not logged again) and goes on to 9; attempt 3, a start over (step 0: metrics.jsonl kept
    aside), is a new W&B run from step 1."""
    run = tmp_path / "run"
    cfg = make_cfg(run, wandb_group="")
    first, rows1 = attempt(run, tmp_path, 1, cfg, 0, range(1, 8))
    second, rows2 = attempt(run, tmp_path, 2, cfg, 5, range(6, 10))
    assert second == first
    assert [r["_step"] for r in rows1] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["_step"] for r in rows2] == [8, 9]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 10))
    third, rows3 = attempt(run, tmp_path, 3, cfg, 0, [1, 2])
    assert third != first and [r["_step"] for r in rows3] == [1, 2]
    assert json.loads((run / wandb_log.ID_FILE).read_text())["id"] == third
    assert (run / "metrics.1.jsonl").exists()


def test_a_resume_past_the_rerun_window_is_a_new_wandb_run_holding_the_kept_log(tmp_path, offline):
    run = tmp_path / "run"
    cfg = make_cfg(run)
    first, _ = attempt(run, tmp_path, 1, cfg, 0, range(1, 13))
    second, rows = attempt(run, tmp_path, 2, cfg, 4, range(5, 7), window=5)  # 12 - 4 > 5: a cut
    assert second != first and [r["_step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # 1..4 replayed
    assert [r["train/loss"] for r in rows] == [rec(s)["loss"] for s in range(1, 7)]


@pytest.mark.parametrize("wandb_had,resume_at,replayed", [(5, 4, []), (3, 5, [4, 5]), (0, 5, [1, 2, 3, 4, 5])])
def test_steps_a_killed_wandb_lost_are_replayed_from_the_log(tmp_path, offline, wandb_had, resume_at, replayed):
    """A killed job's W&B service dies with the rows of its last seconds: W&B holds 1..wandb_had
    of the 1..7 metrics.jsonl holds. The resume at `resume_at` replays the kept steps W&B lacks
    and logs the re-run ones it lacks: W&B ends with every step once, metrics.jsonl's numbers."""
    run = tmp_path / "run"
    cfg = make_cfg(run)
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_DIR", str(tmp_path / "wandb_1"))
    (tmp_path / "wandb_1").mkdir()
    m = MetricsLog(run / "metrics.jsonl", True, 0, 5, cfg)
    for s in range(1, 8):
        if s == wandb_had + 1:
            m._close_view("W&B")  # the rows after this one never reach the file
        m.write(rec(s))
    m.close()
    mp.undo()
    (first, rows1), = offline_runs(tmp_path / "wandb_1")
    second, rows2 = attempt(run, tmp_path, 2, cfg, resume_at, range(resume_at + 1, 10))
    assert second == first and [r["_step"] for r in rows1] == list(range(1, wandb_had + 1))
    assert [r["_step"] for r in rows2] == replayed + list(range(max(wandb_had, resume_at) + 1, 10))
    assert [r["train/loss"] for r in rows1 + rows2] == [rec(s)["loss"] for s in range(1, 10)]


def test_wandb_turned_on_at_a_resume_gets_the_whole_log(tmp_path, offline):
    run = tmp_path / "run"
    m = MetricsLog(run / "metrics.jsonl", True, 0, 5, make_cfg(run, wandb=False))
    for s in range(1, 5):
        m.write(rec(s))
    m.close()
    _, rows = attempt(run, tmp_path, 1, make_cfg(run), 4, [5])
    assert [r["_step"] for r in rows] == [1, 2, 3, 4, 5]


class FakeRun:
    def __init__(self, offline, step):
        self.offline, self.step = offline, step


def test_an_online_run_holds_what_the_server_has():
    identity = {"id": "x", "dirs": []}
    assert wandb_log.held_through(FakeRun(False, 8), identity, 12) == 7
    assert wandb_log.held_through(FakeRun(False, 0), identity, 12) is None


def test_wandb_errors_turn_it_off_never_training(tmp_path, offline, capfd):
    run = tmp_path / "run"
    m = MetricsLog(run / "metrics.jsonl", True, 0, 5, make_cfg(run))

    def boom(*a, **k):
        raise RuntimeError("socket closed")

    m._views["W&B"].run.log = boom
    m.write(rec(1))
    m.write(rec(2))
    m.close()
    assert capfd.readouterr().err.count("W&B logging off after an error: socket closed") == 1
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_wandb_off_opens_nothing(tmp_path, monkeypatch):
    run = tmp_path / "run"
    m = MetricsLog(run / "metrics.jsonl", True, 0, 5, make_cfg(run, wandb=False))
    assert "W&B" not in m._views and not (run / wandb_log.ID_FILE).exists()
    m.close()


def test_missing_wandb_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec: not installed
    with pytest.raises(ConfigError) as e:
        wandb_log.check_installed(make_cfg(tmp_path))
    assert str(e.value) == ("config key 'metrics.wandb': true, but the wandb package is not installed: "
                            "pip install 'hpctrain[wandb]' (or set metrics.wandb = false)")
    wandb_log.check_installed(make_cfg(tmp_path, wandb=False))


def test_missing_wandb_stops_train_at_start(tmp_path):
    """`hpctrain train --metrics.wandb=true` without wandb: one `error:` line, before training."""
    run = tmp_path / "run"
    probe = ("import sys; sys.modules['wandb'] = None\n"
             "from hpctrain.__main__ import main\n"
             f"sys.exit(main(['train', '--run.dir={run}', '--data.path={tmp_path}/none', "
             "'--model.n_layer=1', '--model.n_head=2', '--model.n_embd=32', '--model.block_size=32', "
             "'--model.vocab_size=257', '--train.steps=2', '--train.warmup_steps=0', "
             "'--train.micro_batch_size=2', "
             "'--metrics.wandb=true']))")
    r = run_cmd([sys.executable, "-c", probe], timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == ["error: config key 'metrics.wandb': true, but the wandb package is not installed: "
                     "pip install 'hpctrain[wandb]' (or set metrics.wandb = false)"], r.stderr
    assert not run.exists()
