"""hpctrain/logs.py (data_tools/logs.py): rank 0 alone logs INFO by default, as the bare message;
HPCTRAIN_LOG_RANKS=all or a list adds other ranks with a "[rank N] " prefix; a warning of any rank
appears; HPCTRAIN_LOG_LEVEL filters. Real 2-rank `mpiexec` runs of a tiny script."""
from __future__ import annotations

import sys

import pytest

from tests.conftest import mpirun, run_cmd

# setup from the communicator ("comm"), or from the launcher's environment (no setup call)
SCRIPT = """\
import sys
from mpi4py import MPI
from hpctrain import logs
c = MPI.COMM_WORLD
r = c.Get_rank()
if sys.argv[1] == "comm":
    logs.setup(r, c.Get_size())
logs.get_logger("hpctrain.test").info(f"info of {r}")
if r == 1:
    logs.warning(f"warning: of {r}")
logs.debug(f"debug of {r}")
"""


def run_two_ranks(tmp_path, how: str, **env) -> list[str]:
    script = tmp_path / "log_ranks.py"
    script.write_text(SCRIPT)
    r = mpirun(2, [script, how], timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "", r.stdout  # logging never writes to stdout: that is a command's output
    return sorted(r.stderr.splitlines())


@pytest.mark.parametrize("how", ["comm", "env"])
def test_only_rank_0_logs_info_by_default_and_a_warning_of_rank_1_appears(tmp_path, how):
    assert run_two_ranks(tmp_path, how) == ["[rank 1] warning: of 1", "info of 0"]


def test_every_rank_logs_with_its_prefix_on_request(tmp_path):
    lines = run_two_ranks(tmp_path, "comm", HPCTRAIN_LOG_RANKS="all", HPCTRAIN_LOG_LEVEL="debug")
    assert lines == ["[rank 0] debug of 0", "[rank 0] info of 0", "[rank 1] debug of 1",
                     "[rank 1] info of 1", "[rank 1] warning: of 1"]


def test_a_list_of_ranks_and_the_warning_level(tmp_path):
    assert run_two_ranks(tmp_path, "comm", HPCTRAIN_LOG_RANKS="1") == [
        "[rank 1] info of 1", "[rank 1] warning: of 1"]
    assert run_two_ranks(tmp_path, "env", HPCTRAIN_LOG_RANKS="0,1", HPCTRAIN_LOG_LEVEL="WARNING") == [
        "[rank 1] warning: of 1"]


def test_a_bad_setting_is_one_warning_and_the_default():
    code = "from hpctrain import logs; logs.info('hello')"
    r = run_cmd([sys.executable, "-c", code], timeout=60,
                env={"HPCTRAIN_LOG_RANKS": "zero", "HPCTRAIN_LOG_LEVEL": "loud"})
    lines = r.stderr.splitlines()
    assert r.returncode == 0 and len(lines) == 3 and lines[2] == "hello", r.stderr
    assert "HPCTRAIN_LOG_RANKS='zero'" in lines[0] and "HPCTRAIN_LOG_LEVEL='loud'" in lines[1]
