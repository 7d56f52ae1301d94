"""Which ranks of an async_diloco job are replicas, servers, leaders and pushers, and the
communicators between them (hpctrain/sync/async_diloco.py trains with them).

Flat layout (sync.replica_nodes = 0): the mesh's dp axis counts the replicas, then the server
groups (sync.ps_servers ranks, tp x pp per group); a replica is the tp x pp ranks of one dp index.

Hierarchical layout (sync.replica_nodes = R): the mesh's outermost "replica" axis cuts the ranks
into blocks of R nodes; inside a block the "dp" axis is DDP (each inner-dp rank trains its slice
of every batch its replica claims). The servers are the last blocks: sync.ps_servers must be a
whole number of blocks (R nodes each), so a site of server nodes sits beside the training sites
and every replica crosses the thin link to reach it. Only the inner-dp rank 0 of each (pp, tp)
position (a "pusher") pushes / pulls through the servers' windows; it broadcasts the new weights
and the arrival count to its inner-dp peers, which therefore hold bit-identical weights. With
sync.compression the inbox lives on the pushers and servers alone (`wire`).

FSDP inside (parallel.data_parallel = "fsdp", hierarchical only): each inner-dp rank holds only its
shard, so every rank of a replica is a pusher of its own shard: a "part" of the model is then a
(position, shard) pair, not a position. Its windows are served by the server ranks at the same
(position, inner-dp index) of the server group(s), whose model is sharded like the replicas' (the
servers build the same layout), so server rank i of a group holds the windows of shard i and the
global model is sharded like the replicas. Nothing is broadcast inside a replica (`share` is the
identity); the leader (the replica's first rank) still claims batches, reads the stop flag, holds
the arrival lock and decides the round's steps. With sync.compression each shard's pushes and
pulls (and their error feedback) are those of one more part: the inbox of each part is its
replicas' ranks of that part and its servers.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from hpctrain.distributed.mesh import Mesh
from hpctrain.errors import ConfigError


class ReplicaGroups:
    """This rank's place: trains, replica (-1 on servers), position, part (its index: the position,
    with FSDP inside (position, shard)), leader, pusher; comms team (my replica's ranks, leader
    first), pushers (my replica's inner-dp rank 0 of each position; with FSDP all its ranks),
    inner (my inner-dp peers, pusher first), part_comm (my part everywhere, servers last)."""

    def __init__(self, comm, mesh: Mesh, ps_servers: int):
        self.positions = mesh.tp_size * mesh.pp_size
        self.position = mesh.coord("pp") * mesh.tp_size + mesh.coord("tp")
        dims = mesh.dims
        self.sharded = dims.hierarchical and dims.fsdp  # FSDP inside: a part per (position, shard)
        shards = mesh.dp_size if self.sharded else 1
        if dims.hierarchical:
            block = self.positions * mesh.dp_size  # ranks per replica of nodes
            servers = _server_blocks(ps_servers, block, dims.replicas)  # whole replicas of nodes
            index, inner_rank = mesh.coord("replica"), mesh.dp_rank
            self.server_groups = servers * mesh.dp_size // shards  # server ranks per part
            self.replicas = dims.replicas - servers
            self.control_host = dims.rank_of(0, 0, 0, replica=self.replicas)
        else:
            index, inner_rank = mesh.dp_rank, 0
            self.server_groups = _server_groups(ps_servers, self.positions, mesh.dp_size)
            self.replicas = mesh.dp_size - self.server_groups
            self.control_host = dims.rank_of(0, self.replicas, 0)
        self.trains = index < self.replicas
        self.replica = index if self.trains else -1
        self.parts = self.positions * shards
        self.part = self.position * shards + (inner_rank if self.sharded else 0)
        self.pusher = inner_rank == 0 or not self.trains or self.sharded
        self.leader = self.pusher and self.position == 0 and (inner_rank == 0 or not self.sharded)
        self.team = comm.Split(index, comm.rank)
        self.pushers = comm.Split(2 * index + (0 if self.pusher else 1), comm.rank)
        self.inner = comm.Split(index * self.positions + self.position, inner_rank) \
            if dims.hierarchical else None
        self.part_comm = comm.Split(self.part, comm.rank)  # replicas' ranks first, then the servers

    def wire(self) -> tuple | None:
        """Collective over `part_comm`: the compressed inbox's communicator (my position's pushers,
        replica r at rank r, then its servers) and the servers' ranks in it; None on an inner-dp
        peer (it gets its weights from its pusher). `part_comm` itself in the flat layout and with
        FSDP inside (every rank pushes its shard)."""
        comm = self.part_comm
        if self.inner is not None and not self.sharded:
            comm = self.part_comm.Split(0 if self.pusher else MPI.UNDEFINED, self.part_comm.rank)
            if comm == MPI.COMM_NULL:
                return None
        n = self.server_groups
        return comm, list(range(comm.size - n, comm.size))

    @property
    def inner_size(self) -> int:
        return 1 if self.inner is None else self.inner.size

    def share(self, theta: np.ndarray | None, arrival: int, n: int) -> tuple[np.ndarray, int]:
        """The pusher's (theta, arrival) on each of its inner-dp peers (itself when alone; with
        FSDP inside every rank pulled its own shard)."""
        if self.inner_size == 1 or self.sharded:
            return theta, arrival
        theta = np.ascontiguousarray(theta, dtype=np.float32) if self.pusher else np.empty(n, dtype=np.float32)
        self.inner.Bcast([theta, MPI.FLOAT], root=0)
        return theta, self.inner.bcast(arrival, root=0)

    def mean_inside(self, value: float) -> float:
        """A loss over my replica's inner-dp ranks (each trained its slice of the batch)."""
        return value if self.inner_size == 1 else self.inner.allreduce(value) / self.inner.size


def _server_blocks(ps_servers: int, block: int, blocks: int) -> int:
    """Hierarchical: the servers fill the last whole replicas of nodes; how many."""
    if ps_servers % block or not 0 < ps_servers // block < blocks:
        raise ConfigError(f"config key 'sync.ps_servers': {ps_servers} server ranks with sync.replica_nodes: "
                          f"the servers fill whole groups of nodes ({block} ranks each) and leave at least "
                          f"one of the {blocks} groups to train; use a multiple of {block} below {block * blocks}")
    return ps_servers // block


def _server_groups(ps_servers: int, positions: int, dp_size: int) -> int:
    """Server ranks come in groups of one per position of a replica (tp x pp ranks); how many
    groups, checked against the dp axis (replicas + server groups)."""
    if ps_servers % positions:
        raise ConfigError(f"config key 'sync.ps_servers': {ps_servers} server ranks for replicas of "
                          f"{positions} ranks (parallel.tp x parallel.pp): use a multiple of {positions}")
    if ps_servers // positions >= dp_size:
        raise ConfigError(f"config key 'sync.ps_servers': {ps_servers} servers leave no replica among "
                          f"{dp_size * positions} ranks (run more ranks)")
    return ps_servers // positions
