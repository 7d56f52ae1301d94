"""Two sites joined by a slow link, for the virtual Slurm cluster (tests/slurm/vcluster.py).

Owns: the second site's bridge, the veth pair joining it to the first site's bridge, the token
bucket (`tc qdisc ... tbf`) on both ends of that pair, and measuring the rate a TCP transfer gets
across it and inside a site. vcluster.py puts each node's veth on its site's bridge.

    site 1: node1 node2 --- bridge hpct<tag>  (host .1, slurmctld)
                                 | hpct<tag>x1   tbf RATE (site 1 -> site 2)
                                 | hpct<tag>x2   tbf RATE (site 2 -> site 1)
    site 2: node3 node4 --- bridge hpct<tag>b2

Every link is named after the first bridge (`hpct<tag>...`), so the cluster's `stop()` removes
them and `leftovers()` lists any that survived. One /24 spans both sites (one L2 segment); Slurm's
traffic from site 2 to slurmctld crosses the shaped link.

Knowledge this encodes (kernel 6.x in the test VM): `tc` has tbf and htb but no netem (no delay
or loss emulation, only a rate). The veth ends carry TSO/GSO super-packets of up to 64 KiB; tbf
splits a GSO packet larger than its bucket, and the bucket (`burst`) must hold at least one
timer tick of traffic (rate / HZ) or the shaper falls short of its rate, so the burst is the
larger of 64 KiB and 10 ms of traffic. `latency` bounds the queue (packets beyond are dropped,
which is what TCP needs to find the rate).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}
MEASURE_BYTES = 4 << 20

# Receiver: accept one connection, read to EOF, print bytes and seconds from the first byte.
_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.monotonic(); n += len(b)
print(n, time.monotonic() - t0, flush=True)
"""
_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
c.sendall(b"x" * int(sys.argv[3])); c.close()
"""


def rate_bits(rate: str) -> float:
    """'50mbit' -> 5e7 (tc's bit-rate units: kbit, mbit, gbit)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"link_rate {rate!r}: write it as tc does, e.g. '50mbit'")
    return float(m.group(1)) * UNITS[m.group(2)]


def check_sites(sites, nodes) -> dict[str, int]:
    """node -> site index (1 or 2); every node in exactly one of two sites."""
    if len(sites) != 2:
        raise ValueError(f"sites: two lists of nodes, got {len(sites)}")
    site_of = {n: i for i, site in enumerate(sites, 1) for n in site}
    if sorted(site_of) != sorted(nodes) or sum(map(len, sites)) != len(nodes):
        raise ValueError(f"sites {sites}: each of {nodes} in exactly one site")
    return site_of


def site_bridges(bridge: str) -> dict[int, str]:
    return {1: bridge, 2: f"{bridge}b2"}


def build_link(ip, bridge: str, rate: str) -> None:
    """The second site's bridge and the shaped veth pair to the first one (`ip` raises on error)."""
    second, ends = site_bridges(bridge)[2], (f"{bridge}x1", f"{bridge}x2")
    ip("link", "add", second, "type", "bridge")
    ip("link", "set", second, "up")
    ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
    shape(bridge, rate)
    for end, br in zip(ends, (bridge, second)):
        ip("link", "set", end, "master", br)
        ip("link", "set", end, "up")


def shape(bridge: str, rate: str | None) -> None:
    """Shape both ends of the link to `rate` (tbf), or take the shaping off (None): a benchmark
    compares the same cluster with and without it."""
    for end in (f"{bridge}x1", f"{bridge}x2"):
        subprocess.run(["tc", "qdisc", "del", "dev", end, "root"], capture_output=True, timeout=30)
        if rate is not None:
            burst = max(64 << 10, int(rate_bits(rate) / 8 * 0.01))
            _tc("qdisc", "add", "dev", end, "root", "tbf", "rate", rate, "burst", str(burst),
                "latency", "50ms")


def _tc(*args) -> None:
    r = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {r.stderr.strip()}")


def _in_ns(ns: str, code: str, *args) -> list[str]:
    return ["nsenter", f"--net=/var/run/netns/{ns}", sys.executable, "-c", code, *map(str, args)]


def measure_rate(src_ns: str, dst_ns: str, dst_addr: str, n_bytes: int = MEASURE_BYTES) -> float:
    """Bits per second of one TCP transfer of n_bytes from namespace src_ns to dst_addr (in dst_ns),
    timed by the receiver from its first byte to EOF."""
    sink = subprocess.Popen(_in_ns(dst_ns, _SINK), stdout=subprocess.PIPE, text=True)
    try:
        port = sink.stdout.readline().strip()
        subprocess.run(_in_ns(src_ns, _SOURCE, dst_addr, port, n_bytes), check=True, timeout=120,
                       capture_output=True)
        got, seconds = sink.stdout.readline().split()
        sink.wait(timeout=30)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    if int(got) != n_bytes:
        raise RuntimeError(f"rate probe {src_ns} -> {dst_addr}: {got} of {n_bytes} bytes arrived")
    return int(got) * 8 / max(float(seconds), 1e-6)


def measure_link(cluster, sites) -> dict[str, float]:
    """The rate across the link (first node of site 1 -> first of site 2) and inside site 1."""
    a, b = sites[0][0], sites[1][0]
    inside = sites[0][1] if len(sites[0]) > 1 else None
    t0 = time.monotonic()
    rates = {"cross_site_bits": measure_rate(cluster.netns(a), cluster.netns(b), cluster.address(b))}
    if inside:
        rates["intra_site_bits"] = measure_rate(cluster.netns(a), cluster.netns(inside),
                                                cluster.address(inside))
    rates["probe_s"] = time.monotonic() - t0
    return rates


def link_bytes(bridge: str) -> dict[str, int]:
    """Bytes each end of the link has sent so far: {'x1': site 1 -> 2, 'x2': site 2 -> 1}."""
    return {end: int(open(f"/sys/class/net/{bridge}{end}/statistics/tx_bytes").read())
            for end in ("x1", "x2")}


def master_of(link: str) -> str:
    """The bridge a link is attached to ('' if none)."""
    try:
        return os.path.basename(os.readlink(f"/sys/class/net/{link}/master"))
    except OSError:
        return ""
