"""The global model's update per arrival (hpctrain/sync/outer.py): pure arithmetic."""
import numpy as np
import pytest

from hpctrain.sync.outer import apply_arrival, dynamic_local_steps


def _run(kind, grads, replicas, delay, lr=0.7, mu=0.9):
    theta, m, acc = np.zeros(3), np.zeros(3), np.zeros(3)
    for t, g in enumerate(grads, 1):
        apply_arrival(kind, theta, m, acc, np.asarray(g, dtype=float), t, lr=lr, mu=mu,
                      replicas=replicas, delay=delay)
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
