"""Choosing the next token from a model's logits: greedy, temperature, top-k, top-p (nucleus) and
the repetition penalty, each exactly as transformers' generation does it, and the decoding loop.

Owns: `process_logits` (the logits the next token is drawn from: transformers'
RepetitionPenaltyLogitsProcessor, then TemperatureLogitsWarper, TopKLogitsWarper and
TopPLogitsWarper, in generate()'s order; equal scores tested in tests/unit/test_api.py),
`next_tokens` and `generate` (append tokens, a window of the model's block_size at most, stop
when every row has written an end-of-sequence id). Pure torch on a model's forward: never imports
checkpoint, data or distributed code (hpctrain/api.py loads the model; GPT.generate and `hpctrain
sample` decode with this).

The choices, by the user's arguments:
  temperature 0        greedy: the argmax of the (repetition-penalized) logits
  temperature > 0      sample from softmax(logits / temperature), restricted to the top_k most
                       likely tokens (0 / None: all) and to the smallest set whose probability
                       reaches top_p (1.0: all; the most likely token is always kept)
  repetition_penalty   > 1: a token already in the sequence (prompt included) has its logit
                       divided by it when positive, multiplied when negative (CTRL, as
                       transformers); 1.0: off
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

FILTERED = float("-inf")  # a token taken out of the choice (transformers' filter_value)


def check_sampling(temperature: float, top_k: int | None, top_p: float,
                   repetition_penalty: float) -> str | None:
    """What is wrong with the arguments, in words naming the argument, or None."""
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        return f"temperature {temperature}: must be a finite number >= 0 (0 = greedy)"
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        return f"top_k {top_k}: must be an integer >= 0 (0 = every token)"
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        return f"top_p {top_p}: must be in (0, 1] (1 = every token)"
    if not isinstance(repetition_penalty, (int, float)) or not math.isfinite(repetition_penalty) \
            or repetition_penalty <= 0:
        return f"repetition_penalty {repetition_penalty}: must be a finite number > 0 (1 = off)"
    return None


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [B, V] with each row's `seen` ids [B, T] penalized (RepetitionPenaltyLogitsProcessor)."""
    score = torch.gather(logits, 1, seen)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(1, seen, score)


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Only the k largest logits of each row stay (ties with the k-th stay too; TopKLogitsWarper)."""
    kth = torch.topk(logits, min(k, logits.shape[-1])).values[..., -1:]
    return logits.masked_fill(logits < kth, FILTERED)


def keep_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Only the most likely tokens whose probabilities sum to p stay, at least one (TopPLogitsWarper)."""
    ascending, order = torch.sort(logits, descending=False)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - p)
    drop[..., -1:] = False  # the most likely token
    return logits.masked_fill(drop.scatter(1, order, drop), FILTERED)


def process_logits(logits: torch.Tensor, seen: torch.Tensor | None, temperature: float = 0.0,
                   top_k: int | None = None, top_p: float = 1.0,
                   repetition_penalty: float = 1.0) -> torch.Tensor:
    """The scores [B, V] the next token is chosen from (greedy: their argmax; else sampled from
    their softmax): the repetition penalty over `seen` [B, T], then (sampling only) temperature,
    top-k and top-p, in transformers' order."""
    if repetition_penalty != 1.0 and seen is not None and seen.numel():
        logits = penalize_repetition(logits, seen, repetition_penalty)
    if temperature <= 0:
        return logits
    logits = logits / temperature
    if top_k:
        logits = keep_top_k(logits, top_k)
    if top_p < 1.0:
        logits = keep_top_p(logits, top_p)
    return logits


def next_tokens(logits: torch.Tensor, seen: torch.Tensor | None, temperature: float = 0.0,
                top_k: int | None = None, top_p: float = 1.0, repetition_penalty: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row [B, 1] from the last position's logits [B, V]."""
    scores = process_logits(logits.float(), seen, temperature, top_k, top_p, repetition_penalty)
    if temperature <= 0:
        return scores.argmax(dim=-1, keepdim=True)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(forward: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor, max_new_tokens: int,
             block_size: int, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
             repetition_penalty: float = 1.0, generator: torch.Generator | None = None,
             eos_ids: Iterable[int] = ()) -> torch.Tensor:
    """`idx` [B, T] with up to `max_new_tokens` tokens appended; `forward(ids)` gives logits
    [B, t, V] of the last `block_size` ids at most. With `eos_ids`, a row that wrote one of them
    is finished: it gets eos from then on (as transformers pads with eos), and generation ends when
    every row is finished. The repetition penalty sees the whole sequence, not only the window."""
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=idx.device)
    finished = torch.zeros(idx.shape[0], 1, dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        logits = forward(idx[:, -block_size:])[:, -1, :]
        nxt = next_tokens(logits, idx, temperature, top_k, top_p, repetition_penalty, generator)
        if eos.numel():
            nxt = torch.where(finished, eos[0], nxt)
            finished |= torch.isin(nxt, eos)
        idx = torch.cat([idx, nxt], dim=1)
        if eos.numel() and bool(finished.all()):
            break
    return idx
