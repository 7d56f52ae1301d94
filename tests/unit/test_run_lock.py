"""The run-dir lock's liveness check: an exited process, and a killed one its parent has not
reaped yet (a zombie), both count as gone; a running one does not."""
import os
import signal
import subprocess
import sys
import time

from hpctrain.train.run_lock import _pid_gone


def test_running_zombie_and_reaped_processes():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not _pid_gone(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _pid_gone(child.pid):  # a zombie until we wait() for it
            assert time.monotonic() < deadline, "a killed, unreaped child still counts as alive"
            time.sleep(0.05)
        assert os.path.exists(f"/proc/{child.pid}")  # not reaped yet: the zombie case
    finally:
        child.kill()
        child.wait()
    assert _pid_gone(child.pid)
    assert not _pid_gone(os.getpid())
