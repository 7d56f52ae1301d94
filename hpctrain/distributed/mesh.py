"""The one object that answers "who am I in pp / dp / tp, and which ranks share each axis with me".

Owns: the parallel layout (sizes per named axis), its validation against the world size, the rank
order, and the torch DeviceMesh with named axes. Code elsewhere asks for an axis by name
(`mesh["dp"]`, `mesh.coord("tp")`, `mesh.group("pp")`), never by position, and never assumes a
1-D mesh. It must never import model, data or checkpoint code.

Rank order (row-major over ("pp", "dp", "tp"), TP innermost):

    rank = (pp_index * dp + dp_index) * tp + tp_index

so the ranks of one TP group are consecutive. Launchers place consecutive ranks on the same node
(block distribution: mpiexec and srun default), so a TP group stays inside one node whenever the
ranks per node are a multiple of tp; DP groups cross nodes next, and pipeline stages, which send
only activations between neighbours, are the outermost axis. See docs/parallelism.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpctrain import logs
from hpctrain.distributed.bootstrap import DistContext, apply_timeout
from hpctrain.errors import ConfigError

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel axes; dp = 0 means "what tp and pp leave of the world"."""

    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    fsdp: bool = False

    @classmethod
    def from_world(cls, world_size: int, dp: int = 0, tp: int = 1, pp: int = 1,
                   fsdp: bool = False) -> "ParallelDims":
        if tp < 1 or pp < 1 or dp < 0:
            raise ConfigError(f"parallel layout dp={dp} tp={tp} pp={pp}: sizes must be >= 1 (dp >= 0)")
        if dp == 0:
            if world_size % (tp * pp):
                raise ConfigError(f"parallel layout tp={tp} x pp={pp} = {tp * pp} does not divide the "
                                  f"world size {world_size} (set parallel.tp / parallel.pp)")
            dp = world_size // (tp * pp)
        if dp * tp * pp != world_size:
            raise ConfigError(f"parallel layout dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} does not "
                              f"match the world size {world_size} (set parallel.dp / tp / pp)")
        return cls(world_size=world_size, dp=dp, tp=tp, pp=pp, fsdp=fsdp)

    @classmethod
    def from_config(cls, world_size: int, p) -> "ParallelDims":
        """From a `config.ParallelConfig` section."""
        return cls.from_world(world_size, dp=p.dp, tp=p.tp, pp=p.pp, fsdp=p.data_parallel == "fsdp")

    @property
    def axis_names(self) -> tuple[str, ...]:
        return AXES

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return (self.pp, self.dp, self.tp)

    def coords_of(self, rank: int) -> dict[str, int]:
        """{"pp": i, "dp": j, "tp": k} of a global rank (the rank order above)."""
        tp_i = rank % self.tp
        dp_i = (rank // self.tp) % self.dp
        return {"pp": rank // (self.tp * self.dp), "dp": dp_i, "tp": tp_i}

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def describe(self) -> str:
        kind = "fsdp" if self.fsdp else "ddp"
        return f"pp={self.pp} x dp={self.dp} ({kind}) x tp={self.tp}"


def tp_group_hosts(hosts, tp: int) -> str:
    """'node1 [0,1], node2 [2,3]': the host(s) of every tensor-parallel group (consecutive ranks)."""
    groups = []
    for first in range(0, len(hosts), tp):
        ranks = range(first, min(first + tp, len(hosts)))
        where = "+".join(sorted({hosts[r] for r in ranks}))
        groups.append(f"{where} [{','.join(map(str, ranks))}]")
    return ", ".join(groups)


class Mesh:
    """Named 3-D device mesh (pp, dp, tp; axes of size 1 included) plus this rank's coordinates."""

    def __init__(self, dims: ParallelDims, ctx: DistContext):
        self.dims = dims
        self.rank = ctx.rank
        self.world_comm = ctx.comm  # mpi4py COMM_WORLD, for MPI-backed collectives (grad sync)
        self.device_mesh: DeviceMesh = init_device_mesh(
            ctx.device.type, dims.axis_sizes, mesh_dim_names=dims.axis_names)
        for axis in AXES:  # torch gives its groups its own default timeout, not dist.timeout_s
            apply_timeout(self.device_mesh[axis].get_group())
        if ctx.n_nodes > 1 and dims.tp > 1 and ctx.local_size % dims.tp and ctx.is_main:
            logs.warning(f"warning: parallel.tp={dims.tp} does not divide the {ctx.local_size} ranks "
                         f"per node: some tensor-parallel groups span nodes (slow)")
        if ctx.n_nodes > 1 and dims.tp > 1 and ctx.hosts:
            logs.info(f"tensor-parallel groups: {tp_group_hosts(ctx.hosts, dims.tp)}")

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

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def pp_size(self) -> int:
        return self.size("pp")
