"""parallel.ep: shard every MoE layer's experts of a laid-out model over `ep` ranks borrowed from
the data-parallel ranks (as torchtitan does), and the gradient bookkeeping that this needs.

Owns: the expert mesh (dp split into dp / ep replicas x ep consecutive dp ranks: rank order
(pp, ep_replica, ep, tp), the same global ranks as the Mesh's (pp, dp, tp) with
dp index = replica * ep + ep index), replacing each MoEFeedForward.experts by its
ExpertParallelExperts (hpctrain/parallel/expert.py: DTensor Shard(0) weights under the unsharded
names, so checkpoints stay layout-free), and `ExpertParallel`, which the runner asks to average the
expert gradients (DDP and FSDP never see the expert weights: parallelize.py leaves them out) and
to count each expert once in the gradient norm. It must never run a step or touch the optimizer.

Gradient scaling: each rank's loss is the mean over its micro-batch; the global (1-rank) gradient
is the mean over dp of the ranks' gradients. An expert's gradient on its rank already sums the
contributions of the ep ranks whose tokens it computed, so the global gradient is the sum over the
dp / ep replicas holding that expert, divided by dp (or only summed where the loss was divided
by dp before backward: the MPI gradient hook's `prescaled` loss).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpctrain.distributed.bootstrap import apply_timeout
from hpctrain.distributed.dtensor import is_dtensor
from hpctrain.distributed.mesh import Mesh
from hpctrain.errors import ConfigError
from hpctrain.model.moe import MoEFeedForward
from hpctrain.parallel.expert import WEIGHTS, shard_experts

EXPERT_AXES = ("pp", "ep_replica", "ep", "tp")


@dataclass(frozen=True)
class ExpertParallel:
    """The sharded expert weights of this rank and the groups their gradients need."""

    params: tuple[nn.Parameter, ...]
    mesh: DeviceMesh                       # 1-D, the ep ranks (the weights' DTensor mesh)
    replica_group: dist.ProcessGroup       # the dp / ep ranks holding the same experts
    dp_size: int

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` (a weight or its gradient) is an expert shard of this layout."""
        return is_dtensor(t) and t.device_mesh is self.mesh

    def reduce_grads(self, prescaled: bool) -> None:
        """Expert gradients -> the global batch's (see the module docstring)."""
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.flatten() for g in grads])
        if dist.get_world_size(self.replica_group) > 1:
            dist.all_reduce(flat, group=self.replica_group)
        if not prescaled:
            flat /= self.dp_size
        for g, v in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(v.view_as(g))

    def grad_norm_sq(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Squared L2 norm (fp64) of expert gradients `grads`, each expert counted once (summed
        over the ep ranks)."""
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            sq += (g.to_local().double() ** 2).sum()
        dist.all_reduce(sq, group=self.mesh.get_group())
        return sq


def expert_mesh(mesh: Mesh, ep: int) -> DeviceMesh:
    """The (pp, ep_replica, ep, tp) view of the world's ranks (collective: every rank calls it)."""
    d = mesh.dims
    if ep < 1 or d.dp % ep:
        raise ConfigError(f"config key 'parallel.ep': {ep} must divide the data-parallel size "
                          f"dp={d.dp} (the ep ranks are borrowed from dp)")
    device = mesh.device_mesh.device_type
    emesh = init_device_mesh(device, (d.pp, d.dp // ep, ep, d.tp), mesh_dim_names=EXPERT_AXES)
    for axis in EXPERT_AXES:  # dist.timeout_s, as the Mesh's groups
        apply_timeout(emesh[axis].get_group())
    return emesh


def apply_expert_parallel(model: nn.Module, mesh: Mesh, ep: int) -> ExpertParallel | None:
    """Shard the experts of every MoE layer this rank holds over `ep` ranks (in place)."""
    emesh = expert_mesh(mesh, ep)
    ep_mesh, params = emesh["ep"], []
    for module in list(model.modules()):
        if isinstance(module, MoEFeedForward):
            n = module.cfg.n_experts
            if n % ep:
                raise ConfigError(f"config key 'parallel.ep': {ep} must divide model.moe_experts={n}")
            module.experts = shard_experts(module.experts, n, ep_mesh.get_group(), ep_mesh)
            params += [getattr(module.experts, w) for w in WEIGHTS]
    return ExpertParallel(tuple(params), ep_mesh, emesh["ep_replica"].get_group(), mesh.dp_size)
