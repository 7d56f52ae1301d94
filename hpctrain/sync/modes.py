"""sync.mode -> its strategy object, and what a mode changes before the model exists: where each
rank reads in the data order, and the data config it reads with.

Owns the one place where the mode's name is looked at. Parameter-server code (MPI windows, mpi4py)
is imported only where sync.mode = "ps" runs.
"""
from __future__ import annotations

import dataclasses

import torch.nn as nn

from hpctrain.config import Config
from hpctrain.distributed import DistContext
from hpctrain.distributed.mesh import Mesh
from hpctrain.sync.strategy import SyncStrategy


def data_position(cfg: Config, ctx: DistContext, mesh: Mesh):
    """An object with dp_rank / dp_size: the mesh's dp coordinate, a ps worker's index among the
    workers, or (async_diloco) 0 of 1: a replica trains whole batches it claims (servers read
    no batches)."""
    if cfg.sync.mode == "async_diloco":  # every replica takes whole claimed batches
        from hpctrain.sync.asynchronous import WorkerPosition, count_workers

        count_workers(cfg, ctx)  # sync.replica_nodes: each inner-dp rank its slice of the batch
        return WorkerPosition(mesh.dp_rank, mesh.dp_size) if mesh.dims.hierarchical else WorkerPosition(0, 1)
    if mesh.dims.hierarchical:  # sync.replica_nodes: every rank of every replica its own part
        from hpctrain.sync.asynchronous import WorkerPosition

        return WorkerPosition(mesh.data_rank, mesh.data_size)
    if cfg.sync.mode != "ps":
        return mesh
    from hpctrain.sync.ps_strategy import worker_position

    return worker_position(cfg, ctx)


def data_config(cfg: Config) -> Config:
    """The config the data is read with: asynchronous workers read without the node-local cache
    (its leader paces staging by lockstep steps). A copy: the run's config is saved as given."""
    if cfg.sync.mode not in ("ps", "async_diloco"):
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir="off"))


def build_strategy(cfg: Config, ctx: DistContext, mesh: Mesh, model: nn.Module) -> SyncStrategy:
    """sync: the layout averages gradients every step; diloco: replicas take local steps and
    DiLoCo owns the global model and rounds; ps: workers push to parameter servers."""
    if cfg.sync.mode == "diloco" and cfg.sync.streaming:
        from hpctrain.sync.streaming import StreamingDiLoCo

        return StreamingDiLoCo(model, mesh, cfg.sync, cfg.train.steps, cfg.model.n_layer)
    if cfg.sync.mode == "diloco":
        from hpctrain.sync.diloco import DiLoCo

        return DiLoCo(model, mesh, cfg.sync, cfg.train.steps)
    if cfg.sync.mode == "ps":
        from hpctrain.sync.ps_strategy import ParameterServerSGD

        return ParameterServerSGD(cfg, ctx, model)
    if cfg.sync.mode == "async_diloco":
        from hpctrain.sync.async_diloco import AsyncDiLoCo

        return AsyncDiLoCo(cfg, ctx, mesh, model)
    from hpctrain.sync.synchronous import Synchronous

    local_numel = sum(p.numel() for p in model.parameters())
    return Synchronous(local_numel, mesh.reduce_size, cfg.dist.grad_allreduce)  # dp x cp
