"""Run under mpiexec -n 2: one MoE layer's experts sharded over both ranks (expert parallelism,
hpctrain/parallel/expert.py) on the path a CUDA run takes (the padded grouped matmul sized by host
counts: `_cuda_grouped_mm_fits` forced on), forward and backward, counting host syncs with
tests/unit/test_moe_host_syncs.py's counter. argv[1]: "per_source" (the blocks
parallel.deterministic_experts keeps) or "all_sources" (one group per expert: CUDA's default).
Prints per rank the syncs of forward and of backward by kind."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: tests.unit

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hpctrain.distributed import init_distributed, teardown  # noqa: E402
from hpctrain.model import moe as moe_module  # noqa: E402
from hpctrain.model.moe import MoEConfig, MoEFeedForward, init_moe_  # noqa: E402
from hpctrain.parallel import expert  # noqa: E402
from tests.unit.test_moe_host_syncs import HostSyncs  # noqa: E402

MODE = sys.argv[1]
ctx = init_distributed("gloo", 60)
moe_module._grouped_mm_fits = lambda *tensors: False
moe_module._cuda_grouped_mm_fits = lambda x, w1: x.shape[0] > 0
if MODE == "all_sources":
    expert.one_group_per_expert = lambda received, per_source_grads: True
torch.manual_seed(0)
moe = MoEFeedForward(16, 24, MoEConfig(n_experts=4, top_k=2))
init_moe_(moe, 0.3, 0.3)
moe.experts = expert.shard_experts(moe.experts, 4, dist.group.WORLD, per_source_grads=MODE == "per_source")
x = torch.randn(64, 16, generator=torch.Generator().manual_seed(ctx.rank)) + 0.5
with HostSyncs() as forward:
    out = moe(x)
with HostSyncs() as backward:
    out.square().mean().backward()
rows = torch.tensor(moe.experts.local_rows_computed)
dist.all_reduce(rows)
sys.stdout.write(f"rank {ctx.rank}: forward {forward.total} {dict(forward.counts)} backward "
                 f"{backward.total} rows {int(rows)}\n")
sys.stdout.flush()
teardown()
from hpctrain.__main__ import exit_without_teardown  # noqa: E402

exit_without_teardown(0)
