"""A mixture-of-experts layer's rows moved between token order and expert order without atomic
adds: the dispatch (each token's row copied to its k routed slots, sorted by expert) and the
combine (each token's k expert outputs added back into one row), forward and backward.

Owns the two moves as a pair of autograd functions, each the other's adjoint: a gather one way,
and the other way each token's k rows gathered next to each other (`by_token`: rows grouped by
token, ascending expert inside) and added one after another (the combine's bf16 / fp16 sum in
fp32, rounded once; the dispatch's gradient in its own dtype, as the ops they replace). Nothing scatters with repeated
indices, so a CUDA run adds a token's rows in the same order every time (index_add_ and the
backward of `x[rows]` add them with atomics, in whatever order the threads arrive: #49), and on
a CPU every sum is the one index_add_ made (rows in ascending-expert order, as the sorted rows
list them: bit-identical). It must never route, sort or compute an expert.
"""
from __future__ import annotations

import torch


def rows_by_token(token_of_row: torch.Tensor) -> torch.Tensor:
    """The expert-sorted rows' indices grouped by token (stable: ascending expert inside a token,
    since the rows are sorted by expert)."""
    return token_of_row.argsort(stable=True)


def dispatch(x: torch.Tensor, token_of_row: torch.Tensor, by_token: torch.Tensor, top_k: int) -> torch.Tensor:
    """x [T, C] -> its rows in expert order, [T * top_k, C] (row i is token token_of_row[i]'s)."""
    return _Dispatch.apply(x, token_of_row, by_token, top_k)


def combine(rows: torch.Tensor, token_of_row: torch.Tensor, by_token: torch.Tensor, top_k: int) -> torch.Tensor:
    """Expert-ordered rows [T * top_k, C] -> [T, C], each token's rows added in ascending expert."""
    return _Combine.apply(rows, token_of_row, by_token, top_k)


def sum_per_token(rows: torch.Tensor, by_token: torch.Tensor, top_k: int,
                  in_fp32: bool = False) -> torch.Tensor:
    """Each token's top_k rows added one after another, in the order `by_token` lists them;
    `in_fp32`: a bf16 / fp16 sum kept in fp32 and rounded once (as index_add_ sums on a CPU)."""
    per_token = rows.index_select(0, by_token).view(-1, top_k, rows.shape[-1])
    if in_fp32 and rows.dtype in (torch.bfloat16, torch.float16):
        per_token = per_token.float()
    out = per_token[:, 0]
    for j in range(1, top_k):
        out = out + per_token[:, j]
    return out.to(rows.dtype)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_of_row, by_token, top_k):
        ctx.save_for_backward(by_token)
        ctx.top_k = top_k
        return x.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad_rows):
        (by_token,) = ctx.saved_tensors
        return sum_per_token(grad_rows, by_token, ctx.top_k), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, token_of_row, by_token, top_k):
        ctx.save_for_backward(token_of_row)
        return sum_per_token(rows, by_token, top_k, in_fp32=True)

    @staticmethod
    def backward(ctx, grad_out):
        (token_of_row,) = ctx.saved_tensors
        return grad_out.index_select(0, token_of_row), None, None, None
