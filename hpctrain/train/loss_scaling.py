"""Dynamic loss scaling for train.precision = "fp16" (GPUs without bf16: V100, T4), agreed by all ranks.

Owns: torch.amp.GradScaler (the scale, its growth and backoff), one agreement per step on whether
any rank's gradients overflowed, and the count of overflow steps. fp16 gradients of small values
underflow to zero; the loss is multiplied by the scale before backward and the gradients divided by it
before clipping. When any gradient on any rank is Inf/NaN the step is skipped on EVERY rank and the
scale halves; after `growth_interval` clean steps it doubles. GradScaler decides from the gradients
each rank holds, and under FSDP, TP or PP each rank holds different ones: its per-rank verdict is
replaced by the MAX over the whole world (as torch's ShardedGradScaler does for FSDP1), so every rank
skips the same steps and keeps the same scale. State (`state_dict`) goes into checkpoints: an exact
resume continues with the same scale and growth counter.

It must never step or zero the optimizer except through GradScaler.step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class LossScaling:
    def __init__(self, device: torch.device, init_scale: float, growth_interval: int, enabled: bool):
        self.enabled = enabled
        self.device = device  # where the overflow flag goes: NCCL refuses CPU tensors
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale,
                                           growth_interval=growth_interval, enabled=enabled)
        if enabled:  # creates the scale tensor on `device` (we multiply the loss ourselves)
            self.scaler.scale(torch.ones((), device=device))
        self.overflow_steps = 0  # steps skipped because the scaled gradients overflowed
        self.last_overflowed = False

    @property
    def factor(self) -> float:
        """What the loss is multiplied by before backward this step (1.0 when disabled)."""
        return float(self.scaler.get_scale()) if self.enabled else 1.0

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide this rank's gradients by the scale; collective: True when any rank overflowed."""
        if not self.enabled:
            return False
        self.scaler.unscale_(optimizer)
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        # on this rank's device even where it holds no gradients (found is empty): a CPU flag
        # in the default group's all-reduce stops a NCCL job ("No backend type ... cpu")
        flag = torch.zeros((), dtype=torch.float32, device=self.device)
        for f in found.values():
            flag = torch.maximum(flag, f.detach().float().to(self.device).reshape(()))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        for f in found.values():  # every rank now skips (or takes) the same step
            f.fill_(float(flag.item()))
        self.last_overflowed = bool(flag.item() > 0)
        return self.last_overflowed

    def step(self, optimizer: torch.optim.Optimizer, skip: bool) -> None:
        """Optimizer step unless `skip` or an overflow; then the scale's update (every step)."""
        if not self.enabled:
            if not skip:
                optimizer.step()
            return
        if not skip:
            self.scaler.step(optimizer)  # skips by itself on the agreed overflow
        self.scaler.update()
        self.overflow_steps += int(self.last_overflowed)

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "overflow_steps": self.overflow_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.enabled and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.overflow_steps = int(state.get("overflow_steps", 0))
