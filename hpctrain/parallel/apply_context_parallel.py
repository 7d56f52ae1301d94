"""Context parallelism (parallel.cp > 1) applied to an unmodified model from outside: each attention
module's kernel (its `attend` attribute, `model/attention.py`'s causal_attention) becomes the ring
or Ulysses attention of hpctrain/parallel/context_parallel.py over the mesh's cp group, and a
micro-batch's part of the sequence (`local_batch`, the zig-zag split of hpctrain/parallel/zigzag.py)
goes in with its tokens' global positions.

- `apply_context_parallel(model, mesh, kind)`: swaps every attention's kernel; returns the
  `ContextParallel` that the runner enters once per micro-batch, around forward and backward
  (`with cp.batch(local): ...`), so every layer of that batch, and activation checkpointing's
  recomputation in backward, reads one `CPPlan` (built once per batch: one all-gather of the
  document ids with data.document_mask, none without).
- With pipeline parallelism the schedule runs the micro-batches in its own order (1F1B interleaves
  one micro-batch's forward with another's backward), so the runner enters
  `cp.pipeline_step(local_len, doc_ids, n_micro)` once around the schedule instead: one plan per
  micro-batch, built there (the same collectives as above, before the schedule starts), and each
  attention picks its micro-batch's plan by the address of the document-id rows it is given (the
  schedule's views of `doc_ids`, row block i = micro-batch i); without document ids every
  micro-batch has the one causal plan.
- `local_batch(batch, cp, rank)`: what the loader keeps of a micro-batch ([mb, T+1] tokens or a
  DocumentBatch): rank `rank`'s zig-zag part of the inputs, targets, document ids and positions
  (the tokens' global positions 0..T-1, or their positions in their documents).

Owns: the swap, the per-batch plan and the batch split. It must never edit the model's code or
parameter names, compute attention itself, read data or reduce gradients (the mesh's dp x cp
group does: parallelize.py, runner.py).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from hpctrain.data.documents import DocumentBatch
from hpctrain.distributed.mesh import Mesh
from hpctrain.model.attention import causal_attention
from hpctrain.parallel.context_parallel import CPPlan, ring_attention, ulysses_attention
from hpctrain.parallel.zigzag import LocalBatch, split_batch

KERNELS = {"ring": ring_attention, "ulysses": ulysses_attention}


class ContextParallel:
    """The cp group's attention kernel and the plan of the micro-batch being run."""

    def __init__(self, mesh: Mesh, kind: str):
        self.group, self.cp, self.rank = mesh.group("cp"), mesh.cp_size, mesh.cp_rank
        self.kind, self.kernel = kind, KERNELS[kind]
        self.plan: CPPlan | None = None
        self.plans: dict[int, CPPlan] = {}  # pipeline_step: the micro-batches' doc-id rows' address

    @contextlib.contextmanager
    def batch(self, local: LocalBatch):
        """Every attention inside (forward, and backward's recomputation) attends over the whole
        sequence of `local`'s cp group. Collective over the cp group with document ids."""
        self.plan = CPPlan.build(self.group, local.tokens.shape[1], local.doc_ids)
        try:
            yield
        finally:
            self.plan = None

    @contextlib.contextmanager
    def pipeline_step(self, local_len: int, doc_ids: torch.Tensor | None, n_micro: int):
        """A pipeline schedule's micro-batches inside: `doc_ids` [n_micro x mb, local_len] (the
        schedule's keyword, which it splits into n_micro row blocks) or None. Collective over the
        cp group with document ids (one plan per micro-batch)."""
        if doc_ids is None:
            self.plan = CPPlan.build(self.group, local_len)
        else:
            self.plans = {rows.data_ptr(): CPPlan.build(self.group, local_len, rows)
                          for rows in doc_ids.tensor_split(n_micro)}
        try:
            yield
        finally:
            self.plan, self.plans = None, {}

    def _plan_for(self, doc_ids: torch.Tensor | None) -> CPPlan:
        if self.plan is not None:
            return self.plan
        plan = self.plans.get(doc_ids.data_ptr()) if doc_ids is not None else None
        if plan is None:
            raise RuntimeError("context-parallel attention outside ContextParallel.batch() / "
                               "pipeline_step() (or given document ids that are not a micro-batch's "
                               "rows of pipeline_step's): the runner enters it around each step")
        return plan

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               doc_ids: torch.Tensor | None = None, *, scale: float | None = None,
               dropout_p: float = 0.0) -> torch.Tensor:
        """causal_attention's signature; the document ids are the plan's (the whole sequence's)."""
        plan = self._plan_for(doc_ids)
        if dropout_p:
            raise ValueError("context-parallel attention has no dropout (model.dropout = 0)")
        return self.kernel(q, k, v, plan, scale=scale)


def apply_context_parallel(model: nn.Module, mesh: Mesh, kind: str) -> ContextParallel:
    """Point every attention module of `model` (those whose `attend` is causal_attention) at the
    cp group's `kind` ("ring" | "ulysses") attention; in place."""
    cp = ContextParallel(mesh, kind)
    swapped = 0
    for module in model.modules():
        if getattr(module, "attend", None) is causal_attention:
            module.attend = cp.attend
            swapped += 1
    if not swapped:
        raise ValueError("parallel.cp: the model has no attention module with an `attend` kernel "
                         "(model/attention.py's causal_attention) to make context-parallel")
    return cp


def local_batch(batch: torch.Tensor | DocumentBatch, cp: int, rank: int) -> LocalBatch:
    """Rank `rank`'s zig-zag part of a micro-batch: inputs and targets [mb, T / cp] each, their
    global (or per-document) positions, and with document masking their document ids."""
    if not isinstance(batch, DocumentBatch):
        return split_batch(batch[:, :-1], batch[:, 1:], cp, rank)
    positions = None if batch.positions is None else batch.positions[:, :-1]
    return split_batch(batch.tokens[:, :-1], batch.tokens[:, 1:], cp, rank, positions=positions,
                       doc_ids=batch.doc_ids[:, :-1])
