"""hpctrain/distributed/launcher_exit.py: the PMI-1 `finalize` exchange over a socket pair, and
when it applies (the real launcher is tested in tests/mpi/test_launch.py)."""
import socket
import threading
import time

import pytest

from hpctrain.distributed.launcher_exit import _pmi1_fd, pmi1_finalize


def serve_once(sock, reply):
    got = sock.recv(64)
    if reply is not None:
        sock.sendall(reply)
    return got


@pytest.mark.parametrize("reply, expected", [(b"cmd=finalize_ack rc=0\n", True),
                                             (b"cmd=finalize_ack\n", True),
                                             (b"cmd=error rc=1\n", False)])
def test_finalize_sends_one_line_and_reads_the_ack(reply, expected):
    ours, launcher = socket.socketpair()
    box = {}
    t = threading.Thread(target=lambda: box.update(got=serve_once(launcher, reply)))
    t.start()
    assert pmi1_finalize(ours.fileno(), timeout_s=5) is expected
    t.join()
    assert box["got"] == b"cmd=finalize\n"


def test_a_silent_or_closed_launcher_gives_false_within_the_timeout():
    ours, launcher = socket.socketpair()
    t0 = time.monotonic()
    assert pmi1_finalize(ours.fileno(), timeout_s=0.3) is False
    assert 0.25 < time.monotonic() - t0 < 3
    launcher.close()
    assert pmi1_finalize(ours.fileno(), timeout_s=5) is False  # EOF / broken pipe, not a hang


@pytest.mark.parametrize("env, fd", [({"PMI_FD": "9"}, 9), ({}, None), ({"PMI_FD": "x"}, None),
                                     ({"PMI_FD": "9", "PMI_VERSION": "2"}, None),
                                     ({"PMI_FD": "9", "MPIR_CVAR_PMI_VERSION": "x"}, None),
                                     ({"PMI_FD": "9", "PMI_VERSION": "1"}, 9)])
def test_only_a_pmi1_connection_is_spoken_to(monkeypatch, env, fd):
    for key in ("PMI_FD", "PMI_VERSION", "MPIR_CVAR_PMI_VERSION"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert _pmi1_fd() == fd
