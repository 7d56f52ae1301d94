"""tests/shared_dirs.py: a module fixture's work built once per session, whichever xdist workers
run the module's tests. Checked with a real `pytest -n 2` on a probe module whose 4 parametrized
tests xdist splits between its two workers (2 each), as it split test_moe_tp.py's."""
from __future__ import annotations

import sys
import textwrap

import pytest

from tests.conftest import ROOT, run_cmd
from tests.shared_dirs import shared_dir

PROBE = textwrap.dedent('''
    import os
    import time
    from pathlib import Path

    import pytest

    from tests.shared_dirs import shared_dir

    LOG = Path(os.environ["PROBE_LOG"])


    def build(out):
        with open(LOG / "builds", "a") as f:
            f.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")
        time.sleep(2)  # the other worker asks while this one builds
        (out / "value").write_text("42")


    @pytest.fixture(scope="module")
    def built(tmp_path_factory):
        return shared_dir(tmp_path_factory, "probe", build)


    @pytest.mark.parametrize("i", range(4))
    def test_reads(built, i):
        with open(LOG / "readers", "a") as f:
            f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {built}\\n")
        assert (built / "value").read_text() == "42"
''')


def test_two_xdist_workers_build_once_and_read_the_same_dir(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the checkout's options
    (tmp_path / "test_probe.py").write_text(PROBE)
    log = tmp_path / "log"
    log.mkdir()
    r = run_cmd([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q",
                 "--basetemp", tmp_path / "base", tmp_path / "test_probe.py"], timeout=120,
                cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PROBE_LOG": str(log)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    readers = [line.split() for line in (log / "readers").read_text().splitlines()]
    assert len(readers) == 4 and {w for w, _ in readers} == {"gw0", "gw1"}, readers
    assert len({d for _, d in readers}) == 1, readers
    assert len((log / "builds").read_text().splitlines()) == 1


def test_a_failed_build_leaves_no_mark_and_the_next_call_builds(tmp_path_factory):
    def broken(out):
        (out / "half").write_text("written before the failure")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        shared_dir(tmp_path_factory, "retried", broken)
    calls = []
    out = shared_dir(tmp_path_factory, "retried", lambda d: calls.append(sorted(p.name for p in d.iterdir())))
    assert calls == [[]]  # one build, into an empty dir
    assert shared_dir(tmp_path_factory, "retried", calls.append) == out and len(calls) == 1
