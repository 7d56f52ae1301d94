"""Liveness and Ctrl-C for a plain mpi4py job (``data_tools shard`` / ``validate``): a rank that
dies, hangs or is interrupted ends the whole job with ONE line, within a bound.

Owns: the job guard every multi-rank data_tools command runs under.  Rank 0 hosts a small TCP
heartbeat server (its address travels by MPI broadcast); every other rank sends a beat every
``interval`` seconds and rank 0 answers each.  The protocol is the trainer's
(hpctrain/distributed/watchdog.py): counters judged on the watcher's own clock, a silent peer
declared lost after ``timeout_s``, the rank that saw it first-hand speaks, then MPI Abort ends the
job, also when the main thread is stuck in a collective.  It has its own transport because
data_tools is the lower layer: it must not import torch (whose TCPStore the trainer's watchdog
rides on) or hpctrain.  A silent or disconnected rank is named by rank 0; a silent rank 0 by
rank 1.  SIGINT (Ctrl-C at a terminal reaches every rank and mpiexec) is seen by the same thread
through Python's signal wakeup fd, so a main thread blocked in MPI does not delay it: rank 0
prints one ``error: interrupted`` line and aborts with 130 (a main thread in Python code gets its
KeyboardInterrupt as usual, so it stops before a swap and removes its staging folder).

Bound: lost within timeout_s + 2 intervals + 0.5 s (interval = timeout_s / 10 in [0.2, 5] s).
Must never: run an MPI collective from its thread (only Abort), or print a line per rank.
"""
from __future__ import annotations

import os
import secrets
import selectors
import signal
import socket
import threading
import time
from contextlib import contextmanager

from . import logs

log = logs.get_logger(__name__)

EXIT_PEER_LOST = 3
EXIT_INTERRUPTED = 130
DEFAULT_TIMEOUT_S = 60.0
_GRACE_S = 0.5  # for the line to get through the launcher before Abort tears the job down


