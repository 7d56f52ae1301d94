"""The DPO objective (train.objective = "dpo"): the loss of Rafailov et al. on preference pairs,
TRL's ``DPOTrainer`` arithmetic (loss_type "sigmoid", reverse KL), and the runner that trains on it.

    logp(seq)   = sum over the completion's target tokens of log p(token | the tokens before it)
    ratio       = logp_policy - logp_reference              (per side: chosen, rejected)
    loss        = mean over pairs of -log sigmoid(beta x (ratio_chosen - ratio_rejected))
    rewards/... = beta x ratio_chosen, beta x ratio_rejected, their difference (margins) and the
                  share of pairs whose chosen reward is the larger (accuracies): TRL's names

Owns: those formulas and running them over a step's PairBatches (hpctrain/data/pairs.py) on a
data-parallel layout: each micro-batch's mean loss over its pairs, backward, the global mean loss
and rewards (one all-reduce of the five numbers).  Must never: fetch data, compute the reference
log-probs (train/dpo.py does, once, with the initial model) or apply a layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hpctrain.errors import ConfigError
from hpctrain.parallel.runner import PlainRunner, _value

REWARD_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] fp32: each row's sum of log-probabilities of its targets where ``mask`` is 1."""
    token_logps = -F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                   reduction="none").view_as(targets)
    return (token_logps * mask).sum(-1)


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, [4] mean rewards: chosen, rejected, margins, accuracies) of B pairs from their
    log-probs ``policy`` [2B] (chosen rows, then rejected) and ``reference`` [B, 2]."""
    chosen, rejected = policy.chunk(2)
    chosen_rewards = beta * (chosen - reference[:, 0])
    rejected_rewards = beta * (rejected - reference[:, 1])
    loss = -F.logsigmoid(chosen_rewards - rejected_rewards).mean()
    stats = torch.stack([chosen_rewards.mean(), rejected_rewards.mean(),
                         (chosen_rewards - rejected_rewards).mean(),
                         (chosen_rewards > rejected_rewards).float().mean()])
    return loss, stats.detach()


class DpoRunner(PlainRunner):
    """PlainRunner whose micro-batches are PairBatches and whose loss is DPO's; ``reference``
    maps a batch's pair numbers to their [B, 2] reference log-probs on the device."""

    def __init__(self, layout, beta: float, reference, mean_over_dp: bool = True):
        super().__init__(layout, mean_over_dp)
        self.beta, self.reference = beta, reference
        self.rewards = None  # the last step's global mean rewards: [4] on the device

    def forward_backward(self, micro_batches, autocast, loss_hook=None, loss_scale=1.0):
        means = super().forward_backward(micro_batches, autocast, loss_hook, loss_scale)
        self.rewards = means[1:]
        return means[0]

    def _forward_backward_sum(self, micro_batches, autocast, loss_scale):
        n = len(micro_batches)
        total = torch.zeros(1 + len(REWARD_KEYS), device=self.device)
        for i, batch in enumerate(micro_batches):
            with self._sync_context(i == n - 1):
                with autocast:
                    logits = self.forward_module(batch.tokens[:, :-1])
                policy = sequence_logps(logits, batch.tokens[:, 1:], batch.mask)
                loss, stats = dpo_loss(policy, self.reference(batch.pairs), self.beta)
                hooked = self._loss_hook(loss) if self._loss_hook is not None else loss
                (hooked * self._loss_scale / n / self._loss_divisor).backward()
            self.layout.wait_clock.backward_done()  # DDP has waited for its buckets
            total += torch.cat([_value(hooked.detach()).reshape(1), stats])
        return total

    def _eval_sum(self, batches, autocast):
        raise ConfigError("config key 'train.eval_interval': train.objective = 'dpo' has no "
                          "validation loss yet: set it to 0")
