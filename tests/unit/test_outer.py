"""The global model's update per arrival (hpctrain/sync/outer.py): pure arithmetic."""
import numpy as np
import pytest

from hpctrain.sync.outer import apply_arrival, dynamic_local_steps, with_updates_since


def _run(kind, grads, replicas, delay, lr=0.7, mu=0.9, scales=None):
    theta, m, acc = np.zeros(3), np.zeros(3), np.zeros(3)
    for t, g in enumerate(grads, 1):
        apply_arrival(kind, theta, m, acc, np.asarray(g, dtype=float), t, lr=lr, mu=mu,
                      replicas=replicas, delay=delay, lr_scale=1.0 if scales is None else scales[t - 1])
    return theta, m, acc


def test_delayed_nesterov_with_n_equal_replicas_is_synchronous_nesterov():
    """R arrivals per round, N = R: after every round theta equals synchronous DiLoCo's Nesterov
    step on the round's mean pseudo-gradient."""
    rng = np.random.default_rng(0)
    rounds = [rng.normal(size=(2, 3)) for _ in range(5)]
    theta, m, acc = _run("delayed_nesterov", [g for r in rounds for g in r], replicas=2, delay=2)
    ref, ref_m = np.zeros(3), np.zeros(3)
    for r in rounds:
        mean = r.mean(axis=0)
        ref_m = 0.9 * ref_m + mean
        ref -= 0.7 * (mean + 0.9 * ref_m)
    assert np.allclose(theta, ref, atol=1e-12) and np.allclose(m, ref_m) and not acc.any()


def test_a_constant_inner_lr_leaves_delayed_nesterov_unchanged():
    rng = np.random.default_rng(1)
    grads = rng.normal(size=(8, 3))
    plain, _, _ = _run("delayed_nesterov", grads, replicas=2, delay=2)
    scaled, _, _ = _run("delayed_nesterov", grads, replicas=2, delay=2, scales=[3e-4] * 8)
    assert np.allclose(plain, scaled, rtol=1e-9, atol=1e-12)


def test_delayed_momentum_follows_the_inner_lr_of_the_arrivals_it_is_applied_at():
    """Pseudo-gradients of rounds at inner lr 1e-2, then silent arrivals at 1e-3: every later
    momentum step moves theta 10x less than momentum kept as plain sums would (the
    short-run instability in docs/communication.md); the SGD part of each arrival is unchanged."""
    grads = [[1.0, 0, 0]] * 2 + [[0.0, 0, 0]] * 2
    before, m, _ = _run("delayed_nesterov", grads[:2], replicas=2, delay=2, scales=[1e-2] * 2)
    after, _, _ = _run("delayed_nesterov", grads, replicas=2, delay=2, scales=[1e-2] * 2 + [1e-3] * 2)
    sums, _, _ = _run("delayed_nesterov", grads, replicas=2, delay=2)
    sums_before, _, _ = _run("delayed_nesterov", grads[:2], replicas=2, delay=2)
    assert np.allclose(before, sums_before)  # the first round: the same step
    assert m[0] == pytest.approx(100.0)  # per unit of inner lr: 1 / 1e-2
    late, late_sums = after[0] - before[0], sums[0] - sums_before[0]
    assert late_sums == pytest.approx(-0.7 * 0.9 * 0.9 * 1.0)  # mu * m of the earlier round
    assert late == pytest.approx(late_sums / 10)


def test_naive_nesterov_differs_and_sgd_is_plain():
    grads = [[1.0, 0, 0], [1.0, 0, 0]]
    naive, _, _ = _run("nesterov", grads, replicas=2, delay=2)
    delayed, _, _ = _run("delayed_nesterov", grads, replicas=2, delay=2)
    sgd, _, _ = _run("sgd", grads, replicas=2, delay=2, mu=0.0)
    assert sgd[0] == pytest.approx(-0.7)  # two halves of lr * g
    # naive: m = .5, th = -.7*(.5+.45) ; m = .95, th -= .7*(.5+.855)
    assert naive[0] == pytest.approx(-0.7 * (0.5 + 0.45) - 0.7 * (0.5 + 0.855))
    assert delayed[0] == pytest.approx(-0.7 - 0.7 * 0.9 * 1.0)


def test_one_replica_sgd_lr_one_lands_on_the_local_model():
    theta, m, acc = np.array([1.0, 2.0]), np.zeros(2), np.zeros(2)
    local = np.array([0.5, 2.5])
    apply_arrival("sgd", theta, m, acc, np.array([1.0, 2.0]) - local, 1, lr=1.0, mu=0.0,
                  replicas=1, delay=1)
    assert np.array_equal(theta, local)


def test_dynamic_local_steps_follow_speed_within_bounds():
    assert dynamic_local_steps(16, 0.2, 0.1) == 8      # 2x slower: half the steps
    assert dynamic_local_steps(16, 0.1, 0.1) == 16
    assert dynamic_local_steps(16, 10.0, 0.1) == 1     # never below 1
    assert dynamic_local_steps(16, 0.05, 0.1) == 16    # never above inner_steps
    assert dynamic_local_steps(16, 0.0, 0.1) == 16     # not measured yet


def test_catching_up_keeps_the_replicas_own_work_and_adds_the_others():
    """After a catch-up (new start = theta) the pseudo-gradient start - local is still exactly the
    replica's own work, and its weights moved by what the others' arrivals did to theta."""
    rng = np.random.default_rng(0)
    start = rng.standard_normal(1000).astype(np.float32)
    own = 1e-2 * rng.standard_normal(1000).astype(np.float32)
    others = 1e-2 * rng.standard_normal(1000).astype(np.float32)
    local, theta = start + own, start + others
    caught_up = with_updates_since(local, start, theta)
    np.testing.assert_allclose(theta - caught_up, start - local, atol=1e-6)  # the same pseudo-gradient
    np.testing.assert_allclose(caught_up - local, others, atol=1e-6)
    assert np.abs(caught_up - local).max() > 1e-2  # it did move
