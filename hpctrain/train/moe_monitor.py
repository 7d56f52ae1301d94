"""Load balancing you can see: per mixture-of-experts layer, after every optimizer step, the tokens
each expert received (summed over the ranks that share the router), max/mean load, the router's
entropy, the auxiliary loss, the balancing bias' spread; the bias step itself; and a warning when
an expert stays above `warn_ratio` x the mean load for `warn_steps` steps in a row.

Owns: reading the layers' counters (MoEFeedForward.take_load etc.), the one all-reduce of the loads
(every rank then makes the same bias step), the metric names (`moe.<layer>.<stat>`, and
`moe.<layer>.load` as a list for `hpctrain plot`'s heat map) and the warning's bookkeeping. The
training loop registers `monitor_for(...)`'s `record` as an after_step hook (train/hooks.py) for a
model with MoE layers only: a dense model gets no hook, no collective and no new keys. Where pipeline
stages hold different layers, the stages' records are gathered so rank 0's metrics.jsonl has every
layer (step 1's loads there also count the one shape-inference forward torch's pipeline schedule
runs per stage before its first step). It must never touch gradients.
"""
from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hpctrain.distributed.dtensor import is_dtensor
from hpctrain.model.moe import MoEFeedForward

if TYPE_CHECKING:  # imported where a DTensor exists (distributed/dtensor.py)
    from torch.distributed.tensor import DTensor

log = logging.getLogger("hpctrain.moe")


# blocks.<i>.mlp under any wrapper's prefix (DDP's module., ...) and through the block's own
# wrappers (activation checkpointing's _checkpoint_wrapped_module., compile's _orig_mod.)
_LAYER = re.compile(r"blocks\.(\d+)\.(?:_checkpoint_wrapped_module\.|_orig_mod\.)*mlp$")


def monitor_for(model: torch.nn.Module, model_cfg, mesh, shared_router: bool) -> "MoEMonitor | None":
    """The monitor of this rank's MoE layers, or None for a dense model. `shared_router`: the dp
    replicas step together (every rank then sums the loads over dp and makes the same bias step);
    else each replica balances its own router (DiLoCo's inner steps, ps workers)."""
    if not any(isinstance(m, MoEFeedForward) for m in model.modules()):
        return None
    group = mesh.group("dp") if shared_router and mesh.dp_size > 1 else None
    pp_group = mesh.group("pp") if mesh.pp_size > 1 else None
    return MoEMonitor(model, group, model_cfg.moe_warn_ratio, model_cfg.moe_warn_steps, pp_group)


class MoEMonitor:
    def __init__(self, model: torch.nn.Module, group=None, warn_ratio: float = 3.0, warn_steps: int = 50,
                 pp_group=None):
        self.layers = {_LAYER.search(name).group(1) if _LAYER.search(name) else name: m
                       for name, m in model.named_modules() if isinstance(m, MoEFeedForward)}
        self.group, self.warn_ratio, self.warn_steps = group, warn_ratio, warn_steps
        self.pp_group = pp_group  # pipeline stages: each holds its own layers
        # the loads travel on the parameters' device (NCCL groups take no CPU tensors)
        self.device = next(iter(self.layers.values())).router.weight.device if self.layers else None
        self.speaks = group is None or dist.get_rank(group) == 0  # the warning once per dp group
        self.hot_steps = {name: 0 for name in self.layers}  # steps in a row above warn_ratio

    def record(self, rec: dict) -> None:
        """The loop's after_step hook: adds every MoE layer's metrics to the step's record."""
        mine = self.after_step(rec["step"])
        if self.pp_group is not None:  # rank 0 writes the record: every stage's layers into it
            stages = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(stages, mine, group=self.pp_group)
            mine = {k: v for stage in stages for k, v in stage.items()}
        rec.update(sorted(mine.items(), key=lambda kv: _layer_order(kv[0])))

    def after_step(self, step: int) -> dict:
        """Metrics of the step just taken; updates the balancing biases (same step on every rank)."""
        if not self.layers:
            return {}
        loads = torch.stack([m.take_load().to(self.device) for m in self.layers.values()])
        if self.group is not None and dist.is_initialized():
            dist.all_reduce(loads, group=self.group)  # one collective for every layer
        tp_group = getattr(next(iter(self.layers.values())), "tp_token_group", None)
        if tp_group is not None:  # tensor parallel: each tp rank routed its own sequence shard
            dist.all_reduce(loads, group=tp_group)
        loads = loads.cpu()
        rec = {}
        for (name, moe), load in zip(self.layers.items(), loads):
            _bias_step(moe, load)
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
            bias = bias.full_tensor() if is_dtensor(bias) else bias
            rec[f"moe.{name}.bias_spread"] = float(bias.max() - bias.min())
        return rec

    def _watch(self, name: str, ratio: float, step: int, load: torch.Tensor) -> None:
        self.hot_steps[name] = self.hot_steps[name] + 1 if ratio > self.warn_ratio else 0
        if self.hot_steps[name] == self.warn_steps and self.speaks:
            hot = int(load.argmax())
            log.warning(f"warning: step {step}: MoE layer {name}: expert {hot} has received more "
                        f"than {self.warn_ratio:g} x the mean load for {self.warn_steps} steps "
                        f"(now {ratio:.1f} x); raise model.moe_aux_loss_coef or "
                        f"model.moe_bias_update_rate")


def _bias_step(moe: MoEFeedForward, load: torch.Tensor) -> None:
    """The layer's balancing-bias step. Under FSDP the bias is a sharded DTensor: the step is made
    on a zero vector and each rank adds its shard of it (no collective: the loads are agreed)."""
    bias = moe.router.bias
    if not is_dtensor(bias):
        moe.update_balance_bias(load)
        return
    probe = torch.nn.Parameter(torch.zeros(bias.shape, device=load.device), requires_grad=False)
    moe.router.bias = probe
    try:
        moe.update_balance_bias(load)
    finally:
        moe.router.bias = bias
    with torch.no_grad():
        bias.to_local().add_(_local_shard(probe.detach(), bias).to(bias.dtype))


def _local_shard(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _layer_order(key: str) -> tuple:
    """moe.<layer>.<stat> keys by layer number, then stat (the record reads layer by layer)."""
    parts = key.split(".")
    return (int(parts[1]) if parts[1].isdigit() else 1 << 30, key)
