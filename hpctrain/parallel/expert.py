"""Expert parallelism: a mixture-of-experts layer's experts sharded over the ranks of an `ep` group,
tokens dispatched to the rank that holds their expert and combined back with all-to-all.

Owns: the dispatch (rows already sorted by global expert id, as MoEFeedForward hands them over,
are cut by owning rank, exchanged with all_to_all_single, regrouped by local expert), the local
experts' matmuls (the model's own Experts computation on this rank's slice), and the way back. The
exchange is differentiable (functional collectives' all_to_all_single_autograd): a token's gradient returns
to its rank, and each expert's weight gradient sums the contributions of every rank's tokens.
Every collective's tensor is on the rows' device, as NCCL requires (the counts too: their host copy,
the split sizes, is taken once, after their exchange; tests/mpi/test_expert_parallel.py holds it).
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
from torch.distributed.device_mesh import DeviceMesh

from hpctrain.distributed.dtensor import is_dtensor
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

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """Every collective's tensor is on x's device (NCCL takes no other): the counts are
        exchanged there, and their one host copy, the split sizes, is taken after the exchange."""
        ep, n_local, device = self.ep, self.n_local, x_sorted.device
        # send [dest, its expert], recv [source, my expert]: the rows of each pair
        send = torch.as_tensor(counts, dtype=torch.int64, device=device).reshape(ep, n_local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_h, recv_h = torch.stack([send, recv]).tolist()
        send_rows, recv_rows = [sum(r) for r in send_h], [sum(r) for r in recv_h]
        received = _exchange(x_sorted, recv_rows, send_rows, self.group)
        # received rows are [source][expert]-ordered: regroup them [expert][source] for the matmuls
        order = _source_major_to_expert_major(recv, sum(recv_rows))
        expert_rows = [sum(col) for col in zip(*recv_h)]
        out = Experts.forward(self._local_weights(), received[order], expert_rows)
        self.local_rows_computed += out.shape[0]
        back = torch.empty_like(out).index_copy(0, order, out)  # undo the regrouping
        return _exchange(back, send_rows, recv_rows, self.group)


def _to_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _exchange(rows: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all of rows (send[i] of ours to rank i, recv[i] of its to us)."""
    # ep > 1 only: functional collectives import torch's C++ pytree (~0.1 s CPU at start-up)
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    out = all_to_all_single_autograd(rows.contiguous(), recv, send, group)
    return torch.ops._c10d_functional.wait_tensor(out) if hasattr(out, "wait") else out


def _source_major_to_expert_major(recv: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Row indices (on recv's device, no host sync: `n_rows` is recv's sum) that turn rows laid
    out [source s][expert e] (recv[s, e] rows each) into [expert e][source s] order."""
    flat = recv.reshape(-1)
    src_start = (flat.cumsum(0) - flat).reshape(recv.shape).t().reshape(-1)  # piece [e, s]'s first row
    lengths = recv.t().reshape(-1)                                           # piece [e, s]'s rows
    shift = src_start - (lengths.cumsum(0) - lengths)  # where a piece starts: source-major - expert-major
    return torch.repeat_interleave(shift, lengths, output_size=n_rows) + \
        torch.arange(n_rows, device=recv.device)


def shard_experts(experts: Experts, n_experts: int, group: dist.ProcessGroup,
                  mesh: DeviceMesh | None = None) -> ExpertParallelExperts:
    """This rank's contiguous slice of `experts` (its rows only: the other ranks' are not kept).
    With `mesh` (1-D, the ranks of `group`), each weight is a DTensor Shard(0) of the global
    tensor; a weight on the meta device stays there (meta_init materializes it)."""
    from torch.distributed.tensor import DTensor, Shard  # ep > 1 only (distributed/dtensor.py)

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
