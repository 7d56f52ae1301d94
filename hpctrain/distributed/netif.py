"""Which address rank 0 advertises, and which interface Gloo/NCCL use, when a job spans nodes.

Owns: listing this host's IPv4 interfaces (name, address, prefix length; Linux ioctls), choosing
the rendezvous address from every node's interfaces (pure: `choose_rendezvous`), each rank's own
interface on that network (`local_interface_for`), and the connectivity probe that turns an
unreachable rendezvous into one line within seconds instead of a hang until `dist.timeout_s`.

Why: on Debian/Ubuntu a node's own host name resolves to 127.0.1.1 (/etc/hosts), so "resolve my
host name" gives other nodes a loopback address; Gloo's default device does the same. Across nodes
we therefore never advertise a loopback address: rank 0 takes the interface whose subnet holds an
address of every other node (HPCTRAIN_IFACE or MASTER_ADDR override that). It must never import
torch, MPI or anything outside the standard library.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import time
from dataclasses import dataclass

from hpctrain.errors import RendezvousError  # noqa: F401 - re-exported

_SIOCGIFFLAGS, _SIOCGIFADDR, _SIOCGIFNETMASK = 0x8913, 0x8915, 0x891B
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8
FIX = "set HPCTRAIN_IFACE to the interface the nodes share (e.g. ib0, eth0) or MASTER_ADDR"


@dataclass(frozen=True)
class Iface:
    name: str
    address: str
    prefix: int

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"{self.address}/{self.prefix}", strict=False)

    def __str__(self) -> str:
        return f"{self.name} {self.address}/{self.prefix}"


def _ioctl(s, request: int, name: str) -> bytes:
    return fcntl.ioctl(s.fileno(), request, struct.pack("256s", name[:15].encode()))


def interfaces(include_loopback: bool = False) -> list[Iface]:
    """This host's IPv4 interfaces that are up (loopback left out unless asked)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                flags = struct.unpack("H", _ioctl(s, _SIOCGIFFLAGS, name)[16:18])[0]
                addr = socket.inet_ntoa(_ioctl(s, _SIOCGIFADDR, name)[20:24])
                mask = socket.inet_ntoa(_ioctl(s, _SIOCGIFNETMASK, name)[20:24])
            except OSError:  # no IPv4 address
                continue
            if not flags & _IFF_UP or (flags & _IFF_LOOPBACK and not include_loopback):
                continue
            out.append(Iface(name, addr, ipaddress.ip_network(f"0.0.0.0/{mask}").prefixlen))
    return out


def iface_address(name: str) -> str:
    """IPv4 address of one named interface; RendezvousError naming it when it has none."""
    for i in interfaces(include_loopback=True):
        if i.name == name:
            return i.address
    known = ", ".join(str(i) for i in interfaces(include_loopback=True)) or "none"
    raise RendezvousError(f"HPCTRAIN_IFACE={name}: no IPv4 address on this interface on "
                          f"{socket.gethostname()} (interfaces: {known})")


def _as_ip(address: str):
    """An IPv4/IPv6 address, or a host name (MASTER_ADDR may be one) resolved; None if neither."""
    try:
        return ipaddress.ip_address(address)
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(address))
        except (OSError, ValueError):
            return None


def is_loopback(address: str) -> bool:
    ip = _as_ip(address)
    return bool(ip and ip.is_loopback)


def choose_rendezvous(nodes: dict[str, list[Iface]], rank0_host: str,
                      resolved: str | None = None) -> Iface:
    """Rank 0's interface whose subnet holds an address of every other node.

    `nodes` maps host name -> its interfaces (rank 0's host included); `resolved` is what rank 0's
    host name resolves to (preferred on a tie, e.g. two networks that both reach every node)."""
    others = [h for h in nodes if h != rank0_host]
    candidates = []
    for iface in nodes[rank0_host]:
        net = iface.network
        reached = [h for h in others if any(ipaddress.ip_address(j.address) in net for j in nodes[h])]
        candidates.append((len(reached), iface.address == resolved, iface))
    full = [c for c in candidates if c[0] == len(others)]
    if full:
        # the host name's own address first, then a fast fabric's name, then the first listed
        return max(full, key=lambda c: (c[1], c[2].name.startswith(("ib", "hsn"))))[2]
    mine = ", ".join(str(i) for i in nodes[rank0_host]) or "none but loopback"
    theirs = "; ".join(f"{h}: {', '.join(str(i) for i in nodes[h]) or 'none'}" for h in others[:3])
    raise RendezvousError(f"rank 0 on {rank0_host}: no network interface shares a subnet with every "
                          f"other node of the job (rank 0 has {mine}; {theirs}); {FIX}")


def local_interface_for(address: str, mine: list[Iface]) -> Iface | None:
    """This host's interface on the same subnet as `address` (None if none is)."""
    ip = _as_ip(address)
    for iface in mine if ip is not None else ():
        if ip in iface.network:
            return iface
    return None


def probe(address: str, port: int, timeout_s: float, who: str) -> None:
    """Connect to rank 0's store within `timeout_s` (retrying refusals while it starts) or raise one
    RendezvousError naming both ends: better than c10d's silent retries until dist.timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RendezvousError(f"{who} cannot reach rank 0's rendezvous {address}:{port} "
                                      f"within {timeout_s:.0f}s ({e.strerror or e}); {FIX}") from None
            time.sleep(0.2)
