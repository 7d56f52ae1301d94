"""data.shuffle = "block": a permutation per epoch computed a block at a time (O(shards) memory),
the same for every dp size, exact on resume, reading one block of shards at a time; and the
old "global" order still resumes from its checkpoints."""
import json
import tracemalloc

import numpy as np
import pytest

from hpctrain.data.sampler import GlobalSampler, split_for_rank
from hpctrain.errors import CheckpointError


def windows(n_shards, seed=0, high=40):
    w = np.random.default_rng(seed).integers(0, high, size=n_shards)
    w[0] = max(int(w[0]), 1)
    return w


def block(w, gb=7, seed=3, shards=4):
    return GlobalSampler(int(np.sum(w)), gb, seed, w, "block", shards)


@pytest.mark.parametrize("n_shards,block_shards", [(1, 4), (5, 1), (37, 4), (37, 6), (12, 64)])
def test_every_window_exactly_once_per_epoch(n_shards, block_shards):
    w = windows(n_shards)
    s = block(w, shards=block_shards)
    for epoch in range(3):
        order = s.epoch_order(epoch)
        assert np.array_equal(np.sort(order), np.arange(int(w.sum()))), epoch
    if n_shards > block_shards:
        assert not np.array_equal(s.epoch_order(0), s.epoch_order(1))
        assert not np.array_equal(s.epoch_order(0), block(w, seed=4, shards=block_shards).epoch_order(0))


def test_one_block_is_exactly_the_global_order():
    w = windows(10)
    n = int(w.sum())
    for epoch in range(2):
        want = np.random.Generator(np.random.PCG64([3, epoch])).permutation(n)
        assert np.array_equal(block(w, shards=10).epoch_order(epoch), want)
        assert np.array_equal(GlobalSampler(n, 7, 3, w, "global").epoch_order(epoch), want)
    assert not np.array_equal(block(w, shards=3).epoch_order(0), block(w, shards=10).epoch_order(0))


def test_a_block_reads_only_its_shards():
    w = windows(40, high=30)
    s = block(w, shards=5)
    first = np.concatenate([[0], np.cumsum(w)])
    shard_of = np.searchsorted(first, s.epoch_order(0), side="right") - 1
    at = 0
    for shards in s.blocks(0):
        size = int(w[shards].sum())
        assert set(shard_of[at:at + size].tolist()) <= set(shards.tolist())
        at += size
    assert at == int(w.sum())
    assert len(s.blocks(0)) == 8 and sorted(np.concatenate(s.blocks(0)).tolist()) == list(range(40))
    order0, order1 = np.concatenate(s.blocks(0)), np.concatenate(s.blocks(1))
    assert not np.array_equal(order0, np.arange(40)) and not np.array_equal(order0, order1)


@pytest.mark.parametrize("n_shards,block_shards", [(37, 4), (37, 6), (5, 1), (12, 64)])
def test_block_steps_chain_through_epochs_and_cover_each_steps_windows(n_shards, block_shards):
    """What the node cache stages a block ahead from: block_steps(k) -> (a, z, shards) chains
    block after block (z starts the next, across epochs; a straddling batch is in both); every
    window a step reads is in the shards of a block holding that step; indices_between(a, z)
    is indices_at of each step."""
    w = windows(n_shards)
    s = block(w, shards=block_shards)
    first_window = np.concatenate([[0], np.cumsum(w)])
    end, k, seen, prev = 2 * s.steps_per_epoch + 3, 0, {}, None
    while k < end:
        a, z, shards = s.block_steps(k)
        assert a <= k < z and (prev is None or a in (prev, prev - 1)), (k, a, z, prev)
        batches = s.indices_between(a, z)
        assert batches.shape == (z - a, s.global_batch)
        for j in range(a, z):
            assert np.array_equal(batches[j - a], s.indices_at(j))
            seen.setdefault(j, set()).update(shards.tolist())
        prev, k = z, z
    for j in range(end):
        read = np.searchsorted(first_window, s.indices_at(j), side="right") - 1
        assert set(read.tolist()) <= seen[j], j
    assert s.indices_between(4, 4).shape == (0, s.global_batch)


def test_seek_and_indices_at_agree_with_next_indices():
    w = windows(37)
    walked = block(w)
    steps = [walked.next_indices() for _ in range(3 * walked.steps_per_epoch + 3)]
    first = np.concatenate([[0], np.cumsum(w)])
    for k in range(len(steps)):
        assert np.array_equal(block(w).indices_at(k), steps[k]), k
        jumped = block(w)
        jumped.seek(k)
        assert np.array_equal(jumped.next_indices(), steps[k]), k
        read = set((np.searchsorted(first, steps[k], side="right") - 1).tolist())
        assert read <= set(walked.shards_between(k, k + 1).tolist()), k
    assert walked.shards_between(0, len(steps)).tolist() == list(range(37))


