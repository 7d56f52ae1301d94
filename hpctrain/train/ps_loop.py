"""Asynchronous SGD against parameter servers (sync.mode = "ps").

config -> data -> model (same init everywhere) -> parameters into the servers' MPI windows ->
each worker loop { wait while > sync.staleness steps ahead of the slowest worker -> pull ->
forward/backward of its share of the step's batch -> its own optimizer step -> push the change
(new - pulled) -> advance its clock -> stop flag? } -> at checkpoint steps (or an agreed stop)
all ranks meet, pull and save -> final validation on the pulled parameters -> teardown.

Preemption (a Slurm signal or the wall-time guard, see hpctrain/distributed/preempt.py) cannot use the
lockstep trainer's per-step all-reduce: workers are at different steps and servers sit in MPI
waiting. Any rank with a reason raises the stop flag in the clock window; a worker sees it at its
next step boundary (or while waiting for a straggler) and goes to the meeting; the servers check
their own signals while they wait there. The meeting (one all-reduce MAX of (step, reason)) gives
the stop step: the furthest worker's step, never past the next regular checkpoint; the others
catch up to it, all save, and exit with EXIT_PREEMPTED like any run.

Owns: the worker/server roles and the order above. Workers take the same data a data-parallel run
would (step s, dp index = worker index), so 1 worker with staleness 0 is plain SGD. Layouts (tp/pp/
fsdp) do not apply: each worker holds one whole model. Mid-run validation is off (workers are at
different steps); the final model is evaluated and saved like any run (sample/export work).
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from hpctrain.checkpoint import CheckpointManager
from hpctrain.config import Config
from hpctrain.config_rules import global_batch_line, resolve_grad_accum
from hpctrain.distributed import DistContext
from hpctrain.distributed.preempt import NONE, PreemptionGuard
from hpctrain.errors import ConfigError
from hpctrain.metrics import MetricsLog
from hpctrain.model import GPT, GPTConfig
from hpctrain.parallel import lm_loss
from hpctrain.sync.param_server import ParameterServer
from hpctrain.train.data import TrainData
from hpctrain.train.optim import build_optimizer, lr_at, set_lr

_SD = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class WorkerLayout:
    """Where a rank sits in the data order: workers are the dp ranks (servers read no batches)."""
    dp_rank: int
    dp_size: int


def _flat(params) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in params]).numpy()


def _assign(params, flat: np.ndarray) -> None:
    """Copy into the parameters (vector_to_parameters would alias them to `flat`)."""
    src, at = torch.from_numpy(flat), 0
    with torch.no_grad():
        for p in params:
            p.copy_(src[at:at + p.numel()].view_as(p))
            at += p.numel()


class PSTrainer:
    def __init__(self, cfg: Config, ctx: DistContext):
        self.cfg, self.ctx, t, s = cfg, ctx, cfg.train, cfg.sync
        if ctx.device.type != "cpu":
            raise ConfigError("config key 'sync.mode': 'ps' keeps parameters in host memory (MPI "
                              "windows); use it on CPU ranks, or diloco on GPUs")
        self.n_workers = ctx.world_size - s.ps_servers
        if self.n_workers < 1:
            raise ConfigError(f"config key 'sync.ps_servers': {s.ps_servers} servers leave no worker "
                              f"among {ctx.world_size} ranks (run more ranks)")
        self.is_server = ctx.rank >= self.n_workers
        if cfg.data.cache_dir != "off":  # the cache's leader paces staging by lockstep steps
            cfg.data.cache_dir = "off"
        t.grad_accum = resolve_grad_accum(t, self.n_workers)  # the workers are the dp ranks
        self.data = TrainData(cfg, ctx, WorkerLayout(0 if self.is_server else ctx.rank, self.n_workers))
        torch.manual_seed(t.seed)
        m = cfg.model
        self.model = GPT(GPTConfig(**asdict(m)))
        self.params = list(self.model.parameters())
        self.optimizer = build_optimizer(self.model, t)
        self.ps = ParameterServer(ctx.comm, _flat(self.params), s.ps_servers)
        self.workers = ctx.comm.Split(0 if not self.is_server else 1, ctx.rank)
        self.ckpt = CheckpointManager(cfg.checkpoint_dir, cfg.checkpoint.keep, ctx.rank, ctx.world_size,
                                      timeout_s=cfg.dist.timeout_s,
                                      async_cpu_share=cfg.checkpoint.async_cpu_share)
        self.preempt = PreemptionGuard(cfg.slurm, ctx.comm, ctx.rank,  # signals + wall-time guard
                                       step_sleep_s=cfg.debug.step_sleep_s)
        self._raised = NONE
        self.step = 0

    # ---- checkpoints: every rank takes part; workers' optimizer states are kept per worker -------
    def _state(self) -> dict:
        model, optim = get_state_dict(self.model, self.optimizer, options=_SD)
        state = {"model": model}
        if not self.is_server:
            tensors = {k: v for k, v in optim.items() if isinstance(v, torch.Tensor)}
            state["replica"] = {str(self.ctx.rank): {"optim": tensors}}
        return state

    def _save(self) -> None:
        """Collective at a step every worker has finished: pull the servers' parameters, save."""
        self.ctx.comm.Barrier()  # every worker's pushes up to this step are complete
        self._pull()
        # Passive-target RMA completes only while the target polls MPI: servers wait in this MPI
        # barrier (not in a Gloo collective below) until every rank's pull is done.
        self.ctx.comm.Barrier()
        extra = {"step": self.step, "sampler": self.data.sampler.state_dict(), "rng": [],
                 "world_size": self.ctx.world_size, "config": self.cfg.to_dict(),
                 "tokenizer": self.data.tokenizer_info,
                 "sync": {"mode": "ps", "workers": self.n_workers, "bytes_moved": self.ps.bytes_moved}}
        path = self.ckpt.save(self.step, self._state(), extra)
        if self.ctx.is_main:
            print(f"checkpoint: step {self.step} -> {path}", file=sys.stderr, flush=True)
        self.ctx.comm.Barrier()  # nobody pushes before everybody has read the saved parameters

    def _resume(self) -> None:
        """Resume from the newest checkpoint that loads (older ones are tried when it does not)."""
        self.ckpt.resume_newest(self._resume_from)

    def _resume_from(self, path) -> None:
        state = self._state()
        extra = self.ckpt.load(path, state)
        sync = extra.get("sync", {})
        if sync.get("mode") != "ps" or sync.get("workers") != self.n_workers:
            raise ConfigError(f"config key 'sync.mode': checkpoint {path} was not written by "
                              f"sync.mode='ps' with {self.n_workers} workers; use a new run.dir")
        _, optim = get_state_dict(self.model, self.optimizer, options=_SD)
        if not self.is_server:
            optim.update(state["replica"][str(self.ctx.rank)]["optim"])
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=optim, options=_SD)
        if self.is_server:  # the saved parameters (and every worker's clock) back into my windows
            lo, hi = self.ps.bounds[self.ps.servers.index(self.ctx.rank)]
            self.ps.memory[:] = _flat(self.params)[lo:hi]
            if self.ps.clock_memory is not None:
                self.ps.reset_clocks(int(extra["step"]))
        self.step = int(extra["step"])
        self.data.sampler.load_state_dict(extra["sampler"])
        self.ps.bytes_moved = int(sync["bytes_moved"])
        self.ctx.comm.Barrier()  # windows restored before any worker pulls
        if self.ctx.is_main:
            print(f"resumed from {path} at step {self.step}", file=sys.stderr, flush=True)

    def _pull(self) -> None:
        flat = np.empty(self.ps.n, dtype=np.float32)
        self.ps.pull(flat)
        _assign(self.params, flat)

    # ---- the loop -----------------------------------------------------------------------------
    def fit(self) -> int:
        cfg, t = self.cfg, self.cfg.train
        self._resume()
        end = t.stop_at_step or t.steps
        saves = [s for s in range(self.step + 1, end + 1) if s % cfg.checkpoint.interval == 0 or s == end]
        metrics = MetricsLog(Path(cfg.run.dir) / "metrics.jsonl", self.ctx.is_main, resume_step=self.step)
        if self.ctx.is_main:
            print(f"training (ps): {self.n_workers} workers, {cfg.sync.ps_servers} servers, "
                  f"staleness {cfg.sync.staleness}, steps {self.step} -> {end}", file=sys.stderr, flush=True)
            if t.global_batch:
                print(global_batch_line(t, self.n_workers), file=sys.stderr, flush=True)
        for save_at in saves:
            step, stop = self._run_to(save_at, metrics) if not self.is_server else (-1, NONE)
            step, stop = self._meet(step, stop)
            stop = stop if step < end else NONE  # a stop raised at the last step: just finish
            if stop != NONE and not self.is_server:
                while self.step < step:  # catch up with the furthest worker (no stop checks now)
                    metrics.write(self._worker_step(stop_aware=False))
            self.step = step
            self.preempt.agreed(stop, step)
            self._save()
            if stop != NONE:
                metrics.close()
                self.ps.free()
                return self.preempt.finish(self.step)  # requeue the Slurm job and/or exit 75
        val = self._evaluate()
        if val is not None:
            metrics.write({"step": self.step, "val_loss": val})
            if self.ctx.is_main:
                print(f"step {self.step} val {val:.4f}", file=sys.stderr, flush=True)
        metrics.close()
        self.ps.free()
        return 0

    # ---- stopping early --------------------------------------------------------------------------
    def _raise_if_mine(self) -> None:
        """Raise the stop flag if this rank has a reason to stop (once per reason)."""
        mine = self.preempt.local_reason()
        if mine > self._raised:
            self.ps.raise_stop(mine)
            self._raised = mine

    def _stop_flag(self) -> int:
        self._raise_if_mine()
        return self.ps.stop_flag()

    def _run_to(self, save_at: int, metrics) -> tuple[int, int]:
        """Worker: step up to `save_at` unless the stop flag goes up first. (step, flag)."""
        while self.step < save_at:
            rec = self._worker_step(stop_aware=True)
            if rec is None:  # the flag went up while this worker waited for a straggler
                break
            metrics.write(rec)
            self.preempt.debug_sleep()
            if self._stop_flag() != NONE:
                break
        return self.step, self._stop_flag()

    def _meet(self, step: int, stop: int) -> tuple[int, int]:
        """All ranks: (the furthest worker's step, the highest stop reason). Non-blocking, so a
        server (here for a whole checkpoint interval) raises the flag on its own signals, and
        polling keeps the workers' one-sided operations on its windows progressing."""
        from mpi4py import MPI

        send, got = np.array([step, stop], dtype=np.int64), np.empty(2, dtype=np.int64)
        req = self.ctx.comm.Iallreduce(send, got, op=MPI.MAX)
        while not req.Test():
            if self.is_server:
                self._raise_if_mine()
            time.sleep(0)  # yield the core: ranks may be oversubscribed
        return int(got[0]), int(got[1])

    def _worker_step(self, stop_aware: bool) -> dict | None:
        t, worker = self.cfg.train, self.ctx.rank
        t0 = time.perf_counter()
        lag, stop = self.ps.wait_within(self.step, self.cfg.sync.staleness, stop_aware=stop_aware)
        if stop != NONE:
            return None
        pulled = np.empty(self.ps.n, dtype=np.float32)
        self.ps.pull(pulled)
        _assign(self.params, pulled)
        batches = self.data.next_train_micro_batches()
        if self.cfg.debug.delay_s and worker == self.cfg.debug.delay_rank:
            time.sleep(self.cfg.debug.delay_s)  # test-only straggler
        lr = lr_at(self.step, t)
        set_lr(self.optimizer, lr)
        self.model.train()
        total = 0.0
        for tokens in batches:
            loss = lm_loss(self.model(tokens[:, :-1]), tokens[:, 1:])
            (loss / len(batches)).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip) if t.grad_clip > 0 else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ps.push(_flat(self.params) - pulled)
        self.step += 1
        self.ps.set_clock(worker, self.step)
        dt = time.perf_counter() - t0
        tokens_per_step = self.data.global_batch * self.cfg.model.block_size
        rec = {"step": self.step, "loss": total / len(batches), "lr": lr, "staleness": lag,
               "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
               "comm_bytes": self.ps.bytes_moved}
        if norm is not None:
            rec["grad_norm"] = float(norm)
        if self.ctx.is_main and (self.step % t.log_interval == 0):
            print(f"step {self.step} loss {rec['loss']:.4f} lr {lr:.2e} staleness {lag}",
                  file=sys.stderr, flush=True)
        return rec

    @torch.no_grad()
    def _evaluate(self) -> float | None:
        """Validation loss of the final parameters (pulled by `_save`), averaged over workers."""
        batches = self.data.val_micro_batches() if not self.is_server else None
        if self.is_server:
            return None
        if batches is None:
            return None
        self.model.eval()
        local = sum(lm_loss(self.model(b[:, :-1]), b[:, 1:]).item() for b in batches) / len(batches)
        return self.workers.allreduce(local) / self.workers.size


def train_ps(cfg: Config, ctx: DistContext) -> int:
    return PSTrainer(cfg, ctx).fit()
