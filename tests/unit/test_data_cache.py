"""NodeCache on one rank (a one-rank node: data_tools' SerialComm): staging, LRU eviction under
the budget, a corrupt source shard, crash leftovers and the lock. Multi-node: tests/mpi."""
import os
import shutil

import numpy as np
import pytest

from data_tools.format import DataError, read_manifest
from data_tools.mpiutil import SerialComm
from data_tools.shard import shard_dataset
from hpctrain.data.cache import NodeCache, resolve_cache_dir


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from data_tools.corpora import shakespeare_files

    out = tmp_path_factory.mktemp("d") / "ds"
    shard_dataset(shakespeare_files()[:1], str(out), tokenizer="bytes", shard_tokens=40000,
                  val_fraction=0.0, progress=False, log=lambda s: None)
    return out


def run_steps(cache, needs):
    """Play the ranks' side: publish each step, read its shards; return what was read."""
    cache.start(0, len(needs), lambda k: needs[k])
    got = []
    for k in range(len(needs)):
        cache.publish(k)
        for i in needs[k]:
            path, off = cache.acquire(i)
            got.append(np.fromfile(path, dtype=np.uint16, offset=off, count=8).tolist())
    cache.close()
    return got


def first_tokens(dataset, m, i):
    from data_tools.format import open_shard_layout

    e = m["shards"][i]
    lay = open_shard_layout(os.path.join(dataset, e["file"]), e, m)
    return np.fromfile(lay.path, dtype=np.uint16, offset=lay.offset, count=8).tolist()


def test_stage_evict_and_read_the_same_tokens(dataset, tmp_path):
    m = read_manifest(str(dataset))
    assert len(m["shards"]) >= 4
    sizes = [e["bytes"] for e in m["shards"]]
    needs = [[0], [1], [2], [0], [3]]
    cache = NodeCache(str(tmp_path), str(dataset), m, SerialComm(),
                      budget=max(sizes) * 2, prefetch=0)
    got = run_steps(cache, needs)
    assert got == [first_tokens(dataset, m, i) for k in needs for i in k]
    assert cache.node["evictions"] >= 2 and cache.used <= max(sizes) * 2
    assert cache.copies_per_shard[m["shards"][0]["file"]] == 2  # evicted, then needed again
    files = sorted(f for f in os.listdir(cache.dir) if f.endswith(".h5"))
    assert len(files) <= 2


def test_corrupt_source_leftovers_and_lock(dataset, tmp_path):
    m = read_manifest(str(dataset))
    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    data = bytearray((bad / m["shards"][1]["file"]).read_bytes())
    data[-50] ^= 1
    (bad / m["shards"][1]["file"]).write_bytes(bytes(data))
    cache = NodeCache(str(tmp_path / "c"), str(bad), m, SerialComm(), prefetch=0)
    with pytest.raises(DataError, match=rf"^{bad}/{m['shards'][1]['file']}: sha256 mismatch"):
        run_steps(cache, [[0], [1]])
    # a second job on the same cache directory is refused while the first holds the lock
    with pytest.raises(DataError, match="in use by another running job"):
        NodeCache(str(tmp_path / "c"), str(bad), m, SerialComm())
    os.close(cache._lock_fd)  # the first job ends (as after a kill -9: the kernel drops the lock)
    d = cache.dir
    open(os.path.join(d, ".tmp-12345-train_00002.h5"), "wb").write(b"partial")
    cached = os.path.join(d, m["shards"][0]["file"])
    data = bytearray(open(cached, "rb").read())
    data[-50] ^= 1
    open(cached, "wb").write(bytes(data))
    cache = NodeCache(str(tmp_path / "c"), str(bad), m, SerialComm(), prefetch=0)
    assert not [f for f in os.listdir(d) if f.startswith(".tmp-")]
    assert run_steps(cache, [[0], [2]]) == [first_tokens(dataset, m, 0), first_tokens(dataset, m, 2)]
    assert cache.node["refetched"] == 1 and cache.copies_per_shard[m["shards"][0]["file"]] == 1


def test_resolve_cache_dir(monkeypatch):
    monkeypatch.delenv("HPCTRAIN_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    monkeypatch.delenv("TMPDIR", raising=False)
    assert resolve_cache_dir("auto", 3) is None and resolve_cache_dir("off", 0) is None
    monkeypatch.setenv("TMPDIR", "/scratch/t")
    assert resolve_cache_dir("auto", 3) == "/scratch/t"
    monkeypatch.setenv("SLURM_TMPDIR", "/local/job")
    assert resolve_cache_dir("auto", 1) == "/local/job"
    assert resolve_cache_dir("/dev/shm/c{node}", 2) == "/dev/shm/c2"
    monkeypatch.setenv("HPCTRAIN_RANKS_PER_NODE", "2")
    assert resolve_cache_dir("/x", 1) == "/x/node1"


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    from data_tools.corpora import shakespeare_files

    out = tmp_path_factory.mktemp("d") / "small"
    shard_dataset(shakespeare_files()[:1], str(out), tokenizer="bytes", shard_tokens=4000,
                  val_fraction=0.0, progress=False, log=lambda s: None)
    return out


def node_needs(train, sampler, steps):
    return [sorted(set(train.shard_ids_of(sampler.indices_at(k)).tolist())) for k in range(steps)]


def test_block_order_stages_each_shard_once_per_epoch(small_shards, tmp_path):
    """A budget of two blocks: the block order copies every shard exactly once in an epoch; the
    global order, under the same budget, copies shards again and again (and says so at start)."""
    from types import SimpleNamespace

    from hpctrain.data.prefetch import DataFeed
    from hpctrain.data.sampler import GlobalSampler
    from hpctrain.data.shards import TokenShards

    m = read_manifest(str(small_shards))
    train = TokenShards(str(small_shards), "train", block_size=32)
    n_shards = len(train.shard_ids)
    assert n_shards >= 20
    budget = 2 * 4 * max(e["bytes"] for e in m["shards"])
    copies = {}
    for shuffle in ("block", "global"):
        sampler = GlobalSampler(len(train), 16, 5, train.samples_per_shard, shuffle, 4)
        steps = sampler.steps_per_epoch if shuffle == "block" else 40
        cache = NodeCache(str(tmp_path / shuffle), str(small_shards), m, SerialComm(),
                          budget=budget, prefetch=2)
        feed = DataFeed(cache, None)
        feed.data = SimpleNamespace(sampler=sampler, train=train)
        warning = feed.budget_warning(0)
        assert (warning is None) == (shuffle == "block"), warning
        run_steps(cache, node_needs(train, sampler, steps))
        copies[shuffle] = cache.node["copies"]
        assert cache.used <= budget or shuffle == "global"
        os.close(cache._lock_fd)
    print(f"{n_shards} shards, budget {budget} B: copies {copies} (global: first 40 steps)")
    assert copies["block"] == n_shards, copies
    assert copies["global"] > 3 * n_shards, copies
    feed.data.sampler = GlobalSampler(len(train), 16, 5, train.samples_per_shard, "block", 8)
    assert "data.shuffle_block_shards=8" in feed.budget_warning(0)
