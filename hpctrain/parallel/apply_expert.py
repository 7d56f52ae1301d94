"""parallel.ep: shard every MoE layer's experts of a laid-out model over `ep` ranks borrowed from
the ranks that average gradients, dp (x cp with context parallelism: as torchtitan borrows ep
from dp_shard x cp), and the gradient bookkeeping that this needs.

Owns: the expert mesh (the flattened dp x cp ranks, `Mesh.reduce_size` = n of them, split into
n / ep replicas x ep consecutive ones: rank order (pp, ep_replica, ep, tp), the same global ranks
as the Mesh's (pp, dp, cp, tp) with flattened index dp_index * cp + cp_index = replica * ep +
ep index; at cp = 1 simply dp), replacing each MoEFeedForward.experts by its
ExpertParallelExperts (hpctrain/parallel/expert.py: DTensor Shard(0) weights under the unsharded
names, so checkpoints stay layout-free), and `ExpertParallel`, which the runner asks to average the
expert gradients (DDP and FSDP never see the expert weights: parallelize.py leaves them out) and
to count each expert once in the gradient norm. It must never run a step or touch the optimizer.

Gradient scaling: each rank's loss is the mean over its micro-batch (with cp: over its part of
each sequence, the same number of tokens on every cp rank); the global (1-rank) gradient is the
mean over the n = dp x cp ranks of their gradients. An expert's gradient on its rank already sums
the contributions of the ep ranks whose tokens it computed, so the global gradient is the sum over
the n / ep replicas holding that expert, divided by n (or only summed where the loss was divided
by n before backward: the MPI gradient hook's `prescaled` loss).
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
from hpctrain.parallel.expert import WEIGHTS, ExpertParallelExperts, shard_experts

EXPERT_AXES = ("pp", "ep_replica", "ep", "tp")


@dataclass(frozen=True)
class ExpertParallel:
    """The sharded expert weights of this rank and the groups their gradients need."""

    params: tuple[nn.Parameter, ...]
    mesh: DeviceMesh                       # 1-D, the ep ranks (the weights' DTensor mesh)
    replica_group: dist.ProcessGroup       # the (dp x cp) / ep ranks holding the same experts
    reduce_size: int                       # dp x cp: the ranks whose gradients are averaged
    layers: tuple[ExpertParallelExperts, ...] = ()
    deterministic: bool = False            # parallel.deterministic_experts: sum in tree order

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` (a weight or its gradient) is an expert shard of this layout."""
        return is_dtensor(t) and t.device_mesh is self.mesh

    def reduce_grads(self, prescaled: bool) -> None:
        """Expert gradients -> the global batch's (see the module docstring)."""
        if self.deterministic:
            return self._reduce_in_tree_order(prescaled)
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.flatten() for g in grads])
        if dist.get_world_size(self.replica_group) > 1:
            dist.all_reduce(flat, group=self.replica_group)
        if not prescaled:
            flat /= self.reduce_size
        for g, v in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(v.view_as(g))

    def _reduce_in_tree_order(self, prescaled: bool) -> None:
        """parallel.deterministic_experts: each weight's gradient is the sum over the global
        (flattened dp x cp) index of the per-source gradients in one binary tree, whatever ep is:
        pairwise over this rank's ep sources (an aligned block of those indices), then by
        recursive doubling over the replicas (a two-rank sum a + b is exact on both sides), so
        n / ep / 1 ranks add the same numbers in the same order. Sets .grad (a DTensor like the
        weight)."""
        from torch.distributed.tensor import DTensor

        per_source = [g for layer in self.layers for g in layer.take_source_grads()]
        flat = torch.cat([_pairwise_sum(g).flatten() for g in per_source])
        flat = _recursive_doubling_sum(flat, self.replica_group)
        if not prescaled:
            flat /= self.reduce_size
        sizes = [g[0].numel() for g in per_source]
        for p, v, g in zip(self.params, flat.split(sizes), per_source):
            p.grad = DTensor.from_local(v.view_as(g[0]), p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())

    def grad_norm_sq(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Squared L2 norm (fp64) of expert gradients `grads`, each expert counted once (summed
        over the ep ranks)."""
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            sq += (g.to_local().double() ** 2).sum()
        dist.all_reduce(sq, group=self.mesh.get_group())
        return sq


def _pairwise_sum(t: torch.Tensor) -> torch.Tensor:
    """t[0] + t[1] + ... summed as a balanced binary tree (t.shape[0]: a power of two)."""
    while t.shape[0] > 1:
        t = t[0::2] + t[1::2]
    return t[0]


def _recursive_doubling_sum(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of every rank's `flat` over `group` (a power-of-two size), partner = rank XOR 1, 2,
    4, ...: rank r ends with the tree ((x0 + x1) + (x2 + x3)) + ..., the same on every rank.
    The lower rank of a pair sends first, the higher receives first: NCCL runs a rank's p2p ops in
    order on one stream and a send waits for its receive, so both sending first deadlocks (#49;
    tests/mpi/test_expert_parallel.py runs this with such sends on Gloo)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    step = 1
    while step < n:
        peer = dist.get_global_rank(group, r ^ step)
        other = torch.empty_like(flat)
        if r < r ^ step:
            dist.send(flat, peer, group=group)
            dist.recv(other, peer, group=group)
            flat = flat + other
        else:
            dist.recv(other, peer, group=group)
            dist.send(flat, peer, group=group)
            flat = other + flat
        step *= 2
    return flat


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def expert_mesh(mesh: Mesh, ep: int) -> DeviceMesh:
    """The (pp, ep_replica, ep, tp) view of the world's ranks, ep_replica x ep = dp x cp
    (collective: every rank calls it)."""
    d, n = mesh.dims, mesh.reduce_size
    if ep < 1 or n % ep:
        raise ConfigError(f"config key 'parallel.ep': {ep} must divide dp={d.dp} x cp={d.cp} = {n} "
                          f"(the ep ranks are borrowed from dp x cp)")
    device = mesh.device_mesh.device_type
    emesh = init_device_mesh(device, (d.pp, n // ep, ep, d.tp), mesh_dim_names=EXPERT_AXES)
    for axis in EXPERT_AXES:  # dist.timeout_s, as the Mesh's groups
        apply_timeout(emesh[axis].get_group())
    return emesh


def apply_expert_parallel(model: nn.Module, mesh: Mesh, ep: int,
                          deterministic: bool = False) -> ExpertParallel | None:
    """Shard the experts of every MoE layer this rank holds over `ep` ranks (in place).
    `deterministic` (parallel.deterministic_experts; ep = 1 too): per-source gradients summed in
    one tree order (ExpertParallel._reduce_in_tree_order)."""
    if deterministic and not (_power_of_two(ep) and _power_of_two(mesh.reduce_size)):
        raise ConfigError(f"config key 'parallel.deterministic_experts': needs a power-of-two "
                          f"parallel.ep and dp x cp (got ep={ep}, dp x cp={mesh.reduce_size}); set it "
                          f"to false")
    emesh = expert_mesh(mesh, ep)
    ep_mesh, params, layers = emesh["ep"], [], []
    for module in list(model.modules()):
        if isinstance(module, MoEFeedForward):
            n = module.cfg.n_experts
            if n % ep:
                raise ConfigError(f"config key 'parallel.ep': {ep} must divide model.moe_experts={n}")
            module.experts = shard_experts(module.experts, n, ep_mesh.get_group(), ep_mesh, deterministic)
            params += [getattr(module.experts, w) for w in WEIGHTS]
            layers.append(module.experts)
    return ExpertParallel(tuple(params), ep_mesh, emesh["ep_replica"].get_group(), mesh.reduce_size,
                          tuple(layers), deterministic)
