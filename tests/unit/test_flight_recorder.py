"""The flight recorder's ring buffer, its cost, the forensics file, and `hpctrain doctor`'s summary of
hand-made files (the real-mpiexec cases: tests/mpi/test_forensics.py, test_fault_tolerance.py)."""
from __future__ import annotations

import json
import os
import threading
import time

from hpctrain import doctor
from hpctrain.distributed import flight_recorder as fr


def test_ring_keeps_last_entries_with_per_group_sequence_and_open_one():
    rec = fr.FlightRecorder(size=4)
    for i in range(5):
        rec.step = i
        with rec.collective("all_reduce", "dp(2)"):
            pass
    vote = rec.enter("stop_vote", "world(2)")
    entries = rec.entries()
    assert len(entries) == 4  # the oldest two fell out of the ring
    assert [(e[0], e[1], e[2], e[3]) for e in entries] == [
        ("all_reduce", "dp(2)", 3, 2), ("all_reduce", "dp(2)", 4, 3), ("all_reduce", "dp(2)", 5, 4),
        ("stop_vote", "world(2)", 1, 4)]
    assert rec.open_entry()[:3] == ["stop_vote", "world(2)", 1]
    assert fr.stalled(rec, 60) is None
    vote[4] -= 61  # entered 61 s ago
    assert fr.stalled(rec, 60)[0] == "stop_vote"
    rec.leave(vote)
    assert rec.open_entry() is None and rec.events == 12


def test_recording_costs_well_under_a_step():
    rec = fr.FlightRecorder()
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        with rec.collective("all_reduce", "dp(8)"):
            pass
    per_call_us = (time.perf_counter() - t0) / n * 1e6
    assert per_call_us < 20, per_call_us  # ~2 us here under load; a step is milliseconds or more


def test_forensics_file_is_atomic_with_stacks_and_open_collective(tmp_path):
    rec = fr.FlightRecorder()
    rec.step = 7
    with rec.collective("forward_backward", "dp(2)"):
        pass
    rec.enter("stop_vote", "world(2)")
    record = fr.forensics(1, 2, "rank 0 lost", "verdict", lost=0, rec=rec)
    path = fr.write_forensics(tmp_path, record)
    assert path == os.path.join(tmp_path, "forensics", "rank_1.json")
    assert os.listdir(tmp_path / "forensics") == ["rank_1.json"]  # no tmp file left
    got = json.loads((tmp_path / "forensics" / "rank_1.json").read_text())
    assert got["open"]["op"] == "stop_vote" and got["open"]["seq"] == 1 and got["step"] == 7
    assert [c["open"] for c in got["collectives"]] == [False, True]
    assert got["lost"] == 0 and got["pid"] == os.getpid() and got["kind"] == "verdict"
    main = next(n for n in got["stacks"] if n.startswith(threading.main_thread().name))
    assert "test_forensics_file_is_atomic" in "".join(got["stacks"][main])


def test_forensics_never_writes_through_a_planted_symlink(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "forensics")
    assert fr.write_forensics(tmp_path, {"rank": 0}) is None
    assert os.listdir(tmp_path / "elsewhere") == []


def _rec(rank, world, step, open_, entered=(), **kw):
    entry = lambda op, group, seq, is_open: {"op": op, "group": group, "seq": seq, "step": step,  # noqa: E731
                                             "left": not is_open, "open": is_open,
                                             "duration_s": 9.0, "entered_s_ago": 9.0}
    cols = [entry(*e, False) for e in entered] + ([entry(*open_, True)] if open_ else [])
    return {"rank": rank, "world": world, "step": step, "kind": kw.get("kind", "stall"),
            "verdict": kw.get("verdict", ""), "lost": kw.get("lost"), "pid": 100 + rank,
            "host": "n1", "innermost_frame": kw.get("frame"), "open": cols[-1] if open_ else None,
            "collectives": cols,
            "stacks": {"MainThread (1)": [f'  File "x.py", line 1, in where_rank_{rank}_is\n']}}


def test_doctor_names_the_rank_that_never_entered_and_groups_the_waiting():
    vote = ("stop_vote", "world(4)", 42)
    recs = {r: _rec(r, 4, 41, vote, entered=[("stop_vote", "world(4)", 41)]) for r in (0, 2, 3)}
    recs[1] = _rec(1, 4, 41, None, entered=[("stop_vote", "world(4)", 41)], frame="hpctrain/data.py:9")
    lines = doctor.summary(recs)
    assert "ranks 0,2,3: step 41, inside stop_vote world(4) seq 42 (for 9.0 s)" in lines
    assert any(ln.startswith("rank 1: step 41, in no collective") and "hpctrain/data.py:9" in ln
               for ln in lines)
    check = next(ln for ln in lines if ln.startswith("check:"))
    assert check.startswith("check: rank 1 never entered stop_vote world(4) seq 42 that ranks 0,2,3 ")
    assert any("where_rank_1_is" in ln for ln in lines)  # rank 1's stack follows


def test_doctor_names_a_rank_without_file_that_the_watchdog_named_lost():
    allreduce = ("loss_allreduce", "dp(3)", 9)
    recs = {r: _rec(r, 3, 4, allreduce, kind="verdict", lost=1, verdict="rank 1 on n2 lost")
            for r in (0, 2)}
    lines = doctor.summary(recs)
    assert lines[0].startswith("forensics of 2 of 3 ranks; verdict: rank 1 on n2 lost")
    assert "rank 1: no forensics file (rank 1 named lost by the watchdog)" in lines
    assert any(ln.startswith("check: rank 1 (no forensics file) did not complete loss_allreduce "
                             "dp(3) seq 9 that ranks 0,2 ") for ln in lines)


def test_only_the_main_thread_records():
    rec = fr.FlightRecorder()

    def background():
        with rec.collective("ckpt_gather", "ckpt(2)"):
            pass

    t = threading.Thread(target=background)
    t.start()
    t.join()
    assert rec.entries() == [] and rec.events == 0
