"""The pipeline stage split, pure arithmetic: each layer's estimated cost, the contiguous block ranges
per stage that minimise the most expensive stage, and which stages a pipeline rank holds.

Owns: that split, used by parallel/pipeline.py (the real model) and plan/memory.py (the planned
one), so the planner and the trainer cannot disagree. It must never import torch.
"""
from __future__ import annotations


def layer_costs(n_layer: int, n_embd: int, block_size: int, vocab_size: int) -> tuple[float, list, float]:
    """(embedding, [block] * n_layer, head) costs: multiply-adds per token of forward (backward is
    ~2x of each, so ratios hold). A block: 12 C^2 (q, k, v, o, 4C MLP) + 2 T C (attention scores
    and values). The head: C V (logits) + V (softmax / loss). The embedding: a lookup, but its
    [V, C] gradient scatter and optimizer update scale with V C: counted as V C / 4."""
    c, t, v = n_embd, block_size, vocab_size
    return v * c / 4, [12.0 * c * c + 2.0 * t * c] * n_layer, float(c * v + v)


def split_stages(n_stages: int, emb: float, blocks: list, head: float) -> list[range]:
    """Contiguous, non-empty block ranges per stage minimizing the most expensive stage (the
    first stage also pays `emb`, the last `head`). Exact dynamic program; n_layer is small."""
    n = len(blocks)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n_stages} pipeline stages for {n} blocks")
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holds blocks i..j-1
        return prefix[j] - prefix[i] + (emb if s == 0 else 0.0) + (head if s == n_stages - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]  # best[s][j]: first j blocks in s stages
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], cost(s - 1, i, j))
                if v < best[s][j] - 1e-9:  # ties: keep the earliest cut (more blocks later)
                    best[s][j], cut[s][j] = v, i
    bounds, j = [], n
    for s in range(n_stages, 0, -1):
        i = cut[s][j]
        bounds.append(range(i, j))
        j = i
    return bounds[::-1]


def stages_of_rank(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Stage indices a pipeline rank holds: looped placement (rank r: r, r + pp, r + 2 pp, ...)."""
    return [pp_rank + k * pp for k in range(virtual)]
