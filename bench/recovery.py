"""Effective training time under node losses, on the virtual Slurm cluster (issue #35).

Run (root, Debian; tests/slurm/vcluster.py builds the cluster):
    .venv/bin/python bench/recovery.py                          # 20 min, a node lost every 4 min
    .venv/bin/python bench/recovery.py --minutes 6 --kill-every 2 --modes before after

One virtual cluster of `--nodes` + one node per loss; per configuration (mode) one job of
slurm/train.sbatch (--launcher: the wheel's mpiexec by default, which relaunches inside the allocation
since fcb5108; srun: under srun --mpi=pmi2 the wheel's launches hit the cut PMI line in most tries
here, docs/multinode.md Known; under mpiexec Hydra ends the step ~1 s after a node's SIGKILL and
train.sbatch's probe names the node, so the heartbeat bound matters for srun only) trains the tiny GPT
of tests/slurm (global batch 12, `--nodes` x 1 rank) for `--minutes` from its first trained step;
every `--kill-every` minutes every process of one training node (never node1: it runs the batch
script) is SIGKILLed, as a power loss would. Modes:
  before  today's defaults minus #35's detection and snapshots: no peer snapshots
          (checkpoint.snapshot_interval=0), the old 60 s heartbeat (dist.heartbeat_timeout_s=60):
          a loss is named after 60 s, the relaunch resumes from the PFS checkpoint.
  after   the defaults (8 s beacon heartbeat, peer snapshots every 50 steps).
Both modes get one hot spare per loss (HPCTRAIN_SPARE_NODES), so the layout (dp = --nodes) and the
step time stay the same through the run and 4 losses fit 3 nodes (the global batch of 12 splits over
1, 2, 3 or 6 ranks only); without them 'before' could lose at most --nodes - 1. (Before #35 a lost
node under srun ended the job: no relaunch at all; 'before' is the kinder baseline.)
Every 120 s the bench prints the machine's load (/proc/loadavg): the ceiling depends on it.
The spare pool is not refilled: Slurm takes a failed node out of a --no-kill job's allocation, so a
killed node that boots again cannot rejoin the job; one spare per loss is allocated up front instead.

Measured per loss: kill -> the relaunch's first trained step (its metrics.jsonl record), steps
recomputed (last step at the kill - the step resumed from). Effective training time = the sum of the
step_time_s (+ the --step-sleep that stands in for compute) of the steps the run kept (metrics.jsonl
at the end: recomputed steps are dropped from it on resume) / the wall time from the first trained
step to the end; the same ratio up to the first loss is printed as this machine's ceiling (step-loop
overhead, checkpoints, snapshots, load). Each mode ends with the line
    effective training time: NN.N% (N losses, mean recovery X s, steps recomputed R)
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpctrain import step_faults  # noqa: E402
from tests.conftest import run_cmd  # noqa: E402
from tests.slurm.cluster import ClusterUnavailable  # noqa: E402
from tests.slurm.conftest import TINY, TERMINAL, Jobs, metrics  # noqa: E402
from tests.slurm.test_multinode import PMI2_FLAKE, TRAIN, _merge, shard_args  # noqa: E402
from tests.slurm.vcluster import VirtualCluster  # noqa: E402

BENCH = """
[train]
steps = 1000000
global_batch = 12
micro_batch_size = 2
eval_interval = 0
log_interval = 50
[checkpoint]
interval = 100
"""
MODES = {  # overrides, one spare per loss, heartbeat timeout (s)
    "before": (["--checkpoint.snapshot_interval=0", "--dist.heartbeat_timeout_s=60"], True, 60),
    "after": ([], True, 8),  # the defaults
}
HUNG_S = 60  # a launch with a cut PMI line and no step this long after it could have come: hung
TRIES = 3


class PmiFlake(Exception):
    """A launch hung in MPI_Init on a cut PMI line (docs/multinode.md, Known): the environment's
    fault, not the recovery's; the mode is run again (at most TRIES times), and the report says so."""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="wall time per mode, from the first step")
    ap.add_argument("--kill-every", type=float, default=4.0, help="minutes between node losses")
    ap.add_argument("--nodes", type=int, default=3, help="training nodes (1 rank each)")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--step-sleep", type=float, default=0.25,
                    help="seconds every step sleeps (tests/slurm's SLOW): the tiny model's ~0.06 s steps "
                         "would put a PFS checkpoint (every 100 steps) only ~6 s apart")
    ap.add_argument("--launcher", choices=("mpiexec", "srun"), default="mpiexec",
                    help="train.sbatch's HPCTRAIN_LAUNCHER: the wheel's mpiexec (default: under srun "
                         "--mpi=pmi2 the wheel's launches hit the cut PMI line in most tries here) or srun")
    ap.add_argument("--prefix", help="work folder (default: a new temporary one)")
    a = ap.parse_args(argv)
    a.kills = int((a.minutes - 1e-9) // a.kill_every)
    if any(not MODES[m][1] for m in a.modes) and a.kills >= a.nodes:
        ap.error(f"--minutes {a.minutes} --kill-every {a.kill_every}: {a.kills} losses, but 'before' "
                 f"(no spares) can lose at most {a.nodes - 1} of --nodes {a.nodes}: raise --nodes")
    if a.nodes + a.kills > 9:
        ap.error(f"--nodes {a.nodes} + {a.kills} spares: the virtual cluster has at most 9 nodes")
    return a


def print_load_every(seconds: float) -> None:
    """A daemon thread printing the machine's load average (the other engineers' work shares it)."""
    def loop():
        while True:
            load = Path("/proc/loadavg").read_text().split()[:3]
            print(f"  [{time.strftime('%H:%M:%S', time.gmtime())} UTC] load {' '.join(load)}", flush=True)
            time.sleep(seconds)
    threading.Thread(target=loop, daemon=True).start()


def make_dataset(work: Path) -> Path:
    out = work / "data" / "tiny"
    if not (out / "manifest.json").exists():
        args = shard_args(out)
        run_cmd([sys.executable, "-m", "data_tools", "shard", "--input", *args[:4], "--output", *args[5:]],
                timeout=300, check=True)
    return out


def write_config(work: Path, data: Path, mode: str) -> tuple[Path, Path]:
    text = TINY.replace("micro_batch_size = 4\n", "").replace("interval = 1000\n", "")
    text = text.replace("steps = 40\n", "").replace("eval_interval = 10\n", "").replace("log_interval = 10\n", "")
    run, cfg = work / mode / "run", work / mode / "bench.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(_merge(text.format(run=run, data=data), BENCH))
    return cfg, run


class Watch:
    """The run's metrics.jsonl and the job's log, polled."""

    def __init__(self, jobs: Jobs, job_id: str, run: Path, log: Path):
        self.jobs, self.job_id, self.run, self.log = jobs, job_id, run, log

    def steps(self) -> list[dict]:
        return [r for r in metrics(self.run) if "loss" in r]

    def last_step(self) -> int:
        return max((r["step"] for r in self.steps()), default=0)

    def metrics_file_id(self) -> tuple[int, int] | None:
        """(device, inode) of metrics.jsonl (None: none yet): a resume that drops records replaces it."""
        try:
            st = (self.run / "metrics.jsonl").stat()
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def ended(self) -> bool:
        """An scontrol that fails (slow slurmctld at load 20+) says nothing: not an end (an empty
        answer once took a relaunch's first step for 'never' in the 20-minute run)."""
        recs = self.jobs.show(self.job_id)
        return bool(recs) and all(r.get("JobState") in TERMINAL for r in recs)

    def until(self, predicate, deadline: float) -> bool:
        """Poll until predicate() or the monotonic deadline or the job's end; whether it held."""
        while time.monotonic() < deadline:
            if predicate():
                return True
            if self.ended():
                return predicate()
            time.sleep(0.2)
        return False


class FirstStepAfter:
    """Predicate: the relaunch that resumed from `step` has trained a step (`at`: when first seen).

    The killed launch's records after `step` (steps it trained after the checkpoint or snapshot the
    relaunch resumes from) are still in metrics.jsonl until the relaunch's writer opens it and drops
    them (an atomic rewrite: a new inode). Until then a record past `step` is the killed launch's, not
    the relaunch's first step (the bench once counted them: kill -> resume line instead of -> first
    step, and 'never' when the rewrite landed between two reads)."""

    def __init__(self, watch: Watch, step: int, stale: tuple[int, int] | None):
        self.watch, self.step, self.at = watch, step, None
        self.stale = stale if watch.last_step() > step else None  # None: nothing to drop, appended to

    def __call__(self) -> bool:
        if self.at is None and self.watch.metrics_file_id() != self.stale and self.watch.last_step() > self.step:
            self.at = time.monotonic()
        return self.at is not None


RESUMED = re.compile(r"resumed from (?:the peer snapshot of step (\d+)|\S+ at step (\d+))")


def resumes(log: str) -> list[int]:
    return [int(a or b) for a, b in RESUMED.findall(log)]


def hung_in_init(watch: Watch, since: int, t_start: float, wait_s: float) -> bool:
    """The log past offset `since` has a cut PMI line and `wait_s` passed since `t_start`."""
    return time.monotonic() - t_start > wait_s and PMI2_FLAKE in watch.text()[since:]


def lose_a_node(cluster: VirtualCluster, watch: Watch, victim: str, end: float, heartbeat_s: float) -> dict:
    """SIGKILL every process on `victim`; wait for the relaunch's first trained step (or `end`)."""
    n_resumed, since = len(resumes(watch.text())), len(watch.text())
    killed_at = watch.last_step()
    stale = watch.metrics_file_id()  # the records the killed launch left are not the relaunch's steps
    cluster.kill_node(victim)
    t_kill = time.monotonic()
    print(f"  killed {victim} at step {killed_at}", flush=True)
    hung = lambda: hung_in_init(watch, since, t_kill, heartbeat_s + HUNG_S)  # noqa: E731
    resumed = watch.until(lambda: len(resumes(watch.text())) > n_resumed or hung(), end)
    if hung() and len(resumes(watch.text())) == n_resumed:
        raise PmiFlake(f"the relaunch after the loss of {victim}")
    if not resumed:
        return {"node": victim, "killed_at": killed_at, "recovery_s": None, "recomputed": 0}
    step = resumes(watch.text())[n_resumed]
    first = FirstStepAfter(watch, step, stale)
    recovered = first.at - t_kill if watch.until(first, end) else None
    print(f"  resumed at step {step}; first trained step {'%.1f s' % recovered if recovered else 'never'}"
          f" after the kill; {killed_at - step} step(s) recomputed", flush=True)
    return {"node": victim, "killed_at": killed_at, "recovery_s": recovered, "recomputed": killed_at - step}


def next_victim(active: list[str], loss: int) -> str:
    return active[1 + loss % (len(active) - 1)]


def after_loss(active: list[str], spares: list[str], lost: str) -> None:
    """train.sbatch's replace_lost_node: the next spare takes the lost node's place, else it goes."""
    i = active.index(lost)
    if spares:
        active[i] = spares.pop(0)
    else:
        del active[i]


def submit(jobs: Jobs, work: Path, mode: str, nodes: list[str], n_spares: int, a, cfg: Path) -> tuple[str, Path]:
    overrides = MODES[mode][0]
    env = {**step_faults.env(step_sleep_s=a.step_sleep), "HPCTRAIN_LAUNCHER": a.launcher,
           "HPCTRAIN_SPARE_NODES": str(n_spares), "HPCTRAIN_MAX_RELAUNCH": str(max(a.kills, 2))}
    limit = int(a.minutes + 15)
    job_id = jobs.sbatch(f"--output={work / mode}/train-%j.out", "--chdir", work / mode, "--no-requeue",
                         f"--nodes={len(nodes)}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
                         f"--time={limit}", TRAIN, cfg, *overrides, env=env)
    return job_id, work / mode / f"train-{job_id}.out"


def run_mode(cluster: VirtualCluster, jobs: Jobs, work: Path, data: Path, mode: str, a) -> dict:
    n_spares = a.kills if MODES[mode][1] else 0
    nodes = cluster.nodes[:a.nodes + n_spares]
    active, spares = nodes[:a.nodes], nodes[a.nodes:]
    cfg, run = write_config(work, data, mode)
    job_id, log = submit(jobs, work, mode, nodes, n_spares, a, cfg)
    watch = Watch(jobs, job_id, run, log)
    print(f"== {mode}: job {job_id} on {' '.join(active)}; spare(s): {' '.join(spares) or '-'}", flush=True)
    losses, killed, ceiling = [], [], float("nan")
    try:
        t_sub = time.monotonic()
        if not watch.until(lambda: watch.last_step() >= 1 or hung_in_init(watch, 0, t_sub, 2 * HUNG_S),
                           t_sub + 600):
            if PMI2_FLAKE in watch.text():  # the first launch ended on a cut PMI line
                raise PmiFlake("the first launch")
            raise SystemExit(f"error: {mode}: job {job_id} never trained a step; see {log}")
        if watch.last_step() < 1:
            raise PmiFlake("the first launch")
        t0 = time.monotonic()
        end = t0 + 60 * a.minutes
        for loss in range(a.kills):
            time.sleep(max(0.0, t0 + 60 * a.kill_every * (loss + 1) - time.monotonic()))
            if loss == 0:  # what this machine gives with no loss: the ceiling of the effective time
                ceiling = trained_s(watch.steps(), a.step_sleep) / (time.monotonic() - t0)
            victim = next_victim(active, loss)
            killed.append(victim)
            losses.append(lose_a_node(cluster, watch, victim, end, MODES[mode][2]))
            after_loss(active, spares, victim)
        watch.until(lambda: False, end)
        t_end, kept = time.monotonic(), watch.steps()
    finally:
        stop_job(jobs, job_id)
        for node in killed:
            cluster.boot_node(node)
    return summarize(mode, kept, t_end - t0, losses, watch.text(), a.step_sleep, ceiling)


def run_with_retries(cluster: VirtualCluster, jobs: Jobs, work: Path, data: Path, mode: str, a) -> dict:
    for attempt in range(1, TRIES + 1):
        try:
            return run_mode(cluster, jobs, work / f"try{attempt}", data, mode, a)
        except PmiFlake as e:
            print(f"  {mode} try {attempt}: {e} hung in MPI_Init on a cut PMI line ({PMI2_FLAKE!r}, "
                  f"docs/multinode.md, Known): the environment's flake; run again", flush=True)
    raise SystemExit(f"error: {mode}: every one of {TRIES} tries hit the PMI flake; logs under {work}")


def stop_job(jobs: Jobs, job_id: str) -> None:
    jobs.scancel(job_id)
    try:
        jobs.wait(job_id, timeout=120)
    except AssertionError:  # still ending after 2 min
        jobs.scancel("--signal=KILL", job_id)


def trained_s(steps: list[dict], sleep_s: float) -> float:
    """The steps' time after the first (the clock starts at its record). The step's sleep
    (--step-sleep) comes outside step_time_s and stands in for compute: counted."""
    return sum(r["step_time_s"] + sleep_s for r in steps if r["step"] >= 2)


def summarize(mode: str, kept: list[dict], wall_s: float, losses: list[dict], log: str, sleep_s: float,
              ceiling: float) -> dict:
    trained = trained_s(kept, sleep_s)
    times = [x["recovery_s"] for x in losses if x["recovery_s"] is not None]
    said = [float(s) for s in re.findall(r"recovery: ([\d.]+) s from the loss verdict", log)]
    out = {"mode": mode, "effective": trained / wall_s, "wall_s": wall_s, "trained_s": trained,
           "last_step": max((r["step"] for r in kept), default=0), "losses": len(losses),
           "recovered": len(times), "mean_recovery_s": sum(times) / len(times) if times else float("nan"),
           "recomputed": sum(x["recomputed"] for x in losses), "verdict_to_step_s": said}
    print(f"  {mode}: step {out['last_step']} after {wall_s:.0f} s; trained-step time {trained:.0f} s; "
          f"{len(times)}/{len(losses)} loss(es) recovered inside the run; train.sbatch's verdict -> "
          f"first step: {', '.join(f'{s:.1f} s' for s in said) or '-'}; effective time before the first "
          f"loss (this machine's ceiling): {100 * ceiling:.1f}%")
    print(f"effective training time: {100 * out['effective']:.1f}% ({len(losses)} losses, mean recovery "
          f"{out['mean_recovery_s']:.1f} s, steps recomputed {out['recomputed']})", flush=True)
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    work = Path(a.prefix or tempfile.mkdtemp(prefix="hpctrain-recovery-"))
    work.mkdir(parents=True, exist_ok=True)
    print_load_every(120)
    data = make_dataset(work)
    cluster = VirtualCluster(work / "vcluster", n_nodes=a.nodes + a.kills, cpus=2)
    try:
        cluster.start()
    except ClusterUnavailable as e:
        print(f"error: no virtual Slurm cluster on this machine ({e}): run as root on Debian/Ubuntu",
              file=sys.stderr)
        return 2
    try:
        jobs = Jobs(cluster)
        jobs.env.setdefault("UCX_TLS", "tcp,self,sm")  # as tests/slurm's vjobs: shorter PMI lines
        print(f"{a.minutes:g} min per mode, a node lost every {a.kill_every:g} min ({a.kills} losses), "
              f"{a.nodes} training nodes; work folder {work}", flush=True)
        for mode in a.modes:
            run_with_retries(cluster, jobs, work, data, mode, a)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
