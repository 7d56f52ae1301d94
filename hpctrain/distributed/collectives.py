"""torch.distributed collectives under the name this torch gives them, so no rank prints a
deprecation warning: `all_gather_single`.

torch 2.12 renamed `all_gather_into_tensor` to `all_gather_single` and deprecated the old name
(a FutureWarning on every rank at its first call: at parallel.ep = 2 each rank printed it); torch
2.11, the first GPU machine's, has only the old one. The name is looked up at every call, so a
test that wraps `dist.<name>` (tests/unit/test_gpu_safety.py, tests/mpi/scripts/
expert_parallel_probe.py) sees the call. It must never change what a collective computes.
"""
from __future__ import annotations

import torch.distributed as dist


def all_gather_single(output, input, group=None, async_op: bool = False):
    """dist.all_gather_single (torch >= 2.12), else dist.all_gather_into_tensor: the ranks'
    `input` tensors concatenated into `output`, in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)
