"""Step runners: the layout-aware parts of a training step, called by the loop without knowing the
layout. `build_runner(layout, cfg)` picks one per kind of `Layout`:

  PlainRunner     a loop over micro-batches with gradient sync on the last one (DDP, FSDP, TP, the
                  flat dp all-reduce after backward, one rank)
  PipelineRunner  a torch.distributed.pipelining schedule over this rank's stages

Both offer `forward_backward` (forward + backward of one optimizer step's micro-batches), `eval_loss`
and `clip_grad_norm_`; the base class holds what they share: the loss (fp16 scaling, the loss hook,
`loss_parallel` under TP, or train.loss_chunk's chunked loss on the head's hidden states), the global-mean loss reduction, the gradient norm and the gradient
reductions no wrapper does (the dp average after backward).

The reductions the runner itself runs, and the end of each backward (where DDP waits for its
gradient buckets), are marked on the layout's WaitClock: the straggler detector's waiting time.

Owns: running forward / backward / evaluation on a Layout and the gradient reductions above. It must
never apply a layout (parallelize.py does), touch the optimizer or its state, or import
torch.distributed.pipelining itself (the pipeline split does, only where pp > 1).

Losses returned are the mean over the global batch, identical on every rank and every layout.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.config import Config
from hpctrain.distributed.dtensor import is_dtensor
from hpctrain.distributed.flight_recorder import RECORDER
from hpctrain.errors import ConfigError
from hpctrain.model.moe import MoEFeedForward
from hpctrain.parallel.parallelize import Layout
from hpctrain.parallel.loss import chunked_lm_loss
from hpctrain.parallel.offload import compute_device
from hpctrain.parallel.batch_inputs import model_inputs  # noqa: F401 (the runner's, re-exported)
from hpctrain.parallel.token_mean import lm_loss_sum, per_micro_batch_denominator, trained_count
from hpctrain.parallel.tensor_parallel import sum_moe_grads_over_tp, tp_token_split_moe


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard, sharing storage (in-place collectives on it update the DTensor)."""
    return t._local_tensor if is_dtensor(t) else t


