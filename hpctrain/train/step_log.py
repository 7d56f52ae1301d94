"""The loop's per-step records, read from the device once per log interval.

A step's loss, gradient norm, loss scale and bad-step flag are 0-dim tensors on the compute device;
on a GPU each `.item()` would stall the host until the stream drains, every step. The loop hands
each step's record here (`add`) and they wait, tensors and all, until a log step, the run's end, a
save or a snapshot (`flush`), or until the oldest has waited HPCTRAIN_METRICS_FLUSH_S seconds
(default 1: metrics.jsonl stays at most about a second behind for whoever watches it, at the cost
of at most one read a second where steps are fast, one per step where they are slower): then one stacked device-to-host copy reads every pending number, and
in step order each record gets its Python numbers, the bad-step verdict is counted (BadStepPolicy:
after train.max_bad_steps in a row it raises, before that step's record is written), the progress
line of a log step is printed, and the record goes to metrics.jsonl.

Owns: holding records until a flush and what happens to them then. It must never run a step,
decide when a run saves or stops, or write a record out of step order.
"""
from __future__ import annotations

import os
import time

import torch

from hpctrain import logs
from hpctrain.metrics import format_eta

# what a record's tensor becomes on the host (everything else: float)
CASTS = {"overflow": bool, "overflow_steps": int, "skipped": bool}
FLUSH_ENV = "HPCTRAIN_METRICS_FLUSH_S"  # the longest a record waits (seconds; default 1)


def read_records(records: list[dict]) -> None:
    """Every tensor value of `records` replaced by its Python number, in one host read."""
    slots = [(rec, key) for rec in records for key, v in rec.items() if isinstance(v, torch.Tensor)]
    if not slots:
        return
    values = torch.stack([rec[key].detach().reshape(()).to(torch.float64) for rec, key in slots]).tolist()
    for (rec, key), value in zip(slots, values):
        rec[key] = CASTS.get(key, float)(value)


class StepLog:
    def __init__(self, ctx, metrics, bad_steps, train, end: int, started: tuple[float, int]):
        """`train`: the config's train section (log_interval, max_bad_steps); `end`: the last step
        of this run; `started`: (perf_counter, step) where this run's steps began (the ETA)."""
        self.ctx, self.metrics, self.bad_steps, self.train, self.end = ctx, metrics, bad_steps, train, end
        self.t_start, self.start_step = started
        self.pending: list[dict] = []
        self.max_wait_s, self.oldest = float(os.environ.get(FLUSH_ENV) or 1.0), None

    def add(self, rec: dict) -> None:
        """A step's record; flushed at once on a log step, the run's last step, or when the oldest
        pending one has waited max_wait_s."""
        now = time.monotonic()
        self.pending.append(rec)
        self.oldest = now if self.oldest is None else self.oldest
        step = rec["step"]
        if step % self.train.log_interval == 0 or step >= self.end or now - self.oldest >= self.max_wait_s:
            self.flush()

    def write(self, rec: dict) -> None:
        """A record of host numbers (validation, a meeting) after the pending ones."""
        self.flush()
        self.metrics.write(rec)

    def flush(self) -> None:
        records, self.pending, self.oldest = self.pending, [], None
        read_records(records)
        for rec in records:
            self._count_bad_step(rec)  # raises after max_bad_steps in a row: that record unwritten
            if self.ctx.is_main and (rec["step"] % self.train.log_interval == 0 or rec["step"] == self.end):
                self._progress_line(rec)
            self.metrics.write(rec)

    def _count_bad_step(self, rec: dict) -> None:
        """The step's bad-step verdict into the policy's counts; the record keeps `skipped` and
        `bad_steps` only once a step was skipped (as it always did)."""
        skipped = rec.get("skipped", False)
        self.bad_steps.record(rec["step"], skipped)
        if not (skipped or self.bad_steps.skipped):
            rec.pop("skipped", None), rec.pop("bad_steps", None)
            return
        rec["bad_steps"] = self.bad_steps.skipped
        if skipped and self.ctx.is_main:
            logs.info(f"step {rec['step']}: loss {rec['loss']} / grad norm {rec['grad_norm']}: not "
                      f"finite, update skipped ({self.bad_steps.in_a_row} in a row, "
                      f"train.max_bad_steps={self.train.max_bad_steps})")

    def _progress_line(self, rec: dict) -> None:
        step = rec["step"]
        done = max(1, step - self.start_step)
        eta = (time.perf_counter() - self.t_start) / done * (self.end - step)
        val_txt = f" val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
        val_txt += "".join(f" {key[:-len('/loss')]} {value:.4f}" for key, value in rec.items()
                           if key.startswith("eval/") and key.endswith("/loss"))  # [[eval]] sets
        mfu = rec.get("mfu")
        logs.info(f"step {step}/{self.end} loss {rec['loss']:.4f}{val_txt} lr {rec['lr']:.2e} "
                  f"{rec['tokens_per_s']:,.0f} tok/s mfu {'n/a' if mfu is None else f'{mfu:.1%}'} "
                  f"eta {format_eta(eta)}")
