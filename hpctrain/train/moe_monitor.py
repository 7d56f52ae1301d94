"""Load balancing you can see: per mixture-of-experts layer, after every optimizer step, the tokens
each expert received (summed over the ranks that share the router), max/mean load, the router's
entropy, the auxiliary loss, the balancing bias' spread; the bias step itself; and a warning when
an expert stays above `warn_ratio` x the mean load for `warn_steps` steps in a row.

Owns: reading the layers' counters (MoEFeedForward.take_load etc.), the one all-reduce of the loads
(every rank then makes the same bias step), the metric names (`moe.<layer>.<stat>`, and
`moe.<layer>.load` as a list for `hpctrain plot`'s heat map) and the warning's bookkeeping. The
training loop calls `after_step` from its after-step hook; it must never touch gradients.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from hpctrain.model.moe import MoEFeedForward

log = logging.getLogger("hpctrain.moe")


class MoEMonitor:
    def __init__(self, model: torch.nn.Module, group=None, warn_ratio: float = 3.0, warn_steps: int = 50):
        self.layers = {name.removeprefix("blocks.").removesuffix(".mlp"): m
                       for name, m in model.named_modules() if isinstance(m, MoEFeedForward)}
        self.group, self.warn_ratio, self.warn_steps = group, warn_ratio, warn_steps
        self.hot_steps = {name: 0 for name in self.layers}  # steps in a row above warn_ratio

    def after_step(self, step: int) -> dict:
        """Metrics of the step just taken; updates the balancing biases (same step on every rank)."""
        if not self.layers:
            return {}
        loads = torch.stack([m.take_load().cpu() for m in self.layers.values()])
        if self.group is not None and dist.is_initialized():
            dist.all_reduce(loads, group=self.group)  # one collective for every layer
        rec = {}
        for (name, moe), load in zip(self.layers.items(), loads):
            moe.update_balance_bias(load)
            rec.update(self._layer_record(name, moe, load))
            self._watch(name, float(rec[f"moe.{name}.max_mean"]), step, load)
        return rec

    def _layer_record(self, name: str, moe: MoEFeedForward, load: torch.Tensor) -> dict:
        mean = float(load.float().mean())
        rec = {f"moe.{name}.max_mean": float(load.max()) / mean if mean > 0 else 0.0,
               f"moe.{name}.load": load.tolist()}
        if moe.last_entropy is not None:
            rec[f"moe.{name}.entropy"] = float(moe.last_entropy)
        if moe.last_aux_loss is not None:
            rec[f"moe.{name}.aux_loss"] = float(moe.last_aux_loss)
        if moe.cfg.bias_update_rate > 0:
            bias = moe.router.bias.detach()
            rec[f"moe.{name}.bias_spread"] = float(bias.max() - bias.min())
        return rec

    def _watch(self, name: str, ratio: float, step: int, load: torch.Tensor) -> None:
        self.hot_steps[name] = self.hot_steps[name] + 1 if ratio > self.warn_ratio else 0
        if self.hot_steps[name] == self.warn_steps:
            hot = int(load.argmax())
            log.warning(f"warning: step {step}: MoE layer {name}: expert {hot} has received more "
                        f"than {self.warn_ratio:g} x the mean load for {self.warn_steps} steps "
                        f"(now {ratio:.1f} x); raise model.moe_aux_loss_coef or "
                        f"model.moe_bias_update_rate")
