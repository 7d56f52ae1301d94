"""The global model's update when one replica's pseudo-gradient arrives (sync.mode = "async_diloco").

Pure numpy on one slice of the flat parameter vector; the caller holds the slice's exclusive
window lock, so arrivals apply one after another. With R replicas an arrival counts as 1/R of a
synchronous round (what makes sync.outer_lr mean what it means for DiLoCo), g = start - local:

    sgd               theta -= lr * g / R
    nesterov          m = mu * m + g / R;  theta -= lr * (g / R + mu * m)      (on every arrival)
    delayed_nesterov  theta -= lr * g / R;  acc += g / s                      (every arrival)
                      every N-th arrival:  m = mu * m + acc / N;  theta -= lr * mu * s * m;  acc = 0

s (`lr_scale`) is 1 by default (the momentum is a plain sum, as in synchronous DiLoCo). With
sync.momentum_per_lr it is the mean inner learning rate of the arriving replica's round:
delayed Nesterov's momentum is then kept per unit of inner learning rate and applied at the
current one. An inner AdamW round moves each weight by about lr per step, so under a decaying
schedule the first rounds' pseudo-gradients are 5-10x larger than the last ones; without catch-up,
momentum kept as plain sums carried them into late rounds, where a momentum step could undo the
work of several arrivals (docs/communication.md). With a constant learning rate s cancels.

Naive Nesterov amplifies stale pseudo-gradients (each gets the momentum of every arrival after it);
delayed Nesterov applies the momentum once per N arrivals from their mean, as Liu et al. (2024,
"Asynchronous Local-SGD Training for Language Modeling") propose. With N = R replicas of equal speed,
a round of R arrivals moves theta by lr * (mean g + mu * m), m = mu * m + mean g: synchronous
DiLoCo's Nesterov step (up to staleness).

The end of training (`final`): a replica's last round is cut short where the steps run out (k < H
local steps), and its arrival applies its share alone, theta -= lr * g / R, with no momentum step
and momentum / accumulator untouched, whatever the kind. Its g already holds only k steps of work
(no further scaling); a momentum step there would move theta by lr * mu * m, the momentum of the
full rounds before, with no round after it to follow that look-ahead up: measured on 2 replicas at
H = 4, the last 1-step arrivals moved theta 4x their own pseudo-gradient and the final held-out
loss from ~3.45 to up to 7.7 (tests/mpi/test_async_diloco.py).

A replica that catches up (sync.catch_up) moves its weights by what the global model gained since
its start point, keeping its own work: local += theta - start; start = theta. Owns only this arithmetic: no MPI, no torch.
"""
from __future__ import annotations

import numpy as np

KINDS = ("sgd", "nesterov", "delayed_nesterov")


def apply_arrival(kind: str, theta: np.ndarray, momentum: np.ndarray, acc: np.ndarray,
                  g: np.ndarray, arrival: int, *, lr: float, mu: float, replicas: int,
                  delay: int, lr_scale: float = 1.0, final: bool = False) -> None:
    """Update theta (and momentum / acc) in place for the `arrival`-th arrival (1-based);
    `final`: the last, partial round at the end of training (its share only, module doc)."""
    share = g / replicas
    if kind == "sgd" or final:
        theta -= lr * share
    elif kind == "nesterov":
        momentum *= mu
        momentum += share
        theta -= lr * (share + mu * momentum)
    elif kind == "delayed_nesterov":
        theta -= lr * share
        acc += g / lr_scale
        if arrival % delay == 0:
            momentum *= mu
            momentum += acc / delay
            theta -= (lr * mu * lr_scale) * momentum
            acc[:] = 0.0
    else:
        raise ValueError(f"outer optimizer {kind!r}: expected one of {', '.join(KINDS)}")


def dynamic_local_steps(inner_steps: int, my_step_s: float, fastest_step_s: float) -> int:
    """Local steps for a replica whose steps take `my_step_s` when the fastest takes
    `fastest_step_s`: the fastest does inner_steps, a k times slower one inner_steps / k (at
    least 1), so every round takes about the same wall time."""
    if my_step_s <= 0 or fastest_step_s <= 0:
        return inner_steps
    return max(1, min(inner_steps, round(inner_steps * fastest_step_s / my_step_s)))


def with_updates_since(local: np.ndarray, start: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """A replica's weights after catching up: its own work since its start point (local - start)
    on top of the global model `theta` (which becomes its new start point)."""
    return local + (theta - start)


class OwnChange:
    """What arrival k does to theta when that is the arriving pseudo-gradient's share alone (outer
    SGD; delayed Nesterov on an arrival that takes no momentum step): theta -= lr * (g / R), in the
    same float32 operations as apply_arrival, so a replica whose weights hold exactly the arrivals
    before k adds it itself instead of pulling it (hpctrain/sync/inbox.py)."""

    def __init__(self, kind: str, *, lr: float, replicas: int, delay: int, **_):
        self.kind, self.lr, self.replicas, self.delay = kind, lr, replicas, delay

    def applies(self, arrival: int) -> bool:
        return self.kind == "sgd" or (self.kind == "delayed_nesterov" and arrival % self.delay != 0)

    def __call__(self, view: np.ndarray, g: np.ndarray, arrival: int) -> None:
        share = g / self.replicas
        view -= self.lr * share
