"""CPU offload (parallel.offload): where parameters, gradients and AdamW's state live between uses.

    "none"       everything on the device (the default)
    "optimizer"  ZeRO-Offload: parameters and gradients on the device; AdamW's moments and an fp32
                 master copy of this rank's parameters (its FSDP shards) in host memory; each step
                 copies the gradients device -> host, steps on the CPU (fused AdamW, the same
                 kernel as without offload), copies the parameters host -> device
    "all"        FSDP2's own CPUOffloadPolicy: sharded parameters, gradients and AdamW's state in
                 (pinned) host memory; FSDP2 copies a block's shards to the device for its
                 all-gather and its gradients back after the reduce-scatter; AdamW steps on the CPU

Owns: the choice of what runs where for each mode: FSDP2's policy of the "all" mode
(`fsdp_offload_policy`), the device a layout computes on when its shards are on the host
(`compute_device`), where the bad-step flag goes (`flag_for_step`). The "optimizer" mode's
optimizer is hpctrain/parallel/optim_offload.py's `OffloadedAdamW`. It must never decide the layout
(parallelize.py does) or read the config.

Host syncs per step: "optimizer" one stream synchronize (its device -> host copies and the
bad-step flag); "all" one read of the bad-step flag to the host (`flag_for_step`); FSDP2's copies
run on its streams.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hpctrain.parallel.optim_offload import OffloadedAdamW, local_part


def adamw_class(offload: str) -> type | None:
    """The AdamW class model/optim.py's build_optimizer builds for parallel.offload: host-memory
    state and step for "optimizer"; None (torch's fused AdamW) otherwise."""
    return OffloadedAdamW if offload == "optimizer" else None


def fsdp_offload_policy(offload: str, device: torch.device):
    """FSDP2's offload policy for parallel.offload: CPUOffloadPolicy for "all" (pinned host memory
    where the device is a GPU: asynchronous copies), else its no-offload default."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if offload != "all":
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def compute_device(model: nn.Module, mesh) -> torch.device:
    """Where `model` computes: its parameters' device, or the mesh's where FSDP2 keeps them on
    the host (parallel.offload = "all")."""
    device = next(model.parameters()).device
    kind = mesh.device_mesh.device_type
    if device.type == "cpu" and kind != "cpu":
        return torch.device(kind, torch.get_device_module(kind).current_device())
    return device


def flag_for_step(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> torch.Tensor:
    """The bad-step flag where the optimizer's kernel runs: on the host for FSDP2's offloaded
    shards (parallel.offload = "all"), copied there and waited for (torch's fused AdamW would copy
    it without waiting: a GPU value read before it lands); the flag itself everywhere else."""
    held = next((p for g in optimizer.param_groups for p in g["params"]), None)
    where = None if held is None else local_part(held).device  # a DTensor's own device is the mesh's
    if where is None or isinstance(optimizer, OffloadedAdamW) or flag.device == where:
        return flag
    return flag.to(where)


