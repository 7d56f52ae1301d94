"""Detection that is fast and still safe, under a real mpiexec (the lost-rank cases with the default
bound are test_fault_tolerance.py's test_lost_rank_ends_job_with_its_name; the beacon alone:
tests/unit/test_beacon.py).

* A rank whose main thread holds the GIL in C for 20 s (libc sleep through ctypes.PyDLL: no Python
  thread of it runs) under the DEFAULT dist.heartbeat_timeout_s is not declared lost: its beacon
  process beats for it; the job finishes.
* A straggler whose peer waits 3 x the stall floor in a collective every step: a stall warning only
  while no step time is known (steps 0-1); once the median step is known the bound follows it.
"""
from __future__ import annotations

import re
import time

import pytest

from hpctrain import step_faults
from hpctrain.config_schema import DistConfig
from tests.conftest import losses
from tests.helpers import fault_config as config
from tests.processes import finish, launch

pytestmark = pytest.mark.mpi


def test_gil_held_for_20_s_is_not_a_lost_rank(tmp_path, dataset):
    cfg, run = config(tmp_path, dataset)
    default = DistConfig().heartbeat_timeout_s
    assert default <= 10
    t0 = time.monotonic()
    rc, out = finish(launch(2, cfg, "--train.steps=4", "--checkpoint.interval=1000",
                            f"--dist.heartbeat_timeout_s={default:g}",
                            env=step_faults.env(gil_hold_rank=1, gil_hold_step=2, gil_hold_s=20)),
                     timeout=240)
    assert rc == 0, out[-3000:]
    assert time.monotonic() - t0 > 20  # the hold happened
    assert "lost" not in out and "error:" not in out, out[-3000:]
    assert sorted(losses(run)) == [1, 2, 3, 4]


def test_slow_steps_are_no_stall_once_the_step_time_is_known(tmp_path, dataset):
    cfg, run = config(tmp_path, dataset)
    rc, out = finish(launch(2, cfg, "--train.steps=6", "--checkpoint.interval=1000",
                            "--dist.stall_timeout_s=0.5",
                            env=step_faults.env(delay_rank=1, delay_s=1.5)), timeout=240)
    assert rc == 0, out[-3000:]
    assert sorted(losses(run)) == list(range(1, 7))
    stalls = [int(s) for s in re.findall(r"stalled for more than [\d.]+ s .*\(step (\d+)\)", out)]
    # rank 0 waits ~1.5 s (3 x the floor) for rank 1 in every step; the floor alone would warn in
    # every one of them; from the third step on the bound is 4 x the median step (> 6 s)
    assert all(s <= 1 for s in stalls), (stalls, out[-3000:])
