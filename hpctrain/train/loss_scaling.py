"""Dynamic loss scaling for train.precision = "fp16" (GPUs without bf16: V100, T4), agreed by all ranks.

Owns: torch.amp.GradScaler (the scale, its growth and backoff), one agreement per step on whether
any rank's gradients overflowed, and the count of overflow steps. fp16 gradients of small values
underflow to zero; the loss is multiplied by the scale before backward and the gradients divided by it
before clipping. When any gradient on any rank is Inf/NaN the step is skipped on EVERY rank and the
scale halves; after `growth_interval` clean steps it doubles. GradScaler decides from the gradients
each rank holds, and under FSDP, TP or PP each rank holds different ones: its per-rank verdict is
replaced by the MAX over the whole world (as torch's ShardedGradScaler does for FSDP1), so every rank
skips the same steps and keeps the same scale. Nothing here is read on the host during a step: the
overflow flag, the count and the scale stay device tensors (the loop reads them at log steps),
and the skip is the fused optimizer's `found_inf` (`step_unless`). State (`state_dict`) goes into checkpoints: an exact
resume continues with the same scale and growth counter.

It must never step or zero the optimizer except through GradScaler.step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.parallel.offload import flag_for_step


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """optimizer.step() unless `skip` (a 0-dim float32 tensor on the gradients' device, 1.0 =
    skip), decided on the device where the optimizer can: fused AdamW takes it as `found_inf` (the
    GradScaler protocol: the kernel leaves the weights and moments alone and its step counters are
    rolled back), so the host never reads the flag. Other optimizers (SGD): one host read."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.grad_scale, optimizer.found_inf = None, flag_for_step(optimizer, skip)
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    elif not skip.item():
        optimizer.step()


class LossScaling:
    def __init__(self, device: torch.device, init_scale: float, growth_interval: int, enabled: bool):
        self.enabled = enabled
        self.device = device  # where the overflow flag goes: NCCL refuses CPU tensors
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale,
                                           growth_interval=growth_interval, enabled=enabled)
        if enabled:  # creates the scale tensor on `device` (we multiply the loss ourselves)
            self.scaler.scale(torch.ones((), device=device))
        # on the device, read by the loop at its log steps (a host read per step stalls a GPU)
        self.overflow_count = torch.zeros((), dtype=torch.int64, device=device)  # steps skipped for overflow
        self.overflowed = torch.zeros((), dtype=torch.float32, device=device)  # the last step's flag

    @property
    def factor(self) -> torch.Tensor | float:
        """What the loss is multiplied by before backward this step: the scale as a 0-dim device
        tensor (a power of two), 1.0 when disabled."""
        return self.scaler._get_scale_async() if self.enabled else 1.0

    @property
    def overflow_steps(self) -> int:
        """Steps skipped because the scaled gradients overflowed (a host read)."""
        return int(self.overflow_count.item())

    def unscale_(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """Divide this rank's gradients by the scale; collective: a 0-dim device flag, 1.0 when any
        rank overflowed (None when disabled). Never read on the host."""
        if not self.enabled:
            return None
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
            f.copy_(flag.reshape(f.shape))
        self.overflowed = flag
        return flag

    def step(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
        """Optimizer step unless `skip` (a 0-dim float32 device flag: a bad step) or an overflow;
        then the scale's update (every step). Decided on the device (`step_unless`)."""
        if not self.enabled:
            step_unless(optimizer, skip)
            return
        step_unless(optimizer, torch.maximum(skip, self.overflowed))
        self.scaler.update()
        self.overflow_count += (self.overflowed > 0).to(torch.int64)

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "overflow_steps": self.overflow_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.enabled and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.overflow_count.fill_(int(state.get("overflow_steps", 0)))
