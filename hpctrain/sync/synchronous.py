"""sync.mode = "sync": the layout averages gradients over data-parallel ranks every step, so this
strategy has nothing to do between steps; it says what a checkpoint holds and what was sent.
"""
from __future__ import annotations

from hpctrain.plan.wire import bytes_sent
from hpctrain.sync.strategy import SyncStrategy, refuse_other_mode


class Synchronous(SyncStrategy):
    mode = "sync"

    def __init__(self, local_numel: int, dp_size: int, grad_allreduce: str):
        self.local_numel, self.dp_size, self.grad_allreduce = local_numel, dp_size, grad_allreduce

    def checkpoint_states(self, saved: dict | None = None) -> dict:
        if saved is not None:
            refuse_other_mode(saved, self.mode, "resume it with that mode, or export its global "
                                                "model with `hpctrain export`")
        return super().checkpoint_states(saved)

    def describe(self) -> str:
        return f", sync every step (gradient all-reduce {self.grad_allreduce} over dp={self.dp_size})"

    def comm_bytes(self, step: int) -> int:
        """Bytes this rank has sent: one fp32 gradient all-reduce per step (-1: PowerSGD, which
        depends on its rank and error feedback)."""
        if self.grad_allreduce == "powersgd":
            return -1
        return step * bytes_sent(self.local_numel, self.dp_size, "none")
