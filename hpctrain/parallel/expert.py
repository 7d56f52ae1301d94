"""Expert parallelism: a mixture-of-experts layer's experts sharded over the ranks of an `ep` group,
tokens dispatched to the rank that holds their expert and combined back with all-to-all.

Owns: the dispatch (rows already sorted by global expert id, as MoEFeedForward hands them over,
are cut by owning rank, exchanged with all_to_all_single), the local experts' matmuls (the
model's own Experts computation on this rank's slice: on a CPU, and with
parallel.deterministic_experts, one source rank's block at a time: every group then has the rows
it has with ep = 1, so the forward is bit-equal whatever ep is; on CUDA otherwise every source's
rows of an expert in one group, one grouped matmul per weight: `all_sources_grouped`), and the
way back. The exchange is differentiable (functional collectives' all_to_all_single_autograd): a
token's gradient returns to its rank, and each expert's weight gradient sums the contributions of
every rank's tokens. Every collective's tensor is on the rows' device, as NCCL requires (the
counts too: their host copy, the split sizes, is taken once per layer and forward, after their
exchange, the layer's one host sync; the groups' offsets are cut from the device copy, never
copied back up: tests/mpi/test_expert_parallel.py holds it).
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
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from hpctrain.distributed.collectives import all_gather_single
from hpctrain.distributed.dtensor import is_dtensor
from hpctrain.model.moe import Experts, _grouped_mm_fits, host_list

WEIGHTS = ("w1", "w3", "w2")


class ExpertParallelExperts(nn.Module):
    """Drop-in for `MoEFeedForward.experts` on one rank of `group`: holds experts
    [rank * E/ep, (rank + 1) * E/ep) as w1 / w3 / w2 and is called with every routed row of this
    rank, sorted by global expert, and the global per-expert counts."""

    def __init__(self, weights: dict[str, torch.Tensor], n_experts: int, group: dist.ProcessGroup,
                 per_source_grads: bool = False):
        super().__init__()
        self.group = group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if n_experts % self.ep:
            raise ValueError(f"moe: n_experts {n_experts} is not divisible by ep {self.ep}")
        self.n_local = n_experts // self.ep
        for name in WEIGHTS:
            setattr(self, name, nn.Parameter(weights[name]))
        self.local_rows_computed = 0  # rows this rank's experts ran, summed over calls (a count)
        # parallel.deterministic_experts: each weight's gradient kept per source rank, [ep, ...]
        # (summed over micro-steps; `take_source_grads` hands them over), never in .grad
        self.per_source_grads = per_source_grads
        self.source_grads: dict[str, torch.Tensor] = {}

    def _local_weights(self) -> SimpleNamespace:
        """This rank's slices as plain tensors (a DTensor's local shard; differentiable)."""
        return SimpleNamespace(**{n: _to_local(getattr(self, n)) for n in WEIGHTS})

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """Every collective's tensor is on x's device (NCCL takes no other): the counts are
        exchanged there, and their one host copy, the split sizes, is taken after the exchange."""
        ep, n_local, device = self.ep, self.n_local, x_sorted.device
        # every source's rows per global expert [ep, E]: this rank's receive counts are its
        # columns, the rest place each source's block inside that source's sorted rows (_per_source)
        mine = torch.as_tensor(counts, dtype=torch.int64, device=device).reshape(-1)
        if ep == 1:  # parallel.deterministic_experts on one rank: no exchange
            every = mine
        else:
            every = torch.empty(ep * mine.numel(), dtype=torch.int64, device=device)  # (Gloo: 1-D)
            all_gather_single(every, mine, group=self.group)  # no deprecated name: no warning per rank
        every = every.reshape(ep, -1)
        every_h, lo, hi = host_list(every), self.rank * n_local, (self.rank + 1) * n_local  # the one sync
        send_rows = [sum(every_h[self.rank][d * n_local:(d + 1) * n_local]) for d in range(ep)]
        recv_h, recv_t = [row[lo:hi] for row in every_h], every[:, lo:hi]  # host, device
        recv_rows = [sum(r) for r in recv_h]
        place = [(sum(row[:lo]), sum(row)) for row in every_h]
        received = _exchange(x_sorted, recv_rows, send_rows, self.group) if ep > 1 else x_sorted
        if one_group_per_expert(received, self.per_source_grads):
            out = all_sources_grouped(received, self._local_weights(), recv_t, recv_h)
        else:
            out = self._per_source(received, recv_h, recv_t, place)
        self.local_rows_computed += out.shape[0]
        return _exchange(out, send_rows, recv_rows, self.group) if ep > 1 else out

    def _per_source(self, received: torch.Tensor, recv_h: list[list[int]], recv_t: torch.Tensor,
                    place: list[tuple[int, int]]) -> torch.Tensor:
        """The received rows, laid out [source][local expert], computed source block by source
        block: each block grouped by expert as its source would group its own rows on one rank
        (same rows, order and rows per group), so every grouped-matmul group has the same shape
        whatever ep is, and a step's forward is bit-equal across ep (#34). recv_h / recv_t: the
        rows per [source, local expert] on the host / the device; place[s]: (source s's rows
        before this block, its rows in all) in its sorted rows (see _silu_in_place)."""
        weights, outs = self._local_weights(), []
        for s, block in enumerate(received.split([sum(r) for r in recv_h])):
            w = self._source_weights(weights, s) if self.per_source_grads else weights
            if _grouped_mm_fits(block, w.w1, w.w3, w.w2):
                ends = recv_t[s].cumsum(0).to(torch.int32)
                outs.append(_grouped_swiglu_in_place(block, w, ends, *place[s]))
            else:  # the loop (silu per expert: nothing to place) or CUDA's kernel
                outs.append(Experts.forward(w, block, recv_t[s], recv_h[s]))
        return torch.cat(outs)

    def _source_weights(self, weights: SimpleNamespace, s: int) -> SimpleNamespace:
        """`weights` as seen by source s's block: their gradient goes to source_grads[name][s]."""
        for name in WEIGHTS:
            w = getattr(weights, name)
            if name not in self.source_grads:
                self.source_grads[name] = w.new_zeros(self.ep, *w.shape)
        return SimpleNamespace(**{n: GradToSlot.apply(getattr(weights, n), self.source_grads[n][s])
                                  for n in WEIGHTS})

    def take_source_grads(self) -> list[torch.Tensor]:
        """The per-source gradients [ep, ...] of w1 / w3 / w2 (zeros where no backward ran since the
        last call); the next forward starts new ones."""
        out = []
        for name in WEIGHTS:
            slots = self.source_grads.pop(name, None)
            if slots is None:
                w = _to_local(getattr(self, name))
                slots = w.new_zeros(self.ep, *w.shape)
            out.append(slots)
        return out


