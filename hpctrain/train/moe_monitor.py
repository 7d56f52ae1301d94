"""Load balancing you can see: per mixture-of-experts layer, after every optimizer step, the tokens
each expert received (summed over the ranks that share the router), max/mean load, the router's
entropy, the auxiliary loss, the balancing bias' spread; the bias step itself; and a warning when
an expert stays above `warn_ratio` x the mean load for `warn_steps` steps in a row.

Owns: reading the layers' counters (MoEFeedForward.take_load etc.), the one all-reduce of the loads
(every rank then makes the same bias step), kept on the device: the bias step and the warning's
counters run there every step, and the numbers are copied to the host once, only at a log step
(train.log_interval, and the last step; #49: a host sync per step and layer before), so the
`moe.*` keys are in those steps' records only; the metric names (`moe.<layer>.<stat>`, and
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
from hpctrain.model import spec as model_spec
from hpctrain.model.moe import MoEFeedForward

if TYPE_CHECKING:  # imported where a DTensor exists (distributed/dtensor.py)
    from torch.distributed.tensor import DTensor

log = logging.getLogger("hpctrain.moe")


# blocks.<i>.mlp under any wrapper's prefix (DDP's module., ...) and through the block's own
# wrappers (activation checkpointing's _checkpoint_wrapped_module., compile's _orig_mod.)
_LAYER = re.compile(r"blocks\.(\d+)\.(?:_checkpoint_wrapped_module\.|_orig_mod\.)*mlp$")


def monitor_for(model: torch.nn.Module, model_cfg, mesh, shared_router: bool,
                log_interval: int = 1, last_step: int = 0) -> "MoEMonitor | None":
    """The monitor of this rank's MoE layers, or None for a dense model. `shared_router`: the dp
    replicas step together (every rank then sums the loads over dp and makes the same bias step);
    else each replica balances its own router (DiLoCo's inner steps, ps workers). Its metrics
    are read at steps that are multiples of `log_interval`, and at `last_step`."""
    # a pipeline stage without sparse layers of a MoE model gets a monitor with none: it joins
    # the stages' gather of the records (else the stages with some wait for it at a log step)
    other_stages = (mesh is not None and mesh.pp_size > 1
                    and model_spec.get(model_cfg.arch).n_experts(model_cfg) > 0)
    if not other_stages and not any(isinstance(m, MoEFeedForward) for m in model.modules()):
        return None
    # dp x cp: context-parallel ranks see different tokens of the same sequences
    group = mesh.reduce_group() if shared_router and mesh.reduce_size > 1 else None
    pp_group = mesh.group("pp") if mesh.pp_size > 1 else None
    return MoEMonitor(model, group, model_cfg.moe_warn_ratio, model_cfg.moe_warn_steps, pp_group,
                      log_interval, last_step)


class MoEMonitor:
    def __init__(self, model: torch.nn.Module, group=None, warn_ratio: float = 3.0, warn_steps: int = 50,
                 pp_group=None, log_interval: int = 1, last_step: int = 0):
        self.layers = {_LAYER.search(name).group(1) if _LAYER.search(name) else name: m
                       for name, m in model.named_modules() if isinstance(m, MoEFeedForward)}
        self.group, self.warn_ratio, self.warn_steps = group, warn_ratio, warn_steps
        self.pp_group = pp_group  # pipeline stages: each holds its own layers
        self.log_interval, self.last_step = max(1, log_interval), last_step
        # the loads travel on the parameters' device (NCCL groups take no CPU tensors)
        self.device = next(iter(self.layers.values())).router.weight.device if self.layers else None
        self.speaks = group is None or dist.get_rank(group) == 0  # the warning once per dp group
        self.hot_steps: torch.Tensor | None = None  # per layer, steps in a row above warn_ratio (device)
        self.read_hot, self.read_step = [0] * len(self.layers), 0  # at the last read (host)

    def reads(self, step: int) -> bool:
        """Whether `step`'s metrics are read on the host (a log step)."""
        return step % self.log_interval == 0 or step == self.last_step

    def record(self, rec: dict) -> None:
        """The loop's after_step hook: at a log step, adds every MoE layer's metrics to the record."""
        mine = self.after_step(rec["step"])
        if not self.reads(rec["step"]):
            return
        if self.pp_group is not None:  # rank 0 writes the record: every stage's layers into it
            stages = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(stages, mine, group=self.pp_group)
            mine = {k: v for stage in stages for k, v in stage.items()}
        rec.update(sorted(mine.items(), key=lambda kv: _layer_order(kv[0])))

    def after_step(self, step: int) -> dict:
        """After an optimizer step: the loads summed (one all-reduce for every layer, on the
        device), the balancing biases' step (the same on every rank) and the hot-expert counters,
        all without reading a number on the host; at a log step, the step's metrics, read with
        one host copy ({} at other steps)."""
        if not self.layers:
            return {}
        loads = torch.stack([m.take_load().to(self.device) for m in self.layers.values()])
        if self.group is not None and dist.is_initialized():
            dist.all_reduce(loads, group=self.group)  # one collective for every layer
        tp_group = getattr(next(iter(self.layers.values())), "tp_token_group", None)
        if tp_group is not None:  # tensor parallel: each tp rank routed its own sequence shard
            dist.all_reduce(loads, group=tp_group)
        for moe, load in zip(self.layers.values(), loads):
            _bias_step(moe, load)
        mean = loads.float().mean(1).double()  # (an fp32 mean, as the records always had)
        max_mean = torch.where(mean > 0, loads.max(1).values.double() / mean, 0.0)
        hot = self.hot_steps if self.hot_steps is not None else torch.zeros_like(loads[:, 0])
        self.hot_steps = torch.where(max_mean > self.warn_ratio, hot + 1, 0)
        return self._read(step, loads, max_mean) if self.reads(step) else {}

    def _read(self, step: int, loads: torch.Tensor, max_mean: torch.Tensor) -> dict:
        """Every layer's numbers in one tensor, copied to the host once; the records and warnings."""
        nan = torch.full((), float("nan"), dtype=torch.float64, device=self.device)
        stats = [[max_mean[i], self.hot_steps[i].double(), _as_stat(moe.last_entropy, nan),
                  _as_stat(moe.last_aux_loss, nan), _bias_spread(moe, nan)]
                 for i, moe in enumerate(self.layers.values())]
        table = torch.cat([torch.stack([torch.stack(row) for row in stats]), loads.double()], 1).cpu()
        rec = {}
        for i, (name, row) in enumerate(zip(self.layers, table.numpy().tolist())):  # (on the host)
            ratio, hot, entropy, aux, spread, load = *row[:5], [int(n) for n in row[5:]]
            rec[f"moe.{name}.max_mean"], rec[f"moe.{name}.load"] = ratio, load
            for key, value in (("entropy", entropy), ("aux_loss", aux), ("bias_spread", spread)):
                if value == value:  # not NaN: the layer has this statistic
                    rec[f"moe.{name}.{key}"] = value
            self._watch(i, name, int(hot), ratio, step, load)
        self.read_step = step
        return rec

    def _watch(self, i: int, name: str, hot: int, ratio: float, step: int, load: list[int]) -> None:
        """Warn once per streak of warn_steps or more steps above warn_ratio (a streak that began
        since the last read has fewer steps than the last read's count plus the steps between)."""
        new_streak = hot < self.read_hot[i] + (step - self.read_step)
        if hot >= self.warn_steps and (new_streak or self.read_hot[i] < self.warn_steps) and self.speaks:
            log.warning(f"warning: step {step}: MoE layer {name}: expert {load.index(max(load))} has "
                        f"received more than {self.warn_ratio:g} x the mean load for {hot} steps "
                        f"(now {ratio:.1f} x); raise model.moe_aux_loss_coef or "
                        f"model.moe_bias_update_rate")
        self.read_hot[i] = hot


def _as_stat(value: torch.Tensor | None, missing: torch.Tensor) -> torch.Tensor:
    return missing if value is None else value.to(missing.device, torch.float64).reshape(())


def _bias_spread(moe: MoEFeedForward, missing: torch.Tensor) -> torch.Tensor:
    """max - min of the balancing bias (a collective under FSDP: its full tensor), or `missing`."""
    if moe.cfg.bias_update_rate <= 0:
        return missing
    bias = moe.router.bias.detach()
    bias = bias.full_tensor() if is_dtensor(bias) else bias
    return (bias.max() - bias.min()).to(missing.device, torch.float64)


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
