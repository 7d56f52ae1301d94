"""Observability of real training runs (issue #48 item 6): the W&B logger, offline (never the
network), holds exactly metrics.jsonl's numbers at every step, and a killed run's resume continues
the same W&B run without logging a step twice; torch.profiler over `metrics.profile_steps` writes
one Chrome trace per rank under a real mpiexec, holding those steps only, and changes no number of
the training."""
import json

import pytest

from hpctrain import step_faults
from hpctrain.metrics import wandb_log
from tests.conftest import TINY_TRAIN, losses, records
from tests.helpers import train
from tests.wandb_files import offline_env, offline_runs

pytestmark = pytest.mark.mpi
STEPS = 14


def _config(tmp_path, name, data):
    run = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=data, steps=STEPS) + "[checkpoint]\ninterval = 5\n")
    return cfg, run


def test_wandb_offline_logs_the_jsonl_numbers_and_a_resume_logs_each_step_once(tmp_path, dataset):
    """Killed after step 12 (checkpoint at 10; metrics.jsonl holds 1..11, the killed W&B service
    wrote the rows of 1..K it had flushed), rerun: resumes at 10 and logs, to the same W&B run,
    every step W&B lacks (the kept ones replayed from metrics.jsonl, the re-run ones live) once."""
    pytest.importorskip("wandb")
    cfg, run = _config(tmp_path, "wb", dataset)
    args = ["--metrics.wandb=true", "--train.eval_interval=7"]
    flushing = {"WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL": "0.3"}  # some rows reach the file
    killed = train(1, cfg, *args, check=False, env={**offline_env(WANDB_DIR=tmp_path / "w1"), **flushing,
                                                    **step_faults.env(exit_after_step=12)})
    assert killed.returncode == 137, killed.stderr[-2000:]
    first_id = json.loads((run / wandb_log.ID_FILE).read_text())["id"]
    resumed = train(1, cfg, *args, env=offline_env(WANDB_DIR=tmp_path / "w2"))
    (id1, rows1), = offline_runs(tmp_path / "w1")
    (id2, rows2), = offline_runs(tmp_path / "w2")
    assert id1 == id2 == first_id == json.loads((run / wandb_log.ID_FILE).read_text())["id"]
    held = rows1[-1]["_step"] if rows1 else None  # step 0: the validation at the start
    assert [r["_step"] for r in rows1] == list(range(0, len(rows1))) and len(rows1) <= 12
    assert [r["_step"] for r in rows2] == list(range(len(rows1), STEPS + 1))  # each step once
    assert f"continued, offline{f', holds step {held}' if rows1 else ''}" in resumed.stderr
    logged = {r["_step"]: r for r in rows1 + rows2}
    jsonl = [r for r in records(run) if "loss" in r]
    assert [r["step"] for r in jsonl] == list(range(1, STEPS + 1))
    for r in jsonl:
        w = logged[r["step"]]
        assert (w["train/loss"], w["train/lr"], w["train/grad_norm"]) == (r["loss"], r["lr"], r["grad_norm"])
        assert (w["perf/tokens_per_s"], w["perf/step_time_s"]) == (r["tokens_per_s"], r["step_time_s"])
    val = losses(run, "val_loss")
    assert sorted(val) == [0, 7, 14] and {s: logged[s]["val/loss"] for s in val} == val


def _trace_steps(path) -> list[int]:
    trace = json.loads(path.read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])  # the steps' operators
    return sorted(int(n.split("#")[1]) for n in names if n.startswith("ProfilerStep#"))


def test_profile_steps_write_a_trace_per_rank_and_change_no_number(tmp_path, dataset):
    cfg_plain, plain = _config(tmp_path, "plain", dataset)
    cfg_prof, profiled = _config(tmp_path, "profiled", dataset)
    train(2, cfg_plain)
    r = train(2, cfg_prof, "--metrics.profile_steps=10-12")
    assert losses(profiled) == losses(plain) and sorted(losses(plain)) == list(range(1, STEPS + 1))
    assert not (plain / "profile").exists()
    files = sorted(p.name for p in (profiled / "profile").iterdir())
    assert files == ["rank_0_steps_10-12.json", "rank_1_steps_10-12.json"]
    for rank in (0, 1):
        assert _trace_steps(profiled / "profile" / f"rank_{rank}_steps_10-12.json") == [10, 11, 12]
    assert f"profile: steps 10-12 of rank 0 -> {profiled}/profile/rank_0_steps_10-12.json" in r.stdout + r.stderr
