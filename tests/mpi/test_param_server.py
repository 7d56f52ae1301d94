"""Asynchronous SGD against MPI one-sided parameter servers under a real mpiexec."""
import json

import pytest

from hpctrain import step_faults
from tests.conftest import losses
from tests.helpers import train, write_config

pytestmark = pytest.mark.mpi

SGD = ["--train.optimizer=sgd", "--train.lr=0.05", "--train.min_lr=0.005", "--train.grad_clip=0",
       "--train.steps=20", "--checkpoint.interval=100"]


def test_one_worker_no_staleness_equals_plain_sgd(tmp_path, dataset):
    cfg_a, run_a = write_config(tmp_path, dataset, "plain")
    cfg_b, run_b = write_config(tmp_path, dataset, "ps")
    train(1, cfg_a, *SGD)
    r = train(2, cfg_b, *SGD, "--sync.mode=ps", "--sync.ps_servers=1", "--sync.staleness=0")
    assert "1 workers, 1 servers" in r.stderr
    a, b = losses(run_a), losses(run_b)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    assert a[20] < a[1] - 0.5
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
    va, vb = losses(run_a, "val_loss"), losses(run_b, "val_loss")
    assert abs(va[20] - vb[20]) <= 1e-5
    assert losses(run_b, "staleness")[20] == 0
    assert losses(run_b, "comm_bytes")[20] > 0


def test_two_workers_bounded_staleness_learn_and_resume(tmp_path, dataset):
    """2 workers + 1 server: staleness stays within the bound; a stopped run resumes from the
    servers' parameters saved in its checkpoint."""
    cfg, run = write_config(tmp_path, dataset, "ps2")
    common = ["--sync.mode=ps", "--sync.staleness=1", "--train.steps=30", "--checkpoint.interval=10"]
    straggler = step_faults.env(delay_rank=1, delay_s=0.02)
    train(3, cfg, *common, "--train.stop_at_step=10", env=straggler)
    state = json.loads(next((run / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["sync"] == {"mode": "ps", "workers": 2, "bytes_moved": state["sync"]["bytes_moved"]}
    r = train(3, cfg, *common, env=straggler)
    assert "resumed from" in r.stderr and "at step 10" in r.stderr
    loss, stale = losses(run), losses(run, "staleness")
    assert sorted(loss) == list(range(1, 31))
    assert max(stale.values()) <= 1
    assert sum(loss[s] for s in range(26, 31)) / 5 < loss[1] - 0.8
    assert losses(run, "val_loss")[30] < loss[1] - 1.5  # from ~5.5 (uniform over 257 bytes)
