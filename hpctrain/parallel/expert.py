"""Expert parallelism: a mixture-of-experts layer's experts sharded over the ranks of an `ep` group,
tokens dispatched to the rank that holds their expert and combined back with all-to-all.

Owns: the dispatch (rows already sorted by global expert id, as MoEFeedForward hands them over,
are cut by owning rank, exchanged with all_to_all_single, regrouped by local expert), the local
experts' matmuls (the model's own Experts module on this rank's slice), and the way back. The
exchange is differentiable (functional collectives' all_to_all_single_autograd): a token's gradient returns
to its rank, and each expert's weight gradient sums the contributions of every rank's tokens.
It must never change what a layer computes: with ep ranks holding E / ep contiguous experts each,
every row meets the same expert with the same weights as on one rank (dropless: every row sent is
computed; tests/mpi/test_expert_parallel.py compares with one rank).

Not here (yet): sharding a whole model's layers in place and the gradient averaging / checkpoint
layout of the sharded experts (parallelize.py will call `shard_experts`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from hpctrain.model.moe import Experts


class ExpertParallelExperts(nn.Module):
    """Drop-in for `MoEFeedForward.experts` on one rank of `group`: holds experts
    [rank * E/ep, (rank + 1) * E/ep) and is called with every routed row of this rank, sorted by
    global expert, and the global per-expert counts."""

    def __init__(self, local: Experts, n_experts: int, group: dist.ProcessGroup):
        super().__init__()
        self.local, self.group = local, group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if n_experts % self.ep:
            raise ValueError(f"moe: n_experts {n_experts} is not divisible by ep {self.ep}")
        self.n_local = n_experts // self.ep
        self.local_rows_computed = 0  # rows this rank's experts ran, summed over calls (a count)

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ep, n_local = self.ep, self.n_local
        send = torch.tensor(counts, dtype=torch.int64).reshape(ep, n_local)  # [dest, its expert]
        recv = torch.empty_like(send)  # [source, my expert]: rows each source sends each expert
        dist.all_to_all_single(recv, send, group=self.group)
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
        received = _exchange(x_sorted, recv_rows, send_rows, self.group)
        # received rows are [source][expert]-ordered: regroup them [expert][source] for the matmuls
        order = _source_major_to_expert_major(recv)
        out = self.local(received[order], recv.sum(0).tolist())
        self.local_rows_computed += out.shape[0]
        back = torch.empty_like(out).index_copy(0, order, out)  # undo the regrouping
        return _exchange(back, send_rows, recv_rows, self.group)


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


def shard_experts(experts: Experts, n_experts: int, group: dist.ProcessGroup) -> ExpertParallelExperts:
    """This rank's contiguous slice of `experts` (a copy of its rows: the other ranks' are freed)."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    n_local = n_experts // ep
    rows = slice(rank * n_local, (rank + 1) * n_local)
    local = Experts(n_local, experts.w1.shape[2], experts.w1.shape[1])
    with torch.no_grad():
        for name in ("w1", "w3", "w2"):
            getattr(local, name).copy_(getattr(experts, name)[rows])
    return ExpertParallelExperts(local, n_experts, group)
