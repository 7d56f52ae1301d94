"""MPI probe for tests/mpi/test_meta_init.py: meta-device initialization gives, in every layout,
the initial weights of building the whole model on every rank (bit for bit).

    mpiexec -n N python meta_init_probe.py LAYOUT [LAYOUT ...]

LAYOUT is name=override,override,... (e.g. "fsdp2=parallel.data_parallel=fsdp"; "dp2=" for none).
For each, every rank builds the tiny GPT twice in the layout, with parallel.meta_init false and
true, and compares each parameter it holds (DTensors gathered whole with full_tensor) with the
other build's and with a plain `torch.manual_seed(seed); GPT(cfg)` on CPU (a Llama with
model.arch=llama among the overrides). Rank 0 prints one line
per rank and layout: `SAME <layout> <rank> <n_params>` or `DIFF <layout> <rank> <fqn ...>`.
"""
from __future__ import annotations

import dataclasses
import sys

import torch
from torch.distributed.tensor import DTensor

from hpctrain import config as config_mod
from hpctrain.distributed.abort import run_or_abort
from hpctrain.distributed.bootstrap import init_distributed, teardown
from hpctrain.distributed.mesh import Mesh, ParallelDims
from hpctrain.model import build_model_from_section
from hpctrain.parallel.meta_init import WRAPPER_PREFIXES
from hpctrain.train.model_setup import build_model

MODEL = dict(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=257)
SEED = 1234


def full_params(module) -> dict[str, torch.Tensor]:
    """This rank's parameters by original name, DTensors gathered whole (collective)."""
    out = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        for prefix in WRAPPER_PREFIXES:
            fqn = fqn.replace(prefix, "")
        out[fqn] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
    return out


def build(ctx, overrides: list[str], meta: bool):
    args = ["--run.dir=/nonexistent", "--data.path=/nonexistent", "--train.steps=1", "--train.warmup_steps=0", "--train.micro_batch_size=1",
            f"--train.seed={SEED}", f"--parallel.meta_init={'true' if meta else 'false'}",
            *[f"--model.{k}={v}" for k, v in MODEL.items()], *overrides]
    cfg = config_mod.load(None, args)
    mesh = Mesh(ParallelDims.from_config(ctx.world_size, cfg.parallel), ctx)
    module = build_model(cfg, mesh, ctx.device, cfg.train.precision).layout.module
    tied = None if module.tok_emb is None or module.lm_head is None else \
        module.lm_head.weight is module.tok_emb.weight  # None: the other one is on another stage
    return full_params(module), tied, cfg


def check(ctx, name: str, overrides: list[str]) -> None:
    old, old_tied, cfg = build(ctx, overrides, meta=False)
    new, new_tied, _ = build(ctx, overrides, meta=True)
    torch.manual_seed(SEED)  # the plain model of the [model] section (gpt2, or llama by overrides)
    plain = build_model_from_section(dataclasses.asdict(cfg.model))
    ref = {k: v.detach() for k, v in plain.named_parameters(remove_duplicate=False)}
    diff = [k for k in new if not (torch.equal(new[k], old.get(k, torch.empty(0)))
                                   and torch.equal(new[k], ref[k]))]
    want_tied = cfg.model.arch == "gpt2" or cfg.model.tie_embeddings
    if set(new) != set(old) or {old_tied, new_tied} - {None, want_tied}:
        diff.append(f"names/ties differ: {sorted(set(new) ^ set(old))} tied={old_tied},{new_tied}")
    line = (f"SAME {name} {ctx.rank} {len(new)}" if not diff
            else f"DIFF {name} {ctx.rank} {' '.join(diff)}")
    lines = ctx.comm.gather(line, root=0)  # printed by rank 0: ranks' stdout interleaves
    if ctx.rank == 0:
        print("\n".join(lines), flush=True)


def main() -> None:
    ctx = init_distributed("gloo")
    for spec in sys.argv[1:]:
        name, _, rest = spec.partition("=")
        check(ctx, name, [f"--{o}" for o in rest.split(",") if o])
    teardown()


if __name__ == "__main__":
    run_or_abort(main)
