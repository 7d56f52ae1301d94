"""The node-local shard cache under a real `mpiexec -n 4` split into 2 pretend nodes.

Each node's leader copies a shard from data.path once, the node's ranks read the copy, losses are
bit-identical to a run without the cache; a small budget evicts and still matches; a kill -9 in
the middle of staging, a stray temp file and a corrupted cached shard do not stop the next run; with
blocks of one shard the leaders stage the next block ahead and the losses still match.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_tools.format import read_manifest
from tests.conftest import ROOT, losses, mpiexec_path, records, mpirun
from tests.helpers import SMALL_GPT
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi
NODES = {"HPCTRAIN_RANKS_PER_NODE": "2"}


@pytest.fixture(scope="module")
def dataset(small_shards):
    """Many small shards (tests/conftest.py), so that each node stages several; read only here."""
    return small_shards


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    """Losses of a 4-rank run without the cache (cache_dir=off), trained once per session
    (tests/shared_dirs.py)."""
    def build(out):
        cfg, _ = config(out, dataset, "ref")
        train4(cfg, "--data.cache_dir=off")
    run = shared_dir(tmp_path_factory, "cache_reference", build) / "ref"
    return losses(run), losses(run, "val_loss")


def config(tmp, data, name):
    run = tmp / name
    cfg = tmp / f"{name}.toml"
    cfg.write_text(SMALL_GPT.format(run=run, data=data).replace("steps = 40", "steps = 20"))
    return cfg, run


def train4(cfg, *overrides, timeout=300):
    return mpirun(4, ["-m", "hpctrain", "train", "--config", cfg, *overrides], env=NODES,
                  timeout=timeout, check=True)


def same(a, b):
    """Equal losses. Not bit-for-bit: with 4 ranks the logged loss is a Gloo all-reduce of 4
    floats whose summation order varies between runs (1 ulp; the weights themselves are
    identical — later steps match exactly), so allow 1e-6 relative."""
    return sorted(a) == sorted(b) and all(abs(a[k] - b[k]) <= 1e-6 * abs(b[k]) for k in a)


def node_stats(cache):
    """stats.json of each pretend node (<cache>/node<i>/hpctrain-<uid>/<dataset key>/)."""
    found = sorted(Path(cache).glob("node*/hpctrain-*/hpctrain-*/stats.json"))
    return [json.loads(p.read_text()) for p in found]


def descendants(pid):
    """All live descendants of ``pid`` (from /proc), so a test kills exactly what it started."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def test_each_node_copies_each_shard_once_and_losses_match(tmp_path, dataset, reference):
    cache = tmp_path / "cache"
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    cfg, run = config(tmp_path, data, "cached")
    train4(cfg, f"--data.cache_dir={cache}")
    assert same(losses(run), reference[0]) and same(losses(run, "val_loss"), reference[1])
    stats = node_stats(cache)
    assert len(stats) == 2  # node0/ and node1/, each with its own copies
    names = {s["file"] for s in read_manifest(str(dataset))["shards"]}
    for st in stats:
        assert st["copies_per_shard"] and set(st["copies_per_shard"]) <= names
        assert set(st["copies_per_shard"].values()) == {1}, st["copies_per_shard"]  # never twice on a node
        assert st["evictions"] == 0 and st["bytes_staged"] == st["used"]
    recs = [r for r in records(run) if "loss" in r]
    assert all(r["data_wait_s"] >= 0 and r["data_time_s"] > 0 for r in recs)
    assert sum(r["cache_hits"] + r["cache_misses"] for r in recs) > 0
    assert sum(r["cache_copies"] for r in recs) <= sum(len(s["copies_per_shard"]) for s in stats)
    # The cached copies are what the ranks read: with data.path's shards gone, a new run still
    # trains (each cached shard re-verified once, nothing copied) and gives the same losses.
    for name in names:
        (data / name).unlink()
    cfg2, run2 = config(tmp_path, data, "from_cache")
    train4(cfg2, f"--data.cache_dir={cache}")
    assert same(losses(run2), reference[0]) and same(losses(run2, "val_loss"), reference[1])
    for st in node_stats(cache):
        assert st["copies_per_shard"] == {} and st["reused"] > 0