def test_state_records_the_order_and_resumes_exactly():
    w = windows(37)
    s = block(w)
    for _ in range(s.steps_per_epoch + 2):
        s.next_indices()
    state = json.loads(json.dumps(s.state_dict()))
    assert state["shuffle"] == "block" and state["block_shards"] == 4
    r = GlobalSampler(int(w.sum()), 7, 0, w, "global")  # the saved order and seed win
    r.load_state_dict(state)
    assert (r.shuffle, r.block_shards, r.seed) == ("block", 4, 3)
    for _ in range(30):
        assert np.array_equal(s.next_indices(), r.next_indices())
    del state["block_shards"]
    with pytest.raises(CheckpointError, match="block_shards"):
        r.load_state_dict(state)


def test_a_global_checkpoint_resumes_the_global_order():
    w = windows(37)
    old = GlobalSampler(int(w.sum()), 7, 3)  # as saved before data.shuffle existed
    for _ in range(5):
        old.next_indices()
    state = old.state_dict()
    assert "shuffle" not in state
    new = block(w, seed=0)
    new.load_state_dict(state)
    assert new.shuffle == "global"
    for _ in range(40):
        assert np.array_equal(old.next_indices(), new.next_indices())


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="data.shuffle must be one of"):
        GlobalSampler(10, 2, 0, shuffle="random")
    with pytest.raises(ValueError, match="data.shuffle_block_shards must be >= 1"):
        GlobalSampler(10, 2, 0, [4, 6], "block", 0)
    with pytest.raises(ValueError, match="shard_windows sum to 9"):
        GlobalSampler(10, 2, 0, [4, 5], "block", 1)


def test_a_trillion_tokens_in_little_memory_for_every_dp_size():
    """1e12 tokens in 2,048-token windows over 100,000 shards (488M windows: the "global" order
    would hold 3.9 GB): the first 1,000 steps of 512 sequences on dp 1/8/64/512, resumed mid-way."""
    n_shards, tokens, block_size, gb = 100_000, 10**12, 2048, 512
    per_shard = np.full(n_shards, tokens // n_shards // block_size, dtype=np.int64)
    per_shard[: (tokens // block_size) - int(per_shard.sum())] += 1
    n = int(per_shard.sum())
    assert n == tokens // block_size
    tracemalloc.start()
    reference = None
    for dp in (1, 8, 64, 512):
        mb = gb // dp
        ranks = [GlobalSampler(n, gb, 7, per_shard, "block") for _ in range(2)]  # rank 0, last
        steps = []
        for k in range(1000):
            if k == 500:  # a restart: state -> JSON -> a fresh sampler
                state = json.loads(json.dumps(ranks[1].state_dict()))
                ranks[1] = GlobalSampler(n, gb, 0, per_shard, "block")
                ranks[1].load_state_dict(state)
            g0, g1 = ranks[0].next_indices(), ranks[1].next_indices()
            assert np.array_equal(g0, g1), (dp, k)
            parts = [split_for_rank(g0, r, dp, mb, 1)[0] for r in range(0, dp, max(1, dp // 8))]
            assert all(p.size == mb for p in parts)
            steps.append(np.concatenate([split_for_rank(g0, r, dp, mb, 1)[0] for r in range(dp)])
                         if k % 100 == 0 else g0)
        got = np.concatenate(steps)
        if reference is None:
            reference = got
            assert np.unique(got).size == got.size and 0 <= got.min() and got.max() < n
        assert np.array_equal(got, reference), dp
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"1e12 tokens, {n:,} windows, 4 dp sizes x 1,000 steps: peak {peak / 2**20:.1f} MiB")
    assert peak < 200 * 2**20


def test_make_sampler_passes_the_readers_shards_and_the_order(tmp_path):
    from data_tools.corpora import shakespeare_files
    from data_tools.shard import shard_dataset
    from hpctrain.data import TokenShards, make_sampler

    shard_dataset(shakespeare_files()[:1], str(tmp_path / "d"), tokenizer="bytes",
                  shard_tokens=4000, val_fraction=0.0, progress=False, log=lambda s: None)
    reader = TokenShards(str(tmp_path / "d"), "train", block_size=32)
    s = make_sampler(reader, 16, 5, "block", 4)
    assert (s.shuffle, s.block_shards) == ("block", 4)
    assert np.array_equal(s.shard_windows, reader.samples_per_shard)
    for k, shards in enumerate([s.shards_between(k, k + 1) for k in range(20)]):
        read = np.searchsorted(reader.cum, s.indices_at(k), side="right") - 1
        assert set(read.tolist()) <= set(shards.tolist()) and shards.size <= 8, k
    assert make_sampler(reader, 16, 5).shuffle == "global"  # the library default; config: block
