"""GlobalSampler / split_for_rank: deterministic, epoch rollover, DP-size independent, resumable."""
import json

import numpy as np
import pytest

from hpctrain.data.sampler import GlobalSampler, split_for_rank
from hpctrain.errors import ConfigError


def test_deterministic_and_matches_spec():
    a, b = GlobalSampler(100, 8, seed=3), GlobalSampler(100, 8, seed=3)
    steps = [a.next_indices() for _ in range(30)]
    assert all(np.array_equal(x, b.next_indices()) for x in steps)
    order0 = np.random.Generator(np.random.PCG64([3, 0])).permutation(100)
    assert np.array_equal(np.concatenate(steps[:12]), order0[:96])
    assert not np.array_equal(GlobalSampler(100, 8, seed=4).next_indices(), steps[0])


def test_epoch_rollover_drops_remainder():
    s = GlobalSampler(10, 4, seed=0)
    assert s.steps_per_epoch == 2
    e0 = np.random.Generator(np.random.PCG64([0, 0])).permutation(10)
    e1 = np.random.Generator(np.random.PCG64([0, 1])).permutation(10)
    got = [s.next_indices() for _ in range(4)]
    assert np.array_equal(got[0], e0[:4]) and np.array_equal(got[1], e0[4:8])
    assert np.array_equal(got[2], e1[:4]) and np.array_equal(got[3], e1[4:8])
    assert (s.epoch, s.position) == (1, 8)
    assert len(set(np.concatenate(got[:2]).tolist())) == 8  # no repeats inside an epoch


def test_dp_size_independence():
    gb = 24
    for dp, mb, accum in ((1, 6, 4), (2, 3, 4), (4, 3, 2), (4, 6, 1)):
        s = GlobalSampler(1000, gb, seed=11)
        ref = GlobalSampler(1000, gb, seed=11)
        for _ in range(50):
            g = s.next_indices()
            assert np.array_equal(g, ref.next_indices())
            parts = [split_for_rank(g, r, dp, mb, accum) for r in range(dp)]
            assert all(len(p) == accum and all(m.size == mb for m in p) for p in parts)
            assert np.array_equal(np.concatenate([m for p in parts for m in p]), g)
    assert split_for_rank(np.arange(8), 1, 2, 2, 2)[1].tolist() == [6, 7]
    with pytest.raises(ValueError, match="dp_size 2 x micro_batch 3 x grad_accum 2"):
        split_for_rank(np.arange(8), 0, 2, 3, 2)


def test_state_round_trip_resumes_exactly():
    s = GlobalSampler(37, 5, seed=9)
    for _ in range(9):  # crosses an epoch boundary (7 steps per epoch)
        s.next_indices()
    state = json.loads(json.dumps(s.state_dict()))
    assert state == {"seed": 9, "epoch": 1, "position": 10, "n_samples": 37, "global_batch": 5}
    r = GlobalSampler(37, 5, seed=0)  # the saved seed wins
    r.load_state_dict(state)
    for _ in range(20):
        assert np.array_equal(s.next_indices(), r.next_indices())
    with pytest.raises(ConfigError, match="dataset .* changed"):
        GlobalSampler(38, 5, seed=9).load_state_dict(state)


def test_batch_too_big_for_data():
    from hpctrain.errors import ConfigError

    with pytest.raises(ConfigError, match="'train.micro_batch_size'.* 64 sequences .* 50 windows"):
        GlobalSampler(50, 64, seed=0)
def test_seek_leaves_the_sampler_where_k_steps_would():
    """seek(k) = k calls of next_indices from a fresh sampler, epoch boundaries included."""
    from hpctrain.data.sampler import GlobalSampler

    for k in (0, 1, 4, 5, 6, 11):
        walked, jumped = GlobalSampler(23, 4, seed=3), GlobalSampler(23, 4, seed=3)
        for _ in range(k):
            walked.next_indices()
        jumped.seek(k)
        assert jumped.state_dict() == walked.state_dict(), k
        assert np.array_equal(jumped.next_indices(), walked.next_indices()), k