class JobGuard:
    """Collective to start and to ``stop`` (use ``guarded``, which skips it for one rank)."""

    def __init__(self, comm, timeout_s: float, what: str, after: str = "nothing was changed"):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.timeout, self.what, self.after = float(timeout_s), what, after
        self.interval = max(0.2, min(5.0, self.timeout / 10))
        self.hosts = comm.allgather(socket.gethostname())
        self._stopping = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._last = {r: time.monotonic() for r in range(1, self.size)}  # rank 0: beats seen
        self._done: set[int] = set()
        self._buf: dict = {}  # per connection: a partial line
        self._peer: dict = {}  # rank 0: connection -> the rank that said hello on it
        self._names = {str(r) for r in range(1, self.size)}
        self._token = None
        self._watch_sigint()
        self._sock = self._connect() if self.timeout > 0 else None
        self._thread = threading.Thread(target=self._run, name="data-tools-heartbeat", daemon=True)
        self._thread.start()

    # -- setup (main thread, collective) --------------------------------------------------------
    def _watch_sigint(self) -> None:
        """SIGINT also wakes our thread: the main thread's KeyboardInterrupt waits for it to
        return from C (an MPI wait may never return), ours does not."""
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        self._old_wakeup = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        self._pipe = (rfd, wfd)
        self._sel.register(rfd, selectors.EVENT_READ, "signal")

    def _connect(self):
        listener = None
        if self.rank == 0:
            listener = socket.create_server(("", 0), backlog=max(16, self.size))
            addrs, port = _addresses(self.hosts[0]), listener.getsockname()[1]
            self._token = secrets.token_hex(16)  # a hello must carry it: strangers are ignored
        else:
            addrs = port = None
        addrs, port, self._token = self.comm.bcast((addrs, port, self._token), root=0)
        sock = None
        if self.rank:
            near = ["127.0.0.1"] if self.hosts[self.rank] == self.hosts[0] else []
            sock = _first_reachable(near + addrs, port, self.timeout)
        ok = all(self.comm.allgather(self.rank == 0 or sock is not None))
        if not ok:  # some rank cannot reach rank 0: no heartbeat rather than false alarms
            if self.rank == 0:
                log.warning(
                    f"warning: {self.what}: some rank cannot reach rank 0 on port {port}; "
                    f"running without the heartbeat")
            for s in (sock, listener):
                if s is not None:
                    s.close()
            return None
        if self.rank == 0:
            self._sel.register(listener, selectors.EVENT_READ, "accept")
            return listener
        sock.sendall(f"hello {self.rank} {self._token}\n".encode())
        self._sel.register(sock, selectors.EVENT_READ, "peer")
        self._last = {0: time.monotonic()}
        return sock

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        next_beat = time.monotonic()
        while True:
            for key, _ in self._sel.select(timeout=self.interval / 2):
                self._on_event(key)
            if self._stopping.is_set() and (self.rank or self._sock is None
                                            or len(self._done) == self.size - 1):
                return
            now = time.monotonic()
            if self.rank and self._sock is not None and now >= next_beat:
                next_beat = now + self.interval
                try:
                    self._sock.sendall(b"beat\n")
                except OSError:
                    self._lost(0, "its heartbeat connection broke")
            for r, seen in list(self._last.items()):
                if self._sock is not None and r not in self._done and now - seen > self.timeout:
                    self._lost(r, f"no heartbeat for {now - seen:.0f} s (--heartbeat-timeout "
                                  f"{self.timeout:g}): it died, hangs, or its node is unreachable")

    def _on_event(self, key) -> None:
        if key.data == "signal":
            if signal.SIGINT in os.read(key.fd, 512):
                self._interrupted()
        elif key.data == "accept":
            conn, _ = key.fileobj.accept()
            self._sel.register(conn, selectors.EVENT_READ, "peer")
        else:
            self._read_peer(key.fileobj)

    def _read_peer(self, conn) -> None:
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        lines = (self._buf.pop(conn, b"") + data).split(b"\n")
        self._buf[conn] = lines.pop()[-256:]
        # rank 0: a connection counts once it said hello with a rank of this job and the job's
        # token (a port scan or another user is never taken for a rank); the others talk only to
        # rank 0
        peer = self._peer.get(conn) if self.rank == 0 else 0
        for line in lines:
            word, *rest = line.decode(errors="replace").split() or [""]
            if word == "hello" and self.rank == 0 and rest[1:] == [self._token] and \
                    rest[0] in self._names:
                self._peer[conn] = peer = int(rest[0])
            if peer is None:
                continue
            if word == "done":
                self._done.add(peer)
            elif self.rank == 0:
                conn.sendall(b"ok\n")
            self._last[peer] = time.monotonic()
        if not data:
            self._sel.unregister(conn)
            self._buf.pop(conn, None)
            conn.close()
            if peer is not None and peer not in self._done and not (
                    self.rank and self._stopping.is_set()):
                self._lost(peer, "its process ended or its heartbeat connection closed")

    def _lost(self, r: int, why: str) -> None:
        on = f" on {self.hosts[r]}" if r < len(self.hosts) else ""
        # a silent rank 0 is named by rank 1 first; the others speak only if that Abort missed them
        self._die(f"rank {r}{on} lost during {self.what}: {why}; {self.after}; run it again",
                  EXIT_PEER_LOST,
                  wait=max(0, self.rank - 1) * (2 * _GRACE_S + 1) if r == 0 else 0)

    def _interrupted(self) -> None:
        self._die(f"interrupted (SIGINT) during {self.what}; {self.after}", EXIT_INTERRUPTED,
                  wait=0 if self.rank == 0 else 2 + self.rank * (2 * _GRACE_S + 1))

    def _die(self, msg: str, code: int, wait: float) -> None:
        time.sleep(wait)
        log.error(f"error: {msg}")  # "[rank N] " on a rank other than 0
        time.sleep(_GRACE_S)
        try:
            self.comm.Abort(code)
        finally:
            os._exit(code)

    # -- main thread ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Collective, at a clean end (also after an error every rank shares): no more beats."""
        self._stopping.set()
        try:
            os.write(self._pipe[1], b"\0")  # wake the thread now (not a signal number we act on)
        except OSError:
            pass
        if self.rank and self._sock is not None:
            try:
                self._sock.sendall(b"done\n")
            except OSError:
                pass
        self._thread.join(timeout=self.timeout + 5 if self._sock is not None else 5)
        signal.set_wakeup_fd(self._old_wakeup)
        for key in list(self._sel.get_map().values()):
            if key.data != "signal":
                key.fileobj.close()
        self._sel.close()
        for fd in self._pipe:
            os.close(fd)

    def wait_for_abort(self) -> None:
        """Main thread after KeyboardInterrupt (its cleanup done): the thread ends the job."""
        self._thread.join(timeout=5 + self.size * (2 * _GRACE_S + 1))


def _addresses(host: str) -> list[str]:
    """Rank 0's IPv4 addresses other ranks may use, routable ones first."""
    try:
        found = {ai[4][0] for ai in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        found = set()
    return sorted(found, key=lambda a: a.startswith("127.")) + [host]


def _first_reachable(addrs, port, timeout_s):
    for addr in addrs:
        try:
            s = socket.create_connection((addr, port), timeout=min(5.0, max(1.0, timeout_s / 4)))
            s.setblocking(False)
            return s
        except OSError:
            continue
    return None


@contextmanager
def guarded(comm, timeout_s: float, what: str, after: str = "nothing was changed"):
    """Run the body under a JobGuard (nothing for one rank); ``after`` says in its lines what a
    lost or interrupted run left behind.  It stops at a clean end and after an error every rank
    raised (``collective``); any other error aborts the job, so it keeps watching until then."""
    if comm.Get_size() == 1:
        yield None
        return
    guard = JobGuard(comm, timeout_s, what, after)
    try:
        yield guard
    except BaseException as e:
        if getattr(e, "collective", False):
            guard.stop()
        elif isinstance(e, KeyboardInterrupt):  # the thread prints the job's line and aborts it
            guard.wait_for_abort()
        raise
    guard.stop()
