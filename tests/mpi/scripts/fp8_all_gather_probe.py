"""Run under mpiexec: BACKEND CONFIG [OVERRIDES...]. Builds the config's model in its layout
(train/model_setup.py: train.precision = fp8 converts its Linear layers before FSDP2) and runs one
forward under bf16 autocast, counting the bytes FSDP2 all-gathers by dtype (the output tensors of
every c10d all-gather). Rank 0 prints `GATHERED {json}` and the converted layers' weight elements
(`CONVERTED n`), and the forward's float8 matmuls (`FLOAT8_MM n`: matmuls of two torchao float8 tensors, torch._scaled_mm unless emulated)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hpctrain import config  # noqa: E402
from hpctrain.distributed import init_distributed, teardown  # noqa: E402
from hpctrain.distributed.mesh import Mesh, ParallelDims  # noqa: E402
from hpctrain.train.model_setup import build_model  # noqa: E402
from torchao.float8.float8_training_tensor import Float8TrainingTensor  # noqa: E402


class Gathered(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.float8_mm = 0  # matmuls of torchao's float8 tensors (torch._scaled_mm unless emulated)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.float8_mm += func.__name__.startswith("mm") and all(
            isinstance(a, Float8TrainingTensor) for a in args[:2])
        if func.namespace == "c10d" and "allgather" in func.__name__:
            out = args[0]
            for t in out if isinstance(out, (list, tuple)) else [out]:
                key = str(t.dtype).removeprefix("torch.")
                self.bytes[key] = self.bytes.get(key, 0) + t.numel() * t.element_size()
        return func(*args, **(kwargs or {}))


def converted_elements(model: torch.nn.Module) -> int:
    from torchao.float8.float8_linear import Float8Linear
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, Float8Linear))


cfg = config.load(sys.argv[2], sys.argv[3:])
ctx = init_distributed(sys.argv[1], 60)
mesh = Mesh(ParallelDims.from_config(ctx.world_size, cfg.parallel), ctx)
model = build_model(cfg, mesh, ctx.device, cfg.train.precision).layout.module
tokens = torch.zeros(cfg.train.micro_batch_size, cfg.model.block_size, dtype=torch.long, device=ctx.device)
with Gathered() as gathered, torch.autocast(ctx.device.type, dtype=torch.bfloat16):
    model(tokens)
if ctx.rank == 0:
    print("GATHERED", json.dumps(gathered.bytes), flush=True)
    print("CONVERTED", converted_elements(model), flush=True)
    print("FLOAT8_MM", gathered.float8_mm, flush=True)
teardown()
