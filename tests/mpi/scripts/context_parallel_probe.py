"""Run under mpiexec -n CP (gloo): context-parallel attention (hpctrain/parallel/context_parallel.py)
over every rank against full-sequence SDPA on one rank, fp32. The same q, k, v, output weights and
document ids on every rank (seeded); each rank attends its zig-zag part with the kernel, backward
of sum(out * w), and compares its part of the output and of the q, k, v gradients with its part
of the reference's. Cases: ring / ulysses x causal / document ids x heads 4/4 and 8/4 (GQA), a v width of 12 against a q/k width of 8 (multi-head latent attention; the
ring also with v 6, narrower: its fused CPU blocks zero-pad the narrower side either way), and
ring with Gloo sends replaced by sends that wait for their receive (NCCL's order, #49), the
hang bounded by the group's timeout (argv[1] seconds). Prints per rank and case:
`rank R case NAME out X dq X dk X dv X live N of M expected E` (max |difference|; the chunk pairs
the ring computes, of the 2cp(2cp+1)/2 causal pairs; E: the pairs where some query sees some key,
counted token by token)."""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.distributed import init_distributed, teardown
from hpctrain.parallel.context_parallel import CPPlan, ring_attention, ulysses_attention
from hpctrain.parallel.zigzag import split_for_rank

TIMEOUT_S = int(sys.argv[1])
ctx = init_distributed("gloo", TIMEOUT_S)
r, cp = ctx.rank, ctx.world_size
B, S, D = 2, 48, 8
group = dist.group.WORLD
KERNELS = {"ring": ring_attention, "ulysses": ulysses_attention}


def documents(seed: int) -> torch.Tensor:
    """[B, S] packed document ids: row 0 three long documents, row 1 many short ones (seeded)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(S, generator=g) < 0.3
    starts[0] = False
    return torch.stack([torch.tensor([0] * 20 + [1] * 17 + [2] * 11), starts.long().cumsum(0)])


def pairs_with_a_visible_key(docs) -> int:
    """(query chunk, key chunk) pairs where a query sees a key: causal and, with documents, same id."""
    pos = torch.arange(S)
    visible = pos[:, None] >= pos[None, :]
    if docs is not None:
        visible = visible & (docs[:, :, None] == docs[:, None, :]).any(0)
    c = S // (2 * cp)
    return sum(bool(visible[a * c:(a + 1) * c, b * c:(b + 1) * c].any())
               for a in range(2 * cp) for b in range(2 * cp))


def reference(q, k, v, w, docs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = None
    if docs is not None:
        mask = torch.ones(S, S, dtype=torch.bool).tril() & (docs[:, :, None] == docs[:, None, :])[:, None]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=k.shape[1] != q.shape[1])
    (out * w).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def run_case(kernel: str, with_docs: bool, heads: int, kv_heads: int, v_dim: int = D) -> str:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q, k = (torch.randn(B, h, S, D, generator=g) for h in (heads, kv_heads))
    v = torch.randn(B, kv_heads, S, v_dim, generator=g)
    w = torch.randn(B, heads, S, v_dim, generator=g)
    docs = documents(7) if with_docs else None
    ref = reference(q, k, v, w, docs)
    part = lambda t: split_for_rank(t, cp, r, dim=2)  # noqa: E731
    leaves = [part(t).requires_grad_() for t in (q, k, v)]
    plan = CPPlan.build(group, S // cp, None if docs is None else split_for_rank(docs, cp, r, dim=1))
    out = KERNELS[kernel](*leaves, plan)
    (out * part(w)).sum().backward()
    got = [out.detach()] + [t.grad for t in leaves]
    diffs = [(a - part(b)).abs().max().item() for a, b in zip(got, ref)]
    causal = 2 * cp * (2 * cp + 1) // 2
    return ("out {:.3g} dq {:.3g} dk {:.3g} dv {:.3g}".format(*diffs)
            + f" live {len(plan.live)} of {causal} expected {pairs_with_a_visible_key(docs)}")


class Done:
    """The request of a send that has already completed."""

    def wait(self, *args, **kwargs) -> bool:
        return True


def send_in_stream_order(tensor, dst=None, group=None, tag=0, group_dst=None):
    dist.send(tensor, dst, group=group, tag=tag, group_dst=group_dst)
    return Done()


lines = []
for kernel in KERNELS:
    for with_docs in (False, True):
        for heads, kv_heads in ((4, 4), (8, 4)):
            name = f"{kernel}-{'docs' if with_docs else 'causal'}-{heads}/{kv_heads}"
            lines.append(f"rank {r} case {name} {run_case(kernel, with_docs, heads, kv_heads)}")
    lines.append(f"rank {r} case {kernel}-docs-v12 {run_case(kernel, True, 4, 4, v_dim=12)}")
lines.append(f"rank {r} case ring-causal-v6 {run_case('ring', False, 8, 4, v_dim=6)}")
dist.isend = send_in_stream_order
lines.append(f"rank {r} case ring-waiting-sends {run_case('ring', True, 8, 4)}")
sys.stdout.write("".join(ln + "\n" for ln in lines))
sys.stdout.flush()
teardown()
from hpctrain.__main__ import exit_without_teardown  # noqa: E402

exit_without_teardown(0)
