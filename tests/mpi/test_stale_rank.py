"""A rank frozen past its job's relaunch writes nothing into the run dir when it wakes (issue #35).

A node frozen (SIGSTOP of every process on it) is named lost and left out; the job relaunches into
the same run dir; the node thaws while the relaunch trains and wakes its old rank, whose watchdog
finds its launch's rendezvous store gone and dies. Before, that stale rank wrote its forensics
(<run>/forensics/rank_1.json) over the relaunch's own. Here, without Slurm: launch A (2 ranks
under a real mpiexec); rank 1, its beacon and the hydra proxy above it are SIGSTOPped (the proxy
too, or it would SIGKILL the frozen rank when A ends: on the frozen node slurmd is frozen too);
rank 0 names rank 1 lost and A ends. Launch B trains in the same run dir and writes forensics of
its own (a stall: rank 1 skips step 3's stop vote); then A's rank 1 and its beacon are thawed.

The same inside a save: A's rank 1 stops (a `stop` fault point) right before it opens its share of
A's step-2 checkpoint, or after the share's first chunk; B saves step 2 and its rank 0 stops with the checkpoint complete in its tmp
dir; A's rank 1 thawed then used to rewrite B's `step_00000002.tmp/__1_0.distcp` (the same tmp
name in both launches). Now it ends with exit 2 before it creates or writes anything more
(run_lock's fence), and its tmp dir is A's own (`step_00000002.tmp-<launch id>`).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpctrain import step_faults
from hpctrain.checkpoint import disk_format
from tests.helpers import fault_config as config
from tests.processes import descendants, finish, launch, rank_pid

pytestmark = pytest.mark.mpi

LONG = ["--train.steps=100000", "--checkpoint.interval=100000", "--train.log_interval=2",
        "--dist.heartbeat_timeout_s=2", "--dist.stall_timeout_s=2"]
SAVING = ["--train.steps=100000", "--checkpoint.interval=2", "--train.log_interval=2"]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _until(predicate, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.2)


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _steps(run: Path) -> int:
    m = run / "metrics.jsonl"
    return m.read_text().count("\n") if m.exists() else 0


def _end_launches(launches, frozen) -> None:
    """Kill what a test left (each launch's process group, the frozen processes) and reap it; each
    launch's output tail is printed (pytest shows it when the test failed)."""
    for proc in launches:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _signal(frozen, signal.SIGKILL)
    for proc in launches:
        if proc is not None:
            try:
                print((proc.communicate(timeout=30)[0] or "")[-3000:])
            except (subprocess.TimeoutExpired, ValueError):
                pass


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _record(path: Path) -> dict:
    """A forensics file's record; {} while it is absent or being written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _b_wrote_both(forensics: Path, a_pids: set[int]) -> bool:
    """Both forensics files are launch B's."""
    pids = [_record(forensics / f"rank_{r}.json").get("pid") for r in (0, 1)]
    return all(pid is not None and pid not in a_pids for pid in pids)


def _settled(forensics: Path, quiet_s: float = 3.0, timeout: float = 60) -> dict[str, bytes]:
    """The forensics folder's files once none has changed for `quiet_s` seconds."""
    t0 = time.monotonic()
    last, since = None, time.monotonic()
    while True:
        now = {p.name: p.read_bytes() for p in forensics.iterdir()}
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        assert time.monotonic() - t0 < timeout, "launch B's forensics kept changing"
        time.sleep(0.2)


def test_a_rank_woken_after_the_relaunch_leaves_the_new_forensics_alone(tmp_path, dataset):
    cfg, run = config(tmp_path, dataset)
    first = launch(2, cfg, *LONG, env=step_faults.env(step_sleep_s=0.1))
    second, frozen = None, []
    try:
        _until(lambda: _steps(run) >= 2, 120, "launch A did not train")
        stale = rank_pid(first.pid, 1)
        proxy = _parent(stale)
        frozen = [proxy, stale, *descendants(stale)]  # the proxy, rank 1 and its beacon
        _signal(frozen, signal.SIGSTOP)
        forensics = run / "forensics"
        # (a stall record may come first: stall and heartbeat bounds are both 2 s here)
        _until(lambda: _record(forensics / "rank_0.json").get("kind") == "verdict", 60,
               "rank 0 never named rank 1")
        a_rank0 = _record(forensics / "rank_0.json")
        assert a_rank0["kind"] == "verdict" and a_rank0["lost"] == 1, a_rank0
        _until(lambda: not _running(a_rank0["pid"]), 60, "A's rank 0 did not end")
        first.kill()  # mpiexec (only: its process group holds the frozen rank) waits on the proxy
        first.wait(timeout=30)

        second = launch(2, cfg, *LONG, env=step_faults.env(step_sleep_s=0.2, skip_vote_rank=1,
                                                           skip_vote_step=3, skip_vote_s=5))
        a_pids = {stale, a_rank0["pid"]}
        _until(lambda: _b_wrote_both(forensics, a_pids), 120, "launch B wrote no forensics")
        before = _settled(forensics)  # B's watchdogs may write again under load: wait for quiet
        assert json.loads(before["rank_1.json"])["kind"] == "stall", before["rank_1.json"]

        _signal(frozen[1:], signal.SIGCONT)  # rank 1 of A and its beacon wake; the proxy stays
        _until(lambda: not _running(stale), 60, "the woken stale rank did not end")
        time.sleep(1)
        after = {p.name: p.read_bytes() for p in forensics.iterdir()}
        assert after == before, {k: json.loads(v)["pid"] for k, v in after.items()}
        assert second.poll() is None  # B trains on
    finally:
        _end_launches((first, second), frozen)


def _exit_code(pid: int) -> int | None:
    """A zombie's exit status (waitpid's form, /proc's last stat field: its parent, the frozen
    hydra proxy, never reaps it); None while it runs or once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    return int(fields[-1]) if fields[0] == "Z" else None


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] in "Tt"
    except OSError:
        return False


def _rank(launcher: int, rank: int) -> int | None:
    try:
        return rank_pid(launcher, rank)
    except AssertionError:
        return None


def _tree(run: Path) -> dict[str, tuple]:
    """Every entry of the run dir: (inode, mtime_ns, size, sha256 of a file's bytes)."""
    out = {}
    for p in sorted(run.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        out[str(p.relative_to(run))] = (st.st_ino, st.st_mtime_ns, st.st_size, digest)
    return out


def _launch_a_frozen_in_a_save(cfg, run, point: str):
    """Launch A with rank 1 stopped (SIGSTOP: a fault point) right before it opens its checkpoint
    share (`open`) or after its first chunk (`write`); its proxy and beacon frozen too; A's rank 0
    names it lost and A ends.
    (mpiexec, [proxy, rank 1, its beacon])."""
    first = launch(2, cfg, *SAVING, "--dist.heartbeat_timeout_s=2", "--dist.stall_timeout_s=2",
                   env=step_faults.env(save_point=f"{point}:__1_0.distcp:1:1:stop"))
    _until(lambda: _rank(first.pid, 1), 120, "launch A did not start")
    stale = _rank(first.pid, 1)
    _until(lambda: _stopped(stale), 120, "A's rank 1 never reached its share's open")
    frozen = [_parent(stale), stale, *descendants(stale)]
    _signal(frozen, signal.SIGSTOP)
    _until(lambda: _record(run / "forensics" / "rank_0.json").get("lost") == 1, 60,
           "rank 0 never named rank 1")
    _until(lambda: not _running(_record(run / "forensics" / "rank_0.json")["pid"]), 60,
           "A's rank 0 did not end")
    first.kill()
    first.wait(timeout=30)
    return first, frozen


@pytest.mark.parametrize("point", ["open", "write"])
def test_a_rank_woken_inside_a_save_writes_nothing_into_the_relaunch_run_dir(tmp_path, dataset, point):
    cfg, run = config(tmp_path, dataset)
    first, second, frozen = None, None, []
    try:
        first, frozen = _launch_a_frozen_in_a_save(cfg, run, point)
        stale = frozen[1]
        # B's rank 0 stops with its step-2 checkpoint complete in its tmp dir, not yet renamed: a
        # stale share written now would land in it (B's watchdogs are slowed to stay quiet)
        second = launch(2, cfg, "--train.steps=4", "--checkpoint.interval=2", "--checkpoint.keep=2",
                        "--dist.heartbeat_timeout_s=600", "--dist.stall_timeout_s=600",
                        env=step_faults.env(save_point="commit.marker_written:1:0:stop"))
        _until(lambda: any(run.glob("checkpoints/step_00000002.tmp*/COMMIT.json")), 120, f"B never saved: {sorted(os.listdir(run))}")
        b_rank0 = rank_pid(second.pid, 0)
        _until(lambda: _stopped(b_rank0), 60, "B's rank 0 did not stop at its commit")
        before = _tree(run)

        _signal(frozen[1:], signal.SIGCONT)  # A's rank 1 and its beacon wake; the proxy stays
        _until(lambda: not _running(stale), 60, "the woken stale rank did not end")
        after = _tree(run)
        changed = {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys()
                   if before.get(k) != after.get(k)}
        assert not changed, changed
        code = _exit_code(stale)
        assert code == 2 << 8, code  # exit 2: the fence (waitpid form)

        _signal([b_rank0], signal.SIGCONT)  # B commits step 2, trains and saves step 4, ends
        rc, out = finish(second, timeout=120)
        assert rc == 0, out[-3000:]
        for ckpt in ("step_00000002", "step_00000004"):  # every byte as B wrote it
            problems, commit, _ = disk_format.check_checkpoint(run / "checkpoints" / ckpt, True)
            assert not problems and "__1_0.distcp" in commit["files"], (ckpt, problems, commit)
    finally:
        _end_launches((first, second), frozen)
