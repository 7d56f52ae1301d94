"""Shared fixtures: paths, a real `mpiexec` runner, the real Shakespeare corpus, a small dataset."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def mpiexec_path() -> str:
    exe = BIN / "mpiexec"
    return str(exe) if exe.exists() else (shutil.which("mpiexec") or "mpiexec")


def run_cmd(args, timeout=300, env=None, check=False, cwd=None):
    """Run a command with the venv first on PATH; return CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env["PATH"] = f"{BIN}{os.pathsep}{full_env.get('PATH', '')}"
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                       env=full_env, cwd=cwd or ROOT)
    if check and r.returncode != 0:
        raise AssertionError(f"command failed ({r.returncode}): {' '.join(map(str, args))}\n"
                             f"--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}")
    return r


def mpirun(n, args, **kw):
    """`mpiexec -n N python ARGS...` (MPICH oversubscribes silently on 2 cores)."""
    return run_cmd([mpiexec_path(), "-n", str(n), sys.executable, *args], **kw)


@pytest.fixture(scope="session")
def root():
    return ROOT


# The [run], [data] and [model] sections of the MPI / tune tests' TOMLs: a 1-layer, 32-wide GPT on
# a byte-level dataset, size-checked, no node cache. TINY_SECTIONS + "[train] ..." .format(run, data)
TINY_MODEL = """[model]
n_layer = 1
n_head = 2
n_embd = 32
block_size = 32
vocab_size = 257
"""
TINY_SECTIONS = """
[run]
dir = "{run}"
[data]
path = "{data}"
verify = "size"
cache_dir = "off"
""" + TINY_MODEL

# The smallest training config a subprocess test needs (byte tokenizer, 2 steps by default):
# TINY_TRAIN.format(run=..., data=..., steps=...).
TINY_TRAIN = """
[run]
dir = "{run}"
[data]
path = "{data}"
""" + TINY_MODEL + """[train]
steps = {steps}
warmup_steps = 0
micro_batch_size = 2
eval_interval = 0
log_interval = 1
"""
