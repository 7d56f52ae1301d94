"""parallelize(model, mesh, cfg) -> Layout: apply the job's parallel layout to an unmodified GPT.

Owns: the order in which layouts are applied, as a short sequence of functions that each take and
return modules (pipeline split -> tensor parallel -> expert parallel -> context parallel's attention ->
activation checkpointing -> FSDP2 | DDP -> torch.compile per block or of the whole model; a model built on the meta device is materialized after FSDP2 and before DDP),
which of them a job needs, and the `Layout` they produce: the module the optimizer
and checkpoints see, the module(s) that run forward, the pipeline split, the process groups and
how gradients are averaged over dp. It must never run a training step (runner.py does), read or
write checkpoint state (state.py does), or edit the model's code or parameter names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpctrain.config import Config, DistConfig
from hpctrain.distributed.bootstrap import new_group
from hpctrain.distributed.mesh import Mesh
from hpctrain.errors import ConfigError
from hpctrain.metrics.wait_clock import WaitClock
from hpctrain.model import spec as model_spec
from hpctrain.parallel.activation import (apply_activation_checkpointing, compile_blocked, compile_regions,
                                          compile_scope, compile_whole_model)
from hpctrain.parallel.apply_context_parallel import ContextParallel, apply_context_parallel
from hpctrain.parallel.apply_expert import ExpertParallel, apply_expert_parallel
from hpctrain.parallel.mpi_grad_allreduce import (MPIHookState, time_ddp_allreduce,
                                                  use_mpi_grad_allreduce, use_powersgd)
from hpctrain.parallel.offload import compute_device, fsdp_offload_policy
from hpctrain.parallel.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:  # imported where pp > 1: torch.distributed.pipelining pulls in dynamo (0.4 s)
    from hpctrain.parallel.pipeline import PipelineSplit

# How gradients are averaged over dp: by DDP's all-reduce during backward, by FSDP's
# reduce-scatter, by one flat all-reduce after backward (TP or PP with replicated weights), or not
# at all (dp == 1, or sync.mode = diloco: the replicas train apart)
DpReduce = Literal["ddp", "fsdp", "after_backward", "none"]


@dataclass(frozen=True)
class Layout:
    """The model in this job's layout.

    `module`: what the optimizer and checkpoints see (all parameters this rank holds, original
    FQNs). `forward_modules`: what runs forward: one module (the model, or its DDP / compiled
    wrapper), or one view per pipeline stage this rank holds (`split` is set then).
    `wait_clock`: this rank's time waiting for peers in a step (DDP's hooks and the runner's
    reductions mark it)."""

    module: nn.Module
    forward_modules: tuple[nn.Module, ...]
    mesh: Mesh
    dp_reduce: DpReduce
    split: PipelineSplit | None = None
    tie_group: dist.ProcessGroup | None = None  # {first stage, last stage} at my (dp, cp, tp)
    mpi_grad_allreduce: MPIHookState | None = None   # DDP's MPI hook: its communicator
    wait_clock: WaitClock = field(default_factory=lambda: WaitClock(torch.device("cpu")))
    experts: ExpertParallel | None = None  # parallel.ep > 1: the sharded experts (DDP/FSDP skip them)
    context_parallel: ContextParallel | None = None  # parallel.cp > 1: entered per micro-batch
    compiled: str = ""  # train.compile's scope: "blocks" | "model" ("" = eager)

    @property
    def waits_measured(self) -> bool:
        """Whether `wait_clock` sees every wait of a step: no collective runs inside forward or
        backward except DDP's (timed through its hook). FSDP's all-gathers / reduce-scatters, TP's
        all-reduces and the pipeline's sends and receives run inside autograd, where waiting for a
        peer cannot be told from compute on the host; there busy time is the step's wall time. So
        do context parallelism's ring exchanges and all-to-alls (inside every attention)."""
        return (self.dp_reduce != "fsdp" and self.mesh.tp_size == 1 and self.mesh.pp_size == 1
                and self.mesh.cp_size == 1)

    @property
    def tied_weight_is_head_copy(self) -> bool:
        """This rank holds the tied embedding / head weight only as the last stage's lm_head (no
        tok_emb): the second copy, counted once in the grad norm, saved under tok_emb's name."""
        return (self.split is not None and self.split.tied and self.split.has_last
                and not self.split.has_first)


