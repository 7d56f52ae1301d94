"""The liveness beacon: a small sidecar process per rank that beats for it, outside its GIL.

Owns the liveness protocol (hpctrain/distributed/watchdog.py starts it and owns everything else).
A Python thread in the training process cannot promise a beat every second: any C call that holds
the GIL (an h5py read, some torch ops, unpickling a big object) starves it. This process imports
nothing but the standard library, is started with `python -I -c` (no site, no environment, no
hpctrain import: its command line and environment name no rank, so tools that look for rank
processes never mistake it for one), and for as long as its parent (the rank) lives:

* every `interval` seconds sends `hb <rank>` over UDP to the beacon of rank - 1 (its watcher),
  unless the parent is stopped (/proc/<ppid>/stat state T or t: SIGSTOP, a debugger): a frozen
  rank is silent although its beacon runs;
* watches rank + 1's beats; silent for more than `timeout` seconds (of this process's own clock,
  a stretch in which this process itself did not run is not counted) -> a verdict. Watching starts
  with rank + 1's first beat: one that never comes (UDP blocked between the nodes?) is told to the
  parent (`quiet <rank> <ip:port>`: one warning line) and never becomes a verdict;
* a verdict (its own, or `lost ...` from another beacon) is forwarded once to both ring neighbours
  (and repeated every interval: a flood around the ring reaches every beacon even with one rank
  dead), and handed to the parent as one stdout line `lost <rank> <speak_after> <message>`: the
  parent's watchdog thread writes forensics, prints the line and ends the job with MPI Abort;
* if the parent has not ended `kill_after` seconds after the verdict (its main thread holds the GIL
  in C code, so no Python thread of it runs), prints the verdict line itself (unless the parent
  said `dying`) and SIGKILLs the parent, so that the launcher tears the job down (non-zero exit).

Parent -> beacon, stdin lines: `pred <ip:port> <rank>` (beat to it), `succ <ip:port> <rank>
<host>` (watch it), `done` (clean finish: `done <rank>` goes to the watcher instead of beats), `dying`,
`fence <sha256> <path>` (the run dir's lock as this launch wrote it: no forensics once it differs). EOF or a new
parent pid: the parent is gone, the beacon exits (its silence is then the news). It ignores the
signals a job gets to stop gracefully (SIGTERM, SIGUSR1, ...): Slurm sends them to every process
of a step, and a beacon that died of one would make its live rank look lost.
Cost (2-core VM): ~30 ms to start, ~0.1 ms CPU per beat (about 0.02 % of a core at 0.8 s).
"""
import hashlib
import json
import os
import select
import signal
import socket
import sys
import time

ARGS = ("rank", "world", "timeout", "interval", "kill_after", "stacks_fd")
STACKS_SIGNAL = signal.SIGURG  # the rank's faulthandler dumps its stacks on it (ignored otherwise)


