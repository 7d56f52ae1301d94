"""A real training run of a tiny MoE llama with one hot expert, or the aux-loss gradient of an
accumulated step (tests/mpi/test_moe_training.py). Under `mpiexec -n 1`:

    moe_train_probe.py skew CONFIG [--key=value ...]   every MoE router prefers expert 0 (its row
        gets 2 x a fixed sign vector / sqrt(C): about half the tokens pick it, max/mean ~3.5 of 8),
        then Trainer.fit(): the loop, its MoE monitor hook and metrics.jsonl as `hpctrain train`
    moe_train_probe.py aux CONFIG [--key=value ...]    the gradients of one step over micro-batches
        [b, b] (grad_accum 2) and over one micro-batch cat(b, b): prints `router_rel_diff X`
        (the aux loss must weigh the same per optimizer step) and `aux_share Y` (the part of the
        router gradient that the aux loss makes)
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from hpctrain import config
from hpctrain.distributed import init_distributed, teardown
from hpctrain.model.moe import MoEFeedForward
from hpctrain.train.loop import Trainer


def make_expert_hot(model: torch.nn.Module, expert: int = 0, strength: float = 2.0) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for moe in (m for m in model.modules() if isinstance(m, MoEFeedForward)):
            dim = moe.router.weight.shape[1]
            direction = torch.randint(0, 2, (dim,), generator=gen).float() * 2 - 1
            moe.router.weight[expert] += strength * direction / dim ** 0.5


def router_grads(trainer: Trainer, micro_batches: list[torch.Tensor]) -> torch.Tensor:
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.engine.runner.forward_backward(micro_batches, trainer.engine.autocast)
    return torch.cat([m.router.weight.grad.flatten() for m in trainer.model.modules()
                      if isinstance(m, MoEFeedForward)])


def aux_gradients(trainer: Trainer, coef: float) -> None:
    torch.manual_seed(0)
    b = torch.randint(0, trainer.cfg.model.vocab_size, (2, trainer.cfg.model.block_size + 1))
    accumulated = router_grads(trainer, [b, b])
    big = router_grads(trainer, [torch.cat([b, b])])
    rel = float((accumulated - big).norm() / big.norm())
    moes = [m for m in trainer.model.modules() if isinstance(m, MoEFeedForward)]
    for m in moes:  # the same step without the aux loss: what the main loss alone gives
        m.cfg = dataclasses.replace(m.cfg, aux_loss_coef=0.0)
    main_only = router_grads(trainer, [torch.cat([b, b])])
    share = float((big - main_only).norm() / big.norm())
    print(f"router_rel_diff {rel:.3e}\naux_share {share:.3f}\naux_coef {coef}", flush=True)


def main(argv: list[str]) -> int:
    mode, path, overrides = argv[0], argv[1], argv[2:]
    cfg = config.load(path, overrides)
    ctx = init_distributed(cfg.dist.backend, cfg.dist.timeout_s)
    trainer = Trainer(cfg, ctx)
    status = 0
    if mode == "skew":
        make_expert_hot(trainer.model)
        status = trainer.fit()
    else:
        aux_gradients(trainer, cfg.model.moe_aux_loss_coef)
    teardown()
    return status


if __name__ == "__main__":
    # ends as `hpctrain train` does (the run's files are closed by fit): MPI_Finalize, the launcher
    # told, os._exit, without the interpreter's ~0.8 s teardown of torch
    from hpctrain.__main__ import exit_without_teardown

    exit_without_teardown(main(sys.argv[1:]))
