"""The one object that answers "who am I in pp / dp / cp / tp, and which ranks share each axis with me".

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

With context parallelism (parallel.cp > 1) a fourth
axis "cp" sits between dp and tp, ("pp", "dp", "cp", "tp"):

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

The ranks of one cp group hold the same weights and read the same batches (the dp rank's), each
its zig-zag part of the sequence; gradients and losses are averaged over dp x cp (`reduce_group`,
`reduce_mesh`: the flattened "dp_cp" axis, as torchtitan's dp_shard_cp; plain "dp" when cp = 1).
At cp = 1 there is no "cp" axis (the 3-D mesh, its groups and rank order are unchanged).

Hierarchical layouts (sync.replica_nodes, DiLoCo across groups of nodes): a fourth, outermost
axis "replica" (4-D mesh ("replica", "pp", "dp", "tp")), so a replica is a block of consecutive
ranks = whole nodes, and "dp" is the data-parallel axis *inside* a replica (DDP / FSDP there):

    rank = ((replica_index * pp + pp_index) * dp + dp_index) * tp + tp_index

The data order still spans every rank (`data_rank` / `data_size`: replica_index * dp + dp_index of
replicas * dp); DiLoCo averages over the "replica" axis (`outer_axis`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpctrain import logs
from hpctrain.distributed.bootstrap import DistContext, apply_timeout
from hpctrain.errors import ConfigError

AXES = ("pp", "dp", "tp")
CP_AXES = ("pp", "dp", "cp", "tp")  # parallel.cp > 1


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel axes; dp = 0 means "what tp and pp leave of the world"."""

    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    fsdp: bool = False
    replicas: int = 0  # hierarchical (sync.replica_nodes): replicas of dp x tp x pp ranks; 0 = off
    cp: int = 1        # context parallelism: ranks splitting each sequence (axis "cp" when > 1)
    dp_shard: int = 0  # HSDP (parallel.dp_shard): FSDP shards over dp_shard dp ranks; 0 = all of dp

    @property
    def dp_replicate(self) -> int:
        """HSDP's replicas of the sharded model: dp / dp_shard (1 = plain FSDP, or DDP)."""
        return self.dp // self.dp_shard if self.dp_shard else 1

    @classmethod
    def from_world(cls, world_size: int, dp: int = 0, tp: int = 1, pp: int = 1,
                   fsdp: bool = False, replica_ranks: int = 0, cp: int = 1) -> "ParallelDims":
        if tp < 1 or pp < 1 or dp < 0 or cp < 1:
            raise ConfigError(f"parallel layout dp={dp} tp={tp} pp={pp} cp={cp}: sizes must be >= 1 (dp >= 0)")
        if cp > 1:
            return cls._with_cp(world_size, dp, tp, pp, fsdp, cp)
        if dp == 0:
            if world_size % (tp * pp):
                raise ConfigError(f"parallel layout tp={tp} x pp={pp} = {tp * pp} does not divide the "
                                  f"world size {world_size} (set parallel.tp / parallel.pp)")
            dp = world_size // (tp * pp)
        if dp * tp * pp != world_size:
            raise ConfigError(f"parallel layout dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} does not "
                              f"match the world size {world_size} (set parallel.dp / tp / pp)")
        if not replica_ranks:
            return cls(world_size=world_size, dp=dp, tp=tp, pp=pp, fsdp=fsdp)
        if replica_ranks % (tp * pp) or world_size % replica_ranks:
            raise ConfigError(f"config key 'sync.replica_nodes': a replica of {replica_ranks} ranks "
                              f"must divide the world size {world_size} and be a multiple of tp={tp} "
                              f"x pp={pp}; choose another sync.replica_nodes or parallel.tp / pp")
        return cls(world_size=world_size, dp=replica_ranks // (tp * pp), tp=tp, pp=pp, fsdp=fsdp,
                   replicas=world_size // replica_ranks)

    @classmethod
    def _with_cp(cls, world_size: int, dp: int, tp: int, pp: int, fsdp: bool, cp: int) -> "ParallelDims":
        """pp x dp x cp x tp = the world (config_rules refuses cp with replicas)."""
        if dp == 0:
            if world_size % (tp * pp * cp):
                raise ConfigError(f"parallel layout tp={tp} x pp={pp} x cp={cp} = {tp * pp * cp} does "
                                  f"not divide the world size {world_size} (set parallel.tp / pp / cp)")
            dp = world_size // (tp * pp * cp)
        if dp * tp * pp * cp != world_size:
            raise ConfigError(f"parallel layout dp={dp} x cp={cp} x tp={tp} x pp={pp} = "
                              f"{dp * cp * tp * pp} does not match the world size {world_size} "
                              f"(set parallel.dp / cp / tp / pp)")
        return cls(world_size=world_size, dp=dp, tp=tp, pp=pp, fsdp=fsdp, cp=cp)

    @classmethod
    def from_config(cls, world_size: int, p, replica_ranks: int = 0) -> "ParallelDims":
        """From a `config.ParallelConfig` section (+ the ranks of a replica: `replica_ranks`)."""
        dims = cls.from_world(world_size, dp=p.dp, tp=p.tp, pp=p.pp, fsdp=p.data_parallel == "fsdp",
                              replica_ranks=replica_ranks, cp=p.cp)
        return dims.with_dp_shard(getattr(p, "dp_shard", 0))

    def with_dp_shard(self, dp_shard: int) -> "ParallelDims":
        """These dims with HSDP's shard size (0, or all of dp: plain FSDP, the dims unchanged)."""
        if dp_shard in (0, self.dp):
            return self
        if dp_shard < 0 or self.dp % dp_shard:
            raise ConfigError(f"config key 'parallel.dp_shard': {dp_shard} must divide dp={self.dp} "
                              f"(dp = dp_replicate x dp_shard); use a divisor of {self.dp}")
        return dataclasses.replace(self, dp_shard=dp_shard)

    @property
    def hierarchical(self) -> bool:
        return self.replicas > 0

    @property
    def axis_names(self) -> tuple[str, ...]:
        if self.cp > 1:
            return CP_AXES
        return ("replica", *AXES) if self.hierarchical else AXES

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        if self.cp > 1:
            return (self.pp, self.dp, self.cp, self.tp)
        return ((self.replicas,) if self.hierarchical else ()) + (self.pp, self.dp, self.tp)

    @property
    def outer_axis(self) -> str:
        """The axis DiLoCo averages over: "replica" in a hierarchical layout, else "dp"."""
        return "replica" if self.hierarchical else "dp"

    def coords_of(self, rank: int) -> dict[str, int]:
        """{"pp": i, "dp": j, "tp": k} (+ "replica") of a global rank (the rank order above)."""
        if self.cp > 1:
            tp_i, cp_i = rank % self.tp, (rank // self.tp) % self.cp
            dp_i = (rank // (self.tp * self.cp)) % self.dp
            return {"pp": rank // (self.tp * self.cp * self.dp), "dp": dp_i, "cp": cp_i, "tp": tp_i}
        tp_i = rank % self.tp
        dp_i = (rank // self.tp) % self.dp
        pp_i = (rank // (self.tp * self.dp)) % self.pp
        coords = {"pp": pp_i, "dp": dp_i, "tp": tp_i}
        return {"replica": rank // (self.tp * self.dp * self.pp), **coords} if self.hierarchical else coords

    def rank_of(self, pp: int, dp: int, tp: int, replica: int = 0, cp: int = 0) -> int:
        return (((replica * self.pp + pp) * self.dp + dp) * self.cp + cp) * self.tp + tp

    def outer_groups(self) -> list[list[int]]:
        """The ranks DiLoCo averages over, one list per group: my position in every replica."""
        if not self.hierarchical:
            return [[self.rank_of(pp, d, tp) for d in range(self.dp)]
                    for pp in range(self.pp) for tp in range(self.tp)]
        return [[self.rank_of(pp, d, tp, r) for r in range(self.replicas)]
                for pp in range(self.pp) for d in range(self.dp) for tp in range(self.tp)]

    def describe(self) -> str:
        kind = "fsdp" if self.fsdp else "ddp"
        if self.dp_shard:
            kind = f"hsdp: dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}"
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        inner = f"pp={self.pp} x dp={self.dp} ({kind}){cp} x tp={self.tp}"
        return f"replicas={self.replicas} x ({inner})" if self.hierarchical else inner


def replica_ranks(replica_nodes: int, ctx: DistContext) -> int:
    """Ranks per replica of `replica_nodes` nodes (sync.replica_nodes; 0: not hierarchical)."""
    if not replica_nodes:
        return 0
    if ctx.world_size % ctx.n_nodes or ctx.n_nodes % replica_nodes:
        raise ConfigError(f"config key 'sync.replica_nodes': {replica_nodes} does not divide the "
                          f"{ctx.n_nodes} nodes of {ctx.world_size} ranks evenly ({ctx.local_size} "
                          f"ranks on node {ctx.node_rank}); use a divisor of {ctx.n_nodes}")
    per_node = ctx.world_size // ctx.n_nodes
    if ctx.rank // per_node != ctx.node_rank:  # e.g. srun --distribution=cyclic
        logs.warning(f"warning: rank {ctx.rank} is on node {ctx.node_rank}, but sync.replica_nodes "
                     f"takes consecutive ranks as a node (block placement): its replica spans nodes")
    return replica_nodes * per_node


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
        self._dp_cp: DeviceMesh | None = None  # reduce_mesh() with cp > 1
        self._hsdp: DeviceMesh | None = None   # fsdp_mesh() with parallel.dp_shard
        self.device_mesh: DeviceMesh = init_device_mesh(
            ctx.device.type, dims.axis_sizes, mesh_dim_names=dims.axis_names)
        for axis in dims.axis_names:  # torch gives its groups its own default timeout, not dist.timeout_s
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
    def replicas(self) -> int:
        """DiLoCo's replicas: the "replica" axis in a hierarchical layout, else dp."""
        return self.size(self.dims.outer_axis)

    @property
    def replica_index(self) -> int:
        return self.coord(self.dims.outer_axis)

    @property
    def data_rank(self) -> int:
        """Where this rank reads in the data order (every rank of every replica its own part)."""
        return self.coord("replica") * self.dp_size + self.dp_rank if self.dims.hierarchical else self.dp_rank

    @property
    def data_size(self) -> int:
        return self.dims.replicas * self.dp_size if self.dims.hierarchical else self.dp_size

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def cp_rank(self) -> int:
        return self.coord("cp") if self.dims.cp > 1 else 0

    @property
    def reduce_size(self) -> int:
        """Ranks that average gradients and losses: dp x cp."""
        return self.dp_size * self.dims.cp

    def reduce_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the ranks that average gradients (FSDP2 shards over it): "dp", or with
        cp > 1 the flattened ("dp", "cp") axis "dp_cp" (made once, on the first call)."""
        if self.dims.cp == 1:
            return self.device_mesh["dp"]
        if self._dp_cp is None:
            self._dp_cp = self.device_mesh["dp", "cp"]._flatten("dp_cp")
            apply_timeout(self._dp_cp.get_group())
        return self._dp_cp

    def reduce_group(self) -> dist.ProcessGroup:
        return self.reduce_mesh().get_group()

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: reduce_mesh(), or with HSDP (parallel.dp_shard) its 2-D
        ("dp_replicate", "dp_shard") unflattening: shard over dp_shard consecutive dp ranks (x cp),
        replicate over dp / dp_shard. fully_shard on a 2-D mesh all-gathers and reduce-scatters
        over "dp_shard" and all-reduces the gradient shards over "dp_replicate"."""
        if not self.dims.dp_shard:
            return self.reduce_mesh()
        if self._hsdp is None:
            replicate = self.dims.dp_replicate
            self._hsdp = self.reduce_mesh()._unflatten(
                0, (replicate, self.reduce_size // replicate), ("dp_replicate", "dp_shard"))
            for axis in ("dp_replicate", "dp_shard"):
                apply_timeout(self._hsdp[axis].get_group())
        return self._hsdp

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def pp_size(self) -> int:
        return self.size("pp")
