"""The one object that answers "who am I in dp / tp / pp" for everybody.

Owns: the parallel layout (sizes per named axis), its validation against the world size, and the
torch DeviceMesh with named axes. Code elsewhere asks for an axis by name (`mesh["dp"]`), never by
position, so adding tensor and pipeline axes does not change its callers. It must never import
model, data or checkpoint code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpctrain.dist.bootstrap import DistContext
from hpctrain.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel axes; the data-parallel size is what the others leave of the world."""

    world_size: int
    dp: int

    @classmethod
    def from_world(cls, world_size: int, dp: int = 0) -> "ParallelDims":
        dp = dp or world_size
        if dp != world_size:
            raise ConfigError(f"parallel layout dp={dp} does not match world size {world_size}")
        return cls(world_size=world_size, dp=dp)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return ("dp",)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return (self.dp,)


class Mesh:
    """Named device mesh plus this rank's coordinate on every axis."""

    def __init__(self, dims: ParallelDims, ctx: DistContext):
        self.dims = dims
        self.device_mesh: DeviceMesh = init_device_mesh(
            ctx.device.type, dims.axis_sizes, mesh_dim_names=dims.axis_names)

    def __getitem__(self, axis: str) -> DeviceMesh:
        return self.device_mesh[axis]

    def size(self, axis: str) -> int:
        return self.device_mesh[axis].size()

    def coord(self, axis: str) -> int:
        return self.device_mesh[axis].get_local_rank()

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.device_mesh[axis].get_group()

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")
