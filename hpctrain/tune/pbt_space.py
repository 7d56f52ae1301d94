"""Population-based training's settings and its pure decisions: the `[tune.pbt]` table, the
members' first hyperparameters, exploit (who copies whom) and explore (perturbing within bounds).

    [tune.pbt]
    population = 4          # members; mpiexec -n population*k: each member trains on k ranks
    ready = 50              # steps between two exploit/explore rounds
    quantile = 0.25         # the worst quarter copies a member of the best quarter
    perturb = [0.8, 1.2]    # explore: multiply by one of these (int keys: rounded to their step)
    resample_probability = 0.25   # ... or draw afresh from the [tune.params] distribution
    seed = 0                # the explorer's RNG: the same seed, the same lineage
    exploit = true          # false: the members train their first values to the end (a baseline)

The bounds are the [tune.params] distributions (hpctrain/tune/space.py); only keys the trainer reads
again at every step can be changed while it trains (PBT_MUTABLE). The table's schema and its parsing
(`PbtConfig`, `parse_pbt`) live in space.py with the rest of [tune]. Owns: which keys are mutable,
and the explorer: a `random.Random` whose state is
saved with the population. It must never import torch, MPI, or touch the file system.
"""
from __future__ import annotations

import math
import random

from hpctrain.tune.space import Param, PbtConfig, TuneConfig, _check

# Keys the trainer reads anew at every step (lr_at: lr, min_lr, warmup_steps; the clip: grad_clip)
# or that live in the optimizer's parameter groups (weight_decay, beta1, beta2).
PBT_MUTABLE = ("train.lr", "train.min_lr", "train.warmup_steps", "train.weight_decay",
               "train.grad_clip", "train.beta1", "train.beta2")


def check_mutable(tune: TuneConfig) -> None:
    """PBT changes values while a member trains: only keys the trainer reads again can be tuned."""
    for p in tune.params:
        _check(p.key in PBT_MUTABLE, f"tune.params.{p.key}",
               f"PBT cannot change it during training (it can: {', '.join(PBT_MUTABLE)})")


# ---- the explorer ---------------------------------------------------------------------------
def sample(param: Param, rng: random.Random):
    """A fresh draw from the parameter's distribution."""
    if param.kind == "choice":
        return param.choices[rng.randrange(len(param.choices))]
    if param.kind == "int":
        return param.low + param.step * rng.randrange((param.high - param.low) // param.step + 1)
    if param.kind == "log_uniform":
        return math.exp(rng.uniform(math.log(param.low), math.log(param.high)))
    return rng.uniform(param.low, param.high)


def perturb(param: Param, value, rng: random.Random, factors: tuple):
    """value moved by one of `factors` (an int: rounded to its step, at least one step; a choice:
    to a neighbouring choice), clipped to the bounds. A float at 0 stays there: resampling moves it."""
    if param.kind == "choice":
        i = param.choices.index(value) if value in param.choices else 0
        neighbours = [j for j in (i - 1, i + 1) if 0 <= j < len(param.choices)] or [i]
        return param.choices[neighbours[rng.randrange(len(neighbours))]]
    factor = factors[rng.randrange(len(factors))]
    moved = value * factor
    if param.kind == "int":  # rounded to the grid, but at least one step the factor's way
        snapped = param.low + param.step * round((moved - param.low) / param.step)
        if factor > 1 and snapped <= value:
            snapped = value + param.step
        elif factor < 1 and snapped >= value:
            snapped = value - param.step
        return int(min(param.high, max(param.low, snapped)))
    return float(min(param.high, max(param.low, moved)))


def explore(params: tuple[Param, ...], values: dict, rng: random.Random, pbt: PbtConfig) -> dict:
    """A copied member's new values: each key resampled (with pbt.resample_probability) or
    perturbed, always within its [tune.params] bounds."""
    out = {}
    for p in params:
        if rng.random() < pbt.resample_probability:
            out[p.key] = sample(p, rng)
        else:
            out[p.key] = perturb(p, values[p.key], rng, pbt.perturb)
    return out


def first_values(params: tuple[Param, ...], population: int, rng: random.Random) -> list[dict]:
    """Every member's starting point, drawn in member order from the explorer's RNG."""
    return [{p.key: sample(p, rng) for p in params} for _ in range(population)]


def exploit_plan(losses: list[float], pbt: PbtConfig, rng: random.Random) -> list[tuple[int, int]]:
    """[(loser, donor)]: each member of the worst quantile copies one of the best quantile, drawn
    at random. A non-finite loss ranks last; ties go to the lower member index."""
    n = pbt.n_exchanged()
    if n == 0:
        return []
    order = sorted(range(len(losses)), key=lambda m: (_rank_key(losses[m]), m))
    best, worst = order[:n], order[-n:]
    return [(loser, best[rng.randrange(n)]) for loser in sorted(worst)]


def _rank_key(loss: float) -> float:
    return loss if isinstance(loss, (int, float)) and math.isfinite(loss) else math.inf


def rng_state(rng: random.Random) -> list:
    """The explorer's state as JSON (a list), for the checkpoint."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def rng_from_state(state: list) -> random.Random:
    rng = random.Random()
    rng.setstate((state[0], tuple(state[1]), state[2]))
    return rng
