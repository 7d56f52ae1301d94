"""A resume whose ranks read the checkpoint at different speeds (a busy parallel file system) must
not trip the collective timeout, dist.timeout_s (300 s by default; NCCL's watchdog ends a GPU job
past it): every collective of a load runs on the checkpoint manager's gloo group and its long
timeout, as a save's do (hpctrain/checkpoint/manager.py).

On CPU the default group is gloo as well, so the test makes the group observable by its timeout:
the resume runs with dist.timeout_s = 4 while one rank sleeps 10 s at a point of the load
(HPCTRAIN_TEST_FAULTS save_point=NAME:1:RANK:sleep:10, hpctrain/checkpoint/faults.py). A wait on the
default group times out there and the job ends; on the manager's group the resume goes on, and its
losses equal the straight run's bit for bit.
"""
from __future__ import annotations

import pytest

from hpctrain import step_faults
from tests.conftest import losses
from tests.helpers import copy_run_at, fault_config, train
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi
TIMEOUT_S, SLOW_S = 4, 10


@pytest.fixture(scope="module")
def straight(tmp_path_factory, dataset):
    """FAULT_GPT's 6 steps on 2 ranks, its checkpoints of steps 4 and 6 kept; trained once per
    session (tests/shared_dirs.py), read-only: a test resumes a copy."""
    def build(out):
        cfg, _ = fault_config(out, dataset)
        train(2, cfg, "--checkpoint.keep=2", timeout=300)
    run = shared_dir(tmp_path_factory, "slow_reads_straight", build) / "run"
    assert sorted(losses(run)) == list(range(1, 7))
    return run


# (point, the rank that is slow there): rank 0 scanning the run's checkpoints (latest(): the others
# wait in its broadcast), rank 0 checking the checkpoint and reading its JSON files (the others wait
# for the metadata), rank 1 still reading its tensors when rank 0 reaches the load's last agreement
SLOW_POINTS = [
    pytest.param("load.dcp_done", 1, id="dcp_read@rank1"),
    pytest.param("load.scan", 0, id="scan@rank0", marks=pytest.mark.slow),
    pytest.param("load.begin", 0, id="metadata@rank0", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("point, rank", SLOW_POINTS)
def test_resume_waits_for_a_slow_reader_past_the_collective_timeout(tmp_path, dataset, straight,
                                                                      point, rank):
    cfg, run = fault_config(tmp_path, dataset)
    copy_run_at(straight, run, 4)
    slow = step_faults.env(save_point=f"{point}:1:{rank}:sleep:{SLOW_S}")
    r = train(2, cfg, "--checkpoint.keep=2", f"--dist.timeout_s={TIMEOUT_S}", env=slow,
              check=False, timeout=300)
    # the fault fired, on that rank, at that point (else the test would prove nothing)
    assert f"{step_faults.ENV} sleeps {SLOW_S} s at {point} on rank {rank}" in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
    resumed, ref = losses(run), losses(straight)
    assert sorted(resumed) == list(range(1, 7))
    assert [resumed[s] for s in (5, 6)] == [ref[s] for s in (5, 6)]  # bit for bit
