"""NodeCache on one rank (a one-rank node: data_tools' SerialComm): staging, LRU eviction under
the budget, a corrupt source shard, crash leftovers and the lock, folders and files under the
cache directory that another user planted or can write (refused / fetched again). Multi-node:
tests/mpi; whole training runs against a hostile or failing node: test_data_cache_faults.py."""
import os
import shutil
import stat

import numpy as np
import pytest

from data_tools.format import DataError, read_manifest
from data_tools.mpiutil import SerialComm
from data_tools.shard import shard_dataset
from hpctrain.data.cache import CacheUnavailable, NodeCache, dataset_key, resolve_cache_dir


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from data_tools.corpora import shakespeare_files

    out = tmp_path_factory.mktemp("d") / "ds"
    shard_dataset(shakespeare_files()[:1], str(out), tokenizer="bytes", shard_tokens=40000,
                  val_fraction=0.0, progress=False, log=lambda s: None)
    return out


def run_steps(cache, needs, block_plan=None):
    """Play the ranks' side: publish each step, read its shards; return what was read."""
    cache.start(0, len(needs), lambda k: needs[k], block_plan=block_plan)
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


OTHER_UID = 65534  # "nobody": another user of the node (root can chown to it)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@needs_root
@pytest.mark.parametrize("case", ["others_user_root", "others_dataset_dir", "open_user_root",
                                  "others_cache_dir", "open_cache_dir"])
def test_folder_of_another_user_or_writable_by_others_is_refused(dataset, tmp_path, case):
    """<cache_dir>/hpctrain-<uid>/<key> pre-created mode 0777 (by uid 65534, or by us), or the
    cache_dir itself another user's / writable by all without the sticky bit: the cache refuses
    it (CacheUnavailable naming the folder and why) and writes nothing into it."""
    m = read_manifest(str(dataset))
    base = tmp_path / "scratch"
    user_root = base / f"hpctrain-{os.geteuid()}"
    target = {"others_dataset_dir": user_root / dataset_key(str(dataset)),
              "others_cache_dir": base, "open_cache_dir": base}.get(case, user_root)
    target.mkdir(parents=True)
    (target / m["shards"][0]["file"]).write_bytes(b"planted")
    if user_root.exists():
        os.chmod(user_root, 0o700)
    os.chmod(target, 0o777)
    if case.startswith("others"):
        os.chown(target, OTHER_UID, OTHER_UID)
    with pytest.raises(CacheUnavailable) as err:
        NodeCache(str(base), str(dataset), m, SerialComm())
    assert str(err.value).startswith(f"{target}: ")
    assert (f"uid {OTHER_UID}" if case.startswith("others") else "mode 777") in str(err.value)
    assert sorted(os.listdir(target)) == [m["shards"][0]["file"]]
    assert (target / m["shards"][0]["file"]).read_bytes() == b"planted"


@needs_root
def test_cached_files_others_could_have_written_are_fetched_again(dataset, tmp_path):
    """Files in our cache folder left by an earlier run: a world-writable shard, one owned by
    another uid, and a symlink named like a shard (to a file of the dataset) are never used: the
    cache fetches those three again, reuses only the intact file, and the symlink's target is
    untouched."""
    m = read_manifest(str(dataset))
    names = [e["file"] for e in m["shards"][:4]]
    cache = NodeCache(str(tmp_path), str(dataset), m, SerialComm(), prefetch=0)
    run_steps(cache, [[0], [1], [2]])
    os.close(cache._lock_fd)
    d = cache.dir
    os.chmod(os.path.join(d, names[0]), 0o666)
    os.chown(os.path.join(d, names[1]), OTHER_UID, OTHER_UID)
    target = os.path.join(dataset, names[3])
    before = open(target, "rb").read()
    os.symlink(target, os.path.join(d, names[3]))
    cache = NodeCache(str(tmp_path), str(dataset), m, SerialComm(), prefetch=0)
    assert run_steps(cache, [[0], [1], [2], [3]]) == [first_tokens(dataset, m, i) for i in range(4)]
    assert cache.node["reused"] == 1 and sorted(cache.copies_per_shard) == sorted(
        [names[0], names[1], names[3]])
    for name in names:
        st = os.lstat(os.path.join(d, name))
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == 0o600, (name, oct(st.st_mode))
    assert open(target, "rb").read() == before
    os.close(cache._lock_fd)


