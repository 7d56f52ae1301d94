"""The language-model loss without the full [tokens x vocab] logits: `train.loss_chunk` > 0.

The plain path (runner.lm_loss) applies the head to every position and hands [B*T, V] logits to
F.cross_entropy; autograd keeps them (and builds their gradient) until backward: at the GPT-2
vocabulary that is 1024 x 50304 x 4 B = 206 MB per sequence, twice. Here one autograd Function
walks the tokens in chunks of `chunk`: per chunk, logits = h_chunk @ W^T, the cross-entropy, and at
once the gradient wrt h_chunk and the chunk's share of the gradient wrt W (accumulated in fp32), so
only one chunk's logits are alive at any time; backward only scales the saved gradients. The
chunk's work tensors (fp32 logits; under 16-bit autocast also the 16-bit logits / gradient and
the [V, C] dW product) are buffers allocated once per call and reused by every chunk, with the
bits of a fresh tensor per op (tests/unit/test_chunked_loss.py).

Under tensor parallelism W is the vocabulary-parallel head (a DTensor sharded on dim 0 over "tp"):
each rank computes its vocabulary slice's logits, the row max and the sum of exponentials are
all-reduced over the tp group, the target logit comes from the rank whose slice holds it, and the
gradient wrt h (a sum over the slices) is all-reduced once at the end. h then arrives as the
replicated DTensor the head module gathered (see `ChunkedLossHead`).

With `train.compile = true` (no tensor parallelism) each chunk's softmax and gradient run as one
torch.compile'd function (`_fused_chunk`): its ~8 passes over the [chunk, vocab] logits fuse into
two, ~2x faster per chunk on CPU (docs/benchmarks.md); its numbers round like any compiled code.

Owns: the chunked loss and the head module that hands hidden states to it (`use_chunked_head`).
It must never apply a layout or run the step (parallelize.py / runner.py do).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from hpctrain.distributed.dtensor import is_dtensor

IGNORE_INDEX = -100  # as F.cross_entropy


class ChunkedLossHead(nn.Linear):
    """The model's lm_head when the loss is chunked: same weight (same name, `lm_head.weight`, so
    checkpoints, tying, TP and FSDP see the usual head) but forward returns the hidden states; the
    runner feeds them and `weight` to `chunked_lm_loss`."""

    returns_hidden = True  # read by the TP plan (tensor_parallel.py) and the runner
    compiled = False  # train.compile: the loss runs its chunks compiled (activation.compile_regions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def use_chunked_head(model: nn.Module) -> None:
    """Swap `model.lm_head` (an nn.Linear, possibly on meta) for a ChunkedLossHead sharing its weight."""
    old = model.lm_head
    head = ChunkedLossHead(old.in_features, old.out_features, bias=False, device="meta")
    head.weight = old.weight
    model.lm_head = head


def _vocab_shard(w: torch.Tensor):
    """(local weight, vocab offset of its first row, tp process group or None)."""
    if not is_dtensor(w):
        return w, 0, None
    from torch.distributed.tensor import Shard  # imported: a DTensor exists

    mesh, names = w.device_mesh, w.device_mesh.mesh_dim_names or ()
    sharded = [d for d, p in enumerate(w.placements) if not p.is_replicate()]
    if not sharded:
        return w.to_local(), 0, None
    if len(sharded) != 1 or w.placements[sharded[0]] != Shard(0) or names[sharded[0]] != "tp":
        raise ValueError(f"train.loss_chunk: head weight laid out as {w.placements} over "
                         f"{names}; only a vocabulary shard over 'tp' is supported")
    d = sharded[0]
    rows = -(-w.shape[0] // mesh.size(d))  # torch.chunk's split, as DTensor's Shard(0)
    return w.to_local(), mesh.get_local_rank(d) * rows, mesh.get_group(d)


def _work_buffers(rows: int, w: torch.Tensor, dtype, need_grad: bool, compiled: bool):
    """The [chunk, vocab] work buffers, allocated once per call and reused by every chunk:
    (fp32 logits, 16-bit logits then gradient or None, 16-bit dW product or None).
    The dW product is made when the chunk's fp32 logits are dead, so it lives in their bytes: the
    whole [V, C] when it fits (2 x chunk >= width), else a [2k, C] view for k vocabulary rows at a
    time and their fp32 upcast (`_accumulate_dw`); no [V, C] allocation per chunk or per call."""
    v, c = w.shape
    f32 = None if compiled else torch.empty(rows, v, dtype=torch.float32, device=w.device)
    if dtype == torch.float32:
        return f32, None, None
    low = None if compiled else torch.empty(rows, v, dtype=dtype, device=w.device)
    prod = None
    if need_grad:
        flat = f32.view(-1).view(dtype) if f32 is not None else None
        if flat is not None and flat.numel() >= v * c:
            prod = flat[:v * c].view(v, c)
        elif flat is not None and flat.numel() >= 4 * c:
            prod = flat[:flat.numel() // (2 * c) * 2 * c].view(-1, c)
        else:
            prod = torch.empty(v, c, dtype=dtype, device=w.device)
    return f32, low, prod


def _accumulate_dw(acc: torch.Tensor, g: torch.Tensor, hc: torch.Tensor, prod: torch.Tensor) -> None:
    """acc += (g^T @ hc).float(): the chunk's 16-bit dW product upcast, the same bits as one
    product. `prod` holds the whole [V, C] product (upcast in the dead `g`'s bytes) or is a
    [2k, C] buffer: then k vocabulary rows at a time (each row's dot products are the same),
    upcast in the buffer's second half, as `g` is still read."""
    v = acc.shape[0]
    if prod.shape[0] == v:
        _add_upcast(acc, torch.mm(g.t(), hc, out=prod), g)
        return
    k = prod.shape[0] // 2
    part, spare = prod[:k], prod[k:]
    for r in range(0, v, k):
        n = min(k, v - r)
        _add_upcast(acc[r:r + n], torch.mm(g[:, r:r + n].t(), hc, out=part[:n]), spare)


def _add_upcast(acc: torch.Tensor, part: torch.Tensor, spare: torch.Tensor) -> None:
    """acc += part.float() (the same bits) without a whole fp32 copy of the 16-bit [V, C] `part`
    (add_ of mixed dtypes makes one on CPU): upcast a block of rows at a time into the bytes of
    `spare`, a dead 16-bit tensor (the chunk's gradient, used by now)."""
    flat = spare.reshape(-1)[:spare.numel() // 2 * 2]
    rows = flat.numel() // 2 // part.shape[1]
    if rows == 0 or not spare.is_contiguous():
        acc.add_(part.float())
        return
    scratch = flat.view(torch.float32)
    for r in range(0, part.shape[0], rows):
        blk = part[r:r + rows]
        acc[r:r + rows].add_(scratch[:blk.numel()].view_as(blk).copy_(blk))


def _chunk_loss_and_grad(hc, wc, t, offset, group, weight, f32, low):
    """One chunk: (sum of token losses, d(weight * sum)/d logits as hc's dtype or None).
    `weight`: per-token factor for the gradient (valid / count), or None for forward only.
    `f32`: the fp32 [chunk, vocab] logits buffer; `low`: the 16-bit one (16-bit compute) or None.
    The 16-bit logits are upcast into `f32` and the gradient cast back into `low`."""
    if low is None:
        logits = torch.matmul(hc, wc.t(), out=f32[:len(t)])
    else:
        logits = f32[:len(t)].copy_(torch.matmul(hc, wc.t(), out=low[:len(t)]))
    local_t = t - offset
    owned = (local_t >= 0) & (local_t < wc.shape[0]) & (t != IGNORE_INDEX)
    idx = torch.where(owned, local_t, 0).unsqueeze(1)
    row_max = logits.amax(dim=1)  # values only: max(dim=1) also computes the argmax
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    logits -= row_max.unsqueeze(1)
    target = torch.where(owned, logits.gather(1, idx).squeeze(1), 0.0)
    sum_exp = logits.exp_().sum(dim=1)  # logits now hold exp(logit - max)
    if group is not None:
        both = torch.stack([sum_exp, target])
        dist.all_reduce(both, group=group)
        sum_exp, target = both[0], both[1]
    valid = t != IGNORE_INDEX
    loss_sum = torch.where(valid, sum_exp.log() - target, 0.0).sum()
    if weight is None:
        return loss_sum, None
    # (softmax - one-hot) x weight, in one pass over the chunk's logits. The one-hot part without
    # boolean-mask indexing (a host sync per mask on a GPU): every row's target column (column 0
    # where this rank does not own it) gets weight x owned subtracted, 0 on rows it does not own
    probs = logits.mul_((weight / sum_exp).unsqueeze(1))
    probs.scatter_(1, idx, probs.gather(1, idx) - (weight * owned).unsqueeze(1))
    return loss_sum, probs if low is None else low[:len(t)].copy_(probs)


def _fused_chunk(hc, wc, t, weight):
    """`_chunk_loss_and_grad` without tensor parallelism, written for torch.compile (no in-place
    ops or boolean indexing, which would split the graph): (loss sum, gradient wrt the logits)."""
    logits = (hc @ wc.t()).float()
    valid = t != IGNORE_INDEX
    idx = torch.where(valid, t, 0).unsqueeze(1)
    logits = logits - logits.amax(dim=1, keepdim=True)
    target = torch.where(valid, logits.gather(1, idx).squeeze(1), 0.0)
    exp = logits.exp()
    sum_exp = exp.sum(dim=1)
    loss_sum = torch.where(valid, sum_exp.log() - target, 0.0).sum()
    probs = (exp * (weight / sum_exp).unsqueeze(1)).scatter_add(1, idx, -(weight * valid).unsqueeze(1))
    return loss_sum, probs.to(hc.dtype)


def _fused_add_upcast(acc: torch.Tensor, part: torch.Tensor) -> None:
    """acc += part.float() in one pass (compiled: no fp32 copy of `part`; the same bits)."""
    acc.add_(part.float())


_COMPILED = {}  # function -> torch.compile(function), made on first use


def _compiled(fn):
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, targets, chunk, offset, group, dtype, need_grad, compiled=False,
                denominator=None):
        hc, wc = h.to(dtype), w.to(dtype)
        valid = targets != IGNORE_INDEX
        count = (valid.sum().clamp(min=1).to(torch.float32) if denominator is None
                 else denominator)
        weight = valid.float() / count if need_grad else None
        grad_h = torch.empty_like(h) if need_grad else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        fp32 = dtype == torch.float32
        compiled = compiled and need_grad and group is None
        f32, low, prod = _work_buffers(min(chunk, h.shape[0]), w, dtype, need_grad, compiled)
        for s in range(0, h.shape[0], chunk):
            e = min(s + chunk, h.shape[0])
            if compiled:
                part, g = _compiled(_fused_chunk)(hc[s:e], wc, targets[s:e], weight[s:e])
            else:
                part, g = _chunk_loss_and_grad(hc[s:e], wc, targets[s:e], offset, group,
                                               weight[s:e] if need_grad else None, f32, low)
            total += part
            if need_grad and fp32 and h.dtype == torch.float32:
                torch.matmul(g, wc, out=grad_h[s:e])
                grad_w.addmm_(g.t(), hc[s:e])
            elif need_grad:
                grad_h[s:e] = g @ wc
                if compiled:  # the [V, C] product upcast and added in one compiled pass
                    _compiled(_fused_add_upcast)(grad_w, torch.mm(g.t(), hc[s:e], out=prod))
                else:
                    _accumulate_dw(grad_w, g, hc[s:e], prod)
        if need_grad:
            if group is not None:
                dist.all_reduce(grad_h, group=group)  # every vocabulary slice's share
            ctx.save_for_backward(grad_h, grad_w.to(w.dtype))
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors  # ours, used once: scaled in place (no [V, C] copy)
        return grad_h.mul_(grad_loss), grad_w.mul_(grad_loss), *([None] * 8)


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    chunk: int, compiled: bool = False,
                    denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of logits = hidden @ weight^T, `chunk` tokens at a time;
    the same value and gradients (wrt hidden and weight) as F.cross_entropy on the full logits.
    hidden [..., C] (a replicated DTensor under TP), weight [V, C] (vocab-sharded under TP).
    `compiled`: each chunk's math through torch.compile (train.compile; not under TP).
    `denominator` (a 0-dim fp32 tensor): the sum over the targets divided by it instead of by
    their count (train.objective = sft: hpctrain/parallel/token_mean.py)."""
    if is_dtensor(hidden):
        if not all(p.is_replicate() for p in hidden.placements):
            raise ValueError(f"train.loss_chunk: hidden states laid out as {hidden.placements}; "
                             "the head must gather them (ChunkedLossHead under TP)")
        hidden = hidden.to_local()
    h = hidden
    w, offset, group = _vocab_shard(weight)
    device_type = h.device.type
    dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
             else h.dtype)
    need_grad = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    with torch.autocast(device_type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(h.flatten(0, -2), w, targets.flatten(), chunk,
                                                offset, group, dtype, need_grad, compiled,
                                                denominator)
