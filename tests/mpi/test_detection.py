"""Detection that is fast and still safe, under a real mpiexec (the lost-rank cases with the default
bound are test_fault_tolerance.py's test_lost_rank_ends_job_with_its_name; the beacon alone:
tests/unit/test_beacon.py). One 2-rank launch under the DEFAULT dist.heartbeat_timeout_s, with
dist.stall_timeout_s = 0.5 s and rank 1 a straggler 1.5 s late every step (3 x that floor):

* stall warnings only while no step time is known (steps 0-1): after that the bound is 4 x the
  median step (> 6 s), so a slow step is no stall;
* at step 4 rank 1's main thread holds the GIL in C for HOLD_S = 13 s (libc sleep through
  ctypes.PyDLL: no Python thread of it runs): its beacon process beats for it, so it is not declared
  lost and the job finishes; rank 0, waiting 13 s in that step's stop vote, does report that as a
  stall. Without the beacon the watchdog names a silent rank within the default 8 s + 1 interval
  (0.8 s): 13 s is > 3 s beyond that (asserted) and about twice the stall bound 4 x the median step (was
  20 s).
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
HOLD_S = 13


def test_gil_held_13_s_is_no_loss_and_slow_steps_are_no_stall(tmp_path, dataset):
    cfg, run = config(tmp_path, dataset)
    default = DistConfig().heartbeat_timeout_s
    assert default + max(0.2, min(5.0, default / 10)) + 3 <= HOLD_S  # the watchdog's bound + 3 s
    faults = step_faults.env(delay_rank=1, delay_s=1.5, gil_hold_rank=1, gil_hold_step=4,
                             gil_hold_s=HOLD_S)
    t0 = time.monotonic()
    rc, out = finish(launch(2, cfg, "--train.steps=5", "--checkpoint.interval=1000",
                            f"--dist.heartbeat_timeout_s={default:g}", "--dist.stall_timeout_s=0.5",
                            env=faults), timeout=240)
    assert rc == 0, out[-3000:]
    assert time.monotonic() - t0 > HOLD_S + 5 * 1.5  # the hold and the delays happened
    assert "lost" not in out and "error:" not in out, out[-3000:]
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]
    stalls = {int(s) for s in re.findall(r"stalled for more than [\d.]+ s .*\(step (\d+)\)", out)}
    # the floor alone would warn in every step (rank 0 waits 1.5 s in each)
    assert 4 in stalls and stalls <= {0, 1, 4}, (stalls, out[-3000:])
