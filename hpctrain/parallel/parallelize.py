"""parallelize(model, mesh, cfg): wrap an unmodified model for the job's layout.

Owns: data parallelism (DDP over the mesh's "dp" axis) and the gradient-sync context for gradient
accumulation (sync only on the last micro-batch). Tensor/pipeline parallelism and FSDP plug in here
as further steps in the same short sequence. It must never edit the model's code or parameter names.
"""
from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpctrain.config import Config
from hpctrain.dist.mesh import Mesh


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> nn.Module:
    if mesh.dp_size > 1:
        model = DDP(model, process_group=mesh.group("dp"), gradient_as_bucket_view=True)
    return model


def grad_sync_context(model: nn.Module, sync: bool):
    """Skip the gradient all-reduce for all micro-batches but the last (one all-reduce per step)."""
    if not sync and isinstance(model, DDP):
        return model.no_sync()
    return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model
