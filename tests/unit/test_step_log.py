"""train/step_log.py: the loop's step records keep their device numbers until a log step, then one
host read for all of them; bad-step verdicts are counted in step order at that read."""
import time
import types

import pytest
import torch

from hpctrain.errors import TrainingDivergedError
from hpctrain.metrics.host_syncs import HostSyncCounter
from hpctrain.train.bad_steps import BadStepPolicy
from hpctrain.train.step_log import StepLog


class Written:
    def __init__(self):
        self.records = []

    def write(self, rec):
        self.records.append(dict(rec))


def step_log(max_bad=3, log_interval=4, end=100, flush_s="3600"):
    ctx = types.SimpleNamespace(is_main=False)
    train = types.SimpleNamespace(log_interval=log_interval, max_bad_steps=max_bad)
    written = Written()
    policy = BadStepPolicy(max_bad, 0, 0, 1)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HPCTRAIN_METRICS_FLUSH_S", flush_s)
        return StepLog(ctx, written, policy, train, end, (0.0, 0)), written, policy


def record(step, loss, bad=0.0):
    return {"step": step, "loss": torch.tensor(loss), "lr": 1e-3, "grad_norm": torch.tensor(0.5),
            "tokens_per_s": 1.0, "overflow": torch.tensor(0.0), "overflow_steps": torch.tensor(2),
            "skipped": torch.tensor(bad), "bad_steps": 0, "data_time_s": 0.1}


def test_records_wait_until_a_log_step_then_one_host_read():
    log, written, _ = step_log()
    with HostSyncCounter() as counter:
        for step in (1, 2, 3):
            log.add(record(step, 1.0 + step))
        assert written.records == [] and counter.total == 0
        log.add(record(4, 5.0))
    assert counter.total == 1, counter.counts
    assert [r["step"] for r in written.records] == [1, 2, 3, 4]
    first = written.records[0]
    assert first["loss"] == 2.0 and type(first["loss"]) is float
    assert first["overflow"] is False and first["overflow_steps"] == 2 and type(first["overflow_steps"]) is int
    assert "skipped" not in first and "bad_steps" not in first  # no step skipped yet
    assert list(first) == ["step", "loss", "lr", "grad_norm", "tokens_per_s", "overflow",
                           "overflow_steps", "data_time_s"]


def test_bad_steps_counted_in_order_and_the_streak_raises_before_its_record():
    log, written, policy = step_log(max_bad=2)
    for step, bad in ((1, 0.0), (2, 1.0), (3, 1.0)):
        log.add(record(step, float("nan") if bad else 1.0, bad))
    with pytest.raises(TrainingDivergedError, match=r"steps 2\.\.3"):
        log.flush()
    assert [r["step"] for r in written.records] == [1, 2]
    assert written.records[1]["skipped"] is True and written.records[1]["bad_steps"] == 1
    assert policy.skipped == 2


def test_after_a_skip_records_keep_the_count():
    log, written, _ = step_log()
    for step, bad in ((1, 1.0), (2, 0.0)):
        log.add(record(step, 1.0, bad))
    log.flush()
    assert [(r["skipped"], r["bad_steps"]) for r in written.records] == [(True, 1), (False, 1)]


def test_a_record_waits_at_most_the_flush_time():
    """HPCTRAIN_METRICS_FLUSH_S: a watcher of metrics.jsonl sees a step within that many seconds."""
    log, written, _ = step_log(log_interval=100, flush_s="0.2")
    log.add(record(1, 1.0))
    assert written.records == []
    time.sleep(0.25)
    log.add(record(2, 1.0))
    assert [r["step"] for r in written.records] == [1, 2]
