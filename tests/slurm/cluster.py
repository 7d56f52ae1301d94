"""A real single-node Slurm cluster on localhost, for tests (and for trying the sbatch templates).

Owns: installing the Debian packages when they are missing (apt-get, needs root), writing a
slurm.conf into a private directory, starting slurmctld + slurmd on free ports, waiting for the node to
be idle, and stopping exactly the daemons it started (by pid). It must never touch daemons, jobs or
config files it did not create (no pkill, no /etc/slurm).

    python tests/slurm/cluster.py start [--prefix DIR]   # prints: export SLURM_CONF=DIR/etc/slurm.conf
    python tests/slurm/cluster.py stop  [--prefix DIR]

Knowledge this encodes (Slurm 22.05.8 on Debian 12, no systemd, no cgroups):
- auth/none + cred/none: no munged needed.
- proctrack/pgid + task/none: no cgroups; pgid kills the job's whole process group at its end.
- slurmd runs in the foreground under `tini -s` (a child subreaper): the sandbox's PID 1 reaps orphans
  only every few seconds, and srun leaves an orphaned helper that would hold every job ~3 s longer.
- AuthInfo=cred_expire=10: a requeued job may start again after ~15 s instead of ~160 s.
- FirstJobId differs per start: MPICH under `srun --mpi=pmi2` names its shared memory after
  `jobid.stepid`; a segment left by a killed step would break a new job with the same id.
- CPUs may exceed the real cores (SlurmdParameters=config_overrides), so 2-task jobs and 2-point
  arrays fit on a 2-core machine.
- Job history: jobcomp/filetxt (log/jobcomp.txt), read by `sacct -c` / `sacct --completion`
  (plain `sacct` says accounting is disabled: accounting_storage/filetxt is gone from 22.05).
- MpiDefault=none; jobs choose `srun --mpi=pmi2` (MPICH) or `--mpi=pmix` (Open MPI, needs libpmix-dev
  installed before slurmd starts, which we do).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "tini", "libpmix2", "libpmix-dev")
NODE = "localhost"


class ClusterUnavailable(RuntimeError):
    """This machine cannot run a local Slurm cluster (no root, no apt, no packages)."""


def _missing_packages() -> list[str]:
    missing = []
    for p in PACKAGES:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True,
                           timeout=30)
        if "install ok installed" not in r.stdout:
            missing.append(p)
    return missing


def install_packages() -> None:
    """apt-get install the Slurm packages if any is missing; ClusterUnavailable if we cannot."""
    if shutil.which("dpkg-query") is None:
        raise ClusterUnavailable("not a Debian/Ubuntu machine (no dpkg-query): cannot install Slurm")
    missing = _missing_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"Slurm packages missing ({' '.join(missing)}) and not root to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for attempt in range(10):  # another apt may hold the lists lock
        r = subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True, timeout=600, env=env)
        if r.returncode == 0:
            break
        time.sleep(10)
    else:
        raise ClusterUnavailable(f"apt-get update failed: {r.stderr.strip()[-300:]}")
    r = subprocess.run(["apt-get", "install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=600",
                        "--no-install-recommends", *missing], capture_output=True, text=True,
                       timeout=1200, env=env)
    if r.returncode != 0:
        raise ClusterUnavailable(f"apt-get install {' '.join(missing)} failed: {r.stderr.strip()[-300:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int, comm: str) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return name == comm and stat.rsplit(")", 1)[1].split()[0] != "Z"


class LocalSlurm:
    """One cluster in `prefix`: `start()`, `env` (for subprocesses), `stop()`."""

    def __init__(self, prefix: str | os.PathLike, cpus: int = 4):
        self.prefix = Path(prefix).resolve()
        self.cpus = cpus
        self.conf = self.prefix / "etc" / "slurm.conf"
        self._slurmd: subprocess.Popen | None = None

    @property
    def env(self) -> dict:
        return {"SLURM_CONF": str(self.conf)}

    def _pid(self, name: str) -> int | None:
        try:
            return int((self.prefix / "run" / f"{name}.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def _write_conf(self) -> None:
        p = self.prefix
        for d in ("etc", "state/ctld", "state/d", "log", "run"):
            (p / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._conf_text())

    def _ctld_host(self) -> str:
        return "localhost"

    def _node_lines(self, mem_mib: int) -> str:
        return (f"NodeName={NODE} NodeHostname=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} "
                f"RealMemory={mem_mib} State=UNKNOWN\n")

    def _conf_text(self, per_node: str = "", extra: str = "") -> str:
        """slurm.conf; `per_node` = "-%n" gives every slurmd its own pid/log/spool (several nodes)."""
        p = self.prefix
        first_job_id = 1000 + int(time.time() * 10) % 60_000_000
        mem_kib = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal"))
        return f"""\
