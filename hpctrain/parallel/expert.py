"""Expert parallelism: a mixture-of-experts layer's experts sharded over the ranks of an `ep` group,
tokens dispatched to the rank that holds their expert and combined back with all-to-all.

Owns: the dispatch (rows already sorted by global expert id, as MoEFeedForward hands them over,
are cut by owning rank, exchanged with all_to_all_single, regrouped by local expert), the local
experts' matmuls (the model's own Experts computation on this rank's slice), and the way back. The
exchange is differentiable (functional collectives' all_to_all_single_autograd): a token's gradient returns
to its rank, and each expert's weight gradient sums the contributions of every rank's tokens.
It must never change what a layer computes: with ep ranks holding E / ep contiguous experts each,
every row meets the same expert with the same weights as on one rank (dropless: every row sent is
computed; tests/mpi/test_expert_parallel.py compares with one rank).

The sharded weights keep the unsharded names (`experts.w1` / `w3` / `w2`). Given a 1-D `ep`
DeviceMesh they are DTensors Shard(0) of the global [E, ...] tensors, so checkpoints (DCP), meta
initialization and the optimizer state see one global tensor whatever ep is; given only a process
group they are this rank's plain [E / ep, ...] slices (tests/mpi/scripts/expert_parallel_probe.py).
Sharding a whole model and the gradient averaging: hpctrain/parallel/apply_expert.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hpctrain.model.moe import Experts

WEIGHTS = ("w1", "w3", "w2")


class ExpertParallelExperts(nn.Module):
    """Drop-in for `MoEFeedForward.experts` on one rank of `group`: holds experts
    [rank * E/ep, (rank + 1) * E/ep) as w1 / w3 / w2 and is called with every routed row of this
    rank, sorted by global expert, and the global per-expert counts."""

    def __init__(self, weights: dict[str, torch.Tensor], n_experts: int, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if n_experts % self.ep:
            raise ValueError(f"moe: n_experts {n_experts} is not divisible by ep {self.ep}")
        self.n_local = n_experts // self.ep
        for name in WEIGHTS:
            setattr(self, name, nn.Parameter(weights[name]))
        self.local_rows_computed = 0  # rows this rank's experts ran, summed over calls (a count)

    def _local_weights(self) -> SimpleNamespace:
        """This rank's slices as plain tensors (a DTensor's local shard; differentiable)."""
        return SimpleNamespace(**{n: _to_local(getattr(self, n)) for n in WEIGHTS})

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ep, n_local = self.ep, self.n_local
        send = torch.tensor(counts, dtype=torch.int64).reshape(ep, n_local)  # [dest, its expert]
        recv = torch.empty_like(send)  # [source, my expert]: rows each source sends each expert
        dist.all_to_all_single(recv, send, group=self.group)
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
        received = _exchange(x_sorted, recv_rows, send_rows, self.group)
        # received rows are [source][expert]-ordered: regroup them [expert][source] for the matmuls
        order = _source_major_to_expert_major(recv).to(received.device)
        out = Experts.forward(self._local_weights(), received[order], recv.sum(0).tolist())
        self.local_rows_computed += out.shape[0]
        back = torch.empty_like(out).index_copy(0, order, out)  # undo the regrouping
        return _exchange(back, send_rows, recv_rows, self.group)


def _to_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _exchange(rows: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all of rows (send[i] of ours to rank i, recv[i] of its to us)."""
    out = all_to_all_single_autograd(rows.contiguous(), recv, send, group)
    return torch.ops._c10d_functional.wait_tensor(out) if hasattr(out, "wait") else out


def _source_major_to_expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Row indices that turn rows laid out [source s][expert e] (recv[s, e] rows each) into
    [expert e][source s] order."""
    starts = (recv.reshape(-1).cumsum(0) - recv.reshape(-1)).reshape(recv.shape)  # [s, e] first row
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + recv[s, e]))
              for e in range(recv.shape[1]) for s in range(recv.shape[0])]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def shard_experts(experts: Experts, n_experts: int, group: dist.ProcessGroup,
                  mesh: DeviceMesh | None = None) -> ExpertParallelExperts:
    """This rank's contiguous slice of `experts` (its rows only: the other ranks' are not kept).
    With `mesh` (1-D, the ranks of `group`), each weight is a DTensor Shard(0) of the global
    tensor; a weight on the meta device stays there (meta_init materializes it)."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    n_local = n_experts // ep
    rows = slice(rank * n_local, (rank + 1) * n_local)
    weights = {}
    for name in WEIGHTS:
        full = _to_local(getattr(experts, name).detach())  # (tp: Replicate, the whole tensor)
        part = full[rows].clone()
        if mesh is not None:
            part = DTensor.from_local(part, mesh, [Shard(0)], run_check=False,
                                      shape=full.shape, stride=full.stride())
        weights[name] = part
    return ExpertParallelExperts(weights, n_experts, group)
