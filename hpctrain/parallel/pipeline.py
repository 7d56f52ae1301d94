"""Pipeline parallelism: split the GPT into stages and build a torch.distributed.pipelining schedule.

Owns: applying the stage split (plan/stages.py: balanced by an estimated per-layer cost, embedding
and head included; which stages this pipeline rank holds: one, or `pp_virtual_stages` looped chunks
for the interleaved schedule), turning the model into this rank's "owner" module plus per-stage views, and the schedule.
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

from hpctrain.plan.stages import layer_costs, split_stages, stages_of_rank

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


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