ClusterName=hpctrain-test
SlurmctldHost={self._ctld_host()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={p}/state/ctld
SlurmdSpoolDir={p}/state/d{per_node}
SlurmctldPidFile={p}/run/slurmctld.pid
SlurmdPidFile={p}/run/slurmd{per_node}.pid
SlurmctldLogFile={p}/log/slurmctld.log
SlurmdLogFile={p}/log/slurmd{per_node}.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# job history for `sacct --completion` (-c): Debian's 22.05 has no file-based accounting_storage
# plugin (only slurmdbd, which needs a MySQL server); jobcomp/filetxt needs nothing
JobCompType=jobcomp/filetxt
JobCompLoc={p}/log/jobcomp.txt
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
InactiveLimit=0
MinJobAge=600
# job ids unique across sessions: MPICH names its shared memory after `jobid.stepid` under
# srun/PMI2, and a segment left by a killed step must not meet a new job with the same id
FirstJobId={first_job_id}
KillWait=5
OverTimeLimit=0
{extra}{self._node_lines(int(mem_kib / 1024 * 0.9))}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def run(self, *args, timeout=30, check=False) -> subprocess.CompletedProcess:
        r = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, **self.env))
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, args))} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def start(self, timeout: float = 60.0) -> "LocalSlurm":
        install_packages()
        self._write_conf()
        # slurmctld daemonizes itself; -c: start with a clean job state
        subprocess.run(["slurmctld", "-f", str(self.conf), "-c"], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=60, check=True)
        self._slurmd = subprocess.Popen(
            ["tini", "-s", "--", "slurmd", "-D", "-f", str(self.conf), "-N", NODE],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        (self.prefix / "run" / "tini.pid").write_text(str(self._slurmd.pid))
        deadline = time.monotonic() + timeout
        state = "?"
        while time.monotonic() < deadline:
            r = self.run("sinfo", "-h", "-n", NODE, "-o", "%T")
            state = r.stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return self
            if state.startswith(("down", "drain", "fail")):
                self.run("scontrol", "update", f"NodeName={NODE}", "State=RESUME")
            time.sleep(0.3)
        log = (self.prefix / "log" / "slurmctld.log")
        tail = log.read_text()[-1500:] if log.exists() else ""
        self.stop()
        raise RuntimeError(f"local Slurm node did not become idle (state {state!r}); slurmctld.log:\n{tail}")

    def _cancel_jobs(self, rounds: int) -> int | None:
        """scancel everything and wait (rounds x 0.2 s) for an empty queue; slurmctld's pid."""
        ctld = self._pid("slurmctld")
        if ctld and _alive(ctld, "slurmctld"):
            self.run("scancel", "--partition=debug")
            for _ in range(rounds):
                if not self.run("squeue", "-h").stdout.strip():
                    break
                time.sleep(0.2)
        return ctld

    def stop(self) -> None:
        """Cancel our jobs, then stop slurmd and slurmctld (only the pids we started)."""
        ctld = self._cancel_jobs(rounds=100)
        for name, pid in (("slurmd", self._pid("slurmd")), ("tini", self._pid("tini")),
                          ("slurmctld", ctld)):
            if pid and _alive(pid, name):
                os.kill(pid, signal.SIGTERM)
                for _ in range(150):
                    if not _alive(pid, name):
                        break
                    time.sleep(0.1)
                else:
                    os.kill(pid, signal.SIGKILL)
        if self._slurmd is not None:
            try:
                self._slurmd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._slurmd.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="a local Slurm cluster (needs root): one node on localhost, "
                                "or --nodes N virtual nodes (network namespaces, see vcluster.py)")
    p.add_argument("action", choices=["start", "stop"])
    p.add_argument("--prefix", default="/tmp/hpctrain-slurm", help="state, logs and conf go here")
    p.add_argument("--cpus", type=int, default=None, help="CPUs per node (default 4, virtual: 2)")
    p.add_argument("--nodes", type=int, default=0, help="virtual nodes (1-9); 0 = one node on localhost")
    p.add_argument("--ubuntu-hosts", action=argparse.BooleanOptionalAction, default=True,
                   help="virtual nodes: own host name resolves to 127.0.1.1, as Debian/Ubuntu write it")
    a = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.slurm.vcluster import VirtualCluster

    virtual = a.nodes > 0 or (Path(a.prefix) / "run" / "vcluster.json").exists()
    if virtual:
        c = VirtualCluster(a.prefix, max(a.nodes, 1), a.cpus or 2, debian_hosts=a.ubuntu_hosts)
    else:
        c = LocalSlurm(a.prefix, a.cpus or 4)
    if a.action == "start":
        c.start()
        print(f"export SLURM_CONF={c.conf}")
        if virtual:
            print(f"# nodes {' '.join(f'{n}={c.address(n)}' for n in c.nodes)}; node-local scratch "
                  f"{c.local} (SLURM_TMPDIR in jobs); stop: python {__file__} stop --prefix {a.prefix}")
    else:
        c.stop()
        if virtual and c.leftovers():
            print(f"left behind: {', '.join(c.leftovers())}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
