"""`hpctrain tune pbt` under a real mpiexec: the exploit copy is bit for bit (members of 1 rank,
and of 2 tensor-parallel ranks); a population stopped (train.stop_at_step, and USR1 as a
preemption) and run again writes the same lineage, byte for byte, as one that never stopped."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hpctrain import step_faults
from tests.conftest import BIN, ROOT, TINY_SECTIONS, mpiexec_path, mpirun
from tests.tune_setup import make_dataset

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 24
PBT_TOML = TINY_SECTIONS + """[train]
steps = 24
micro_batch_size = 2
warmup_steps = 0
eval_interval = 8
eval_batches = 2
log_interval = 8
[checkpoint]
interval = 1000
[tune.pbt]
population = 2
ready = 4
seed = 1
[tune.params]
train.lr = {{ log_uniform = [1e-5, 1e-2] }}
train.weight_decay = {{ uniform = [0.0, 0.2] }}
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("pbt-data") / "d")


def write_config(tmp_path, data, run):
    cfg = tmp_path / f"{run}.toml"
    cfg.write_text(PBT_TOML.format(run=tmp_path / run, data=data))
    return cfg


@pytest.mark.parametrize("ranks,overrides", [(4, ["--tune.pbt.population=4"]),
                                             (4, ["--tune.pbt.population=2", "--parallel.tp=2"])],
                         ids=["4x1rank", "2x2rank-tp2"])
def test_exploit_copies_weights_and_optimizer_state_bit_for_bit(tmp_path, data, ranks, overrides):
    out = tmp_path / "probe.json"
    r = mpirun(ranks, [ROOT / "tests/mpi/scripts/pbt_exploit_probe.py",
                       write_config(tmp_path, data, "probe"), out, *overrides], timeout=240,
               env={"HPCTRAIN_THREADS": "1"})  # 4 ranks on 2 cores
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(out.read_text())
    k = ranks // int(overrides[0].split("=")[1])
    n = got["params"] + got["optim_tensors"]
    assert got["params"] >= 10 and got["optim_tensors"] == 3 * got["params"]  # exp_avg, _sq, step
    # before: member 0 matches itself; the others share only the step counters (3 steps each)
    assert got["before"][:k] == [[n, n]] * k
    assert all(equal == got["params"] for equal, _ in got["before"][k:]), got["before"]
    assert got["after"] == [[n, n]] * ranks  # every tensor of every rank, bit for bit
    assert len(set(got["losses"])) == 1, got["losses"]  # the next step is the same step


def start(cfg, *overrides, faults=None):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1",
               HPCTRAIN_THREADS="1", **(faults or {}))
    return subprocess.Popen([mpiexec_path(), "-n", "2", sys.executable, "-m", "hpctrain", "tune", "pbt",
                             str(cfg), *overrides], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=240):
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out


def train_steps(run_dir, member):
    path = run_dir / f"member_{member}" / "metrics.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in recs if "loss" in r]


def test_resumed_population_writes_the_same_lineage(tmp_path, data):
    rc, out = finish(start(write_config(tmp_path, data, "whole")))
    assert rc == 0, out
    whole = (tmp_path / "whole" / "lineage.jsonl").read_text()
    records = [json.loads(line) for line in whole.splitlines()]
    assert [r["step"] for r in records if r["event"] == "round"] == [4, 8, 12, 16, 20]
    exploits = [r for r in records if r["event"] == "exploit"]
    assert len(exploits) == 5 and all(r["loss"] >= r["donor_loss"] for r in exploits)
    for r in exploits:
        assert 1e-5 <= r["new"]["train.lr"] <= 1e-2 and 0.0 <= r["new"]["train.weight_decay"] <= 0.2

    # stopped by the test knob at step 10, then run again
    rc, out = finish(start(write_config(tmp_path, data, "knob"), "--train.stop_at_step=10"))
    assert rc == 0, out
    assert (tmp_path / "knob" / "member_1" / "checkpoints" / "step_00000010" / "COMMIT.json").is_file()
    rc, out = finish(start(write_config(tmp_path, data, "knob")))
    assert rc == 0 and "resumed from" in out, out
    assert (tmp_path / "knob" / "lineage.jsonl").read_text() == whole

    # preempted by USR1 mid-run (mpiexec passes it on to every rank): exit 75, then run again
    proc = start(write_config(tmp_path, data, "usr1"), faults=step_faults.env(step_sleep_s=0.25))
    deadline = time.monotonic() + 120
    while len(train_steps(tmp_path / "usr1", 0)) < 6 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    rc, out = finish(proc)
    assert rc == 75, out
    stopped = [len(train_steps(tmp_path / "usr1", m)) for m in (0, 1)]
    assert stopped[0] == stopped[1] and 6 <= stopped[0] < STEPS, (stopped, out)
    rc, out = finish(start(write_config(tmp_path, data, "usr1")))
    assert rc == 0, out
    assert (tmp_path / "usr1" / "lineage.jsonl").read_text() == whole
    assert train_steps(tmp_path / "usr1", 1) == list(range(1, STEPS + 1))


