"""The training loop. It reads like the algorithm:

config -> bootstrap -> mesh -> data -> model, parallelized from outside -> resume if a committed
checkpoint exists -> loop { batch -> forward/backward over micro-batches -> clip -> step -> metrics ->
maybe validate -> maybe checkpoint -> maybe stop } -> final checkpoint -> teardown.

Owns: the order of those steps and the trainer state that goes into a checkpoint (step, sampler
position, RNG). It must never parse MPI/Slurm environment (bootstrap does), build parallel wrappers
(parallelize does) or write checkpoint files itself (the checkpoint manager does).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpctrain import config as config_mod
from hpctrain.checkpoint import CheckpointManager
from hpctrain.config import Config
from hpctrain.config_rules import check_resume_batch, global_batch_line, resolve_grad_accum
from hpctrain.distributed import DistContext
from hpctrain.distributed.bootstrap import mpi_library
from hpctrain.distributed.preempt import PreemptionGuard
from hpctrain.distributed.mesh import Mesh, ParallelDims
from hpctrain.distributed.watchdog import guard as peer_watchdog
from hpctrain.errors import ConfigError
from hpctrain.metrics import MetricsLog, format_eta, measure_peak_flops
from hpctrain.metrics.straggler import StragglerDetector
from hpctrain.model import GPT, GPTConfig
from hpctrain.parallel import build_runner, checkpoint_state, load_checkpoint_state, parallelize
from hpctrain.sync.compress import bytes_sent
from hpctrain.sync.diloco import DiLoCo
from hpctrain.train import rng
from hpctrain.train import run_lock
from hpctrain.train.data import TrainData
from hpctrain.train.guard import NonFiniteGuard, all_finite
from hpctrain.train.loss_scaling import LossScaling
from hpctrain.train.optim import build_optimizer, lr_at, set_lr
from hpctrain.train.precision import resolve_precision


def log(ctx: DistContext, msg: str) -> None:
    if ctx.is_main:
        print(msg, file=sys.stderr, flush=True)


class Trainer:
    def __init__(self, cfg: Config, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        t = cfg.train
        self.mesh = Mesh(ParallelDims.from_config(ctx.world_size, cfg.parallel), ctx)
        # The one place dp is known: with train.global_batch the accumulation follows it (elastic
        # restart on another node count); data, pipeline micro-batches, prefetch and the resume
        # check below all read the resolved train.grad_accum.
        t.grad_accum = resolve_grad_accum(t, self.mesh.dp_size)
        # and the one place the device is known: "auto" becomes bf16 or fp32 (measured, job-wide)
        self.precision_given = t.precision
        t.precision = resolve_precision(t.precision, ctx.device, t.micro_batch_size * cfg.model.block_size,
                                        cfg.model.n_embd)
        self.data = TrainData(cfg, ctx, self.mesh)
        torch.manual_seed(t.seed)  # identical initial weights on every rank
        m = cfg.model
        self.model_cfg = GPTConfig(**dataclasses.asdict(m))  # [model] holds exactly GPTConfig's fields
        self.raw_model = GPT(self.model_cfg).to(ctx.device)
        self.n_params, self.flops_per_token = self.raw_model.num_params(), self.raw_model.flops_per_token()
        self.layout = parallelize(self.raw_model, self.mesh, cfg)  # the modules in this job's layout
        self.model = self.layout.module  # this rank's parameters (a pipeline stage holds a subset)
        self.runner = build_runner(self.layout, cfg)  # layout-aware fwd/bwd, clip, eval
        self.optimizer = build_optimizer(self.model, t)
        # sync.mode = diloco: replicas take local steps; DiLoCo owns the global model and rounds
        self.diloco = DiLoCo(self.model, self.mesh, cfg.sync, t.steps) if cfg.sync.mode == "diloco" else None
        self.ckpt = CheckpointManager(cfg.checkpoint_dir, cfg.checkpoint.keep, ctx.rank, ctx.world_size,
                                      timeout_s=cfg.dist.timeout_s,
                                      full_checksums=cfg.checkpoint.full_checksums,
                                      async_cpu_share=cfg.checkpoint.async_cpu_share)
        self.guard = NonFiniteGuard(t.max_bad_steps, cfg.debug.inject_nan_at_step, ctx.rank, ctx.world_size)
        self.step_skipped = False
        self.preempt = PreemptionGuard(cfg.slurm, ctx.comm, ctx.rank,  # signals + wall-time guard
                                       step_sleep_s=cfg.debug.step_sleep_s)
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
        self.autocast = (torch.autocast(ctx.device.type, dtype=half) if half is not None
                         else contextlib.nullcontext())
        self.loss_scaling = LossScaling(ctx.device, t.loss_scale_init, t.loss_scale_growth_interval,
                                        enabled=t.precision == "fp16")
        self.step = 0
        self._local_numel: int | None = None
        self.stragglers = StragglerDetector(ctx.comm, window=t.straggler_window)
        rng.seed_rank(t.seed, ctx.rank)

    # ---- checkpoint state -------------------------------------------------------------------
    def _tensor_state(self) -> dict:
        state = checkpoint_state(self.layout, self.optimizer)
        return self.diloco.checkpoint_state(state) if self.diloco else state

    def comm_bytes(self) -> int:
        """Bytes this rank has sent to keep replicas in sync (gradients or pseudo-gradients)."""
        if self.diloco:
            return self.diloco.bytes_sent
        if self._local_numel is None:
            self._local_numel = sum(p.numel() for p in self.model.parameters())
        n = self._local_numel  # per-step gradient all-reduce (fp32)
        return self.step * bytes_sent(n, self.mesh.dp_size, "none") if self.cfg.dist.grad_sync != "powersgd" else -1

    def save(self) -> None:
        t0 = time.perf_counter()
        rngs = self.ctx.comm.allgather(rng.capture())
        state = self._tensor_state()  # first: DiLoCo finishes an in-flight average into its state
        extra = {"step": self.step, "sampler": self.data.sampler.state_dict(), "rng": rngs,
                 "world_size": self.ctx.world_size, "config": self.cfg.to_dict(),
                 "tokenizer": self.data.tokenizer_info, "loss_scaling": self.loss_scaling.state_dict(),
                 "sync": self.diloco.extra_state() if self.diloco else {"mode": self.cfg.sync.mode}}
        if not all_finite(self.model.parameters(), self.ctx.device):  # never save a broken state
            raise FloatingPointError(f"step {self.step}: non-finite weights; not saving a checkpoint")
        if self.cfg.checkpoint.async_save:  # returns after the copy to host memory
            self.ckpt.save_async(self.step, state, extra)
            log(self.ctx, f"checkpoint: step {self.step} staged in {time.perf_counter() - t0:.2f}s, "
                          f"writing in the background")
            return
        path = self.ckpt.save(self.step, state, extra)
        log(self.ctx, f"checkpoint: step {self.step} -> {path} ({time.perf_counter() - t0:.2f}s)")

    def maybe_resume(self) -> None:
        """Resume from the newest checkpoint that loads (older ones are tried when it does not)."""
        self.ckpt.resume_newest(self._resume_from)

    def _resume_from(self, path: Path) -> None:
        saved = json.loads((path / "trainer_state.json").read_text())
        _check_same_model(saved["config"]["model"], self.cfg.to_dict()["model"], path)
        saved_mode = saved.get("sync", {}).get("mode", "sync")
        if saved_mode == "diloco" and not self.diloco:
            raise ConfigError(f"config key 'sync.mode': checkpoint {path} was written with sync.mode="
                              f"'diloco' (one state per replica); resume it with sync.mode='diloco' "
                              f"or export its global model with `hpctrain export`")
        with_diloco = self.diloco is not None and saved_mode == "diloco"
        if with_diloco:
            self.diloco.load_extra_state(saved["sync"], path)
        state = self._tensor_state() if with_diloco else checkpoint_state(self.layout, self.optimizer)
        extra = self.ckpt.load(path, state)
        load_checkpoint_state(self.layout, self.optimizer, self.diloco.replica_state(state)
                              if with_diloco else state)
        if self.diloco is not None and not with_diloco:
            self.diloco.reset_from_model()  # continue a synchronous run with DiLoCo
        self.step = int(extra["step"])
        check_resume_batch(int(extra["sampler"]["global_batch"]), self.cfg.train, self.mesh.dp_size, path)
        self.data.sampler.load_state_dict(extra["sampler"])
        self.loss_scaling.load_state_dict(extra.get("loss_scaling", {}))
        saved = extra["rng"]
        if extra["world_size"] == self.ctx.world_size:
            rng.restore(saved[self.ctx.rank])
        else:  # another world size: fresh but deterministic dropout streams
            rng.seed_rank(self.cfg.train.seed + self.step, self.ctx.rank)
        log(self.ctx, f"resumed from {path} at step {self.step}")

    # ---- one optimizer step -----------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        t = self.cfg.train
        micro_batches = self.data.next_train_micro_batches()
        debug = self.cfg.debug
        if debug.delay_s and self.ctx.rank == debug.delay_rank:
            time.sleep(debug.delay_s)  # test-only straggler
        # forward/backward of every micro-batch in training mode (DDP/FSDP/TP loop or pipeline
        # schedule); the loss is the mean over the global batch; test-only NaN injection via the hook
        loss_avg = self.runner.forward_backward(micro_batches, self.autocast,
                                                loss_hook=lambda loss: self.guard.poison(self.step + 1, loss),
                                                loss_scale=self.loss_scaling.factor)
        overflow = self.loss_scaling.unscale_(self.optimizer)  # fp16: agreed by every rank
        grad_norm = self.runner.clip_grad_norm_(t.grad_clip)  # global norm over shards and stages
        # a NaN/Inf loss or grad norm on any rank: every rank skips the update; the loss is the
        # global mean and, where gradients are synchronized every step (all but DiLoCo's inner
        # steps), so is the norm: no vote needed then. An fp16 overflow is the loss scale's
        # business (skipped, counted apart), not a bad step
        self.step_skipped = self.guard.should_skip(self.step + 1, loss_avg,
                                                   0.0 if overflow else grad_norm,
                                                   agreed=self.diloco is None)
        self.loss_scaling.step(self.optimizer, skip=self.step_skipped)
        self.optimizer.zero_grad(set_to_none=True)
        return loss_avg.item(), float(grad_norm)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        batches = self.data.val_micro_batches()
        if batches is None:
            return None
        return self.runner.eval_loss(batches, self.autocast)

    # ---- the loop ---------------------------------------------------------------------------
    def fit(self) -> int:
        cfg, ctx, t = self.cfg, self.ctx, self.cfg.train
        self.maybe_resume()
        end = t.stop_at_step or t.steps
        self._write_run_config()
        metrics = MetricsLog(Path(cfg.run.dir) / "metrics.jsonl", ctx.is_main, resume_step=self.step)
        peak = self._peak_flops()
        tokens_per_step = self.data.global_batch * cfg.model.block_size
        self._log_start(tokens_per_step, end)
        last_saved = self.step if self.step > 0 else -1
        if self.step == 0 and t.eval_interval:
            val = self.evaluate()  # the starting point of the validation curve
            if val is not None:
                metrics.write({"step": 0, "val_loss": val})
                log(ctx, f"step 0 val {val:.4f}")
        start_step, t_start = self.step, time.perf_counter()
        while self.step < end:
            lr = lr_at(self.step, t)
            set_lr(self.optimizer, lr)
            t0 = time.perf_counter()
            loss, grad_norm = self.train_step()
            dt = time.perf_counter() - t0
            self.step += 1
            if self.diloco:
                self.diloco.after_step(self.step)  # ends a round (average + outer step) when due
            tok_s = tokens_per_step / dt
            rec = self._step_record(loss, grad_norm, lr, dt, tok_s, peak)
            metrics.write(rec)
            if ctx.is_main and (self.step % t.log_interval == 0 or self.step == end):
                eta = (time.perf_counter() - t_start) / (self.step - start_step) * (end - self.step)
                val_txt = f" val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
                log(ctx, f"step {self.step}/{end} loss {loss:.4f}{val_txt} lr {lr:.2e} "
                         f"{tok_s:,.0f} tok/s mfu {rec['mfu']:.1%} eta {format_eta(eta)}")
            if self.step % cfg.checkpoint.interval == 0 or self.step == end:
                self.save()
                last_saved = self.step
            if self.step < end and self.preempt.should_stop(self.step):
                break  # all ranks agreed to stop at this step: the checkpoint below is saved now
        if last_saved != self.step:
            self.save()
        self.ckpt.wait()  # an async save still in flight: commit it (or raise its error) first
        if self.diloco:
            self.diloco.close()
        metrics.close()
        if self.preempt.stopped:
            return self.preempt.finish(self.step)  # requeue the Slurm job and/or exit 75
        if t.stop_at_step and self.step < t.steps:
            log(ctx, f"stopped at train.stop_at_step={t.stop_at_step}; rerun the same command to resume")
        return 0

    def _step_record(self, loss: float, grad_norm: float, lr: float, dt: float, tok_s: float,
                     peak: float) -> dict:
        """The metrics of the step just taken (collective: validation, data and straggler stats)."""
        ctx, t = self.ctx, self.cfg.train
        rec = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": tok_s, "mfu": self.flops_per_token * tok_s / (peak * ctx.world_size),
               "step_time_s": dt, "epoch": self.data.sampler.state_dict()["epoch"],
               "comm_bytes": self.comm_bytes()}
        if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.steps):
            val = self.evaluate()
            if val is not None:
                rec["val_loss"] = val
        if self.loss_scaling.enabled:
            rec.update(loss_scale=self.loss_scaling.factor, overflow=self.loss_scaling.last_overflowed,
                       overflow_steps=self.loss_scaling.overflow_steps)
        if self.step_skipped or self.guard.skipped:
            rec.update(skipped=self.step_skipped, bad_steps=self.guard.skipped)
            if self.step_skipped:
                log(ctx, f"step {self.step}: loss {loss} / grad norm {grad_norm}: not finite, "
                         f"update skipped ({self.guard.in_a_row} in a row, "
                         f"train.max_bad_steps={t.max_bad_steps})")
        rec.update(self.data.step_metrics())  # data_time_s, data_wait_s, cache_* (all ranks)
        sync = self.layout.mpi_grad_sync
        rec.update(self.stragglers.observe(dt, dt - (sync.take_wait() if sync else 0.0)))
        warning = self.stragglers.warning(self.step, rec)
        if warning:
            log(ctx, warning)
        return rec

    def _write_run_config(self) -> None:
        """<run.dir>/config.toml: the config as given (train.grad_accum and train.precision not
        the resolved ones)."""
        cfg = self.cfg
        if not self.ctx.is_main:
            return
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        given = dataclasses.replace(cfg.train, precision=self.precision_given)
        if cfg.train.global_batch:
            given = dataclasses.replace(given, grad_accum=1)
        saved = dataclasses.replace(cfg, train=given)
        (Path(cfg.run.dir) / "config.toml").write_text(config_mod.to_toml(saved))

    def _log_start(self, tokens_per_step: int, end: int) -> None:
        ctx, t = self.ctx, self.cfg.train
        log(ctx, f"training: {self.n_params / 1e6:.2f}M params, world {ctx.world_size} "
                 f"[{self.mesh.dims.describe()}] "
                 f"({ctx.backend}, {ctx.threads} threads/rank, {mpi_library()}), "
                 f"{ctx.n_nodes} node(s), rendezvous {ctx.master_addr}:{ctx.master_port}"
                 f"{f' via {ctx.iface}' if ctx.iface else ''}, "
                 f"{tokens_per_step} tokens/step, {t.precision}"
                 f"{' (auto)' if self.precision_given == 'auto' else ''}, "
                 f"steps {self.step} -> {end} of {t.steps}")
        if t.global_batch:  # how the global batch splits on this world (elastic restarts)
            log(ctx, global_batch_line(t, self.mesh.dp_size))

    def _peak_flops(self) -> float:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.cfg.train.precision,
                                                                     torch.float32)
        peak = torch.tensor(measure_peak_flops(self.ctx.device, dtype), dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.AVG)
        return float(peak)


def _check_same_model(saved: dict, current: dict, path) -> None:
    diff = [k for k in current if saved.get(k) != current[k] and k != "dropout"]
    if diff:
        k = diff[0]
        raise ConfigError(f"config key 'model.{k}': {current[k]!r} differs from checkpoint {path} "
                          f"({saved.get(k)!r}); use a new run.dir to train a different model")


def train(cfg: Config, ctx: DistContext) -> int:
    with peer_watchdog(ctx, cfg.dist.heartbeat_timeout_s), run_lock.hold(cfg.run.dir, ctx):
        # a lost rank ends the job, named; one job per run.dir
        if cfg.sync.mode == "ps":
            from hpctrain.train.ps_loop import train_ps

            return train_ps(cfg, ctx)
        return Trainer(cfg, ctx).fit()
