"""Run under mpiexec -n EP: one MoE layer with its experts sharded over every rank
(hpctrain/parallel/expert.py) against the same layer on one rank, under deliberately skewed
routing. Prints, per rank, the max |difference| of its tokens' outputs, of its experts' weight
gradients (relative to their largest entry) and of the router's gradient (summed over ranks,
relative to its largest entry), the rows
its experts computed, and how many dist collectives the sharded layer ran, each held to the rank's
device as NCCL holds it (a tensor off it ends the probe with NCCL's message)."""
import copy
import sys

import torch
import torch.distributed as dist

from hpctrain.distributed import init_distributed, teardown
from hpctrain.model.moe import MoEConfig, MoEFeedForward, init_moe_
from hpctrain.parallel.expert import shard_experts

E, TOP_K, DIM, HIDDEN, TOKENS = int(sys.argv[1]), 2, 16, 24, 192
ctx = init_distributed("gloo", 60)
r, ep = ctx.rank, ctx.world_size
torch.manual_seed(0)  # the same layer, batch and output weights on every rank
moe = MoEFeedForward(DIM, HIDDEN, MoEConfig(n_experts=E, top_k=TOP_K, n_shared_experts=1))
init_moe_(moe, 0.3, 0.3)
with torch.no_grad():
    moe.router.weight[0] += 0.5  # expert 0 favoured (the tokens' mean is positive)
x = torch.randn(TOKENS, DIM) + 0.5
w = torch.randn(TOKENS, DIM)

ref = copy.deepcopy(moe)  # one rank, every token
(ref(x) * w).sum().backward()
share = slice(r * TOKENS // ep, (r + 1) * TOKENS // ep)
out_ref = ref(x).detach()[share]

moe.experts = shard_experts(moe.experts, E, dist.group.WORLD)
# NCCL refuses a collective on a tensor off the rank's device ("No backend type associated with
# device type cpu"). Here the device is the CPU: a tensor built without naming its device lands on
# "meta" (the defect's class: a host tensor where the rank's device was meant), which never reaches
# the real backend (meta kernels are fakes), so dist's collectives refuse it first, as NCCL would.
torch.set_default_device("meta")
checked = []  # the devices every dist collective of the layer's forward and backward was given


def device_only(collective):
    def refusing(*args, **kwargs):
        devices = {t.device.type for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
        checked.append(devices)
        if devices - {"cpu"}:
            raise RuntimeError(f"No backend type associated with device type {min(devices - {'cpu'})}")
        return collective(*args, **kwargs)
    return refusing


real = {name: getattr(dist, name)  # all_gather_single: the counts' exchange (torch >= 2.12)
        for name in ("all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor",
                     "all_gather_single") if hasattr(dist, name)}
for name, collective in real.items():
    setattr(dist, name, device_only(collective))
out = moe(x[share])
(out * w[share]).sum().backward()
torch.set_default_device("cpu")
for name, collective in real.items():
    setattr(dist, name, collective)
rows = slice(r * E // ep, (r + 1) * E // ep)
d_out = (out.detach() - out_ref).abs().max()
# relative to the largest entry: one rank sums an expert's rows in one matmul, ep ranks per source
d_experts = max((getattr(moe.experts, n).grad - getattr(ref.experts, n).grad[rows]).abs().max()
                / getattr(ref.experts, n).grad[rows].abs().max() for n in ("w1", "w3", "w2"))
router_grad = moe.router.weight.grad.clone()
dist.all_reduce(router_grad)
d_router = (router_grad - ref.router.weight.grad).abs().max() / ref.router.weight.grad.abs().max()
computed = torch.tensor(int(moe.experts.local_rows_computed))
dist.all_reduce(computed)
load = moe.take_load()
dist.all_reduce(load)
# one write per line: unbuffered (PYTHONUNBUFFERED=1), print writes the newline apart and the
# ranks' lines can interleave
sys.stdout.write(f"rank {r}: out {float(d_out):.3g} experts {float(d_experts):.3g} router "
                 f"{float(d_router):.3g} computed {int(computed)} routed {int(load.sum())} "
                 f"max_load {int(load.max())} collectives {len(checked)}\n")
sys.stdout.flush()
teardown()
# ends as `hpctrain train` does (MPI_Finalize, the launcher told, os._exit): without the
# interpreter's ~0.8 s teardown of torch per rank, which the product never runs after a job
from hpctrain.__main__ import exit_without_teardown  # noqa: E402

exit_without_teardown(0)
