"""Our DPO loss and rewards (hpctrain/parallel/dpo.py) equal TRL's: the same batch of per-token
log-probs (policy) and reference log-probs goes through TRL's own ``DPOTrainer._compute_loss``
(loss_type "sigmoid", precomputed reference log-probs) and through ours."""
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hpctrain.parallel.dpo import REWARD_KEYS, dpo_loss, sequence_logps

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer", reason="trl (the test extra) not installed")


def _trl_loss(per_token_logps, completion_mask, ref, beta):
    """TRL's loss and reward metrics for a batch [chosen rows; rejected rows] whose model returns
    ``per_token_logps`` (TRL's fused LM head returns the log-probs of the labels, 0 off them)."""
    n = per_token_logps.shape[0]
    outputs = SimpleNamespace(log_probs=per_token_logps, entropy=torch.zeros_like(per_token_logps),
                              mean_logits=torch.zeros_like(per_token_logps),
                              is_top1=torch.zeros_like(per_token_logps, dtype=torch.bool))
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), beta=beta, loss_types=["sigmoid"], loss_weights=[1.0],
        f_divergence_type="reverse_kl", precompute_ref_logps=True, ld_alpha=None,
        use_weighting=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t,
                                    gather_for_metrics=lambda t: t))
    inputs = {"input_ids": torch.ones(n, per_token_logps.shape[1] + 1, dtype=torch.long),
              "attention_mask": torch.ones(n, per_token_logps.shape[1] + 1, dtype=torch.long),
              "completion_mask": torch.cat([torch.ones(n, 1), completion_mask], 1).long(),
              "ref_chosen_logps": ref[:, 0], "ref_rejected_logps": ref[:, 1]}
    loss = trl_dpo.DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, False)
    return loss, {k: trainer._metrics["train"][k][-1] for k in REWARD_KEYS}


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_and_rewards_equal_trls(beta):
    gen = torch.Generator().manual_seed(0)
    pairs, t, vocab = 6, 12, 50
    logits = torch.randn(2 * pairs, t, vocab, generator=gen) * 3
    targets = torch.randint(0, vocab, (2 * pairs, t), generator=gen)
    mask = (torch.rand(2 * pairs, t, generator=gen) > 0.4).float()
    ref = torch.randn(pairs, 2, generator=gen) * 5 - 40
    token_logps = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0] * mask
    policy = sequence_logps(logits, targets, mask)
    ours, stats = dpo_loss(policy, ref, beta)
    theirs, metrics = _trl_loss(token_logps, mask, ref, beta)
    assert abs(ours.item() - theirs.item()) <= 1e-5, (ours.item(), theirs.item())
    for key, value in zip(REWARD_KEYS, stats.tolist()):
        assert abs(value - metrics[key]) <= 1e-5, (key, value, metrics[key])
    assert 0 < metrics["rewards/accuracies"] < 1 and abs(ours.item() - math.log(2)) > 0.05


def test_equal_policy_and_reference_give_log_2_and_zero_rewards():
    policy = torch.tensor([-30.0, -12.5, -31.0, -14.0])
    loss, stats = dpo_loss(policy, torch.stack(policy.chunk(2), 1), beta=0.3)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert stats.tolist() == [0.0, 0.0, 0.0, 0.0]
