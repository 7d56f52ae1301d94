"""`hpctrain doctor` on damaged forensics files (issue #47): each damaged file is named with what is
wrong, the intact ranks are still reported, nothing is a traceback, and no file is read whole before
its size is known (the well-formed cases: test_flight_recorder.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpctrain import doctor
from tests.conftest import ROOT


def _record(rank: int, world: int) -> dict:
    """A record as flight_recorder.forensics writes it: rank 0 waits in a stop vote."""
    vote = {"op": "stop_vote", "group": f"world({world})", "seq": 7, "step": 3, "left": False,
            "open": True, "duration_s": 61.0, "entered_s_ago": 61.0}
    return {"rank": rank, "world": world, "host": "n1", "pid": 100 + rank, "kind": "stall",
            "verdict": "", "lost": None, "step": 3, "time": 0.0,
            "innermost_frame": "hpctrain/train/loop.py:9 in step", "open": vote,
            "collectives": [vote], "stacks": {"MainThread (1)": ['  File "x.py", line 1\n']}}


def _write(run, rank, text: str) -> str:
    folder = run / "forensics"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank_{rank}.json").write_text(text)
    return str(folder / f"rank_{rank}.json")


def _doctor(run) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "hpctrain", "doctor", str(run)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_damaged_files_are_named_and_the_intact_rank_is_reported(tmp_path):
    good = json.dumps(_record(0, 5))
    _write(tmp_path, 0, good)
    deep = _write(tmp_path, 1, "[" * 100_000 + "]" * 100_000)
    truncated = _write(tmp_path, 2, good[:len(good) // 2])
    a_list = _write(tmp_path, 3, "[1, 2]")
    wrong_type = _write(tmp_path, 4, json.dumps(dict(_record(4, 5), world="5")))
    r = _doctor(tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("forensics of 1 of 5 ranks")
    assert any(ln.startswith("rank 0: step 3, inside stop_vote world(5) seq 7") for ln in lines)
    for rank, path, what in ((1, deep, "nested"), (2, truncated, "JSON"), (3, a_list, "list"),
                             (4, wrong_type, "'world'")):
        line = next(ln for ln in lines if ln.startswith(f"rank {rank}: damaged"))
        assert path in line and what in line, line
    assert not any("no forensics file" in ln for ln in lines), lines


def test_only_damaged_files_give_one_error_line_each(tmp_path, capsys):
    deep = _write(tmp_path, 0, "{\"a\": " * 50_000 + "1" + "}" * 50_000)
    garbage = _write(tmp_path, 1, "\x00\x01 not json")
    assert doctor.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(ln.startswith("error:") for ln in err), err
    assert deep in err[0] and garbage in err[1]


@pytest.mark.parametrize("change, named", [
    ({"rank": True}, "'rank'"), ({"step": "3"}, "'step'"), ({"collectives": [1]}, "collectives[0]"),
    ({"collectives": {}}, "'collectives'"), ({"open": {"op": "x"}}, "'group'"),
    ({"open": []}, "'open'"), ({"stacks": {"MainThread (1)": "x"}}, "'stacks'"),
    ({"verdict": None}, "'verdict'"), ({"world": 0}, "world 0"), ({"rank": 2}, "rank 2 of world 2"),
    ({"world": 10 ** 9}, "world 1000000000")])
def test_a_wrong_shape_is_named(change, named):
    with pytest.raises(doctor.DamagedFile) as e:
        doctor.check_record(dict(_record(1, 2), **change))
    assert named in str(e.value)


def test_a_file_for_another_rank_an_oversized_one_and_a_fifo_are_named(tmp_path, monkeypatch):
    _write(tmp_path, 0, json.dumps(_record(0, 4)))
    _write(tmp_path, 1, json.dumps(_record(0, 4)))  # rank 0's record under rank 1's name
    _write(tmp_path, 2, json.dumps(_record(2, 4)) + " " * 4096)
    os.mkfifo(tmp_path / "forensics" / "rank_3.json")  # opening it for reading must not block
    monkeypatch.setattr(doctor, "MAX_FILE_BYTES", 4096)
    recs, damaged = doctor.load_all(tmp_path)
    assert sorted(recs) == [0]
    assert [(r, p.name) for r, p, _ in damaged] == [(1, "rank_1.json"), (2, "rank_2.json"),
                                                    (3, "rank_3.json")]
    whats = [what for _, _, what in damaged]
    assert "rank 0" in whats[0] and "larger than" in whats[1] and "regular file" in whats[2]
    lines = doctor.summary(recs, damaged)
    assert sum(ln.startswith("rank 1: damaged forensics file") for ln in lines) == 1
    assert not any("no forensics file" in ln for ln in lines), lines
    assert any(ln.startswith("check: ranks 1,2,3 (no usable forensics file) did not complete "
                             "stop_vote world(4) seq 7") for ln in lines), lines
