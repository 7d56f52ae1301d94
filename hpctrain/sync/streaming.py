"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): DiLoCo whose model is split into P
fragments of transformer blocks taken with a stride (fragment p = blocks p, p + P, p + 2P, ...: the
paper's "strided" pattern, which it prefers to contiguous blocks), fragment p synchronized every H
inner steps at its own offset p * H // P, its all-reduce overlapped with the next tau inner steps
and then mixed in.

Owns: the split by blocks, the per-fragment arrival schedule (sent at step t, merged after inner
step t + tau), the mixing, and the record of what was synced at each step. Everything else (the
anchor, the outer Nesterov step, compression, checkpoints) is DiLoCo's (hpctrain/sync/diloco.py).

Round of fragment p after inner step t (t % H == p * H // P), with the global fragment g_p:
    delta    = g_p - local_p                        (measured from the global fragment)
    avg      = mean over replicas of delta          (compress.average: fp32 | bf16 | int8 | int4)
without sync.overlap:  g_p <- OuterOpt(g_p, avg);  local_p <- g_p           (plain DiLoCo's round)
with sync.overlap:     the average runs in the background; after inner step t + tau
                       (sync.overlap_steps) g_p <- OuterOpt(g_p, avg) and
                       local_p <- alpha * local_p + (1 - alpha) * g_p       (sync.mix_alpha)
so the tau inner steps taken meanwhile are kept in part. tau <= H // P (config rule): a fragment's
average arrives before the next fragment is sent, so at most one is in flight at any step. The last
step merges what is in flight, then flushes every fragment synchronously (as DiLoCo). Embeddings
(parameters before the first block) go with block 0's fragment, the final norm / head with the last
block's; P = 1 without overlap is plain DiLoCo, bit for bit.

Checked against an open implementation, pytorch/torchft torchft/local_sgd.py (class DiLoCo and
_StreamingDiLoCoFragment, 2025): the pseudo-gradient is the saved global fragment minus the local
one (`_save_grads`), sent tau = `fragment_sync_delay` steps before it is applied (`prepare_sync`
at local step H/P - tau, `perform_sync` at H/P: the same schedule as ours shifted by tau); the
outer optimizer (Nesterov SGD, one per fragment or shared: per parameter state either way, as our
momentum is) steps the restored global fragment, which is saved as the next reference, and the
local fragment is merged by `global.lerp_(local, alpha)` = alpha * local + (1 - alpha) * global
(`fragment_update_alpha`; torchft defaults to 0, the paper uses 0.5, our sync.mix_alpha default).
torchft leaves the split to the caller (`model_fragments`); the fragment pattern follows the paper.

Error feedback (sync.error_feedback, int8 / int4): each replica keeps, per parameter, what its
codes left out of its pseudo-gradient (e_sent) and of the chunk average it re-encodes (e_owned;
compress.average) and adds them to the fragment's next round, so the quantization error of 4-bit
codes does not pile up round after round. Both are replica state (checkpointed beside "start").
"""
from __future__ import annotations

import re
import time

import torch

from hpctrain.distributed.flight_recorder import RECORDER
from hpctrain.errors import ConfigError
from hpctrain.plan.wire import bytes_sent
from hpctrain.sync.compress import average
from hpctrain.sync.diloco import DiLoCo, _local, split_fragments

_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def block_fragments(names: list[str], sizes: list[int], n: int, n_layer: int) -> list[list[int]]:
    """n groups of parameter indices, strided: group f holds blocks f, f + n, f + 2n, ... (global
    block indices: a pipeline stage keeps its blocks' names, so a fragment is the same layers on
    every stage and syncs at the same step); parameters before the first block join block 0's
    group, the rest outside blocks the last block's ((n_layer - 1) % n). Groups may be empty (a
    stage without any of a fragment's blocks: it never syncs there). Without any block:
    split_fragments by size."""
    ids = [int(m.group(1)) if (m := _BLOCK.search(name)) else None for name in names]
    blocks = sorted({b for b in ids if b is not None})
    if not blocks:
        return split_fragments(sizes, n)
    last = (max(n_layer, blocks[-1] + 1) - 1) % n
    groups, seen_block = [[] for _ in range(n)], False
    for i, b in enumerate(ids):
        seen_block = seen_block or b is not None
        groups[b % n if b is not None else (last if seen_block else 0)].append(i)
    return groups


class StreamingDiLoCo(DiLoCo):
    """The sync strategy of sync.mode = "diloco" with sync.streaming = true."""
    streaming = True

    def __init__(self, module, mesh, cfg, total_steps: int, n_layer: int):
        super().__init__(module, mesh, cfg, total_steps)
        self.start = self.anchor  # every delta is measured from the global fragment
        names = [n for n, _ in module.named_parameters()]
        self.fragments = block_fragments(names, [_local(p).numel() for p in self.params],
                                         cfg.fragments, n_layer)
        self.offsets = [f * cfg.inner_steps // cfg.fragments for f in range(cfg.fragments)]
        self.has_pending = [False] * cfg.fragments
        self.inflight = [None] * cfg.fragments
        self.arrive_at: list[int | None] = [None] * cfg.fragments  # step after which f merges
        self.step = 0
        self.synced_now: list[int] = []  # fragments sent at the current step (step_metrics)
        with torch.no_grad():  # error feedback: per parameter, e_sent and e_owned (docstring)
            self.residuals = [[torch.zeros_like(p) for p in self.params] for _ in range(2)] \
                if cfg.error_feedback else []
        self.sending: list[tuple | None] = [None] * cfg.fragments  # flat residuals in flight
        self.sent_now = 0  # the fragment of the synchronous round under way (_average)

    def after_step(self, step: int) -> None:
        self.step, self.synced_now, final = step, [], step >= self.total_steps
        for f, at in enumerate(self.arrive_at):
            if at is not None and (final or step >= at):
                self._merge(f)
        for f in self.due(step):
            self._round(f, flush=final)

    @torch.no_grad()
    def _round(self, f: int, flush: bool) -> None:
        idx = self.fragments[f]
        if not idx:  # fewer blocks on this rank (pipeline stage) than fragments: nothing to send,
            if self.cfg.overlap and not flush:  # but the schedule's state (saved from rank 0's
                self.has_pending[f] = True  # stage) stays the same on every stage: an empty
                self.arrive_at[f] = self.step + self.cfg.overlap_steps  # average "in flight"
            return
        self.synced_now.append(f)
        self.sending[f] = self._flat_residuals(idx)
        if flush or not self.cfg.overlap:
            self.sent_now = f  # plain DiLoCo's synchronous round (its _average: this fragment's)
            super()._round(f, flush=True)
            return self._keep_residuals(f)
        delta = torch.cat([(_local(self.anchor[i]) - _local(self.params[i])).flatten().float()
                           for i in idx])
        self._count(delta)
        self.inflight[f] = self.pool.submit(self._average, self._to_wire(delta), self.sending[f])
        self.arrive_at[f] = self.step + self.cfg.overlap_steps

    def _average(self, delta: torch.Tensor, feedback: tuple | None = None) -> torch.Tensor:
        """The replicas' mean of a fragment's pseudo-gradient; with error feedback its flat
        residuals (passed by the pool's caller, else the synchronous round's fragment's)."""
        if feedback is None and self.cfg.error_feedback:
            feedback = self.sending[self.sent_now]
        return average(delta, self.group, self.cfg.compression, self.cfg.int8_block, feedback)

    def _flat_residuals(self, idx: list[int]) -> tuple | None:
        """Fragment idx's residuals as flat fp32 tensors on the average's device (updated there)."""
        if not self.residuals:
            return None
        return tuple(self._to_wire(torch.cat([_local(r[i]).flatten().float() for i in idx]))
                     for r in self.residuals)

    @torch.no_grad()
    def _keep_residuals(self, f: int) -> None:
        """After fragment f's average is done: its updated flat residuals back into the parameters'
        (on the main thread: the pool thread runs no CUDA work)."""
        flats, self.sending[f] = self.sending[f], None
        for r, flat in zip(self.residuals, flats or ()):
            for i, v in zip(self.fragments[f], self._unflatten(self.fragments[f], flat)):
                _local(r[i]).copy_(v)

    def _count(self, delta: torch.Tensor) -> None:
        self.bytes_sent += bytes_sent(delta.numel(), self.replicas, self.cfg.compression,
                                      self.cfg.int8_block)
        self.syncs += 1
        if self.is_main:
            # on the device: read only when round_line prints it (a host read per round otherwise)
            self.round_log = {"norm": delta.norm(), "wait_s": self.round_log.get("wait_s", 0.0)}

    @torch.no_grad()
    def _merge(self, f: int) -> None:
        """Fragment f's average has arrived (waits if not): the outer step on the global fragment,
        then the local fragment mixed with it."""
        t0 = time.perf_counter()
        with RECORDER.collective("diloco_round_wait (average in flight)", f"dp({self.replicas})"):
            self._resolve(f)
        self._waited(t0)
        self._keep_residuals(f)
        idx, alpha = self.fragments[f], self.cfg.mix_alpha
        if self.has_pending[f]:
            self._outer_step(idx, [_local(self.pending[i]) for i in idx])
            for i in idx:
                _local(self.params[i]).mul_(alpha).add_(_local(self.anchor[i]), alpha=1 - alpha)
        self.has_pending[f], self.arrive_at[f] = False, None

    def step_metrics(self) -> dict:
        return {"synced_fragments": list(self.synced_now)} if self.synced_now else {}

    def describe(self) -> str:
        c = self.cfg
        tail = f" tau={c.overlap_steps} alpha={c.mix_alpha:g}" if c.overlap else ""
        tail += " error feedback" if self.residuals else ""
        return super().describe() + f" streaming (fragments by blocks{tail})"

    def state_dict(self) -> dict:
        state = super().state_dict()  # waits for the averages in flight: their residuals are final
        for f in range(len(self.fragments)):
            self._keep_residuals(f)
        if self.residuals:
            replica = state["replica"][str(self.replica)]
            replica["e_sent"], replica["e_owned"] = (self._by_name(r, replica["model"])
                                                     for r in self.residuals)
        return {**state, "streaming": True, "arrive_at": list(self.arrive_at),
                "error_feedback": bool(self.residuals)}

    def _check_saved(self, saved: dict) -> None:
        super()._check_saved(saved)
        if bool(saved.get("error_feedback")) != bool(self.residuals):  # its residuals: there or not
            raise ConfigError(f"config key 'sync.error_feedback': {str(bool(self.residuals)).lower()}, "
                              f"but the checkpoint was written with {str(not self.residuals).lower()}; "
                              f"keep it for the run's lifetime")

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.arrive_at = list(state["arrive_at"])