def _value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32). Vocab-sharded DTensor logits need `loss_parallel()`."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class StepRunner(ABC):
    """What every layout's step shares; subclasses run the micro-batches (`_forward_backward_sum`,
    `_eval_sum`) and add their own reductions over pipeline stages."""

    def __init__(self, layout: Layout, mean_over_dp: bool = True, loss_chunk: int = 0,
                 token_mean: bool = False):
        """`token_mean`: each micro-batch's loss is its sum over trained targets / D, the mean
        over the global batch's trained tokens (train.objective = sft: parallel/token_mean.py)."""
        self.layout, self.mean_over_dp, self.loss_chunk = layout, mean_over_dp, loss_chunk
        self.token_mean, self._denominator = token_mean, None  # D of the step being run
        self.device = compute_device(layout.module, layout.mesh)  # parallel.offload = all: not the params'
        self._loss_hook, self._loss_scale = None, 1.0
        # Parameters counted in the grad norm: the tied weight's second copy (last stage) is skipped.
        skip = {id(layout.module.lm_head.weight)} if layout.tied_weight_is_head_copy else set()
        self._norm_params = [q for q in layout.module.parameters() if id(q) not in skip]
        # MoE layers: their auxiliary loss enters the gradient inside the layer, weighted like the
        # main loss of a micro-batch (none in a dense model)
        self._moe_layers = [m for m in layout.module.modules() if isinstance(m, MoEFeedForward)]
        # MoE layers run on each tp rank's own sequence shard: their gradients are summed over tp
        self._moe_tp_layers, self._moe_tp_group = tp_token_split_moe(layout.module)
        # gradients and losses are averaged over dp x cp (cp = 1: the dp group itself)
        self._reduce_size, self._reduce_group = layout.mesh.reduce_size, layout.mesh.reduce_group()
        self._dp_name = (f"dp({layout.mesh.dp_size})" if layout.mesh.cp_size == 1  # the flight
                         else f"dp_cp({self._reduce_size})")                    # recorder's name

    # ---- the loss -------------------------------------------------------------------------
    def _loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's output is logits, or with train.loss_chunk the head's hidden states; the
        mean over the targets, or with token_mean their sum / the step's D."""
        d = self._denominator
        if not self.loss_chunk:
            return lm_loss(output, targets) if d is None else lm_loss_sum(output, targets) / d
        # fetched each time: FSDP swaps the registered parameter between sharded and unsharded
        head = self.layout.module.lm_head
        return chunked_lm_loss(output, head.weight, targets, self.loss_chunk, head.compiled,
                               denominator=d)

    def _set_denominator(self, batches: list) -> None:
        """token_mean: D of `batches` (this rank's micro-batches of one step or evaluation):
        N counted here and summed over the ranks the loss is averaged over (one all-reduce)."""
        if not self.token_mean:
            return
        count = trained_count([model_inputs(b)[2] for b in batches])
        ranks = self._reduce_size if self.mean_over_dp else 1
        if ranks > 1:
            count = self._all_reduce_dp(count, "trained_tokens", average=False)
        self._denominator = per_micro_batch_denominator(count, len(batches), ranks)

    def _scaled_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss that backward sees: after the loss hook, times the loss scale."""
        loss = self._loss(logits, targets)
        loss = self._loss_hook(loss) if self._loss_hook is not None else loss
        scaled = isinstance(self._loss_scale, torch.Tensor) or self._loss_scale != 1.0
        return loss * self._loss_scale if scaled else loss

    def _cp_context(self, batch):
        """parallel.cp > 1: the batch's context-parallel plan, around its forward and backward."""
        cp = self.layout.context_parallel
        return cp.batch(batch) if cp is not None else contextlib.nullcontext()

    def _loss_context(self):
        if self.layout.mesh.tp_size == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel  # imported by the TP plan

        return loss_parallel()

    def _replica_mean(self, local_sum: torch.Tensor, count: int) -> torch.Tensor:
        """Mean loss of this dp replica from this rank's sum over `count` micro-batches."""
        return (local_sum / count).to(torch.float32)

    def _all_reduce_dp(self, value: torch.Tensor, name: str, average: bool) -> torch.Tensor:
        """`value` summed (or averaged) over the dp x cp ranks, in place. CPU with the MPI gradient
        hook: its communicator over the same ranks (3 us over shared memory; Gloo's TCP takes
        360 us, every step): sum, then divide, as Gloo's AVG. (DiLoCo's inner steps: where a
        faster replica waits for a slower one.)"""
        sync = self.layout.mpi_grad_allreduce
        with self.layout.wait_clock.blocked(), RECORDER.collective(name, self._dp_name):
            if sync is None:
                op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
                dist.all_reduce(value, op=op, group=self._reduce_group)
                return value
            from mpi4py import MPI

            sync.comm.Allreduce(MPI.IN_PLACE, value.numpy(), op=MPI.SUM)
        if average:
            value /= self._reduce_size
        return value

    def _global_mean(self, local_sum: torch.Tensor, count: int) -> torch.Tensor:
        """Mean loss over the global batch: the replica means averaged over dp (unless the
        replicas step apart: sync.mode = ps, where the loss stays this worker's)."""
        loss = self._replica_mean(local_sum, count)
        if self.mean_over_dp and self._reduce_size > 1:
            self._all_reduce_dp(loss, "loss_allreduce", average=True)
        return loss

    # ---- gradients ------------------------------------------------------------------------
    def _finish_grads(self) -> None:
        """The dp average when neither DDP nor FSDP does it (TP or PP with replicated weights), and
        the expert-parallel weights' (which DDP and FSDP leave out)."""
        experts = self.layout.experts
        if self._moe_tp_group is not None:
            with self.layout.wait_clock.blocked(), RECORDER.collective(
                    "moe_tp_grad_allreduce", f"tp({self.layout.mesh.tp_size})"):
                sum_moe_grads_over_tp(self._moe_tp_layers, self._moe_tp_group)
        if experts is not None:  # the MPI hook's loss was divided by dp before backward
            experts.reduce_grads(prescaled=self.layout.mpi_grad_allreduce is not None)
        if self.layout.dp_reduce != "after_backward":
            return
        grads = [_local(q.grad) for q in self.layout.module.parameters()
                 if q.grad is not None and not (experts is not None and experts.holds(q))]
        flat = torch.cat([g.flatten() for g in grads])
        with self.layout.wait_clock.blocked(), RECORDER.collective("grad_allreduce", self._dp_name):
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self._reduce_group)
        for g, v in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(v.view_as(g))

    def _replica_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of this replica's gradients (DTensor shards are combined over their mesh)."""
        experts = self.layout.experts
        expert_grads = [g for g in grads if experts is not None and experts.holds(g)]
        if expert_grads:
            grads = [g for g in grads if not experts.holds(g)]
        if not grads:  # on the device: a pp stage's norm goes into an all-reduce (NCCL: no CPU)
            norm = torch.zeros((), device=self.device)
        else:
            norm = _value(torch.nn.utils.get_total_norm(grads, 2.0))
        if experts is not None:  # sharded over ep: each expert counted once
            sq = experts.grad_norm_sq(expert_grads, self.device)
            norm = (norm.double() ** 2 + sq).sqrt().to(norm.dtype)
        return norm

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of all gradients (every shard, every stage, the tied weight once); clips
        to `max_norm` when it is > 0. Returns the norm before clipping, a 0-dim tensor on the device
        (never read on the host here)."""
        norm = self._replica_grad_norm([q.grad for q in self._norm_params if q.grad is not None])
        if max_norm > 0:
            experts, params = self.layout.experts, list(self.layout.module.parameters())
            if experts is not None:  # foreach ops take plain tensors and DTensors apart
                params = [q for q in params if not experts.holds(q)]
                torch.nn.utils.clip_grads_with_norm_(list(experts.params), max_norm, norm)
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # ---- the step and evaluation ----------------------------------------------------------
    def forward_backward(self, micro_batches: list[torch.Tensor], autocast, loss_hook=None,
                         loss_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """Forward + backward of one optimizer step's micro-batches ([mb, T+1] token tensors, or
        DocumentBatches: `model_inputs`) in training mode; leaves averaged gradients in `.grad`, times `loss_scale` (fp16 loss
        scaling: a 0-dim device tensor, never read on the host but for MoE's aux loss). Returns the
        global mean loss (same value on every rank, unscaled, on the device).
        `loss_hook(loss) -> loss`, if given, sees each micro-batch loss before backward."""
        self.layout.module.train()
        self._set_denominator(micro_batches)
        self._loss_hook, self._loss_scale = loss_hook, loss_scale
        for moe in self._moe_layers:  # the aux loss is per optimizer step, as the main loss
            moe.aux_scale = float(loss_scale) * self._micro_batch_weight(len(micro_batches))
        try:  # DDP's / FSDP's gradient collectives run inside: recorded as one phase
            with RECORDER.collective("forward_backward (DDP/FSDP all-reduce inside)", self._dp_name):
                total = self._forward_backward_sum(micro_batches, autocast, loss_scale)
        finally:
            self._loss_hook, self._loss_scale, self._denominator = None, 1.0, None
        self._finish_grads()
        return self._global_mean(total, len(micro_batches))

    def _micro_batch_weight(self, n: int) -> float:
        """What backward multiplies one micro-batch's loss by (besides the fp16 loss scale)."""
        return 1.0 / n

    @torch.no_grad()
    def eval_loss(self, batches: list[torch.Tensor], autocast) -> float:
        """Mean loss over every rank's `batches` (equal-sized micro-batches), forward only."""
        self.layout.module.eval()
        self._set_denominator(batches)
        try:
            with self._loss_context():
                total = self._eval_sum(batches, autocast)
        finally:
            self._denominator = None
        return self._global_mean(total, len(batches)).item()

    @abstractmethod
    def _forward_backward_sum(self, micro_batches: list[torch.Tensor], autocast,
                              loss_scale: float) -> torch.Tensor:
        """Run forward + backward; return this rank's sum of the unscaled micro-batch losses."""

    @abstractmethod
    def _eval_sum(self, batches: list[torch.Tensor], autocast) -> torch.Tensor:
        """Run forward only; return this rank's sum of the batch losses."""


class PlainRunner(StepRunner):
    """One forward module, micro-batches in a loop; the dp gradient sync runs on the last one."""

    def __init__(self, layout: Layout, mean_over_dp: bool = True, loss_chunk: int = 0,
                 token_mean: bool = False):
        super().__init__(layout, mean_over_dp, loss_chunk, token_mean)
        (self.forward_module,) = layout.forward_modules
        # the MPI hook sums: the loss is divided by dp before backward instead (no pass over grads)
        self._loss_divisor = self._reduce_size if layout.mpi_grad_allreduce is not None else 1

    def _micro_batch_weight(self, n: int) -> float:
        return 1.0 / n / self._loss_divisor  # as (loss / n / self._loss_divisor).backward()

    def _sync_context(self, last: bool):
        if self.layout.dp_reduce == "ddp" and not last:
            return self.forward_module.no_sync()
        if self.layout.dp_reduce == "fsdp":
            self.forward_module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _forward_backward_sum(self, micro_batches, autocast, loss_scale):
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        with self._loss_context():
            for i, batch in enumerate(micro_batches):
                inputs, keywords, targets = model_inputs(batch)
                with self._sync_context(i == n - 1), self._cp_context(batch):
                    with autocast:
                        logits = self.forward_module(inputs, **keywords)
                        # the chunked loss's matmuls in autocast's dtype, as the head's would be
                        loss = self._scaled_loss(logits, targets) if self.loss_chunk else None
                    if loss is None:  # the plain path: the loss outside autocast, as always
                        loss = self._scaled_loss(logits, targets)
                    (loss / n / self._loss_divisor).backward()
                self.layout.wait_clock.backward_done()  # DDP has waited for its buckets
                total += _value(loss.detach()) / loss_scale  # a power of two: exact
        return total

    def _eval_sum(self, batches, autocast):
        total = torch.zeros((), device=self.device)
        for batch in batches:
            inputs, keywords, targets = model_inputs(batch)
            with autocast, self._cp_context(batch):
                logits = self.forward_module(inputs, **keywords)
                loss = self._loss(logits, targets) if self.loss_chunk else None
            total += _value(loss if loss is not None else self._loss(logits, targets))
        return total


class PipelineRunner(StepRunner):
    """A pipeline schedule over this rank's stage views; ranks without the last stage hold no loss
    (0, summed away over pp). The tied embedding / head gradient is summed over its two stages."""

    def __init__(self, layout: Layout, schedule: str, n_micro: int, mean_over_dp: bool = True,
                 loss_chunk: int = 0, token_mean: bool = False):
        super().__init__(layout, mean_over_dp, loss_chunk, token_mean)
        self.n_micro = n_micro
        self.schedule = layout.split.build_schedule(list(layout.forward_modules), schedule, n_micro,
                                                    self._scaled_loss, self.device,
                                                    layout.mesh.group("pp"))

    def _micro_batch_weight(self, n: int) -> float:
        return 1.0  # the schedule divides the gradients by n_micro after backward (scale_grads)

    def _schedule_inputs(self, micro_batches: list) -> tuple[tuple, dict, list]:
        """(args, kwargs, losses) for schedule.step / eval: the first stage gets the inputs, the
        last the targets and a list that the schedule fills with one loss per micro-batch. The
        model's keywords (data.document_mask's doc_ids, positions) go to every stage: the schedule
        splits them into micro-batches as the inputs, and every pp rank of a dp replica read the
        same micro-batches, so nothing travels with the activations. With parallel.cp > 1 they are
        all the cp rank's zig-zag part ([mb, T / cp]; LocalBatch), and so are the activations."""
        split, losses = self.layout.split, []
        inputs, keywords, targets = zip(*(model_inputs(b) for b in micro_batches))
        kwargs = {key: torch.cat([k[key] for k in keywords]) for key in keywords[0]}
        if split.has_last:
            kwargs.update(target=torch.cat(targets), losses=losses)
        return (torch.cat(inputs),) if split.has_first else (), kwargs, losses

    def _forward_backward_sum(self, micro_batches, autocast, loss_scale):
        total = torch.zeros((), device=self.device)
        args, kwargs, losses = self._schedule_inputs(micro_batches)
        with self._loss_context(), autocast, self._cp_pipeline_context(kwargs):
            self.schedule.step(*args, **kwargs)
        for loss in losses:
            total += _value(loss.detach()) / loss_scale  # a power of two: exact
        return total

    def _eval_sum(self, batches, autocast):
        """The schedule runs n_micro micro-batches at a time; the last group is padded."""
        total = torch.zeros((), device=self.device)
        for start in range(0, len(batches), self.n_micro):
            group = batches[start:start + self.n_micro]
            real = len(group)
            args, kwargs, losses = self._schedule_inputs(group + [group[-1]] * (self.n_micro - real))
            with autocast, self._cp_pipeline_context(kwargs):
                self.schedule.eval(*args, **kwargs)
            for loss in losses[:real]:
                total += _value(loss)
        return total

    def _cp_pipeline_context(self, kwargs: dict):
        """parallel.cp > 1: the plans of the schedule's micro-batches (their cp-local positions and
        document ids are in `kwargs`, which the schedule splits into n_micro row blocks)."""
        cp = self.layout.context_parallel
        if cp is None:
            return contextlib.nullcontext()
        return cp.pipeline_step(kwargs["positions"].shape[1], kwargs.get("doc_ids"), self.n_micro)

    def _replica_mean(self, local_sum, count):
        loss = super()._replica_mean(local_sum, count)
        dist.all_reduce(loss, group=self.layout.mesh.group("pp"))
        return loss

    def _replica_grad_norm(self, grads):
        norm = super()._replica_grad_norm(grads)
        sq = norm.to(torch.float64) ** 2
        dist.all_reduce(sq, group=self.layout.mesh.group("pp"))
        return sq.sqrt().to(norm.dtype)

    def _finish_grads(self) -> None:
        self._sum_tied_weight_grads()
        super()._finish_grads()

    def _sum_tied_weight_grads(self) -> None:
        """Both copies of the tied embedding / head weight get the sum of their gradients, so both
        take the unsplit model's optimizer step."""
        weight = self.layout.split.tied_weight()
        if weight is None:
            return
        if is_dtensor(weight) and weight.grad.placements != weight.placements:
            # e.g. the vocab-parallel embedding's grad may come back replicated: match the head's
            weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)
        dist.all_reduce(_local(weight.grad), group=self.layout.tie_group)


