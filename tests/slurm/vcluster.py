"""A virtual multi-node Slurm cluster on one machine: N nodes, each a Linux network + UTS + mount
namespace with its own hostname, address, node-local scratch disk, /dev/shm and `slurmd -N nodeK`.

    python tests/slurm/cluster.py start --nodes 3 --prefix DIR   # prints the export lines
    python tests/slurm/cluster.py stop --prefix DIR

How it is built (needs root and `ip`):
- a bridge `hpct<tag>` on a private /24 that no interface of this machine uses; the host end holds
  .1 and runs slurmctld (so sbatch/squeue work from the host as from a login node);
- node K: network namespace `hpctrain-<tag>-nodeK` joined to the bridge by a veth pair (inside it is
  `eth0`, address .(10+K)); inside it `unshare --uts --mount` sets the hostname `nodeK`, bind-mounts
  the node's own hosts file over /etc/hosts, its own folder DIR/nodes/nodeK/local over DIR/local
  (the same path on every node, different contents: the node-local scratch disk), a tmpfs over
  /dev/shm, and execs `tini -s -- slurmd -D -N nodeK`. Those mounts live and die with the node's
  mount namespace; the rest of the file system (checkout, venv, data, /tmp) is shared: it plays
  the parallel file system.
- hosts files: every node name resolves on every node; a node's OWN name resolves to 127.0.1.1 as
  Debian/Ubuntu installers write it (`debian_hosts=True`, the default), which is what breaks naive
  rendezvous code on real clusters.
- TaskProlog gives every job step SLURM_TMPDIR=TMPDIR=DIR/local/job<id> on its node; the Epilog
  removes it at the job's end. `scratch_kib={K: n}` makes node K's scratch a tmpfs of n KiB (a full
  disk).
- `stop()` cancels the jobs, kills every process inside the nodes' network namespaces (they are
  ours by construction), stops slurmctld by pid, deletes the namespaces and the bridge, and
  `leftovers()` lists anything that survived. The state needed for that is in DIR/run/vcluster.json,
  written before anything is created, so `stop` also cleans a half-started cluster.
- `sites=[["node1","node2"],["node3","node4"]], link_rate="50mbit"`: two sites, each its own bridge,
  joined by a veth pair shaped with tc's token bucket on both ends (tests/slurm/sites.py);
  `start()` measures the rate a TCP transfer gets across the link and inside a site
  (`link_rates`: cross_site_bits, intra_site_bits).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.slurm import sites as two_sites
from tests.slurm.cluster import ClusterUnavailable, LocalSlurm, _alive, install_packages

NODE_IP_BASE = 10


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *map(str, args)], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(map(str, args))}: {r.stderr.strip()}")
    return r


def _used_subnets() -> set[str]:
    out = _ip("-4", "-o", "addr", "show", check=False).stdout
    return {".".join(tok.split("/")[0].split(".")[:3]) for tok in out.split() if tok.count(".") == 3}


def _ns_inode(ns: str) -> int | None:
    try:
        return os.stat(f"/var/run/netns/{ns}").st_ino
    except OSError:
        return None


def pids_in_netns(ns: str) -> list[int]:
    """Processes whose network namespace is `ns` (by namespace inode)."""
    ino = _ns_inode(ns)
    if ino is None:
        return []
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}/ns/net").st_ino == ino:
                    pids.append(int(d))
            except OSError:
                pass
    return pids


class VirtualCluster(LocalSlurm):
    """`start()`, `env`, `nodes`, `address(node)`, `run_on(node, ...)`, `kill_node`, `stop()`."""

    def __init__(self, prefix, n_nodes: int = 3, cpus: int = 2, debian_hosts: bool = True,
                 scratch_kib: dict[int, int] | None = None, sites: list[list[str]] | None = None,
                 link_rate: str = "50mbit"):
        super().__init__(prefix, cpus)
        if not 1 <= n_nodes <= 9:
            raise ValueError(f"--nodes {n_nodes}: 1 to 9 nodes")
        self.n_nodes, self.debian_hosts = n_nodes, debian_hosts
        self.scratch_kib = dict(scratch_kib or {})
        self.tag = hashlib.sha256(str(self.prefix).encode()).hexdigest()[:4]
        self.bridge = f"hpct{self.tag}"
        self.nodes = [f"node{k}" for k in range(1, n_nodes + 1)]
        self.local = self.prefix / "local"
        self.state_file = self.prefix / "run" / "vcluster.json"
        self.subnet = ""
        self.sites, self.link_rate, self.link_rates = sites, link_rate, {}
        if sites:
            self.site_of = two_sites.check_sites(sites, self.nodes)
            two_sites.rate_bits(link_rate)

    # -- naming ------------------------------------------------------------------------------------
    def netns(self, node: str) -> str:
        return f"hpctrain-{self.tag}-{node}"

    def address(self, node: str) -> str:
        return f"{self.subnet}.{NODE_IP_BASE + self.nodes.index(node) + 1}"

    def _ctld_host(self) -> str:
        return f"localhost({self.subnet}.1)"

    def _node_lines(self, mem_mib: int) -> str:
        mem = min(mem_mib // self.n_nodes, 8192)
        return "".join(f"NodeName={n} NodeHostname={n} NodeAddr={self.address(n)} CPUs={self.cpus} "
                       f"RealMemory={mem} TmpDisk=1024 State=UNKNOWN\n" for n in self.nodes)

    # -- files ---------------------------------------------------------------------------------------
    def _hosts_file(self, node: str) -> str:
        lines = ["127.0.0.1 localhost", f"{self.subnet}.1 slurmctld-host"]
        for n in self.nodes:
            if n == node and self.debian_hosts:
                lines.append(f"127.0.1.1 {n}")
            else:
                lines.append(f"{self.address(n)} {n}")
        return "\n".join(lines) + "\n"

    def _write_scripts(self) -> str:
        etc = self.prefix / "etc"
        prolog, epilog = etc / "task_prolog.sh", etc / "epilog.sh"
        prolog.write_text(f"#!/bin/sh\nd={self.local}/job$SLURM_JOB_ID\nmkdir -p \"$d\"\n"
                          "echo \"export SLURM_TMPDIR=$d\"\necho \"export TMPDIR=$d\"\n")
        epilog.write_text(f"#!/bin/sh\nrm -rf {self.local}/job$SLURM_JOB_ID\nexit 0\n")
        for f in (prolog, epilog):
            f.chmod(0o755)
        # SlurmdTimeout: a crashed node is DOWN after ~10 s instead of 300 s
        return f"TaskProlog={prolog}\nEpilog={epilog}\nSlurmdTimeout=10\n"

    def _save_state(self, **extra) -> None:
        state = {"tag": self.tag, "bridge": self.bridge, "subnet": self.subnet,
                 "nodes": self.nodes, "namespaces": [self.netns(n) for n in self.nodes],
                 "sites": self.sites, "link_rate": self.link_rate, **extra}
        self.state_file.write_text(json.dumps(state))

    def _load_state(self) -> dict:
        try:
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        self.subnet, self.nodes, self.bridge = state["subnet"], state["nodes"], state["bridge"]
        self.sites, self.link_rates = state.get("sites"), state.get("link_rates", {})
        return state

    # -- start ---------------------------------------------------------------------------------------
    def _pick_subnet(self) -> str:
        used = _used_subnets()
        for third in range(int(self.tag, 16) % 200 + 20, 256):
            cand = f"10.213.{third}"
            if cand not in used:
                return cand
        raise ClusterUnavailable("no free 10.213.x.0/24 subnet for the virtual cluster")

    def _network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        bridges = {n: self.bridge for n in self.nodes}
        if self.sites:
            two_sites.build_link(_ip, self.bridge, self.link_rate)
            by_site = two_sites.site_bridges(self.bridge)
            bridges = {n: by_site[self.site_of[n]] for n in self.nodes}
        for k, node in enumerate(self.nodes, 1):
            ns, host_end = self.netns(node), f"{self.bridge}n{k}"
            _ip("netns", "add", ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", f"{self.bridge}p{k}")
            _ip("link", "set", f"{self.bridge}p{k}", "netns", ns)
            _ip("-n", ns, "link", "set", f"{self.bridge}p{k}", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", host_end, "master", bridges[node])
            _ip("link", "set", host_end, "up")

    def _boot_node(self, k: int, node: str) -> None:
        home = self.prefix / "nodes" / node
        (home / "local").mkdir(parents=True, exist_ok=True)
        (home / "hosts").write_text(self._hosts_file(node))
        scratch = (f"mount -t tmpfs -o size={self.scratch_kib[k]}k tmpfs {self.local}"
                   if k in self.scratch_kib else f"mount --bind {home / 'local'} {self.local}")
        script = (f"set -e; hostname {node}; {scratch}; mount --bind {home / 'hosts'} /etc/hosts; "
                  f"mount -t tmpfs -o size=2g tmpfs /dev/shm; "
                  f"exec tini -s -- slurmd -D -f {self.conf} -N {node}")
        log = open(self.prefix / "log" / f"boot-{node}.log", "w")
        # nsenter, not `ip netns exec`: that one remounts /sys, hiding the cgroup mounts slurmd reads
        subprocess.Popen(["nsenter", f"--net=/var/run/netns/{self.netns(node)}", "unshare", "--uts", "--mount",
                          "--propagation", "private", "--", "sh", "-c", script],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()

    def start(self, timeout: float = 60.0) -> "VirtualCluster":
        if os.geteuid() != 0:
            raise ClusterUnavailable("the virtual cluster needs root (network namespaces)")
        if subprocess.run(["which", "ip", "unshare"], capture_output=True).returncode != 0:
            raise ClusterUnavailable("the virtual cluster needs `ip` (iproute2) and `unshare`")
        install_packages()
        for d in ("etc", "state/ctld", "log", "run", "local"):
            (self.prefix / d).mkdir(parents=True, exist_ok=True)
        self.subnet = self._pick_subnet()
        self._save_state()
        try:
            self._network()
        except RuntimeError as e:
            self.stop()
            raise ClusterUnavailable(f"cannot build the virtual network: {e}") from e
        if self.sites:
            try:
                self.link_rates = two_sites.measure_link(self, self.sites)
            except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as e:
                self.stop()
                raise RuntimeError(f"two sites: the rate probe failed: {e}") from e
            self._save_state(link_rates=self.link_rates)
        self.conf.write_text(self._conf_text(per_node="-%n", extra=self._write_scripts()))
        subprocess.run(["slurmctld", "-f", str(self.conf), "-c"], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=60, check=True)
        for k, node in enumerate(self.nodes, 1):
            self._boot_node(k, node)
        try:
            self.wait_idle(self.nodes, timeout)
        except RuntimeError:
            self.stop()
            raise
        return self

    def wait_idle(self, nodes, timeout: float = 60.0) -> None:
        deadline, states = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            if all(states.get(n) in ("idle", "mixed", "allocated") for n in nodes):
                return
            for n, st in states.items():
                if n in nodes and st.startswith(("down", "drain", "fail")):
                    self.run("scontrol", "update", f"NodeName={n}", "State=RESUME")
            time.sleep(0.3)
        logs = " | ".join(p.read_text()[-300:] for p in (self.prefix / "log").glob("boot-*.log"))
        raise RuntimeError(f"virtual nodes not idle after {timeout}s: {states}; boot logs: {logs}")

    # -- faults --------------------------------------------------------------------------------------
    def kill_node(self, node: str) -> list[int]:
        """Power loss: SIGKILL every process on the node (slurmd, slurmstepd, the ranks)."""
        return self.signal_node(node, signal.SIGKILL)

    def signal_node(self, node: str, sig: int) -> list[int]:
        """`sig` to every process on the node (SIGSTOP: a hung kernel, nothing on it runs; SIGCONT
        wakes it)."""
        pids = pids_in_netns(self.netns(node))
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def boot_node(self, node: str) -> None:
        """Bring a killed node back (its network namespace survived the kill)."""
        k = self.nodes.index(node) + 1
        self._boot_node(k, node)
        self.wait_idle([node])

    # -- stop ----------------------------------------------------------------------------------------
    def stop(self) -> None:
        state = self._load_state()
        if not state:
            return
        ctld = self._cancel_jobs(rounds=25)
        for ns in state["namespaces"]:
            self._kill_all_in(ns)
        if ctld and _alive(ctld, "slurmctld"):
            os.kill(ctld, signal.SIGTERM)
            for _ in range(100):
                if not _alive(ctld, "slurmctld"):
                    break
                time.sleep(0.1)
            else:
                os.kill(ctld, signal.SIGKILL)
        for k in range(1, len(state["namespaces"]) + 1):
            _ip("link", "del", f"{self.bridge}n{k}", check=False)  # and its peer in the namespace
        for ns in state["namespaces"]:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        if state.get("sites"):
            _ip("link", "del", f"{self.bridge}x1", check=False)  # and x2
            _ip("link", "del", two_sites.site_bridges(self.bridge)[2], check=False)
        for _ in range(50):  # the kernel removes links asynchronously
            if not self.leftovers():
                break
            time.sleep(0.1)

    @staticmethod
    def _kill_all_in(ns: str) -> None:
        for sig, rounds in ((signal.SIGTERM, 20), (signal.SIGKILL, 50)):
            pids = pids_in_netns(ns)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            for _ in range(rounds):
                if not pids_in_netns(ns):
                    return
                time.sleep(0.1)

    def leftovers(self) -> list[str]:
        """What of this cluster still exists: namespaces, links, processes (empty after stop)."""
        state = self._load_state() or {"namespaces": [], "bridge": self.bridge}
        left = [f"netns {ns}" for ns in state["namespaces"] if _ns_inode(ns) is not None]
        links = _ip("-o", "link", "show", check=False).stdout
        left += [f"link {tok.rstrip(':').split('@')[0]}" for tok in links.split()
                 if tok.startswith(state["bridge"])]
        ctld = self._pid("slurmctld")
        if ctld and _alive(ctld, "slurmctld"):
            left.append(f"slurmctld pid {ctld}")
        return left
