"""How the checkpoint manager's ranks agree: every rank-local outcome is gathered (or rank 0's
answer broadcast) before the next collective step, and any failure on any rank becomes the same
one-line CheckpointError raised on every rank, so no rank is ever left waiting in a collective that
another skipped. With one process and no process group the collectives are the identity.
A collective without a `group` runs on `_group()`: the world here; the checkpoint manager's own
gloo group there (manager.py), so that a rank slow to read or write on a busy file system is
waited for on host sockets with that group's long timeout, never on the default (NCCL) group.
"""
from __future__ import annotations

import torch.distributed as dist

from hpctrain.distributed.flight_recorder import RECORDER
from hpctrain.errors import CheckpointError


class Agreement:
    """`rank` of `world_size` processes (torch.distributed's, when it is initialized)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._dist = dist.is_available() and dist.is_initialized()
        name = type(self).__name__
        if self._dist and (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(f"{name}(rank={rank}, world_size={world_size}) but "
                             f"torch.distributed says {dist.get_rank()}/{dist.get_world_size()}")
        if not self._dist and world_size != 1:
            raise ValueError(f"{name} with world_size > 1 needs torch.distributed initialized")

    def _group(self):
        """The group of a collective called without one (None: the default group)."""
        return None

    def _gather(self, obj, group=None) -> list:
        if not self._dist:
            return [obj]
        group = self._group() if group is None else group
        out = [None] * self.world_size
        with RECORDER.collective("ckpt_gather", self._group_name(group)):  # main thread only
            dist.all_gather_object(out, obj, group=group)
        return out

    def _bcast(self, obj, group=None):
        if not self._dist:
            return obj
        group = self._group() if group is None else group
        box = [obj]
        with RECORDER.collective("ckpt_bcast", self._group_name(group)):
            dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def _group_name(self, group) -> str:
        """The flight recorder's name: the world, or the saves' own gloo group (every rank)."""
        return f"{'world' if group is None else 'ckpt'}({self.world_size})"

    def _raise_first(self, errs: list, prefix: str) -> None:
        """errs: per rank, None or (priority, text). Raise the most direct one, lowest rank first."""
        failed = sorted((e[0], r, e[1]) for r, e in enumerate(errs) if e)
        if failed:
            _, r, text = failed[0]
            where = f"rank {r}: " if self.world_size > 1 else ""
            raise CheckpointError(f"{prefix} failed: {where}{text}")

    def _agree(self, err: tuple[int, str] | None, prefix: str) -> None:
        """All ranks learn whether any rank failed; all raise the same one-line error if so."""
        self._raise_first(self._gather(err), prefix)
