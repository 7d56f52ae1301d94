"""`hpctrain plan --sbatch FILE` on a real local Slurm (issue #48 item 4): the planner writes the
job script for the cluster's CPU node (`--gpus-per-node 0 --ranks-per-node 2`), `sbatch FILE`
alone submits it (no arguments: the config and the recommended layout are in the script), and
the job trains with that layout to completion."""
from __future__ import annotations

import re

import pytest

from hpctrain.plan.cli import main as plan_main
from tests.slurm.conftest import TINY, losses

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # as every test here: it may install and start Slurm

STEPS = 12


def test_the_planned_script_is_the_whole_submission(jobs, multinode_dataset, tmp_path, capsys):
    cfg, run, script = tmp_path / "tiny.toml", tmp_path / "run", tmp_path / "tiny.sbatch"
    cfg.write_text(TINY.format(run=run, data=multinode_dataset).replace("steps = 40", f"steps = {STEPS}"))
    assert plan_main(["--config", str(cfg), "--nodes", "1", "--gpus-per-node", "0", "--ranks-per-node",
                      "2", "--time", "00:20:00", "--sbatch", str(script)]) == 0
    out = capsys.readouterr().out
    assert f"submit it: sbatch {script}" in out
    flags = dict(re.findall(r"--parallel\.(tp|pp)=(\d+)", script.read_text()))
    jid = jobs.sbatch("--chdir", tmp_path, script)  # the script's own #SBATCH lines, nothing else
    (rec,) = jobs.wait(jid, timeout=240)
    log = (tmp_path / f"slurm-hpctrain-tiny-{jid}.out").read_text()
    assert (rec["JobState"], rec["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert (rec["JobName"], rec["NumNodes"], rec["NumTasks"], rec["TimeLimit"]) == (
        "hpctrain-tiny", "1", "2", "00:20:00"), rec
    # the recommended layout is what trained: "world 2 [pp=P x dp=D (ddp) x tp=T]"
    assert f"world 2 [pp={flags['pp']} x dp={2 // (int(flags['tp']) * int(flags['pp']))}" in log, log
    assert "training finished" in log
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
