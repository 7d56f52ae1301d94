"""Rendezvous interface choice across nodes (pure logic) and the fast unreachable-store probe."""
from __future__ import annotations

import socket
import time

import pytest

from hpctrain.distributed.mesh import tp_group_hosts
from hpctrain.distributed.netif import (Iface, RendezvousError, choose_rendezvous, interfaces,
                                 is_loopback, local_interface_for, probe)

ETH = {"n1": [Iface("eth0", "192.168.1.1", 24), Iface("ib0", "10.0.0.1", 16)],
       "n2": [Iface("eth0", "192.168.1.2", 24), Iface("ib0", "10.0.7.2", 16)],
       "n3": [Iface("ib0", "10.0.9.3", 16)]}


def test_picks_the_interface_whose_subnet_reaches_every_node():
    assert choose_rendezvous(ETH, "n1").name == "ib0"           # eth0 misses n3
    two = {h: ETH[h] for h in ("n1", "n2")}
    assert choose_rendezvous(two, "n1").name == "ib0"            # both reach: fast fabric first
    assert choose_rendezvous(two, "n1", resolved="192.168.1.1").name == "eth0"  # the host's own


def test_no_common_subnet_is_one_line_naming_the_fix():
    nodes = {"a": [Iface("eth0", "192.168.1.1", 24)], "b": [Iface("eth0", "192.168.2.1", 24)]}
    with pytest.raises(RendezvousError) as e:
        choose_rendezvous(nodes, "a")
    msg = str(e.value)
    assert "rank 0 on a" in msg and "HPCTRAIN_IFACE" in msg and "\n" not in msg
    with pytest.raises(RendezvousError):  # a node with only loopback (filtered out) reaches nobody
        choose_rendezvous({"a": [], "b": nodes["b"]}, "a")


def test_each_rank_finds_its_own_interface_on_that_network():
    assert local_interface_for("10.0.0.1", ETH["n3"]).name == "ib0"
    assert local_interface_for("192.168.1.1", ETH["n3"]) is None
    assert is_loopback("127.0.1.1") and is_loopback("127.0.0.1") and not is_loopback("10.0.0.1")
    assert is_loopback("localhost") and not is_loopback("no-such-host.invalid")  # MASTER_ADDR names
    assert local_interface_for("no-such-host.invalid", ETH["n3"]) is None


def test_this_hosts_interfaces_leave_loopback_out():
    assert all(not is_loopback(i.address) for i in interfaces())
    assert any(is_loopback(i.address) for i in interfaces(include_loopback=True))


def test_probe_fails_within_its_timeout_naming_both_ends():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        t0 = time.monotonic()
        with pytest.raises(RendezvousError) as e:
            probe("127.0.0.1", port, 1.0, "rank 3 on nodeX")
    assert time.monotonic() - t0 < 3
    assert f"rank 3 on nodeX cannot reach rank 0's rendezvous 127.0.0.1:{port}" in str(e.value)


def test_tp_group_hosts():
    assert tp_group_hosts(("a", "a", "b", "b"), 2) == "a [0,1], b [2,3]"
    assert tp_group_hosts(("a", "b", "b", "a"), 2) == "a+b [0,1], a+b [2,3]"