def test_a_hung_member_rank_ends_the_population_naming_it(tmp_path, data):
    """Member 1's only rank is SIGSTOPped mid-run: member 0 waits for it in the stop vote or the
    round's allgather over COMM_WORLD, which only the heartbeat sees; the job ends within its bound
    with one line naming rank 1 and its host (#30: it hung for good)."""
    from tests.processes import rank_pid

    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1",
               HPCTRAIN_THREADS="1", **step_faults.env(step_sleep_s=0.25))
    proc = subprocess.Popen([mpiexec_path(), "-n", "2", sys.executable, "-m", "hpctrain", "tune", "pbt",
                             str(write_config(tmp_path, data, "hang")),
                             "--dist.heartbeat_timeout_s=5"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(train_steps(tmp_path / "hang", 1)) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        os.kill(rank_pid(proc.pid, 1), signal.SIGSTOP)
        t_fault = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t_fault
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started, stopped rank too
            proc.wait()
    errors = [line for line in out.splitlines() if "error:" in line]
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert 4 < elapsed < 5 + 3 * 0.5 + 3 + 5, elapsed  # timeout + 3 intervals + grace + slack
    assert len(errors) == 1 and f"rank 1 on {socket.gethostname()} lost: no heartbeat" in errors[0], \
        out[-3000:]
    # the survivor's forensics go to the population's run dir, and doctor names the lost rank
    rec = json.loads((tmp_path / "hang" / "forensics" / "rank_0.json").read_text())
    assert (rec["kind"], rec["rank"], rec["world"], rec["lost"]) == ("verdict", 0, 2, 1), rec
    assert not (tmp_path / "hang" / "forensics" / "rank_1.json").exists()
    r = subprocess.run([sys.executable, "-m", "hpctrain", "doctor", str(tmp_path / "hang")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and "rank 1: no forensics file (rank 1 named lost" in r.stdout, \
        r.stdout + r.stderr


def test_locks_taken_over_from_a_killed_population_are_one_line(tmp_path, data):
    """Both members' run dirs hold the run lock of a process that is gone (a population killed):
    the relaunch takes both over and says so in ONE line naming each member's run dir and the pid
    it took over from (#47: one line per member, i.e. per rank at members of 1 rank)."""
    cfg = write_config(tmp_path, data, "killed")
    gone = {}
    for member in (0, 1):
        pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                 capture_output=True, text=True).stdout)
        run = tmp_path / "killed" / f"member_{member}"
        run.mkdir(parents=True)
        (run / ".hpctrain.lock").write_text(json.dumps(
            {"host": socket.gethostname(), "pid": pid, "job": None, "restart": "0", "started": 1.0}))
        gone[run] = pid
    rc, out = finish(start(cfg, "--train.stop_at_step=4"))
    assert rc == 0, out
    lines = [line for line in out.splitlines() if "took over the lock" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: "), out
    for run, pid in gone.items():
        assert f"run dir {run}: took over the lock of pid {pid} on {socket.gethostname()}" in lines[0]
        assert f"process {pid} on {socket.gethostname()} has exited" in lines[0]
