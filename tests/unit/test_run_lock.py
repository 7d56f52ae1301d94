"""The run-dir lock's liveness check: an exited process, and a killed one its parent has not
reaped yet (a zombie), both count as gone; a running one does not."""
import os
import signal
import subprocess
import sys
import time

from hpctrain import step_faults
from hpctrain.distributed.run_lock import _pid_gone


def test_running_zombie_and_reaped_processes():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not _pid_gone(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _pid_gone(child.pid):  # a zombie until we wait() for it
            assert time.monotonic() < deadline, "a killed, unreaped child still counts as alive"
            time.sleep(0.05)
        assert os.path.exists(f"/proc/{child.pid}")  # not reaped yet: the zombie case
    finally:
        child.kill()
        child.wait()
    assert _pid_gone(child.pid)
    assert not _pid_gone(os.getpid())


# ---- a suspended holder, an atomic lock (#30) -------------------------------------------------
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.conftest import BIN, ROOT, TINY_TRAIN, fill, run_cmd  # noqa: E402


@pytest.fixture(scope="module")
def dataset(one_play):
    return one_play


LEASE = "2"  # HPCTRAIN_RUN_LOCK_LEASE_S for these tests: a frozen holder loses its lock quickly


def _env() -> dict:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1", "HPCTRAIN_RUN_LOCK_LEASE_S": LEASE, "HPCTRAIN_TENSORBOARD": "0"}


def _start(cfg: Path, log: Path, faults: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpctrain", "train", "--config", str(cfg),
                             "--checkpoint.interval=20"], cwd=ROOT, env={**_env(), **(faults or {})},
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def _wait_for(predicate, proc, what: str, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not predicate():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        assert time.monotonic() - t0 < timeout, f"no {what} after {timeout} s"
        time.sleep(0.1)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_holder_frozen_past_the_lease_stops_at_once_and_the_new_holder_owns_the_run(tmp_path, dataset):
    """scontrol suspend / SIGSTOP longer than the lease: a second job takes the lock over; the first,
    woken, exits 2 at once with one line naming the lock and the new holder, and writes nothing
    more: the second's metrics have every step once and its checkpoints verify."""
    run, cfg = tmp_path / "run", tmp_path / "t.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=dataset, steps=60))
    metrics = run / "metrics.jsonl"
    first = _start(cfg, tmp_path / "first.log", step_faults.env(step_sleep_s=0.05))
    second = None
    try:
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 25, first, "step 25")
        os.kill(first.pid, signal.SIGSTOP)
        time.sleep(float(LEASE) + 1.5)
        second = _start(cfg, tmp_path / "second.log")
        _wait_for(lambda: "step 25/" in (tmp_path / "second.log").read_text(), second, "second's step 25")
        os.kill(first.pid, signal.SIGCONT)
        t0 = time.monotonic()
        assert first.wait(timeout=30) == 2
        assert time.monotonic() - t0 < 10
        assert second.wait(timeout=180) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    log = (tmp_path / "first.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert "Traceback" not in log and len(errors) == 1, log[-3000:]
    assert str(run / ".hpctrain.lock") in errors[0]
    assert f"pid {second.pid} on {socket.gethostname()}" in errors[0]
    assert _steps(metrics) == list(range(1, 61))
    r = run_cmd([sys.executable, "-m", "hpctrain", "ckpt", "verify", run, "--full"], timeout=120)
    assert r.returncode == 0 and r.stdout.count("intact") == 3, r.stdout + r.stderr
    assert not list(run.glob(".hpctrain.lock*"))


def test_an_empty_lock_left_by_an_interrupted_creation_is_taken_over_at_once(tmp_path, dataset):
    """An older version created the lock empty and then hit a full disk: the next run starts."""
    run, cfg = tmp_path / "run", tmp_path / "t.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=dataset, steps=2))
    run.mkdir()
    (run / ".hpctrain.lock").write_bytes(b"")
    r = run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", cfg], timeout=120,
                env={"HPCTRAIN_RUN_LOCK_LEASE_S": "600"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"warning: run dir \S+: took over the lock of pid \? on \?.*empty or unreadable", r.stderr)
    assert _steps(run / "metrics.jsonl") == [1, 2] and not list(run.glob(".hpctrain.lock*"))


def test_a_full_disk_leaves_no_lock_and_the_next_run_starts(tmp_path, dataset, mounts):
    """ENOSPC while the lock is written: one line naming the lock, no lock file (not even an empty
    one) left; with space again the next run starts at once."""
    disk = mounts.tmpfs(tmp_path / "disk", "4m")
    run, cfg = disk / "run", tmp_path / "t.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=dataset, steps=2))
    run.mkdir()
    filler = disk / "filler"
    fill(filler)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.iterdir()}
    r = run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", cfg], timeout=120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and str(run / ".hpctrain.lock") in errors[0], r.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.iterdir()} == before
    filler.unlink()
    r = run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", cfg], timeout=120)
    assert r.returncode == 0 and "took over" not in r.stderr, r.stderr[-3000:]


def test_a_stale_rank_stops_before_writing_once_a_newer_launch_holds_the_lock(tmp_path, monkeypatch, capsys):
    """stop_if_taken_over: a no-op while the lock is this launch's; exit 2 with one line naming the
    file once another launch's lock replaced it. A launch's tmp dir name is its own."""
    import types

    import pytest

    from hpctrain.checkpoint import disk_format
    from hpctrain.distributed import run_lock

    def _exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", _exit)
    share = tmp_path / "step_00000002.tmp-x" / "__1_0.distcp"
    assert run_lock.launch_id() is None and run_lock.taken_over() is None
    with run_lock.hold(tmp_path, types.SimpleNamespace(rank=0, comm=None)):
        launch = run_lock.launch_id()
        tmp = disk_format.tmp_path(tmp_path / "step_00000002", launch)
        assert len(launch) == 12 and tmp.name == f"step_00000002.tmp-{launch}"
        assert disk_format.parse_dir_name(tmp.name) == (2, "tmp")
        run_lock.stop_if_taken_over(share)  # ours: nothing happens
        newer = tmp_path / "newer"
        newer.write_text('{"host": "h2", "pid": 4242, "job": null, "started": 1.0}\n')
        os.replace(newer, tmp_path / run_lock.LOCK_NAME)  # a newer launch took the run dir over
        with pytest.raises(SystemExit) as stopped:
            run_lock.stop_if_taken_over(share)
        assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{share}: not written" in err[0] and "pid 4242 on h2" in err[0], err
    assert run_lock.launch_id() is None  # released