def apply_pipeline(model: nn.Module, mesh: Mesh, schedule: str, virtual_stages: int) -> PipelineSplit:
    """Keep only this pipeline rank's stages of `model` (in place; the rest is deleted)."""
    from hpctrain.parallel.pipeline import PipelineSplit

    virtual = virtual_stages if schedule == "interleaved" else 1
    return PipelineSplit(model, mesh.coord("pp"), mesh.pp_size, virtual)


def tied_weight_group(mesh: Mesh) -> dist.ProcessGroup | None:
    """Process group of {first stage, last stage} ranks at my (dp, cp, tp) coordinate in my replica
    (sync.replica_nodes; else the one replica) (collective: every rank creates every group)."""
    dims, mine = mesh.dims, None
    for r in range(max(1, dims.replicas)):
        for d in range(dims.dp):
            for c in range(dims.cp):
                for k in range(dims.tp):
                    ranks = [dims.rank_of(0, d, k, r, c), dims.rank_of(dims.pp - 1, d, k, r, c)]
                    group = new_group(ranks)
                    if mesh.rank in ranks:
                        mine = group
    return mine


def apply_fsdp(model: nn.Module, roots: tuple[nn.Module, ...], mesh: Mesh, precision: str,
               experts: ExpertParallel | None = None, offload: str = "none") -> None:
    """FSDP2 over dp: each block, then each root (the model or its stage views); half-precision
    parameters with fp32 gradient reduction under bf16 / fp16. Expert-parallel weights are left
    out (sharded over ep already; the runner averages their gradients). A root keeps its
    parameters (embedding, final norm, head) gathered from forward to backward
    (reshard_after_forward=False, as torchtitan): backward needs them at once, so resharding would
    only all-gather them again. `offload` = "all": shards, gradients (and so AdamW's state) in
    host memory (parallel/offload.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # DTensor: not at start-up

    ignored = set(experts.params) if experts is not None else None
    half = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(precision)
    mp = (MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
          if half is not None else MixedPrecisionPolicy())
    dp_mesh = mesh.fsdp_mesh()  # "dp" (with cp > 1 dp x cp flattened); HSDP: (replicate, shard)
    policy = fsdp_offload_policy(offload, torch.device(mesh.device_mesh.device_type))
    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored, offload_policy=policy)
    for root in roots:
        fully_shard(root, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored,
                    reshard_after_forward=False, offload_policy=policy)


def ddp_comm_hook(mode: str, device: torch.device) -> str | None:
    """The comm hook dist.grad_allreduce puts on DDP: "powersgd"; "mpi" ("mpi", and "auto" on CPU:
    ~2x faster than Gloo here, docs/benchmarks.md); or None, DDP's own C++ all-reduce ("backend",
    and "auto" on GPUs: NCCL, no Python call per bucket, no pass over the gradients of its own).
    Trade-off of "mpi": a rank SIGKILLed while its peers sit in MPI_Allreduce makes MPICH end the
    job at once (non-zero exit, its own "BAD TERMINATION ... RANK r" notice) instead of our
    heartbeat verdict line; "backend" keeps Gloo for the verdict."""
    if mode == "mpi" and device.type != "cpu":
        raise ConfigError("config key 'dist.grad_allreduce': 'mpi' reduces CPU gradients only; use "
                          "'backend' (NCCL) on GPUs")
    if mode == "powersgd":
        return "powersgd"
    return "mpi" if mode == "mpi" or (mode == "auto" and device.type == "cpu") else None


def apply_ddp(model: nn.Module, mesh: Mesh, dist_cfg: DistConfig, clock: WaitClock | None = None,
              experts: ExpertParallel | None = None) -> tuple[DDP, MPIHookState | None]:
    """DDP over dp (overlaps the all-reduce with backward) with the comm hook dist.grad_allreduce
    asks for (ddp_comm_hook), timed by `clock`; returns the wrapper and, for the MPI hook, its
    state. The MPI hook expects the loss divided by dp before backward (`prescaled`: it sums,
    saving a pass over the gradients). Without a hook DDP reduces on its own, timed by a callback
    at the end of backward's compute (time_ddp_allreduce)."""
    group = mesh.reduce_group()  # dp (x cp: context-parallel ranks hold the same weights)
    if experts is not None:  # sharded over ep: the runner averages their gradients
        held = {id(q) for q in experts.params}
        DDP._set_params_and_buffers_to_ignore_for_model(
            model, [name for name, q in model.named_parameters() if id(q) in held])
    ddp = DDP(model, process_group=group, gradient_as_bucket_view=True)
    hook = ddp_comm_hook(dist_cfg.grad_allreduce, next(model.parameters()).device)
    if hook == "powersgd":
        use_powersgd(ddp, group, dist_cfg.powersgd_rank, clock)
    elif hook == "mpi":
        return ddp, use_mpi_grad_allreduce(ddp, group, mesh.world_comm, prescaled=True, clock=clock)
    else:
        time_ddp_allreduce(ddp, clock)
    return ddp, None


