"""#21 for blends: each component's epoch is a block order over its own shards (O(shards)
memory), still exactly the old full permutation for components of at most block_shards shards,
still a pure function of the step (the same for every dp size) and exact on resume."""
import json
import time
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from hpctrain.data.mixture import MixtureSampler, interleave
from hpctrain.data.prefetch import DataFeed
from hpctrain.data.sampler import split_for_rank
from hpctrain.errors import CheckpointError


def windows(n_shards, seed, high=40):
    w = np.random.default_rng(seed).integers(0, high, size=n_shards)
    w[0] = max(int(w[0]), 1)
    return w


def mixture(ws, parts=(7, 3), gb=12, seed=5, blend_seed=4, shuffle="block", shards=4):
    return MixtureSampler([int(np.sum(w)) for w in ws], parts, gb, seed, blend_seed, ws, shuffle,
                          shards)


def old_stream(sizes, parts, seed, blend_seed, start, stop):
    """The blend order before #21, computed directly from its definition: position s takes
    component pattern[s % period] and is its j-th draw; draw j is
    PCG64([seed, blend_seed, c, j // n_c]).permutation(n_c)[j % n_c] (+ the offset of c)."""
    pattern = interleave(list(parts), blend_seed)
    period, offsets = len(pattern), np.concatenate([[0], np.cumsum(sizes)])
    out, perms = [], {}
    for s in range(start, stop):
        c = int(pattern[s % period])
        j = (s // period) * parts[c] + int(np.sum(pattern[:s % period] == c))
        e, p = divmod(j, int(sizes[c]))
        if (c, e) not in perms:
            rng = np.random.Generator(np.random.PCG64([seed, blend_seed, c, e]))
            perms[(c, e)] = rng.permutation(int(sizes[c]))
        out.append(int(offsets[c]) + int(perms[(c, e)][p]))
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("shuffle,shards", [("block", 4), ("block", 64), ("global", 1)])
def test_small_components_keep_the_old_order_bit_for_bit(shuffle, shards):
    """Components of <= block_shards shards ("global": any number) are one block each: exactly
    the old per-component permutations, across several epochs of the small component."""
    ws = [windows(4 if shards == 4 else 37, 1), windows(3, 2, high=9)]
    s = mixture(ws, shuffle=shuffle, shards=shards)
    sizes = [int(np.sum(w)) for w in ws]
    got = np.concatenate([s.next_indices() for _ in range(40)])
    assert np.array_equal(got, old_stream(sizes, (7, 3), 5, 4, 0, 480))
    assert s.component_epochs()[1] > 3  # the small component went round several epochs


def test_many_shards_read_a_block_at_a_time_and_each_window_once_per_epoch():
    ws = [windows(37, 1), windows(23, 2)]
    s = mixture(ws, shards=4)
    sizes = np.array([int(np.sum(w)) for w in ws])
    steps = int(np.ceil(max(sizes / np.array([0.7, 0.3])) / s.global_batch)) + 2
    idx = np.concatenate([s.next_indices() for _ in range(steps)])
    comp = np.searchsorted(np.cumsum(sizes), idx, side="right")
    assert not np.array_equal(idx[: 480], old_stream(sizes, (7, 3), 5, 4, 0, 480))
    for c in (0, 1):
        drawn = idx[comp == c] - s.offsets[c]
        assert drawn.size >= sizes[c], c
        first = drawn[: sizes[c]]  # the component's epoch 0: a permutation of its windows
        assert np.array_equal(np.sort(first), np.arange(sizes[c])), c
        assert np.array_equal(first, s.order(c, 0)) and not np.array_equal(first, s.order(c, 1))
        # ... read block after block: each block's draws come from its 4 shards only
        shard_of = np.searchsorted(np.cumsum(ws[c]), first, side="right")
        order, at = s._orders[c].shard_order_of(0), 0
        for b in range(0, order.size, 4):
            n = int(ws[c][order[b:b + 4]].sum())
            assert set(shard_of[at:at + n].tolist()) <= set(order[b:b + 4].tolist()), (c, b)
            at += n


def test_resume_mid_epoch_is_exact_and_the_saved_order_wins():
    ws = [windows(37, 1), windows(23, 2)]
    s = mixture(ws, shards=4)
    ref = [s.next_indices() for _ in range(60)]
    s = mixture(ws, shards=4)
    for _ in range(23):
        s.next_indices()
    state = json.loads(json.dumps(s.state_dict()))
    assert (state["shuffle"], state["block_shards"]) == ("block", 4)
    r = mixture(ws, seed=0, shuffle="global", shards=64)  # the saved seed and order win
    r.load_state_dict(state)
    assert (r.shuffle, r.block_shards, r.seed, r.steps_done) == ("block", 4, 5, 23)
    for k in range(23, 60):
        assert np.array_equal(r.next_indices(), ref[k]), k
    assert np.array_equal(r.copy().indices_at(31), ref[31])
    del state["block_shards"]
    with pytest.raises(CheckpointError, match="block_shards"):
        r.load_state_dict(state)


def test_a_checkpoint_from_before_21_resumes_the_old_order():
    """A state without ``shuffle`` was saved by the old full permutations: it continues them,
    for components of any number of shards, whatever data.shuffle says now."""
    ws = [windows(37, 1), windows(23, 2)]
    sizes = [int(np.sum(w)) for w in ws]
    s = mixture(ws, shuffle="global")
    for _ in range(17):
        s.next_indices()
    state = s.state_dict()
    assert "shuffle" not in state and "block_shards" not in state
    r = mixture(ws, shards=4)
    r.load_state_dict(state)
    assert r.shuffle == "global"
    got = np.concatenate([r.next_indices() for _ in range(30)])
    assert np.array_equal(got, old_stream(sizes, (7, 3), 5, 4, 17 * 12, 47 * 12))


def test_the_order_is_the_same_for_every_dp_size():
    ws = [windows(37, 1), windows(23, 2)]
    walked = mixture(ws, gb=24, shards=4)
    ref = [walked.next_indices() for _ in range(50)]
    for k in (0, 7, 49, 23, 1):  # random access, out of order, from a fresh copy
        assert np.array_equal(walked.copy().indices_at(k), ref[k]), k
    for dp, mb, accum in ((1, 6, 4), (2, 3, 4), (4, 3, 2), (8, 3, 1)):
        s = mixture(ws, gb=24, shards=4)
        for k in range(50):
            g = s.next_indices()
            assert np.array_equal(g, ref[k])
            mine = [m for r in range(dp) for m in split_for_rank(g, r, dp, mb, accum)]
            assert np.array_equal(np.concatenate(mine), g)


def test_the_node_cache_stages_a_blend_per_step():
    """A blend has no block_steps/blocks: DataFeed's block look-ahead stays off for it."""
    s = mixture([windows(37, 1), windows(23, 2)], shards=4)
    assert s.shuffle == "block" and not hasattr(s, "blocks")
    assert DataFeed._block_plan(SimpleNamespace(_plan_sampler=s, data=None), 0) is None


def test_bad_settings():
    with pytest.raises(ValueError, match="sum to"):
        MixtureSampler([10, 5], [1, 1], 4, 0, 0, [[4, 5], [5]], "block", 2)
    with pytest.raises(ValueError, match="data.shuffle must be one of"):
        MixtureSampler([10, 5], [1, 1], 4, 0, 0, None, "random")
    with pytest.raises(ValueError, match="shuffle_block_shards must be >= 1"):
        MixtureSampler([10, 5], [1, 1], 4, 0, 0, [[4, 6], [5]], "block", 0)


def test_a_trillion_token_blend_in_little_memory():
    """1e12 tokens in 2,048-token windows, 0.7 / 0.3 over components of 70,000 and 30,000 shards
    (488M windows: the old full permutations would hold 3.9 GB per rank, 7.8 GB across an epoch
    change): 1,000 steps of 512, resumed mid-way from JSON, checked against random access."""
    tokens, block_size, gb = 10**12, 2048, 512
    ws = []
    for share, n_shards in ((7, 70_000), (3, 30_000)):
        n = tokens * share // 10 // block_size
        w = np.full(n_shards, n // n_shards, dtype=np.int64)
        w[: n - int(w.sum())] += 1
        ws.append(w)
    assert sum(int(w.sum()) for w in ws) == 488_281_250
    mixture([[5, 5], [5]], gb=4).next_indices()  # numpy's lazy imports are not the sampler's
    tracemalloc.start()
    t0 = time.perf_counter()
    ranks = [mixture(ws, gb=gb, seed=7, shards=64) for _ in range(2)]
    got = []
    for k in range(1000):
        if k == 500:  # a restart: state -> JSON -> a fresh sampler
            state = json.loads(json.dumps(ranks[1].state_dict()))
            ranks[1] = mixture(ws, gb=gb, seed=0, shards=64)
            ranks[1].load_state_dict(state)
        g0, g1 = ranks[0].next_indices(), ranks[1].next_indices()
        assert np.array_equal(g0, g1), k
        got.append(g0)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    got = np.concatenate(got)
    assert np.unique(got).size == got.size and 0 <= got.min() and got.max() < 488_281_250
    assert np.array_equal(ranks[0].copy().indices_at(999), got[-gb:])
    print(f"1e12-token blend, 2 components, 100,000 shards: 2 samplers x 1,000 steps of {gb}: "
          f"peak {peak / 2**20:.1f} MiB, {seconds:.1f} s")
    assert peak < 200 * 2**20
