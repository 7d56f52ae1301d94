"""The step engine: ONE optimizer step on any layout and precision, and nothing else.

    micro-batches -> forward/backward over them (the runner: a DDP/FSDP/TP loop or a pipeline
    schedule; under autocast, scaled by the fp16 loss scale) -> unscale (fp16: overflow agreed by
    every rank) -> clip (the global norm over shards and stages) -> the bad-step vote (a NaN/Inf
    loss or norm on any rank: every rank skips) -> optimizer step (or skip) -> zero_grad
    -> (loss, grad norm)

Owns the step's precision machinery (autocast, the fp16 loss scaling, the bad-step policy) and the
test-only faults inside a step (hpctrain/step_faults.py, from the run plan). It must never fetch
data, set the learning rate, know the sync mode's rounds or write metrics: the loop does
(hpctrain/train/loop.py).
"""
from __future__ import annotations

import contextlib
import time

import torch

from hpctrain.parallel import StepRunner
from hpctrain.step_faults import StepFaults
from hpctrain.train.bad_steps import BadStepPolicy
from hpctrain.train.loss_scaling import LossScaling
from hpctrain.train.precision import half_dtype


class StepEngine:
    def __init__(self, runner: StepRunner, optimizer: torch.optim.Optimizer, train, faults: StepFaults,
                 device: torch.device, rank: int, world_size: int, agreed: bool):
        """`train`: the resolved train section (run plan); `agreed`: gradients are synchronized
        every step, so the loss and the norm are already global (no bad-step vote needed)."""
        self.runner, self.optimizer, self.faults, self.rank = runner, optimizer, faults, rank
        self.agreed = agreed
        self.bad_steps = BadStepPolicy(train.max_bad_steps, faults.inject_nan_at_step, rank, world_size)
        half = half_dtype(train.precision)
        self.autocast = (torch.autocast(device.type, dtype=half) if half is not None
                         else contextlib.nullcontext())
        self.loss_scaling = LossScaling(device, train.loss_scale_init, train.loss_scale_growth_interval,
                                        enabled=train.precision == "fp16")
        self.skipped = None  # the last step's bad-step flag (a 0-dim device tensor, 1.0: skipped)

    def step(self, micro_batches, step: int, grad_clip: float, started: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Optimizer step number `step` (1-based) on `micro_batches`; (loss, grad norm) as 0-dim
        device tensors: nothing in a step is read on the host (the loop reads its log steps').
        `started`: perf_counter() when the step began (its batch fetch included)."""
        faults = self.faults
        if faults.delay_s and self.rank == faults.delay_rank:
            time.sleep(faults.delay_s)  # test-only straggler
        # forward/backward of every micro-batch in training mode; the loss is the mean over the
        # global batch; test-only NaN injection via the hook
        loss_avg = self.runner.forward_backward(micro_batches, self.autocast,
                                                loss_hook=lambda loss: self.bad_steps.poison(step, loss),
                                                loss_scale=self.loss_scaling.factor)
        overflow = self.loss_scaling.unscale_(self.optimizer)  # fp16: agreed by every rank
        grad_norm = self.runner.clip_grad_norm_(grad_clip)  # global norm over shards and stages
        # a NaN/Inf loss or grad norm on any rank: every rank skips the update; the loss is the
        # global mean and, where gradients are synchronized every step (all but DiLoCo's inner
        # steps), so is the norm: no vote needed then. An fp16 overflow is the loss scale's
        # business (skipped, counted apart), not a bad step
        voted_norm = grad_norm if overflow is None else torch.where(overflow > 0, 0.0, grad_norm)
        self.skipped = self.bad_steps.flag(loss_avg, voted_norm, agreed=self.agreed)
        self.loss_scaling.step(self.optimizer, skip=self.skipped)  # decided on the device
        self.optimizer.zero_grad(set_to_none=True)
        if faults.compute_sleep_s > 0:  # test-only: accelerator time on a shared CPU
            time.sleep(faults.compute_sleep_s)
        if faults.slow_factor > 1 and self.rank == faults.delay_rank:  # test-only: k x slower
            time.sleep((faults.slow_factor - 1.0) * (time.perf_counter() - started))
        return loss_avg.detach(), grad_norm

    @torch.no_grad()
    def eval_loss(self, batches) -> torch.Tensor:
        """This replica's mean loss over `batches` in evaluation mode, in the step's precision."""
        return self.runner.eval_loss(batches, self.autocast)
