"""How long this rank waited for its peers during one step, so that busy = step time - wait is its
own work: the straggler detector's input (hpctrain/metrics/straggler.py).

Between `begin()` and `take()` (one optimizer step; validation and checkpoints fall outside) two
kinds of waiting are recorded:

  * a blocking collective, `with clock.blocked(): dist.all_reduce(...)` (the loss mean over dp, the
    dp gradient all-reduce after backward, the MPI gradient hook's Allreduce): its whole duration,
    i.e. waiting for the last peer to arrive plus the transfer;
  * DDP's asynchronous gradient reduction, whatever the comm hook (PowerSGD, the MPI hook) or
    none (DDP's own Gloo / NCCL all-reduce): the hook wrapper marks when this rank has handed a
    bucket over (`handed_over`), or without a hook an autograd callback marks the end of
    backward's compute, and the runner marks the end of backward (`backward_done`), where DDP waits
    for every bucket's reduction (hpctrain/parallel/mpi_grad_allreduce.py). From the last hand-over
    to the end of backward this rank has no gradient left to compute: that time is waiting (and
    the transfer). Work a hook chains onto its
    reduction's future (PowerSGD's orthogonalization and second matmul) also runs then and counts
    as waiting; it is the same on every rank, so it shifts all busy times alike.

On CUDA the marks are CUDA events on the current stream (the host runs ahead of the GPU, so host
clocks would measure kernel launches); they are read in `take()`, after the step has synchronized
the stream (`loss.item()`), so they add no synchronization. On CPU they are perf_counter() readings.
"""
from __future__ import annotations

import contextlib
import time

import torch


class WaitClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._spans: list[tuple] = []  # (start mark, end mark) of each wait this step
        self._handoff = None           # the last bucket hand-over not yet followed by backward_done
        self._armed = False

    def begin(self) -> None:
        """A step starts: forget anything recorded before."""
        self._spans, self._handoff, self._armed = [], None, True

    def take(self) -> float:
        """Seconds waited since `begin()`; stops recording until the next `begin()`."""
        total = sum(self._seconds(a, b) for a, b in self._spans)
        self._spans, self._handoff, self._armed = [], None, False
        return total

    @contextlib.contextmanager
    def blocked(self):
        """Around a blocking collective: its duration is waiting."""
        if not self._armed:
            yield
            return
        start = self._mark()
        try:
            yield
        finally:
            self._spans.append((start, self._mark()))

    def handed_over(self) -> None:
        """A DDP comm hook has taken a gradient bucket (called from the autograd thread)."""
        if self._armed:
            self._handoff = self._mark()

    def backward_done(self) -> None:
        """backward() returned (DDP has waited for its reductions): the time since the last
        hand-over was waiting. Nothing when no bucket was handed over (no_sync micro-batches)."""
        if self._armed and self._handoff is not None:
            self._spans.append((self._handoff, self._mark()))
            self._handoff = None

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()  # already done after the step's loss.item(): no wait in practice
            return start.elapsed_time(end) / 1000.0
        return end - start