def parent_state(ppid):
    """'gone', 'stopped' or 'running'."""
    if os.getppid() != ppid:
        return "gone"
    try:
        with open(f"/proc/{ppid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "running"  # no /proc (the ppid check above still holds)
    return "gone" if state in "ZXx" else "stopped" if state in "Tt" else "running"


class Beacon:
    def __init__(self, rank, world, timeout, interval, kill_after, stacks_fd="-1"):
        self.rank, self.world = int(rank), int(world)
        self.timeout, self.interval = float(timeout), float(interval)
        self.kill_after = float(kill_after)
        self.stacks_fd = int(stacks_fd)
        self.run_dir = os.environ.get("BEACON_RUN_DIR", "")
        self.ppid = os.getppid()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.pred = self.succ = None      # (ip, port) of rank - 1 (our watcher), rank + 1
        self.succ_rank, self.succ_host = None, ""
        self.succ_done = self.done = self.dying = False
        self.seen = None                  # when rank + 1 last beat (None: never yet)
        self.early_beats = {}             # rank -> last beat heard before `succ` was told
        self.known_at, self.quiet_told = 0.0, False
        self.verdict = None               # (lost rank, message) once known
        self.verdict_at = 0.0
        self.forward_left = 0
        self.fence = None                 # (sha256, path) of the run dir's lock as this launch wrote it

    def say(self, line):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def send(self, addr, text):
        if addr is not None:
            try:
                self.sock.sendto(text.encode(), addr)
            except OSError:
                pass

    def on_parent_line(self, line):
        parts = line.split(None, 3)
        if parts and parts[0] == "pred" and len(parts) >= 3:
            self.pred = _addr(parts[1])
            if parent_state(self.ppid) == "running":  # the first beat now, not one interval later
                self.send(self.pred, f"hb {self.rank}")
        elif parts and parts[0] == "succ" and len(parts) >= 3:
            self.succ, self.succ_rank = _addr(parts[1]), int(parts[2])
            self.succ_host = parts[3] if len(parts) > 3 else ""
            self.seen, self.known_at = self.early_beats.get(self.succ_rank), time.monotonic()
        elif parts == ["done"]:
            self.done = True
            for _ in range(3):
                self.send(self.pred, f"done {self.rank}")
        elif parts == ["dying"]:
            self.dying = True
        elif parts and parts[0] == "fence" and len(parts) >= 3:
            self.fence = (parts[1], line.split(None, 2)[2])  # (sha256 of the run lock, its path)

    def on_datagram(self, data, now):
        kind, _, rest = data.decode(errors="replace").partition(" ")
        if kind == "hb" and rest == str(self.succ_rank):
            self.seen = now
        elif kind == "hb" and self.succ_rank is None and rest.isdigit():
            self.early_beats[int(rest)] = now  # a beat before we were told whom to watch
        elif kind == "done" and rest == str(self.succ_rank):
            self.succ_done = True
        elif kind == "lost" and self.verdict is None:
            lost, _, msg = rest.partition(" ")
            self.decide(int(lost), msg, speak_after=1, now=now)

    def decide(self, lost, msg, speak_after, now):
        self.verdict, self.verdict_at, self.forward_left = (lost, msg), now, 3
        self.forward()
        self.say(f"lost {lost} {speak_after} {msg}")

    def forward(self):
        lost, msg = self.verdict
        for addr, rank in ((self.pred, (self.rank - 1) % self.world), (self.succ, self.succ_rank)):
            if rank != lost:
                self.send(addr, f"lost {lost} {msg}")
        self.forward_left -= 1

    def check_silence(self, now):
        if self.succ is None or self.succ_done or self.verdict is not None:
            return
        if self.seen is None:  # never heard from it: UDP blocked? no verdict on that, one warning
            if not self.quiet_told and now - self.known_at > self.timeout:
                self.quiet_told = True
                self.say(f"quiet {self.succ_rank} {self.succ[0]}:{self.succ[1]}")
            return
        if now - self.seen > self.timeout:
            on = f" on {self.succ_host}" if self.succ_host else ""
            msg = (f"rank {self.succ_rank}{on} lost: no heartbeat for {now - self.seen:.0f} s "
                   f"(dist.heartbeat_timeout_s={self.timeout:g}): it died, hangs, was stopped, or "
                   f"its node is unreachable")
            self.decide(self.succ_rank, msg, speak_after=0, now=now)

    def last_resort(self, now):
        """The parent did not end after the verdict: its main thread holds the GIL. Its stacks
        (faulthandler, which needs no GIL), its forensics file, the line, then SIGKILL."""
        stacks = ""
        if self.stacks_fd >= 0:
            try:
                os.kill(self.ppid, STACKS_SIGNAL)
                time.sleep(0.5)
                stacks = os.pread(self.stacks_fd, 1 << 20, 0).decode(errors="replace")
            except OSError:
                pass
        try:
            os.kill(self.ppid, signal.SIGKILL)
        except OSError:
            pass
        if not self.dying:  # the parent wrote neither its file nor its line
            self.write_forensics(stacks)
            prefix = f"[rank {self.rank}] " if self.rank else ""
            sys.stderr.write(f"{prefix}error: {self.verdict[1]}\n")
            sys.stderr.flush()
        sys.exit(0)

    def write_forensics(self, stacks):
        """<run_dir>/forensics/rank_<r>.json as flight_recorder.write_forensics writes it (tmp +
        rename under an O_NOFOLLOW folder descriptor), from what a beacon knows."""
        if not self.run_dir or not self.fence_holds():
            return
        record = {"rank": self.rank, "world": self.world, "host": socket.gethostname(),
                  "pid": self.ppid, "kind": "verdict", "verdict": self.verdict[1],
                  "lost": self.verdict[0], "step": "?", "time": time.time(),
                  "innermost_frame": "the main thread held the GIL (stacks from faulthandler)",
                  "open": None, "collectives": [],
                  "stacks": {"MainThread (faulthandler, every thread)": stacks.splitlines(True)}}
        folder, name = os.path.join(self.run_dir, "forensics"), f"rank_{self.rank}.json"
        try:
            os.makedirs(folder, mode=0o755, exist_ok=True)
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                tmp = f".{name}.{os.getpid()}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644,
                             dir_fd=dir_fd)
                with os.fdopen(fd, "w") as f:
                    json.dump(record, f, indent=1)
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        except (OSError, ValueError):
            pass

    def fence_holds(self):
        """False when the run dir's lock now holds other bytes than this launch's: a newer launch
        owns the run dir (we were frozen past the relaunch), so we write nothing there."""
        if self.fence is None:
            return True
        try:
            with open(self.fence[1], "rb") as f:
                now = f.read(65536)
        except OSError:
            return True
        return hashlib.sha256(now).hexdigest() == self.fence[0]

    def tick(self, now, last_tick):
        if now - last_tick > max(self.timeout / 2, 3 * self.interval):
            if self.seen is not None:  # we did not run: not their silence
                self.seen = max(self.seen, now - self.interval)
        state = parent_state(self.ppid)
        if state == "gone":
            sys.exit(0)
        if self.done:
            self.send(self.pred, f"done {self.rank}")
        elif state == "running" and self.pred is not None:
            self.send(self.pred, f"hb {self.rank}")
        if state == "running":
            self.check_silence(now)
        if self.verdict is not None:
            if self.forward_left > 0:
                self.forward()
            if now - self.verdict_at > self.kill_after:
                self.last_resort(now)

    def run(self):
        self.say(f"port {self.sock.getsockname()[1]}")
        stdin = sys.stdin.fileno()
        last_tick = next_tick = time.monotonic()
        pending = b""
        while True:
            wait = max(0.0, next_tick - time.monotonic())
            ready, _, _ = select.select([stdin, self.sock], [], [], wait)
            now = time.monotonic()
            if stdin in ready:
                data = os.read(stdin, 4096)
                if not data:
                    sys.exit(0)  # the parent closed the pipe: it is gone
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self.on_parent_line(line.decode(errors="replace").strip())
            if self.sock in ready:
                data, _ = self.sock.recvfrom(4096)
                self.on_datagram(data, now)
            if now >= next_tick:
                self.tick(now, last_tick)
                last_tick, next_tick = now, now + self.interval


