"""Pipeline parallelism: split the GPT into stages and build a torch.distributed.pipelining schedule.

Owns: the stage split (balanced by an estimated per-layer cost, embedding and head included), which
stages this pipeline rank holds (one, or `pp_virtual_stages` looped chunks for the interleaved
schedule), turning the model into this rank's "owner" module plus per-stage views, and the schedule.
It must never edit the model's code or parameter names: stages are made by deleting blocks that are
not owned (the ModuleDict keys "0".."L-1", hence the FQNs, survive) and setting tok_emb / pos_emb to
None off the first stage and norm_f / lm_head off the last, which the model's forward allows.

The tied embedding / head weight lives on both the first stage (tok_emb) and the last (lm_head);
both start from the same initial value and the pipeline runner (runner.py) sums their gradients over
the pp axis after backward, so both copies take the identical optimizer step (exactly the unsplit
model's update).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


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


def _stage_view(owner: nn.Module, blocks: range, first: bool, last: bool) -> nn.Module:
    """A module of the model's class sharing the owner's submodules, holding only one stage."""
    view = owner.__class__.__new__(owner.__class__)
    nn.Module.__init__(view)
    view.cfg = owner.cfg
    view.tok_emb = owner.tok_emb if first else None
    view.pos_emb = owner.pos_emb if first else None
    view.drop = owner.drop
    view.blocks = nn.ModuleDict({str(i): owner.blocks[str(i)] for i in blocks})
    view.norm_f = owner.norm_f if last else None
    view.lm_head = owner.lm_head if last else None
    return view


class PipelineSplit:
    """This pipeline rank's part of the model: `owner` (all its parameters, original FQNs; used for
    the optimizer and checkpoints) and `views` (one nn.Module per stage it runs)."""

    def __init__(self, model: nn.Module, pp_rank: int, pp: int, virtual: int):
        c = model.cfg
        # llama may untie: then tok_emb and lm_head are two parameters, nothing is shared
        self.tied = model.lm_head.weight is model.tok_emb.weight
        self.n_stages = pp * virtual
        self.bounds = split_stages(self.n_stages, *layer_costs(c.n_layer, c.n_embd, c.block_size,
                                                                c.vocab_size))
        self.stage_ids = stages_of_rank(pp_rank, pp, virtual)
        self.has_first = 0 in self.stage_ids
        self.has_last = self.n_stages - 1 in self.stage_ids
        keep = {str(i) for s in self.stage_ids for i in self.bounds[s]}
        for key in list(model.blocks.keys()):
            if key not in keep:
                del model.blocks[key]
        if not self.has_first:
            model.tok_emb = None
            model.pos_emb = None
        if not self.has_last:
            model.norm_f = None
            model.lm_head = None
        self.owner = model
        self.views: list[nn.Module] = []

    def make_views(self) -> list[nn.Module]:
        """Call after blocks were wrapped (activation checkpointing, TP, FSDP) in the owner."""
        self.views = [_stage_view(self.owner, self.bounds[s], s == 0, s == self.n_stages - 1)
                      for s in self.stage_ids]
        return self.views

    def tied_weight(self) -> torch.Tensor | None:
        """The tied embedding / head weight this rank holds (first or last stage), else None."""
        if not self.tied:
            return None
        if self.owner.tok_emb is not None:
            return self.owner.tok_emb.weight
        if self.owner.lm_head is not None:
            return self.owner.lm_head.weight
        return None

    def build_schedule(self, modules: list[nn.Module], schedule: str, n_microbatches: int,
                       loss_fn, device, pp_group):
        stages = [PipelineStage(m, s, self.n_stages, device, group=pp_group)
                  for m, s in zip(modules, self.stage_ids)]
        cls = SCHEDULES[schedule]
        if schedule == "interleaved":
            return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