@needs_root
def test_disk_full_mid_run_reads_data_path_still_verified(dataset, tmp_path):
    """A cache disk (real tmpfs) with room for 1.5 shards and a budget for all: the second shard
    meets ENOSPC, the leader stops writing there (no temp file, no error.txt) and hands out
    data.path's copy (verified: the third, corrupt there, is a DataError naming it)."""
    from tests.conftest import Mounts

    m = read_manifest(str(dataset))
    src = tmp_path / "src"
    shutil.copytree(dataset, src)
    third = src / m["shards"][2]["file"]
    data = bytearray(third.read_bytes())
    data[-50] ^= 1
    third.write_bytes(bytes(data))
    mounts = Mounts()
    try:
        disk = mounts.tmpfs(tmp_path / "disk", f"{m['shards'][0]['bytes'] * 3 // 2 // 1024}k")
        cache = NodeCache(str(disk), str(src), m, SerialComm(), budget=1 << 30, prefetch=0)
        assert run_steps(cache, [[0], [1]]) == [first_tokens(dataset, m, i) for i in (0, 1)]
        assert cache.shared_only and cache.node["copies"] == 1
        assert cache.acquire(0)[0] == cache.path_of(0)
        assert cache.acquire(1)[0] == str(src / m["shards"][1]["file"])
        with pytest.raises(DataError, match=rf"^{third}: sha256 mismatch"):
            cache._stage(2)
        assert sorted(os.listdir(cache.dir)) == sorted(["lock", m["shards"][0]["file"],
                                                        "state.bin", "stats.json"])
        os.close(cache._lock_fd)
    finally:
        mounts.remove()


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


def block_feed(small_shards, tmp_path, budget_blocks, prefetch_blocks, block_shards=4, epochs=1):
    """A one-rank node reading the block order of ``small_shards`` through a cache of
    ``budget_blocks`` blocks of the largest shard; (feed, cache, needs of each step of
    ``epochs`` epochs)."""
    from types import SimpleNamespace

    from hpctrain.data.prefetch import DataFeed
    from hpctrain.data.sampler import GlobalSampler
    from hpctrain.data.shards import TokenShards

    m = read_manifest(str(small_shards))
    train = TokenShards(str(small_shards), "train", block_size=32)
    sampler = GlobalSampler(len(train), 16, 5, train.samples_per_shard, "block", block_shards)
    budget = int(budget_blocks * block_shards * max(e["bytes"] for e in m["shards"]))
    cache = NodeCache(str(tmp_path), str(small_shards), m, SerialComm(), budget=budget,
                      prefetch=2, prefetch_blocks=prefetch_blocks)
    feed = DataFeed(cache, None)
    feed.data = SimpleNamespace(sampler=sampler, train=train, micro_batch=16, grad_accum=1)
    feed.local_dp, feed._plan_sampler = [0], sampler.copy()
    return feed, cache, node_needs(train, sampler, epochs * sampler.steps_per_epoch)


def read_with_slow_pfs(cache, needs, block_plan, copies_per_step=1):
    """The ranks' side, step by step and without threads: the leader's ``work()`` copies
    ``copies_per_step`` shards from the shared file system while a step computes; a shard not
    ready when the step reads it is a miss (the rank waits while the leader stages it).
    Returns (misses per step, log of ("copy"/"evict", shard, slowest rank's step))."""
    log = []
    stage, evict = cache._stage, cache._evict
    cache._stage = lambda i: (log.append(("copy", i, int(cache.progress.min()))), stage(i))
    cache._evict = lambda j: (log.append(("evict", j, int(cache.progress.min()))), evict(j))
    cache.start(0, len(needs), lambda k: needs[k], block_plan=block_plan, background=False)
    misses = []
    for k in range(len(needs)):
        cache.publish(k)
        missed = 0
        for i in needs[k]:
            if cache.ready[i] <= 0:
                missed += 1
                while cache.ready[i] <= 0:
                    assert cache.work(), "the leader stalled with a rank waiting"
            cache.acquire(i)
        misses.append(missed)
        goal = cache.node["copies"] + copies_per_step  # this step's compute time
        while cache.node["copies"] < goal and cache.work():
            pass
    os.close(cache._lock_fd)
    return misses, log


def evicted_while_needed(log, needs, upto):
    """Evictions of a shard that a step in [slowest rank's step, upto(slowest)] reads."""
    return [(j, p) for what, j, p in log if what == "evict"
            and any(j in needs[s] for s in range(max(p, 0), min(upto(p), len(needs) - 1) + 1))]


