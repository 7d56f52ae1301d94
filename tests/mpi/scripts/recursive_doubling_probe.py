"""Run under mpiexec -n N (a power of two): parallel.deterministic_experts' recursive-doubling sum
(hpctrain/parallel/apply_expert.py `_recursive_doubling_sum`) over every rank, each rank's
vector distinct, with point-to-point sends that complete only once the peer has posted its
receive, and nothing after a send on that rank starting before it completes: NCCL's order (every
p2p op of a rank queued on one stream; a send past NCCL's internal buffer waits for its match).
Gloo's own `send` already waits for the matching receive; `dist.isend` is replaced by it here
(a request that is done when returned). A rank that waits for a peer stuck in its own send ends
after the group's timeout (argv[1] seconds) with Gloo's "Timed out" error: the hang, bounded.
Prints per rank whether its sum is bit-equal to the tree sum ((x0 + x1) + (x2 + x3)) + ... and
the seconds the sum took."""
import sys
import time

import torch
import torch.distributed as dist

from hpctrain.distributed import init_distributed, teardown
from hpctrain.parallel.apply_expert import _recursive_doubling_sum

TIMEOUT_S = int(sys.argv[1])
ctx = init_distributed("gloo", TIMEOUT_S)
r, n = ctx.rank, ctx.world_size


class Done:
    """The request of a send that has already completed."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def send_in_stream_order(tensor, dst=None, group=None, tag=0, group_dst=None):
    dist.send(tensor, dst, group=group, tag=tag, group_dst=group_dst)
    return Done()


def vector(rank: int) -> torch.Tensor:
    """Rank `rank`'s values, at scales 1, 10, 100 by rank: the order of the sum shows in the bits."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(1 << 16, generator=g) * 10.0 ** (rank % 3)


dist.isend = send_in_stream_order
start = time.perf_counter()
got = _recursive_doubling_sum(vector(r), dist.group.WORLD)
seconds = time.perf_counter() - start
tree = [vector(i) for i in range(n)]
while len(tree) > 1:
    tree = [a + b for a, b in zip(tree[0::2], tree[1::2])]
sys.stdout.write(f"rank {r}: equal {int(torch.equal(got, tree[0]))} seconds {seconds:.3f}\n")
sys.stdout.flush()
teardown()
from hpctrain.__main__ import exit_without_teardown  # noqa: E402

exit_without_teardown(0)
