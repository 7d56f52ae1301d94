"""bench/gpu_session.sh, the one command of a lent multi-GPU machine (issue 49): valid bash, and on
a machine with fewer than 2 GPUs (this one) one line saying so, results.json holding that line,
exit 0, in seconds; its 2-GPU part alone (PARTS=multi, bench/two_gpu_runs.py) the same. The
JSON a GPU session writes: `collect` on a pytest JUnit file and a runs file."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, run_cmd

SCRIPT = ROOT / "bench" / "gpu_session.sh"
pytestmark = pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="a machine with 2 GPUs runs the session")


def test_the_session_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.parametrize("parts, line", [
    (None, "gpu_session: skipped: the 2-GPU session needs 2 CUDA GPUs, this machine has {n} "
           '(one GPU: PARTS="tests throughput ...")'),
    ("multi", "two_gpu_runs: skipped: needs 2 CUDA GPUs, this machine has {n}"),
])
def test_fewer_than_two_gpus_is_one_line_and_a_json(tmp_path, parts, line):
    env = {"PYTHON": sys.executable, "PARTS": parts or ""}
    r = run_cmd(["bash", SCRIPT, tmp_path], env=env, timeout=120)
    want = line.format(n=torch.cuda.device_count())
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    if parts is None:
        assert lines == [want]
        assert json.loads((tmp_path / "results.json").read_text()) == {"skipped": want}
    else:  # the header (machine.txt), the part's one line, where the results went
        assert lines[-2:] == [want, f"results: {tmp_path}/results.json"], lines
        assert json.loads((tmp_path / "results.json").read_text()) == {"two_gpu_runs": {"skipped": want}}


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_a" name="test_one" time="1.0" />
<testcase classname="tests.gpu.test_a" name="test_two" time="1.0"><failure message="x">x</failure></testcase>
<testcase classname="tests.gpu.test_b" name="test_three" time="0.0"><skipped message="needs 2 GPUs" /></testcase>
</testsuite></testsuites>"""


def test_collect_merges_the_tests_and_the_runs(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from two_gpu_runs import collect
    finally:
        sys.path.remove(str(ROOT / "bench"))
    (tmp_path / "tests.xml").write_text(JUNIT)
    runs = {"machine": "2 x H100", "fsdp2": {"status": "pass", "tokens_per_s": 1000, "step1_loss": 5.5,
                                             "peak_mem_gib": 3.2}}
    (tmp_path / "two_gpu_runs.json").write_text(json.dumps(runs))
    collect(tmp_path)
    got = json.loads((tmp_path / "results.json").read_text())
    assert got["tests"] == {"tests.gpu.test_a::test_one": "passed", "tests.gpu.test_a::test_two": "failed",
                            "tests.gpu.test_b::test_three": "skipped"}
    assert got["tests_summary"] == {"failed": 1, "passed": 1, "skipped": 1}
    assert got["two_gpu_runs"] == runs