def test_block_lookahead_stages_the_next_block_before_its_first_step(small_shards, tmp_path):
    """Budget of two blocks, a shared file system that copies one shard per step, two epochs:
    without look-ahead every block boundary waits for its shards (prefetch = 2 steps is too
    short); with it, the leader stages block b+1 while the node reads block b (across the epoch
    boundary too), so after block 0 no step misses, every shard is still copied once per epoch
    (once in all in epoch 0), and nothing that a later step of the epoch reads is evicted."""
    runs = {}
    for blocks in (1, 0):
        feed, cache, needs = block_feed(small_shards, tmp_path / f"b{blocks}", 2, blocks, epochs=2)
        plan = feed.lookahead_plan(0)
        assert plan is not None  # two blocks fit: no warning
        misses, log = read_with_slow_pfs(cache, needs, plan)
        runs[blocks] = (misses, log, cache)
    sampler, n_shards = feed._plan_sampler, len(feed.data.train.shard_ids)
    per_epoch = sampler.steps_per_epoch
    starts, z = [], 0  # the first step of each block (a batch straddling two is in both)
    while z < len(needs):
        starts.append(sampler.block_steps(z)[0])
        z = sampler.block_steps(z)[1]
    assert len(starts) >= 4, starts
    on_misses, on_log, on = runs[1]
    off_misses, _, off = runs[0]
    print(f"{n_shards} shards, blocks start at {starts}: misses at block starts with look-ahead "
          f"{[on_misses[a] for a in starts]}, without {[off_misses[a] for a in starts]}; "
          f"after block 0: {sum(on_misses[starts[1]:])} vs {sum(off_misses[starts[1]:])}; "
          f"look-ahead staged {on.node['lookahead']}")
    assert sum(on_misses[starts[1]:]) == 0, on_misses
    assert off_misses[starts[1]] > 0, off_misses  # per-step staging alone waits there
    assert sum(off_misses[a] > 0 for a in starts[1:]) >= len(starts) // 2, off_misses
    block0 = set(feed._block_plan(0).shards.tolist())
    assert on.node["lookahead"] == on.node["copies"] - len(block0) and off.node["lookahead"] == 0
    last0 = max(a for a in starts if a < per_epoch)  # epoch 0's last block starts
    for c, log in ((on, on_log), (off, runs[0][1])):
        epoch0 = [i for what, i, p in log if what == "copy" and p < last0]  # none of epoch 1's
        assert len(epoch0) == len(set(epoch0)), epoch0
        assert c.node["copies"] <= 2 * n_shards and max(c.copies_per_shard.values()) == 2
        assert c.used <= c.budget
    assert len([i for what, i, p in on_log if what == "copy" and p < last0]) == n_shards
    # in an epoch every shard is in one block: nothing the epoch reads again is evicted; and
    # across the epoch boundary nothing the current or the next block reads
    epoch0 = [e for e in on_log if e[2] < per_epoch]
    assert evicted_while_needed(epoch0, needs, lambda p: per_epoch - 1) == []
    next_block_end = lambda p: sampler.block_steps(sampler.block_steps(p)[1])[1] - 1  # noqa: E731
    assert evicted_while_needed(on_log, needs, next_block_end) == []
    # the same with the leader's thread and ranks that do not wait: still one copy per shard
    feed, cache, needs = block_feed(small_shards, tmp_path / "thread", 2, 1)
    run_steps(cache, needs, feed.lookahead_plan(0))
    assert cache.node["copies"] == n_shards and set(cache.copies_per_shard.values()) == {1}
    assert cache.used <= cache.budget


def test_block_lookahead_off_when_two_blocks_do_not_fit(small_shards, tmp_path):
    """A budget of 1.5 blocks: the feed warns and stages per step only (the same copies and
    evictions, in the same order, as data.prefetch_blocks = 0); even given the block plan, the
    cache's look-ahead only stages what fits beside what the node still needs: it never evicts a
    shard a step >= the slowest rank's step reads, in the epoch."""
    logs = {}
    for name, blocks in (("on", 1), ("off", 0), ("forced", 1)):
        feed, cache, needs = block_feed(small_shards, tmp_path / name, 1.5, blocks)
        plan = feed._block_plan if name == "forced" else feed.lookahead_plan(0)
        assert (plan is None) == (name != "forced")
        misses, logs[name] = read_with_slow_pfs(cache, needs, plan)
        assert cache.used <= cache.budget
        print(f"1.5 blocks, {name}: {sum(misses)} misses, {cache.node['copies']} copies, "
              f"{cache.node['lookahead']} staged ahead")
        if name == "on":
            assert cache.node["lookahead"] == 0
    assert logs["on"] == logs["off"]
    assert evicted_while_needed(logs["off"], needs, lambda p: p + 2) == []  # prefetch window
    assert evicted_while_needed(logs["forced"], needs, lambda p: len(needs)) == []