def test_block_lookahead_stages_the_next_block_and_losses_match(tmp_path, dataset):
    """Blocks of one shard (about 20 steps each): each node's leader stages the next block's
    shard ahead (cache_lookahead), still once per node, and the losses are those without cache."""
    order = ("--data.shuffle_block_shards=1", "--train.steps=40")
    cfg_off, run_off = config(tmp_path, dataset, "blocks_off")
    train4(cfg_off, "--data.cache_dir=off", *order)
    cache = tmp_path / "cache"
    cfg, run = config(tmp_path, dataset, "blocks")
    r = train4(cfg, f"--data.cache_dir={cache}", *order)
    assert "not a block ahead" not in r.stderr
    assert same(losses(run), losses(run_off))
    assert same(losses(run, "val_loss"), losses(run_off, "val_loss"))
    assert sum(r["cache_lookahead"] for r in records(run) if "loss" in r) >= 2  # >= 1 per node
    for st in node_stats(cache):
        assert st["lookahead"] >= 1 and set(st["copies_per_shard"].values()) == {1}, st
        assert st["evictions"] == 0


@pytest.mark.slow
def test_budget_smaller_than_dataset_evicts_and_matches(tmp_path, dataset, reference):
    m = read_manifest(str(dataset))
    size = {sp: sum(s["bytes"] for s in m["shards"] if s["split"] == sp) for sp in ("train", "val")}
    budget = size["val"] + size["train"] // 2  # val shards stay pinned; half the train shards fit
    cache = tmp_path / "cache"
    cfg, run = config(tmp_path, dataset, "small")
    r = train4(cfg, f"--data.cache_dir={cache}", f"--data.cache_bytes={budget}")
    assert "smaller than one step" not in r.stderr
    assert same(losses(run), reference[0]) and same(losses(run, "val_loss"), reference[1])
    for st in node_stats(cache):
        assert st["evictions"] > 0 and st["used"] <= budget
        assert max(st["copies_per_shard"].values()) >= 2  # evicted, needed again, staged again
    assert sum(r["cache_evictions"] for r in records(run) if "loss" in r) > 0


@pytest.mark.slow
def test_kill_9_while_staging_then_restart(tmp_path, dataset, reference):
    cache = tmp_path / "cache"
    cfg, run = config(tmp_path, dataset, "killed")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **NODES)
    cmd = [mpiexec_path(), "-n", "4", sys.executable, "-m", "hpctrain", "train", "--config",
           str(cfg), f"--data.cache_dir={cache}", "--train.steps=2000", "--checkpoint.interval=1000"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(list(Path(cache).glob("node0/*/*/train_*.h5"))) < 2:
            time.sleep(0.02)  # kill while the leader is still staging train shards
    finally:
        job = descendants(p.pid)  # mpiexec, its proxy and the 4 ranks (own process groups)
        for pid in [p.pid, *job]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(timeout=30)
    assert len(job) >= 4
    node0 = next(Path(cache).glob("node0/hpctrain-*/hpctrain-*"))
    (node0 / ".tmp-999999-train_00001.h5").write_bytes(b"half a shard")  # a crash's leftover
    cached = sorted(node0.glob("train_*.h5"))
    assert cached, "the killed run staged nothing on node0"
    data = bytearray(cached[0].read_bytes())
    data[-100] ^= 1  # bit rot in the cache: must be detected and fetched again
    cached[0].write_bytes(bytes(data))
    cfg2, run2 = config(tmp_path, dataset, "restarted")
    train4(cfg2, f"--data.cache_dir={cache}")
    assert same(losses(run2), reference[0]) and same(losses(run2, "val_loss"), reference[1])
    st0 = node_stats(cache)[0]
    assert st0["refetched"] >= 1 and st0["copies_per_shard"].get(cached[0].name) == 1
    assert not list(Path(cache).rglob(".tmp-*"))
