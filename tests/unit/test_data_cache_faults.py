"""Whole training runs (`python -m hpctrain train`, one rank) against a hostile or failing node
(#30): a symlink planted where the node cache would put its folder, a cache disk that is full or
read-only (real tmpfs mounts, root only), and a shard cut while training reads it. The cache
must never touch what a planted link points to, a sick cache disk is one warning and training
reads data.path instead (exit 0), and a cut shard is one error line naming it (never SIGBUS).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_tools.format import read_manifest
from hpctrain.data.cache import dataset_key
from tests.conftest import BIN, ROOT, TINY_TRAIN, Mounts, checksums, run_cmd

USER_ROOT = f"hpctrain-{os.geteuid()}"
STEPS = 6


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from data_tools.corpora import shakespeare_files

    out = tmp_path_factory.mktemp("faults") / "ds"
    run_cmd([sys.executable, "-m", "data_tools", "shard", "--input", sorted(shakespeare_files())[0],
             "--output", out, "--tokenizer", "bytes", "--shard-tokens", "40000",
             "--val-fraction", "0.1", "--no-progress"], check=True, timeout=120)
    return out


def config(tmp: Path, data: Path, steps: int = STEPS) -> tuple[Path, Path]:
    run, cfg = tmp / "run", tmp / "train.toml"
    cfg.write_text(TINY_TRAIN.format(run=run, data=data, steps=steps))
    return cfg, run


def train(tmp: Path, data: Path, cache: Path, *extra: str):
    cfg, run = config(tmp, data)
    r = run_cmd([sys.executable, "-m", "hpctrain", "train", "--config", cfg,
                 f"--data.cache_dir={cache}", *extra], timeout=180)
    return r, run


def steps_logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum("loss" in json.loads(line) for line in path.read_text().splitlines() if line)


def lines_naming(stderr: str, kind: str, path: Path) -> list[str]:
    return [l for l in stderr.splitlines() if re.match(rf"(\[rank \d+\] )?{kind}: ", l)
            and str(path) in l]


@pytest.mark.parametrize("where", ["user_root", "dataset_dir"])
def test_planted_symlink_is_refused_and_its_target_untouched(tmp_path, dataset, where):
    """A symlink to another dataset (same shard names) at the predictable per-user folder or at
    the dataset's folder in it (and at the layout before #30, <cache_dir>/<key>): one warning
    naming the link, training reads data.path to the end, the victim is bit for bit unchanged."""
    victim = tmp_path / "victim"
    shutil.copytree(dataset, victim)
    before = checksums(victim)
    cache = tmp_path / "shm"
    key = dataset_key(str(dataset))
    cache.mkdir()
    (cache / key).symlink_to(victim)  # where hpctrain put its folder before
    if where == "user_root":
        link = cache / USER_ROOT
    else:
        (cache / USER_ROOT).mkdir(mode=0o700)
        link = cache / USER_ROOT / key
    link.symlink_to(victim)
    r, run = train(tmp_path, dataset, cache)
    assert r.returncode == 0, r.stderr[-3000:]
    warned = lines_naming(r.stderr, "warning", link)
    assert len(warned) == 1 and "symlink" in warned[0], r.stderr[-3000:]
    assert checksums(victim) == before and link.is_symlink()
    assert steps_logged(run) == STEPS and "Traceback" not in r.stderr


def cache_disk(tmp: Path, dataset: Path, mounts: Mounts, case: str) -> Path:
    """A tmpfs for the cache: read-only; too small for any shard; or room for ~1.5 shards while
    data.cache_bytes allows them all (staging meets ENOSPC after training started)."""
    largest = max(e["bytes"] for e in read_manifest(str(dataset))["shards"])
    if case == "read_only_at_start":
        return mounts.tmpfs(tmp / "ro", "1m", readonly=True)
    size = largest // 2 if case == "full_at_start" else largest * 3 // 2
    return mounts.tmpfs(tmp / "scratch", f"{(size + 4095) // 4096 * 4}k")


@pytest.mark.parametrize("case", ["full_mid_run", "full_at_start", "read_only_at_start"])
def test_sick_cache_disk_is_one_warning_and_training_reads_data_path(tmp_path, dataset, mounts,
                                                                      case):
    disk = cache_disk(tmp_path, dataset, mounts, case)
    r, run = train(tmp_path, dataset, disk, "--data.cache_bytes=1000000000")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and steps_logged(run) == STEPS
    warned = [l for l in r.stderr.splitlines() if l.startswith("warning:") and "cache" in l]
    assert len(warned) == 1 and str(disk) in warned[0] and str(dataset) in warned[0], r.stderr
    sizes = {e["file"]: e["bytes"] for e in read_manifest(str(dataset))["shards"]}
    left = [p for p in disk.rglob("*") if p.is_file()]
    assert not [p for p in left if p.name.startswith(".tmp-") or p.name == "error.txt"]
    for p in left:  # whatever was staged is whole
        assert p.name not in sizes or p.stat().st_size == sizes[p.name], p
    if case == "full_mid_run":
        assert [p for p in left if p.name in sizes], "nothing was staged before the disk filled"


def wait_for_steps(run: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while steps_logged(run) < n:
        assert proc.poll() is None and time.time() < deadline, "training ended or stalled"
        time.sleep(0.05)


@pytest.mark.parametrize("where", ["data_path", "cached_copy"])
def test_shard_cut_while_training_reads_it_is_one_error_naming_it(tmp_path, dataset, where):
    """Training runs; then every train shard it reads (data.path's, or the node cache's copies)
    is cut to 4 KiB: the next batch ends the run with one error line naming a cut shard, exit 1,
    no SIGBUS (a memory-mapped reader died with signal 7, naming nothing)."""
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    cache = tmp_path / "cache" if where == "cached_copy" else "off"
    cfg, run = config(tmp_path, data, steps=100000)
    err = tmp_path / "stderr"
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "train", "--config", str(cfg),
                                 f"--data.cache_dir={cache}"],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=f)
    try:
        wait_for_steps(run, 2, proc)
        folder = data if where == "data_path" else cache / USER_ROOT / dataset_key(str(data))
        cut = sorted(folder.glob("train_*.h5"))
        assert cut
        for p in cut:
            os.truncate(p, 4096)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.read_text()
    assert rc not in (0, -signal.SIGBUS) and rc > 0, (rc, stderr[-3000:])
    errors = [l for l in stderr.splitlines() if re.match(r"(\[rank \d+\] )?error: ", l)]
    assert len(errors) == 1 and any(f"{p}: " in errors[0] for p in cut), stderr[-3000:]
    assert "Traceback" not in stderr
