"""The bad-step policy: a NaN/Inf loss or gradient norm skips the optimizer step on every rank.

Owns the decision "is this step's update usable", agreed by all ranks with one MAX all-reduce of a
flag over the whole world (robust for any layout: under TP/PP/FSDP ranks may see different partial
losses or norms), the count of skipped steps, and stopping with a clear error after
`train.max_bad_steps` bad steps in a row (the caller must then not save: the newest checkpoint stays
the last good state). Also the test-only fault inject_nan_at_step (hpctrain/step_faults.py: NaN
loss on the last rank only, so agreement is what makes the other ranks skip too). And the check of
the weights a run starts from (init.from's, a resumed checkpoint's): `first_nonfinite`, agreed alike.

It must never step or zero the optimizer itself (the loop does), and never decide on one rank alone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.distributed.flight_recorder import RECORDER
from hpctrain.errors import TrainingDivergedError, UserError  # noqa: F401 - re-exported


class BadStepPolicy:
    def __init__(self, max_bad_steps: int, inject_nan_at_step: int, rank: int, world_size: int):
        self.max_bad = max_bad_steps
        self.inject_at = inject_nan_at_step
        self.poisoned_rank = world_size - 1
        self.rank = rank
        self.skipped = 0          # total skipped steps in this process's run (metrics: bad_steps)
        self.in_a_row = 0

    def poison(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """TEST ONLY: the loss of step `inject_nan_at_step` becomes NaN on the last rank."""
        if self.inject_at and step == self.inject_at and self.rank == self.poisoned_rank:
            return loss * float("nan")
        return loss

    def flag(self, loss: torch.Tensor, grad_norm: torch.Tensor | float, agreed: bool = False) -> torch.Tensor:
        """A 0-dim float32 flag on the loss's device: 1.0 when any rank saw a non-finite loss or
        grad norm for this step. Collective over the default group unless `agreed`: the loss and
        the norm are already the same on every rank (the all-reduced mean loss and the global norm
        of synchronized gradients, where a NaN on any rank reaches all), so every rank decides
        alike without a vote. Never read on the host (the optimizer skips on it: loss_scaling.py)."""
        loss = loss.detach().float().reshape(())
        norm = torch.as_tensor(grad_norm, dtype=torch.float32, device=loss.device).reshape(())
        flag = (~torch.isfinite(loss) | ~torch.isfinite(norm)).float()
        if not agreed and dist.is_available() and dist.is_initialized():
            with RECORDER.collective("finite_check", f"world({dist.get_world_size()})"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def record(self, step: int, bad: bool) -> bool:
        """Count step `step`'s verdict (read from its flag, in step order; the loop reads them at
        its log steps and before a save); raises TrainingDivergedError after max_bad_steps bad
        steps in a row."""
        if not bad:
            self.in_a_row = 0
            return False
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_bad:
            raise TrainingDivergedError(
                f"loss or gradient norm not finite for {self.in_a_row} steps in a row (steps "
                f"{step - self.in_a_row + 1}..{step}, train.max_bad_steps={self.max_bad}): stopping "
                f"without saving; the newest checkpoint is the last good state (lower train.lr, "
                f"check the data, or use train.precision=fp32)")
        return True

    def should_skip(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | float,
                    agreed: bool = False) -> bool:
        """`flag` read on the host and `record`ed at once: True if this step is skipped."""
        return self.record(step, bool(self.flag(loss, grad_norm, agreed).item() != 0))


def all_finite(params, device) -> bool:
    """Collective: every rank's parameters are finite (checked before a checkpoint is written).
    One host read: every tensor's isfinite().all() flag stacked on the device, one MIN all-reduce."""
    flags = [torch.isfinite((p.to_local() if hasattr(p, "to_local") else p).detach()).all() for p in params]
    ok = (torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device))
    ok = ok.to(device=device, dtype=torch.float32)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item() == 1)


def first_nonfinite(named: dict, device) -> str | None:
    """Collective over the default group (when there is one): the name of the first tensor of
    `named` (this rank's, by name; a DTensor: its local part) holding NaN or inf, on the lowest
    rank that has one; None when every rank's are finite. One pass and one host sync: every
    tensor's isfinite().all() flag stacked on the device, one MIN all-reduce of their AND; the
    names are gathered only when one is bad."""
    unique = {}
    for name, tensor in named.items():  # a tied weight once
        unique.setdefault(id(tensor), (name, tensor.to_local() if hasattr(tensor, "to_local") else tensor))
    names = [name for name, _ in unique.values()]
    flags = torch.stack([torch.isfinite(t.detach()).all() for _, t in unique.values()]) if unique \
        else torch.ones(1, dtype=torch.bool, device=device)
    ok = flags.all().to(torch.float32).to(device)
    collective = dist.is_available() and dist.is_initialized()
    if collective:
        with RECORDER.collective("finite_weights", f"world({dist.get_world_size()})"):
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() == 1:
        return None
    mine = None if bool(flags.all()) else names[flags.tolist().index(False)]
    if not collective:
        return mine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return next((name for name in every if name is not None), None)


def check_resumed_weights(model, device, path) -> None:
    """Collective, after a resume's load: UserError naming checkpoint `path`'s first model tensor
    holding NaN or inf (saves refuse such weights: this one was written elsewhere or edited)."""
    from hpctrain.parallel.meta_init import _held_params

    bad = first_nonfinite(_held_params(model), device)
    if bad is not None:
        raise UserError(f"checkpoint {path}: tensor 'model.{bad}' holds NaN or inf values; move "
                        f"{path} aside to resume from the checkpoint before it")