def one_group_per_expert(received: torch.Tensor, per_source_grads: bool) -> bool:
    """Whether every source's rows of an expert go in one group (all_sources_grouped): on CUDA,
    unless parallel.deterministic_experts keeps the per-source blocks (and their gradients)."""
    return received.is_cuda and not per_source_grads


def all_sources_grouped(received: torch.Tensor, w: SimpleNamespace, recv_t: torch.Tensor,
                        recv_h: list[list[int]]) -> torch.Tensor:
    """The received rows ([source][local expert], recv_t / recv_h rows each, on the device / the
    host) computed with every source's rows of an expert in one group: regrouped [expert][source]
    (a stable sort by expert), one grouped matmul per weight (ep x fewer, larger groups than
    _per_source), put back in the received order. Within rounding of _per_source, not bit-equal
    to it: used on CUDA, where parallel.deterministic_experts is off (tests/unit/test_moe_grouped.py)."""
    n_sources, n_local = recv_t.shape
    device, n = received.device, received.shape[0]
    group_of_row = torch.repeat_interleave(torch.arange(n_sources * n_local, device=device),
                                           recv_t.reshape(-1), output_size=n)
    expert_of_row = group_of_row % n_local
    by_expert = expert_of_row.argsort(stable=True)  # [expert][source], source order inside
    per_expert_h = [sum(row[e] for row in recv_h) for e in range(n_local)]
    out = Experts.forward(w, received.index_select(0, by_expert), recv_t.sum(0), per_expert_h)
    return out.index_select(0, by_expert.argsort())


class GradToSlot(torch.autograd.Function):
    """Identity on a weight; its gradient is added to `slot` (a view of the per-source buffer)
    instead of flowing to the weight, whose .grad the fixed-order reduction sets
    (hpctrain/parallel/apply_expert.py)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, slot: torch.Tensor):
        ctx.slot = slot
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        ctx.slot.add_(grad)
        return None, None


SILU_ALIGN = 64  # elements: a multiple of the CPU kernels' chunk (2 vectors: 32 fp32 / 64 bf16 on AVX-512)


def _grouped_swiglu_in_place(x: torch.Tensor, w: SimpleNamespace, ends: torch.Tensor,
                             before: int, total: int) -> torch.Tensor:
    """hpctrain.model.moe.grouped_swiglu on one source's block, its silu as in place (below)."""
    gate = torch._grouped_mm(x, w.w1.transpose(-2, -1), offs=ends)
    up = torch._grouped_mm(x, w.w3.transpose(-2, -1), offs=ends)
    return torch._grouped_mm(_silu_in_place(gate, before, total) * up, w.w2.transpose(-2, -1), offs=ends)


def _silu_in_place(gate: torch.Tensor, before: int, total: int) -> torch.Tensor:
    """F.silu(gate) bit-equal to these rows' inside their source's whole [total, H] tensor, `before`
    rows in (as with ep = 1). A CPU elementwise kernel runs vectorized in chunks counted from the
    tensor's start and its last (n mod chunk) elements scalar, whose exp rounds differently: the
    rows are computed at the same offset mod SILU_ALIGN and, where the source's rows end within
    SILU_ALIGN elements after them, ending with them. (Not where a kernel splits a tensor over
    threads: > 32,768 elements with several intra-op threads per rank.)"""
    h = gate.shape[-1]
    start, end = before * h, before * h + gate.numel()
    lead, stop = start % SILU_ALIGN, min(total * h, -(-end // SILU_ALIGN) * SILU_ALIGN)
    if lead == 0 and stop == end:
        return F.silu(gate)
    flat = F.pad(gate.reshape(-1), (lead, stop - end))
    return F.silu(flat)[lead:lead + gate.numel()].view_as(gate)


def _to_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _exchange(rows: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all of rows (send[i] of ours to rank i, recv[i] of its to us)."""
    # ep > 1 only: functional collectives import torch's C++ pytree (~0.1 s CPU at start-up)
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    out = all_to_all_single_autograd(rows.contiguous(), recv, send, group)
    return torch.ops._c10d_functional.wait_tensor(out) if hasattr(out, "wait") else out


def shard_experts(experts: Experts, n_experts: int, group: dist.ProcessGroup,
                  mesh: DeviceMesh | None = None, per_source_grads: bool = False) -> ExpertParallelExperts:
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
    return ExpertParallelExperts(weights, n_experts, group, per_source_grads)