def _addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def stack_dump_fd():
    """Called by the rank: an anonymous file (created, then unlinked) that this process's
    faulthandler dumps every thread's stack into on STACKS_SIGNAL; its descriptor, or -1."""
    import faulthandler
    import tempfile

    try:
        f = tempfile.TemporaryFile(prefix="beacon-stacks-")
        faulthandler.register(STACKS_SIGNAL, file=f, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        return -1
    stack_dump_fd.file = f  # kept open for the life of the process
    return f.fileno()


def start(rank, world, timeout, interval, kill_after, stacks_fd=-1, run_dir=None):
    """(the beacon's Popen, its UDP port): called by the rank (watchdog.py), not by the beacon.
    Its source travels in the environment, so that its command line names nothing (tests find rank
    processes by "hpctrain" in theirs); so does run_dir (where it writes the rank's forensics when
    the rank cannot)."""
    import subprocess

    with open(__file__) as f:
        source = f.read()
    args = [str(v) for v in (rank, world, timeout, interval, kill_after, stacks_fd)]
    python = os.path.realpath(sys.executable)  # the base interpreter: a venv's path may name us
    # the environment as the rank's (LD_LIBRARY_PATH of a module-loaded Python...; -I ignores
    # PYTHON*), less the launcher's rank variables: nothing takes it for a rank
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_COMM_WORLD"))}
    env["BEACON_SRC"] = source
    env["BEACON_RUN_DIR"] = os.fspath(run_dir) if run_dir else ""
    proc = subprocess.Popen([python, "-I", "-c", "import os; exec(os.environ['BEACON_SRC'])",
                             *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, close_fds=True, pass_fds=(stacks_fd,) if stacks_fd >= 0 else ())
    first = proc.stdout.readline().decode(errors="replace").split()
    if len(first) != 2 or first[0] != "port":
        proc.kill()
        raise OSError(f"the heartbeat beacon did not start (said {' '.join(first)!r})")
    return proc, int(first[1])


def local_ip(peer_host, peer_port):
    """This host's address on the route to `peer_host` (rank 0): where the other beacons reach us."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_host, int(peer_port)))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def main(argv):
    # Ctrl-C, Slurm's preemption and end-of-time signals (often sent to every process of the
    # step) are the parent's to handle: the beacon ends when its parent does, or by SIGKILL
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    Beacon(**dict(zip(ARGS, argv))).run()


if __name__ == "__main__":
    main(sys.argv[1:])
