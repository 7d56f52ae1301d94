"""The liveness beacon (hpctrain/distributed/beacon.py) on its own: a parent process starts it, this
test plays its neighbour over UDP (no MPI, no torch; ~3 s).

* a stopped parent (SIGSTOP) gets no beats sent for it; SIGCONT: beats again;
* a verdict while the parent's main thread holds the GIL in C: the beacon prints the one error line
  itself and SIGKILLs the parent within kill_after;
* a neighbour never heard from (UDP blocked) is told to the parent once (`quiet`), never a verdict.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from tests.conftest import ROOT

PARENT = """
import ctypes, sys, time
from hpctrain.distributed import beacon
proc, port = beacon.start(0, 2, {timeout}, 0.1, kill_after=1.0, stacks_fd=beacon.stack_dump_fd(),
                          run_dir={run_dir!r})
proc.stdin.write(b"pred 127.0.0.1:{peer} 1\\nsucc 127.0.0.1:{peer} 1 nodeB\\n"); proc.stdin.flush()
print(port, flush=True)
if {hold}:
    ctypes.PyDLL(None).sleep(30)  # the GIL stays held: no thread of this process reads the verdict
print(proc.stdout.readline().decode().strip(), flush=True)  # what the beacon tells its rank
time.sleep(30)
"""


def _parent(peer_port: int, timeout: float, hold: bool, run_dir: str = ""):
    code = PARENT.format(timeout=timeout, peer=peer_port, hold=hold, run_dir=run_dir)
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _beats(sock, seconds: float) -> int:
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            n += sock.recv(100) == b"hb 0"
        except socket.timeout:
            pass
    return n


def test_stopped_parent_is_silent():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        parent = _parent(sock.getsockname()[1], timeout=60.0, hold=False)
        try:
            port = int(parent.stdout.readline())
            assert port > 0
            assert _beats(sock, 1.0) >= 5  # every 0.1 s
            os.kill(parent.pid, signal.SIGSTOP)
            time.sleep(0.3)
            _beats(sock, 0.05)  # drain what was sent before the stop took effect
            assert _beats(sock, 1.0) == 0
            os.kill(parent.pid, signal.SIGCONT)
            assert _beats(sock, 1.0) >= 5
        finally:
            parent.kill()
            parent.communicate()


def test_verdict_ends_a_parent_that_holds_the_gil(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))  # plays rank 1: beats once, then silent: lost after 1 s
        parent = _parent(sock.getsockname()[1], timeout=1.0, hold=True, run_dir=str(tmp_path))
        t0 = time.monotonic()
        try:
            sock.sendto(b"hb 1", ("127.0.0.1", int(parent.stdout.readline())))  # then silent
            _, err = parent.communicate(timeout=20)
        finally:
            parent.kill()
        assert parent.returncode == -signal.SIGKILL
        assert time.monotonic() - t0 < 1.0 + 0.2 + 1.0 + 5  # timeout + tick + kill_after + start
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: rank 1 on nodeB lost: no heartbeat"), err
    # its forensics, written by the beacon: the stacks faulthandler dumped with the GIL held
    rec = json.loads((tmp_path / "forensics" / "rank_0.json").read_text())
    assert (rec["kind"], rec["lost"], rec["pid"], rec["open"]) == ("verdict", 1, parent.pid, None)
    stack = "".join(rec["stacks"]["MainThread (faulthandler, every thread)"])
    assert 'File "<string>", line 9' in stack, stack  # the PyDLL sleep line of PARENT
    r = subprocess.run([sys.executable, "-m", "hpctrain", "doctor", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "rank 0" in r.stdout and "Traceback" not in r.stderr, r


def test_a_neighbour_never_heard_from_is_a_warning_not_a_verdict():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))  # plays rank 1 and never beats at all
        parent = _parent(sock.getsockname()[1], timeout=0.5, hold=False)
        try:
            port = int(parent.stdout.readline())
            assert port > 0 and parent.stdout.readline().split() == [
                "quiet", "1", f"127.0.0.1:{sock.getsockname()[1]}"]
            time.sleep(1.5)  # three timeouts more: still no verdict, the parent lives
            assert parent.poll() is None
        finally:
            parent.kill()
            _, err = parent.communicate()
        assert "error" not in err, err


def test_a_beacon_that_cannot_start_is_a_warning(monkeypatch, capsys):
    """No beacon (its interpreter cannot start): one warning, the watchdog runs on, stop() works."""
    import datetime
    from types import SimpleNamespace

    import torch.distributed as dist

    from hpctrain.distributed import watchdog

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    ctx = SimpleNamespace(rank=1, world_size=2, comm=None, master_addr="127.0.0.1",
                          master_port=store.port, hosts=("nodeA", "nodeB"))
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    wd = watchdog.Watchdog(ctx, 5.0)
    try:
        assert wd._beacon is None and wd._thread.is_alive()
    finally:
        wd.stop()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "beacon" in ln]
    assert len(lines) == 1 and "rank 1 on nodeB: its heartbeat beacon did not start" in lines[0], err
    assert not store.check(["hpctrain/beacon/1"])  # its neighbours' beacons never watch it


def test_a_beacon_that_dies_under_a_live_rank_is_a_warning(capsys):
    """The beacon ends while its rank runs (killed, crashed): the rank says so at once, naming the
    beacon's pid and status, before its watcher names the live rank lost; a clean stop() says nothing."""
    import datetime
    from types import SimpleNamespace

    import torch.distributed as dist

    from hpctrain.distributed import watchdog

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    ctx = SimpleNamespace(rank=1, world_size=2, comm=None, master_addr="127.0.0.1",
                          master_port=store.port, hosts=("nodeA", "nodeB"))
    for kill in (True, False):
        wd, err = watchdog.Watchdog(ctx, 5.0), ""
        try:
            pid = wd._beacon.pid
            if kill:
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while "heartbeat beacon" not in err and time.monotonic() < deadline:
                    time.sleep(0.05)
                    err += capsys.readouterr().err
        finally:
            wd.stop()
        err += capsys.readouterr().err
        if kill:
            assert f"rank 1 on nodeB: its heartbeat beacon (pid {pid}) ended with status -9" in err, err
        else:
            assert "heartbeat beacon" not in err, err


def test_a_stall_record_never_replaces_the_verdicts(tmp_path):
    """The stall and heartbeat bounds may be equal (2 s in tests/mpi/test_stale_rank.py): the
    watchdog thread's stall record, written just after the beacon reader's verdict record, used to
    replace it in forensics/rank_<r>.json (CI: 'rank 0 never named rank 1')."""
    import datetime
    from types import SimpleNamespace

    import torch.distributed as dist

    from hpctrain.distributed import watchdog

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    ctx = SimpleNamespace(rank=0, world_size=2, comm=None, master_addr="127.0.0.1",
                          master_port=store.port, hosts=("nodeA", "nodeB"))
    wd = watchdog.Watchdog(ctx, 5.0, run_dir=tmp_path)
    try:
        path = tmp_path / "forensics" / "rank_0.json"
        assert wd._write_forensics("stalled in x", "stall") == str(path)  # before any verdict
        wd.verdict = "rank 1 on nodeB lost"  # as _die sets it, before writing its record
        assert wd._write_forensics(wd.verdict, "verdict", 1) == str(path)
        assert wd._write_forensics("stalled in x", "stall") is None
        record = json.loads(path.read_text())
        assert record["kind"] == "verdict" and record["lost"] == 1, record
    finally:
        wd.stop()
