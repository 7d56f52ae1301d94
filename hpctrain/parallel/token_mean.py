"""The loss as the mean over the trained tokens of the whole global batch (train.objective = sft).

A masked micro-batch's targets (parallel/batch_inputs.py's MaskedBatch) hold IGNORE_INDEX where
no loss is taken (non-assistant tokens). Each micro-batch's loss is its SUM over trained targets
divided by one per-step number

    D = N / (n x R)      N: trained targets in the global batch (every micro-batch, every dp x cp
                            rank), n: micro-batches per step, R: ranks the losses and gradients
                            are averaged over (dp x cp)

so that the runner's usual arithmetic (each micro-batch's loss x 1/n, then the mean over R ranks,
for the loss and for the gradients: DDP, FSDP, the after-backward all-reduce, the pipeline's
scale_grads) gives sum / N: every trained token weighs the same, however the tokens fall into
micro-batches and ranks (a per-micro-batch mean would weigh a token of a short answer more).

Owns: counting trained targets, D and the summed loss. It must never read data or decide which
tokens are trained (hpctrain/train/objective.py does; hpctrain/parallel/batch_inputs.py masks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hpctrain.parallel.loss import IGNORE_INDEX


def trained_count(targets_of_batches: list[torch.Tensor]) -> torch.Tensor:
    """int64 0-dim tensor: the targets not ignored, over every tensor given (on their device)."""
    return sum((t != IGNORE_INDEX).sum() for t in targets_of_batches)


def per_micro_batch_denominator(global_trained: torch.Tensor, n_micro: int, ranks: int) -> torch.Tensor:
    """D = N / (n x R) as fp32 (N >= 1: a global batch without a trained token has loss 0)."""
    return global_trained.clamp(min=1).to(torch.float64).div(n_micro * ranks).to(torch.float32)


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy (fp32) over the targets not ignored (0 when none are).
    Vocab-sharded DTensor logits need `loss_parallel()`."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
