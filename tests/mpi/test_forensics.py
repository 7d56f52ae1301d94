"""Forensics of a hung collective under a real mpiexec (the frozen-rank case is in
test_fault_tolerance.py's SIGSTOP test): rank 1 sleeps instead of entering the stop vote of step 3
(HPCTRAIN_TEST_FAULTS skip_vote_*), rank 0 waits in it past dist.stall_timeout_s while rank 1
still beats: a stall (under DiLoCo, H = 2, a checkpoint at step 2: their collectives are recorded too). Both ranks write <run>/forensics/rank_<r>.json, the job still finishes, and
`hpctrain doctor` names rank 1 as the one that never entered rank 0's stop vote.
"""
from __future__ import annotations

import json
import re
import sys

import pytest

from hpctrain import step_faults
from tests.conftest import run_cmd
from tests.helpers import fault_config as config
from tests.processes import finish, launch

pytestmark = pytest.mark.mpi


def test_hung_collective_writes_forensics_and_doctor_names_the_absent_rank(tmp_path, dataset):
    cfg, run = config(tmp_path, dataset)
    proc = launch(2, cfg, "--train.steps=4", "--checkpoint.interval=2",
                  "--dist.stall_timeout_s=2", "--sync.mode=diloco", "--sync.inner_steps=2",
                  env=step_faults.env(skip_vote_rank=1, skip_vote_step=3, skip_vote_s=5))
    rc, out = finish(proc, timeout=120)
    assert rc == 0, out[-3000:]  # a stall writes files and warns; it ends nothing
    assert (run / "forensics" / "rank_0.json").exists(), out[-3000:]
    recs = {r: json.loads((run / "forensics" / f"rank_{r}.json").read_text()) for r in (0, 1)}
    waiting, absent = recs[0], recs[1]
    assert waiting["kind"] == "stall" and waiting["rank"] == 0 and waiting["world"] == 2
    assert waiting["open"]["op"] == "stop_vote" and waiting["open"]["group"] == "world(2)"
    assert waiting["step"] == 3 and waiting["open"]["duration_s"] > 2
    seq = waiting["open"]["seq"]
    # the world group's collectives (the load's broadcast, a vote per step, the save's gather),
    # numbered 1, 2, ... on this rank: the vote it hangs in is the last
    assert [c["seq"] for c in waiting["collectives"] if c["group"] == "world(2)"] == list(range(1, seq + 1))
    assert [c["step"] for c in waiting["collectives"] if c["op"] == "stop_vote"] == [1, 2, 3]
    assert [c for c in waiting["collectives"] if c["open"]] == [waiting["collectives"][-1]]
    # DiLoCo's round average after inner step 2 (its all-reduce is recorded too), left
    assert [(c["op"], c["group"], c["left"]) for c in waiting["collectives"]
            if c["op"].startswith("diloco")] == [("diloco_round_allreduce", "dp(2)", True)]
    # the step-2 checkpoint's agreement (main thread's gather/broadcast), all left
    saves = [c for c in waiting["collectives"] if c["op"].startswith("ckpt_") and c["step"] == 2]
    assert len(saves) >= 2 and all(c["left"] for c in saves), saves  # (step 0: the resume probe)
    # rank 1 wrote its file because rank 0 published the stall: it is in no collective, asleep
    assert absent["open"] is None and absent["step"] == 3
    assert not any(c["op"] == "stop_vote" and c["seq"] == seq for c in absent["collectives"])
    assert "step_faults.py" in absent["innermost_frame"]
    assert any("hang_before_vote" in "".join(s) for s in absent["stacks"].values())
    assert absent["pid"] != waiting["pid"] and "Traceback" not in out

    r = run_cmd([sys.executable, "-m", "hpctrain", "doctor", str(run)], timeout=60)
    report = r.stdout
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(rf"rank 1 never entered stop_vote world\(2\) seq {seq} that rank 0 ", report), report
    assert "hang_before_vote" in report  # rank 1's stack follows


def test_doctor_without_files_is_one_line(tmp_path):
    r = run_cmd([sys.executable, "-m", "hpctrain", "doctor", str(tmp_path)], timeout=60)
    assert r.returncode == 1
    out = r.stdout + r.stderr
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "forensics" in lines[0], out
