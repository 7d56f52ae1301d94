"""Per-rank random state capture/restore, as JSON-able strings (checkpoints never pickle).

Data order does not use these (the sampler is a pure function of seed, epoch and position); they
drive dropout, so a resumed run draws the same masks as an uninterrupted one.
"""
from __future__ import annotations

import base64

import torch


def capture() -> dict:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def restore(state: dict) -> None:
    def decode(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    torch.set_rng_state(decode(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(decode(state["cuda"]))


def seed_rank(seed: int, rank: int) -> None:
    """Distinct dropout streams per rank, fixed by (seed, rank)."""
    torch.manual_seed(seed * 1_000_003 + rank + 1)