def apply_compile(model: nn.Module, cfg: Config, device: torch.device, plain_or_ddp: bool) -> str:
    """train.compile over train.compile_scope's unit; returns the scope used ("blocks" | "model")."""
    blocked = compile_blocked(device)
    if blocked:
        raise ConfigError(f"train.compile: {blocked}")
    p = cfg.parallel
    layout_allows_model = plain_or_ddp and p.tp == 1 and p.pp == 1 and p.ep == 1
    has_experts = model_spec.get(cfg.model.arch).n_experts(cfg.model) > 0
    scope = compile_scope(cfg.train.compile_scope, device, layout_allows_model, has_experts)
    if scope == "model":
        compile_whole_model(model)
    else:
        compile_regions(model)
    return scope


def dp_reduction(mesh: Mesh, cfg: Config) -> DpReduce:
    """How this job averages gradients over dp (x cp; see DpReduce)."""
    if mesh.reduce_size == 1:
        return "none"
    if cfg.parallel.data_parallel == "fsdp":
        return "fsdp"
    if cfg.sync.mode != "sync" and not mesh.dims.hierarchical:  # (hierarchical: dp = inside a replica)
        return "none"
    return "ddp" if mesh.tp_size == 1 and mesh.pp_size == 1 else "after_backward"


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config, precision: str,
                materialize: Callable[[nn.Module], None] | None = None) -> Layout:
    """Apply cfg.parallel's layout to `model` in place (pipeline stages delete what they do not own).

    `precision`: the resolved train.precision (FSDP2's mixed precision; never "auto").
    `materialize`: for a model built on the meta device (meta_init.py), allocates and initializes
    this rank's parameters; called once they are sharded (TP, FSDP2) and before DDP (which
    broadcasts rank 0's)."""
    p = cfg.parallel
    split = apply_pipeline(model, mesh, p.pp_schedule, p.pp_virtual_stages) if mesh.pp_size > 1 else None
    if mesh.tp_size > 1:
        family = model_spec.get(cfg.model.arch)
        apply_tensor_parallel(model, mesh["tp"], lambda layer: family.block_tp_plan(cfg.model, layer),
                              sequence_parallel=p.sp)
    experts = (apply_expert_parallel(model, mesh, p.ep, p.deterministic_experts)
               if p.ep > 1 or p.deterministic_experts else None)
    context_parallel = apply_context_parallel(model, mesh, p.cp_attention) if mesh.cp_size > 1 else None
    apply_activation_checkpointing(model, p.activation_checkpoint, p.ac_every)
    roots = tuple(split.make_views()) if split else (model,)
    dp_reduce, mpi_grad_allreduce = dp_reduction(mesh, cfg), None
    if p.offload == "all" and dp_reduce != "fsdp":
        raise ConfigError(f"config key 'parallel.offload': 'all' is FSDP2's CPU offload, which this "
                          f"job does not shard with (dp x cp = {mesh.reduce_size}, "
                          f"data_parallel = {p.data_parallel!r}); use 'optimizer' or 'none'")
    if dp_reduce == "fsdp":
        apply_fsdp(model, roots, mesh, precision, experts, p.offload)
    if materialize is not None:
        materialize(model)
    device = compute_device(model, mesh)  # parallel.offload = all: the shards are on the host
    clock = WaitClock(device)
    if dp_reduce == "ddp":
        ddp, mpi_grad_allreduce = apply_ddp(model, mesh, cfg.dist, clock, experts)
        roots = (ddp,)
    compiled = ""
    if cfg.train.compile:  # after DDP/FSDP wrapping (config: never with pp > 1)
        compiled = apply_compile(model, cfg, device, dp_reduce != "fsdp" and experts is None)
    return Layout(module=model, forward_modules=roots, mesh=mesh, dp_reduce=dp_reduce, split=split,
                  tie_group=tied_weight_group(mesh) if split else None,
                  mpi_grad_allreduce=mpi_grad_allreduce, wait_clock=clock, experts=experts,
                  compiled=compiled, context_parallel=context_parallel)
