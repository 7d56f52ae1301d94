"""parallelize(model, mesh, cfg) -> ParallelModel: apply the job's layout to an unmodified GPT.

Owns: the order in which layouts are applied (pipeline split -> tensor parallel -> activation
checkpointing -> FSDP / DDP), and the layout-aware parts of a training step that the loop calls
without knowing the layout: forward + backward over a list of micro-batches (a plain loop with
gradient sync on the last one, or a pipeline schedule), the global gradient norm and clipping,
the validation loss, and layout-free checkpoint state (torch.distributed.checkpoint.state_dict).
It must never edit the model's code or parameter names.

Losses returned are the mean over the global batch, identical on every rank and every layout.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel as DDP

from hpctrain.config import Config
from hpctrain.distributed.mesh import Mesh
from hpctrain.errors import ConfigError
from hpctrain.parallel.mpi_grad_sync import use_mpi_grad_sync, use_powersgd
from hpctrain.parallel.activation import apply_activation_checkpointing
from hpctrain.parallel.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:  # imported where pp > 1: torch.distributed.pipelining pulls in dynamo (0.4 s)
    from hpctrain.parallel.pipeline import PipelineSplit

# Optimizer state keyed "state.<fqn>.<name>": the same keys on every layout and pipeline stage.
_SD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_TIED_LAST, _TIED_FIRST = "state.lm_head.weight.", "state.tok_emb.weight."


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard, sharing storage (in-place collectives on it update the DTensor)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32). Vocab-sharded DTensor logits need `loss_parallel()`."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _mpi_grad_sync(mode: str, device: torch.device) -> bool:
    """dist.grad_sync: "mpi" (and "auto" on CPU) all-reduces DDP gradients with MPI, ~2x faster
    than Gloo here (docs/benchmarks.md). Trade-off: a rank SIGKILLed while its peers sit in
    MPI_Allreduce makes MPICH end the job at once (non-zero exit, its own "BAD TERMINATION ... RANK
    r" notice) instead of our heartbeat verdict line; "backend" keeps Gloo for the verdict."""
    if mode == "mpi" and device.type != "cpu":
        raise ConfigError("config key 'dist.grad_sync': 'mpi' reduces CPU gradients only; use "
                          "'backend' (NCCL) on GPUs")
    return mode == "mpi" or (mode == "auto" and device.type == "cpu")


class ParallelModel:
    """The model in this job's layout plus the layout-aware steps of training.

    `module` is what the optimizer and checkpoints see (all parameters this rank holds, original
    FQNs); `forward_backward`, `clip_grad_norm_`, `eval_loss` hide DDP / FSDP / TP / PP."""

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config):
        p, t = cfg.parallel, cfg.train
        self.mesh, self.cfg = mesh, cfg
        self.dp, self.tp, self.pp = mesh.dp_size, mesh.tp_size, mesh.pp_size
        self.fsdp = p.data_parallel == "fsdp" and self.dp > 1
        self.split: PipelineSplit | None = None
        if self.pp > 1:
            from hpctrain.parallel.pipeline import PipelineSplit

            virtual = p.pp_virtual_stages if p.pp_schedule == "interleaved" else 1
            self.split = PipelineSplit(model, mesh.coord("pp"), self.pp, virtual)
        if self.tp > 1:
            apply_tensor_parallel(model, mesh["tp"])
        apply_activation_checkpointing(model, p.activation_checkpoint, p.ac_every)
        roots = self.split.make_views() if self.split else [model]
        if self.fsdp:
            half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
            mp = (MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
                  if half is not None else MixedPrecisionPolicy())
            for block in model.blocks.values():
                fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
            for root in roots:
                fully_shard(root, mesh=mesh["dp"], mp_policy=mp)
        # Plain DDP for pure data parallelism (overlaps the all-reduce with backward); with TP or
        # PP, gradients are averaged over dp by one flat all-reduce after backward instead. Under
        # sync.mode = diloco the dp replicas train apart: no gradient sync over dp at all.
        self.replicas_apart = cfg.sync.mode != "sync"
        dp_sync = self.dp > 1 and not self.replicas_apart
        self.ddp = dp_sync and not self.fsdp and self.tp == 1 and self.pp == 1
        self.manual_dp = dp_sync and not self.fsdp and not self.ddp
        self.module = model
        self.forward_module = DDP(model, process_group=mesh.group("dp"),
                                  gradient_as_bucket_view=True) if self.ddp else roots[0]
        self.grad_sync_state = None
        if self.ddp and cfg.dist.grad_sync == "powersgd":
            use_powersgd(self.forward_module, mesh.group("dp"), cfg.dist.powersgd_rank)
        elif self.ddp and _mpi_grad_sync(cfg.dist.grad_sync, next(model.parameters()).device):
            self.grad_sync_state = use_mpi_grad_sync(self.forward_module, mesh.group("dp"),
                                                     mesh.world_comm, prescaled=True)
        # the MPI hook sums: the loss is divided by dp before backward instead (no pass over grads)
        self.loss_divisor = self.dp if self.grad_sync_state is not None else 1
        if t.compile:  # after DDP/FSDP wrapping, as torchtitan does (DDP graphs split at buckets)
            self.forward_module = torch.compile(self.forward_module)
        self.n_micro = t.grad_accum
        self.device = next(model.parameters()).device
        self.schedule = None
        self.tie_group = None
        self._loss_hook, self._loss_scale = None, 1.0
        if self.split:
            try:
                self.schedule = self.split.build_schedule(roots, p.pp_schedule, self.n_micro, self._pp_loss,
                                                          self.device, mesh.group("pp"))
            except ValueError as e:
                key = "train.global_batch" if t.global_batch else "train.grad_accum"  # derived or given
                raise ConfigError(f"config key '{key}': {self.n_micro} micro-batches do not "
                                  f"fit parallel.pp_schedule={p.pp_schedule!r} with pp={self.pp} "
                                  f"({e})") from None
            self.tie_group = self._tie_group()
        # Parameters counted in the grad norm: the tied weight's second copy (last stage) is skipped.
        skip = {id(model.lm_head.weight)} if (self.split and self.split.has_last
                                              and not self.split.has_first) else set()
        self.norm_params = [q for q in model.parameters() if id(q) not in skip]

    # ---- layout helpers -------------------------------------------------------------------
    def _tie_group(self):
        """Process group of {first stage, last stage} ranks at my (dp, tp) coordinate."""
        dims, mine = self.mesh.dims, None
        for d in range(dims.dp):
            for k in range(dims.tp):
                ranks = [dims.rank_of(0, d, k), dims.rank_of(dims.pp - 1, d, k)]
                group = dist.new_group(ranks)
                if self.mesh.rank in ranks:
                    mine = group
        return mine

    def _pp_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(logits, targets)
        loss = self._loss_hook(loss) if self._loss_hook is not None else loss
        return loss * self._loss_scale if self._loss_scale != 1.0 else loss

    def _loss_context(self):
        return loss_parallel() if self.tp > 1 else contextlib.nullcontext()

    def _sync_context(self, last: bool):
        if self.ddp and not last:
            return self.forward_module.no_sync()
        if self.fsdp and self.split is None:
            self.forward_module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _finish_grads(self) -> None:
        """Gradient reductions the wrappers do not do: the tied weight over pp, and the dp average
        when neither DDP nor FSDP is used (TP or PP with replicated data parallelism)."""
        if self.split is not None and self.split.tied_weight() is not None:
            weight = self.split.tied_weight()
            if isinstance(weight, DTensor) and weight.grad.placements != weight.placements:
                # e.g. the vocab-parallel embedding's grad may come back replicated: match the head's
                weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)
            dist.all_reduce(_local(weight.grad), group=self.tie_group)
        if self.manual_dp:
            grads = [_local(q.grad) for q in self.module.parameters() if q.grad is not None]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.mesh.group("dp"))
            for g, v in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(v.view_as(g))

    def _global_mean(self, local_sum: torch.Tensor, count: int) -> torch.Tensor:
        """Mean loss over the global batch from this rank's sum over `count` micro-batches (pipeline
        ranks without the last stage hold 0 and are summed away over pp)."""
        loss = (local_sum / count).to(torch.float32)
        if self.cfg.sync.mode == "ps":  # workers at different steps: the loss stays this worker's
            return loss
        if self.pp > 1:
            dist.all_reduce(loss, group=self.mesh.group("pp"))
        if self.dp > 1 and self.grad_sync_state is not None:
            # CPU with the MPI gradient hook: its communicator over the same dp ranks (3 us over
            # shared memory; Gloo's TCP takes 360 us, every step). Sum, then divide: as Gloo's AVG
            from mpi4py import MPI

            self.grad_sync_state.comm.Allreduce(MPI.IN_PLACE, loss.numpy(), op=MPI.SUM)
            loss /= self.dp
        elif self.dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.mesh.group("dp"))
        return loss

    # ---- training -------------------------------------------------------------------------
    def train(self) -> None:
        self.module.train()

    def forward_backward(self, micro_batches: list[torch.Tensor], autocast, loss_hook=None,
                         loss_scale: float = 1.0) -> torch.Tensor:
        """Forward + backward of one optimizer step's micro-batches ([mb, T+1] token tensors); leaves
        averaged gradients in `.grad`, times `loss_scale` (fp16 loss scaling). Returns the global
        mean loss (same value on every rank, unscaled). `loss_hook(loss) -> loss`, if given, sees
        each micro-batch loss before backward."""
        n = len(micro_batches)
        self._loss_hook, self._loss_scale = loss_hook, loss_scale
        total = torch.zeros((), device=self.device)
        if self.schedule is not None:
            x = torch.cat([b[:, :-1] for b in micro_batches])
            y = torch.cat([b[:, 1:] for b in micro_batches])
            losses: list = []
            with self._loss_context(), autocast:
                self.schedule.step(*((x,) if self.split.has_first else ()),
                                   **(dict(target=y, losses=losses) if self.split.has_last else {}))
            for loss in losses:
                total += _value(loss.detach()) / loss_scale  # a power of two: exact
        else:
            with self._loss_context():
                for i, tokens in enumerate(micro_batches):
                    with self._sync_context(i == n - 1):
                        with autocast:
                            logits = self.forward_module(tokens[:, :-1])
                        loss = self._pp_loss(logits, tokens[:, 1:])
                        (loss / n / self.loss_divisor).backward()
                    total += _value(loss.detach()) / loss_scale
        self._loss_hook, self._loss_scale = None, 1.0
        self._finish_grads()
        return self._global_mean(total, n)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global L2 norm of all gradients (every shard, every stage, the tied weight once); clips
        to `max_norm` when it is > 0. Returns the norm before clipping."""
        grads = [q.grad for q in self.norm_params if q.grad is not None]
        norm = _value(torch.nn.utils.get_total_norm(grads, 2.0))
        if self.pp > 1:
            sq = norm.to(torch.float64) ** 2
            dist.all_reduce(sq, group=self.mesh.group("pp"))
            norm = sq.sqrt().to(norm.dtype)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(list(self.module.parameters()), max_norm, norm)
        return float(norm)

    @torch.no_grad()
    def eval_loss(self, batches: list[torch.Tensor], autocast) -> float:
        """Mean loss over every rank's `batches` (equal-sized micro-batches), forward only."""
        self.module.eval()
        total = torch.zeros((), device=self.device)
        with self._loss_context():
            if self.schedule is None:
                for tokens in batches:
                    with autocast:
                        logits = self.forward_module(tokens[:, :-1])
                    total += _value(lm_loss(logits, tokens[:, 1:]))
            else:  # the schedule runs n_micro micro-batches at a time; pad the last group
                for start in range(0, len(batches), self.n_micro):
                    group = batches[start:start + self.n_micro]
                    real = len(group)
                    group = group + [group[-1]] * (self.n_micro - real)
                    x = torch.cat([b[:, :-1] for b in group])
                    y = torch.cat([b[:, 1:] for b in group])
                    losses: list = []
                    with autocast:
                        self.schedule.eval(*((x,) if self.split.has_first else ()),
                                           **(dict(target=y, losses=losses) if self.split.has_last
                                              else {}))
                    for loss in losses[:real]:
                        total += _value(loss)
        return self._global_mean(total, len(batches)).item()

    # ---- checkpoint state -----------------------------------------------------------------
    def renames_tied(self) -> bool:
        """This rank holds the last pipeline stage but not the first: its copy of the tied weight is
        lm_head.weight, saved under tok_emb.weight (train/states.OptimState)."""
        return self._renames_tied()

    def _renames_tied(self) -> bool:
        return self.split is not None and self.split.has_last and not self.split.has_first

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """{"model": ..., "optim": ...} tensors with layout-free FQNs, for CheckpointManager.
        Optimizer hyper-parameters are not saved: they come from the config (lr from the step).
        The tied weight's optimizer state is saved under its first name, tok_emb.weight, as in an
        unsplit model (the last pipeline stage writes the same values under the same key)."""
        model_sd, optim_sd = get_state_dict(self.module, optimizer, options=_SD_OPTIONS)
        optim = {}
        for k, v in optim_sd.items():
            if isinstance(v, torch.Tensor):
                if self._renames_tied() and k.startswith(_TIED_LAST):
                    k = _TIED_FIRST + k[len(_TIED_LAST):]
                optim[k] = v
        return {"model": model_sd, "optim": optim}

    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Apply a `checkpoint_state()` dict filled by CheckpointManager.load (any saved layout)."""
        _, current = get_state_dict(self.module, optimizer, options=_SD_OPTIONS)
        optim = {k: v for k, v in current.items() if not isinstance(v, torch.Tensor)}
        for k, v in state["optim"].items():
            if self._renames_tied() and k.startswith(_TIED_FIRST):
                k = _TIED_LAST + k[len(_TIED_FIRST):]
            optim[k] = v
        set_state_dict(self.module, optimizer, model_state_dict=state["model"],
                       optim_state_dict=optim, options=_SD_OPTIONS)


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> ParallelModel:
    """Apply cfg.parallel's layout to `model` in place (pipeline stages delete what they do not own)."""
    return ParallelModel(model, mesh, cfg)


def grad_sync_context(model: nn.Module, sync: bool):
    """Skip the gradient all-reduce for all micro-batches but the last (one all-reduce per step)."""
    if not sync and isinstance(model, DDP):
        return model.no_sync()
    return contextlib.nullcontext()