def build_runner(layout: Layout, cfg: Config, grad_accum: int, mean_over_dp: bool = True,
                 token_mean: bool = False) -> StepRunner:
    """The runner for `layout`: a pipeline schedule where it is split into stages, else a loop;
    `grad_accum`: the resolved micro-batches per step (the pipeline's micro-batches).
    `mean_over_dp=False`: reported losses stay this replica's (replicas that never step together).
    `token_mean`: the loss is the mean over the global batch's trained tokens (objective sft)."""
    if cfg.data.document_positions and layout.mesh.tp_size > 1 and layout.module.pos_emb is not None:
        raise ConfigError(f"config key 'data.document_positions': the learned position table is "
                          f"split over parallel.tp={layout.mesh.tp_size} by sequence, which "
                          f"per-document positions do not follow: use parallel.tp = 1 or "
                          f"data.document_positions = false (rotary families have no table)")
    if layout.split is None:
        return PlainRunner(layout, mean_over_dp, cfg.train.loss_chunk, token_mean)
    p, t = cfg.parallel, cfg.train
    try:
        return PipelineRunner(layout, p.pp_schedule, grad_accum, mean_over_dp, t.loss_chunk,
                              token_mean)
    except ValueError as e:
        key = "train.global_batch" if t.global_batch else "train.grad_accum"  # derived or given
        raise ConfigError(f"config key '{key}': {grad_accum} micro-batches do not fit "
                          f"parallel.pp_schedule={p.pp_schedule!r} with pp={layout.mesh.pp_size} "
                          f"({e})") from None
