"""The training loop, one for every sync mode. It reads like the algorithm:

config -> bootstrap -> mesh -> the run plan (train/run_plan.py: dp, grad_accum, precision, resolved
once) -> data -> model, parallelized from outside -> sync strategy -> the step engine -> resume if a
committed checkpoint exists -> per span (up to the next checkpoint step or a hook's boundary)
{ per step { strategy.before_step -> batch -> engine.step (forward/backward over micro-batches ->
clip -> optimizer step) -> strategy.after_step -> metrics -> maybe validate -> stop? } ->
strategy.meet (where every rank stops) -> checkpoint at a checkpoint step or a stop } -> final
validation where steps were not collective -> teardown. `self.hooks` (train/hooks.py) are called at
the named points in between: PBT and the strategies' saves use them.

Owns: the order of those steps and the trainer's checkpoint entry (step, world size, config,
tokenizer). It must never parse MPI/Slurm environment (bootstrap does), build parallel wrappers
(parallelize does), know what a sync mode does between steps (hpctrain/sync/strategy.py), run the
step's arithmetic (train/engine.py), write the user's Config, or write checkpoint files itself (the
checkpoint manager does).
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

from hpctrain import config as config_mod
from hpctrain import logs
from hpctrain.checkpoint import CheckpointManager
from hpctrain.checkpoint.snapshot import PeerSnapshots
from hpctrain.config import Config
from hpctrain.config_rules import global_batch_line, stop_at_step_line
from hpctrain.distributed import DistContext, run_lock
from hpctrain.distributed.bootstrap import mpi_library
from hpctrain.distributed.preempt import NONE, Preemption
from hpctrain.distributed.mesh import Mesh, ParallelDims, replica_ranks
from hpctrain.distributed.watchdog import watch_peers
from hpctrain.metrics import MetricsLog, profiling
from hpctrain.metrics.host_syncs import StepSyncLog
from hpctrain.metrics.mfu import MfuMeter
from hpctrain.metrics.peak import job_meter
from hpctrain.metrics.straggler import StragglerDetector
from hpctrain.parallel import build_runner
from hpctrain.parallel.offload import adamw_class
from hpctrain.sync import modes
from hpctrain.train import rng, run_plan
from hpctrain.train.data import TrainData
from hpctrain.train.bad_steps import all_finite, check_resumed_weights
from hpctrain.train.engine import StepEngine
from hpctrain.train.step_log import StepLog
from hpctrain.train.hooks import LoopHooks
from hpctrain.train.resume import resume_newest
from hpctrain.train.model_setup import build_model, check_model_fits, lora_base
from hpctrain.train.moe_monitor import monitor_for
from hpctrain.train.named_evals import NamedEvals
from hpctrain.model.optim import build_optimizer, lr_at, set_lr, undecayed_matrices
from hpctrain.train.states import ModelState, OptimState, RNGStates


def log(ctx: DistContext, msg: str) -> None:
    """A progress line of this run (hpctrain.logs: rank 0 of the job by default,
    HPCTRAIN_LOG_RANKS=all for every rank; a PBT member other than 0 logs only then)."""
    if ctx.is_main:
        logs.info(msg)


def _checkpoints(cfg: Config, ctx: DistContext) -> CheckpointManager:
    """The run's checkpoints, as its [checkpoint] section and dist.timeout_s say."""
    c = cfg.checkpoint
    return CheckpointManager(cfg.checkpoint_dir, c.keep, ctx.rank, ctx.world_size, timeout_s=cfg.dist.timeout_s,
                             full_checksums=c.full_checksums, async_cpu_share=c.async_cpu_share,
                             layout=c.layout, node_id=ctx.node_rank, stripe_count=c.stripe_count,
                             stripe_size=c.stripe_size)


class Trainer:
    def __init__(self, cfg: Config, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx  # cfg: the user's, never written
        self.mesh = Mesh(ParallelDims.from_config(ctx.world_size, cfg.parallel,
                                                  replica_ranks(cfg.sync.replica_nodes, ctx)), ctx)
        # resolved once: where this rank reads the data, train.grad_accum (from train.global_batch
        # and dp: elastic restarts), train.precision ("auto": measured, job-wide), TF32, the faults
        self.plan = run_plan.resolve(cfg, ctx, self.mesh)
        t = self.plan.train
        self.hparams = t  # the values each step reads (lr schedule, clip): a PBT member's its own
        self.data = self._open_data()
        # the model in this job's layout, initialized from t.seed (on the meta device first, then
        # only this rank's shards: parallel.meta_init)
        built = build_model(cfg, self.mesh, ctx.device, t.precision)
        self.params, self.flops_per_token, self.fp8_line = built.params, built.flops_per_token, built.fp8
        self.layout = built.layout  # the modules in this job's layout
        self.model = self.layout.module  # this rank's parameters (a pipeline stage holds a subset)
        self.optimizer = build_optimizer(self.model, t, undecayed_matrices(cfg.model),
                                         adamw_class(cfg.parallel.offload))
        self.ckpt = _checkpoints(cfg, ctx)
        self.preempt = Preemption(cfg.slurm, ctx.comm, ctx.rank,  # signals + wall-time guard
                                       step_sleep_s=self.plan.faults.step_sleep_s, run_dir=cfg.run.dir)
        # what happens between steps and what a checkpoint holds (hpctrain/sync/strategy.py)
        self.sync = modes.build_strategy(cfg, ctx, self.mesh, self.model)
        self.sync.bind_local_state(ModelState(self.model, lora_base(cfg)), OptimState(self.model, self.optimizer,
                                                                      self.layout.tied_weight_is_head_copy))
        # forward/backward, clip and eval in this layout; losses averaged over dp where replicas
        # step together (every mode but ps); train.objective = sft: over the trained tokens
        runner = build_runner(self.layout, cfg, t.grad_accum, self.sync.collective_steps,
                              self.data.objective.token_mean)
        # one optimizer step in this layout and precision (hpctrain/train/engine.py)
        self.engine = StepEngine(runner, self.optimizer, t, self.plan.faults, ctx.device, ctx.rank,
                                 ctx.world_size, agreed=self.sync.global_each_step)
        self.named_evals = NamedEvals(cfg, self.data, ctx.comm, self.sync, self.engine)  # [[eval]] sets
        # the loop's named hook points (hpctrain/train/hooks.py): the strategy's saves, PBT's rounds
        self.hooks = LoopHooks()
        self.hooks.add("before_save", self.sync.before_save)  # ps, async_diloco: the servers' model
        self.hooks.add("after_save", self.sync.after_save)
        profiling.attach(self)  # metrics.profile_steps / memory_snapshot_steps: their windows of steps
        # every checkpoint.snapshot_interval steps: the state into node memory here and on a buddy node
        self.snapshots = PeerSnapshots(cfg.checkpoint.snapshot_interval, cfg.checkpoint.snapshot_dir,
                                       cfg.run.dir, ctx, timeout_s=cfg.dist.timeout_s,
                                       cpu_share=cfg.checkpoint.async_cpu_share,
                                       full_checksums=cfg.checkpoint.full_checksums,
                                       enabled=self.sync.collective_steps and self.sync.global_each_step)
        self.hooks.add("after_step", self._after_step_snapshot)
        # MoE layers (none in a dense model): loads, balancing bias step and warning after each step
        moe = monitor_for(self.model, cfg.model, self.mesh, self.sync.collective_steps and self.sync.global_each_step,
                          t.log_interval, self.plan.end_step)  # read on the host at log steps only
        if moe is not None:
            self.hooks.add("after_step", moe.record)
        self.step, self._flush_now, self._step_log = 0, False, None
        # HPCTRAIN_COUNT_HOST_SYNCS=1: each step's host syncs into host_syncs.rank<r>.json (tests)
        self.sync_log = StepSyncLog(cfg.run.dir, ctx.rank) if StepSyncLog.enabled() else None
        self.stragglers = StragglerDetector(ctx.comm, window=t.straggler_window)
        rng.seed_rank(t.seed, ctx.rank)

    def _open_data(self) -> TrainData:
        """The data this rank trains on (train/dpo.py reads preference pairs instead)."""
        return TrainData(modes.data_config(self.cfg), self.ctx, self.plan.position,
                         self.plan.train.grad_accum, cp=(self.mesh.cp_size, self.mesh.cp_rank))

    # ---- checkpoint state -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The checkpoint's "trainer" entry (the trainer is one of its Stateful objects)."""
        config = self.plan.resolved_config(self.cfg, self.hparams)  # as checkpoints always held it
        return {"step": self.step, "world_size": self.ctx.world_size, "config": config.to_dict(),
                "tokenizer": self.data.tokenizer_info}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])

    def checkpoint_states(self, saved: dict | None = None) -> dict:
        """{name: Stateful} of a checkpoint of this run; `saved`, the JSON state of one about to be
        loaded, lets the sync strategy refuse a checkpoint of another mode (reads only)."""
        states = self.sync.checkpoint_states(None if saved is None else saved.get("sync", {}))
        return {**states, "trainer": self, "sampler": self.data.sampler,
                "rng": RNGStates(self.ctx.comm, self.cfg.train.seed, lambda: self.step),
                "loss_scaling": self.engine.loss_scaling}

    def save(self) -> None:
        t0 = time.perf_counter()
        background = self.cfg.checkpoint.async_save
        self.hooks.run("before_save")  # ps, async_diloco: the servers' parameters into the model
        self.data.sampler.seek(self.step)  # where batches are claimed out of order, the agreed step
        states = self.checkpoint_states()
        if not all_finite(self.model.parameters(), self.ctx.device):  # never save a broken state
            raise FloatingPointError(f"step {self.step}: non-finite weights; not saving a checkpoint")
        path = self.ckpt.save_states(self.step, states, background=background)
        self.hooks.run("after_save")
        if background:  # returned after the copy to host memory
            log(self.ctx, f"checkpoint: step {self.step} staged in {time.perf_counter() - t0:.2f}s, "
                          f"writing in the background")
        else:
            log(self.ctx, f"checkpoint: step {self.step} -> {path} ({time.perf_counter() - t0:.2f}s)")

    def _after_step_snapshot(self, rec: dict) -> None:
        if self.snapshots.due(self.step):
            self.snapshots.save(self.step, self.checkpoint_states())
            self._flush_now = True  # a resume from it cuts metrics.jsonl there: no gap before it
        if self.plan.faults.exit_after_step == self.step:  # test fault: a job killed after a step
            self.snapshots.wait()
            self._step_log.flush()  # the steps before this one, as when each was written at once
            os._exit(137)

    def maybe_resume(self) -> None:
        """The newest peer snapshot or checkpoint into this trainer, or step 0 (train/resume.py)."""
        resume_newest(self)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over every replica (None: no validation split, or a ps server)."""
        batches = self.data.val_micro_batches() if self.sync.trains else None
        if batches is None:
            return None
        return self.sync.mean_over_replicas(self.engine.eval_loss(batches))

    # ---- the loop ---------------------------------------------------------------------------
    def fit(self) -> int:
        """Train up to train.stop_at_step / train.steps in spans that end at checkpoint steps and at
        the boundaries hooks add, calling self.hooks at their named points."""
        t, hooks = self.cfg.train, self.hooks
        self.maybe_resume()
        hooks.run("resumed")
        if t.stop_at_step and self.step >= t.stop_at_step:  # a rerun of a stopped run, unchanged
            log(self.ctx, stop_at_step_line(t, self.step, resumed=True))
            self.sync.close()
            return 0
        end = self.plan.end_step
        metrics = self._start(end)
        # each step's record waits with its device tensors until a log step (one host read each)
        metrics = self._step_log = StepLog(self.ctx, metrics, self.engine.bad_steps, t, end,
                                           (self.t_start, self.start_step))
        stop = NONE
        while self.step < end and stop == NONE:
            checkpoint_at = min(end, _next_multiple(self.step, self.cfg.checkpoint.interval))
            until = hooks.next_boundary(self.step, checkpoint_at)
            stop = self._run_until(until, end, metrics)
            stop = self._meet(stop, end, metrics)
            hooks.run("at_meeting")
            if stop != NONE or until == checkpoint_at:
                metrics.flush()  # the records up to here, and a bad-step streak's error, first
                self.save()
        return self._end_of_run(metrics)

    def _start(self, end: int) -> MetricsLog:
        """config.toml, metrics.jsonl, the start-up lines, the "start" hooks and the starting point
        of the validation curve."""
        self._write_run_config()
        metrics = self._metrics_log()
        self.peak = self._peak_flops()
        self._log_start(end)
        self.hooks.run("start")
        validate = self.cfg.train.eval_interval or self.hooks.validate_at_start
        if self.step == 0 and validate and self.sync.collective_steps:
            self._validate(metrics)  # the starting point of the validation curve
        self.t_start, self.start_step = time.perf_counter(), self.step
        return metrics

    def _meet(self, stop: int, end: int, metrics: StepLog) -> int:
        """Where every rank stops at the end of a span (the strategy decides the step); the agreed
        stop reason."""
        step, stop = self.sync.meet(self.preempt, self.step, stop, end)
        if self.sync.meeting_metrics():  # async_diloco: the last, partial round's arrival
            metrics.write({"step": max(self.step, step), **self.sync.meeting_metrics()})
        while self.sync.trains and self.sync.every_worker_steps and self.step < step:
            metrics.add(self._one_step(end, stop_aware=False))  # ps: catch up with the furthest
        metrics.flush()
        self.step = max(self.step, step)
        return stop

    def _end_of_run(self, metrics: StepLog) -> int:
        t = self.cfg.train
        metrics.flush()
        self.ckpt.wait()  # an async save still in flight: commit it (or raise its error) first
        self.snapshots.finish()  # the run's newest state is on the PFS: its snapshots go
        if not self.sync.collective_steps and not self.preempt.stopped:
            self._validate(metrics)  # ps: the final parameters (pulled by the save)
        self.hooks.run("end_of_run")
        self.sync.close()
        metrics.metrics.close()
        if self.sync_log is not None:
            self.sync_log.write()
        if self.preempt.stopped:
            return self.preempt.finish(self.step, resumed_at=self.start_step)  # requeue and/or exit 75
        if t.stop_at_step and self.step < t.steps:
            log(self.ctx, stop_at_step_line(t, self.step))
        return 0

    def _run_until(self, until: int, end: int, metrics: StepLog) -> int:
        """Train up to step `until` unless a stop comes first; the agreed stop reason (NONE)."""
        while self.sync.trains and self.step < until:
            with self._counting_syncs(self.step + 1):
                rec = self._one_step(end, until=until)
                if rec is not None:
                    metrics.add(rec)  # read from the device at log steps (StepLog)
                    if self._flush_now:  # a snapshot was taken: its steps' records on disk
                        metrics.flush()
                        self._flush_now = False
            if rec is None:  # asynchronous: the stop flag is up (the meeting reads it), or the
                return NONE  # next batch is past the checkpoint step
            if self.step < end:
                stop = self.sync.stop_reason(self.preempt, self.step)
                if stop != NONE:
                    return stop
        return NONE

    def _one_step(self, end: int, stop_aware: bool = True, until: int | None = None) -> dict | None:
        """One optimizer step with the strategy's hooks around it; its metrics record."""
        if not self.sync.before_step(self.step, stop_aware, until):
            return None
        claimed = self.sync.batch_index(self.step)  # async_diloco: the global batch this step trains
        lr = lr_at(self.step if claimed is None else claimed, self.hparams)
        set_lr(self.optimizer, lr)
        clock = self.layout.wait_clock  # this rank's waiting for peers inside the step
        clock.begin()
        t0 = time.perf_counter()
        micro_batches = self.data.next_train_micro_batches(claimed)
        loss, grad_norm = self.engine.step(micro_batches, self.step + 1, self.hparams.grad_clip, started=t0)
        dt = time.perf_counter() - t0
        wait = clock.take()  # before validation, DiLoCo's round and the metrics collectives
        loss = self.sync.step_loss(loss)  # hierarchical DiLoCo: averaged over the replicas too
        self.step = self.sync.next_step(self.step)
        self.sync.after_step(self.step)  # DiLoCo: ends a round when due; ps: pushes the update
        round_line = self.sync.round_line(self.step, self.cfg.train.log_interval)
        if round_line:  # DiLoCo, async_diloco: a round ended (at most one line per log_interval)
            log(self.ctx, round_line)
        rec = self._step_record(loss, grad_norm, lr, dt, wait)
        self.hooks.run("after_step", rec)
        return rec  # its device numbers are read at a log step, with its progress line (StepLog)

    def _counting_syncs(self, step: int):
        """HPCTRAIN_COUNT_HOST_SYNCS=1: the host syncs of step `step` counted (metrics/host_syncs.py)."""
        return self.sync_log.count(step) if self.sync_log is not None else contextlib.nullcontext()

    def _metrics_log(self) -> MetricsLog:
        """metrics.jsonl from rank 0; where workers step apart, each other worker writes its own
        metrics.rank<r>.jsonl (no per-step collective gathers them)."""
        run, ctx = Path(self.cfg.run.dir), self.ctx
        window = self.cfg.checkpoint.interval
        if ctx.is_main or self.sync.collective_steps:
            return MetricsLog(run / "metrics.jsonl", ctx.is_main, self.step, window, self.cfg)
        return MetricsLog(run / f"metrics.rank{ctx.rank}.jsonl", self.sync.writes_metrics, self.step, window)

    def _validate(self, metrics: MetricsLog) -> None:
        val, named = self.evaluate(), self.named_evals.metrics(self.step)
        rec = {**({"val_loss": val} if val is not None else {}), **named}
        if rec:
            metrics.write({"step": self.step, **rec})
            log(self.ctx, f"step {self.step}" + "".join(f" {k.replace('_loss', '')} {v:.4f}" for k, v in rec.items()))

    def _step_record(self, loss, grad_norm, lr: float, dt: float, wait: float) -> dict:
        """The metrics of the step just taken (`wait`: of its `dt` seconds, those spent waiting for
        peers). Where steps are collective (every rank steps together) also validation, data and
        straggler statistics, which are collectives. `loss`, `grad_norm` (and the loss scale and
        bad-step flag) stay device tensors until StepLog reads them at a log step."""
        ctx, t = self.ctx, self.cfg.train
        tok_s = self.data.global_batch * self.cfg.model.block_size / dt
        rec = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": tok_s, "mfu": self.peak(tok_s),  # MfuMeter: never above 1
               "step_time_s": dt, "epoch": self.data.sampler.state_dict()["epoch"],
               "comm_bytes": self.sync.comm_bytes(self.step), **self.sync.step_metrics()}
        if rec["mfu"] is None:  # a GPU not in the datasheet table: said once at start-up
            del rec["mfu"]
        if ctx.device.type == "cuda":  # the high-water mark since start (no sync: allocator counters)
            rec["gpu_mem_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
        collective = self.sync.collective_steps
        if collective and t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.steps):
            val = self.evaluate()
            if val is not None:
                rec["val_loss"] = val
        rec.update(self.named_evals.metrics(self.step) if collective else {})
        scaling = self.engine.loss_scaling  # device tensors (copies: they change in place)
        if scaling.enabled:
            rec.update(loss_scale=scaling.factor.clone(), overflow=scaling.overflowed.clone(),
                       overflow_steps=scaling.overflow_count.clone())
        # the bad-step flag, counted at the flush (StepLog drops both keys until a step is skipped)
        rec.update(skipped=self.engine.skipped, bad_steps=0)
        if not collective:
            return rec
        rec.update(self.data.step_metrics())  # data_time_s, data_wait_s, cache_* (all ranks)
        measured = self.layout.waits_measured  # FSDP / TP / PP: busy is the wall time
        rec.update(self.stragglers.observe(dt, dt - wait if measured else dt, wall=not measured))
        warning = self.stragglers.warning(self.step, rec)
        if warning:
            log(ctx, warning)
        return rec

    def _write_run_config(self) -> None:
        """<run.dir>/config.toml: the config as given (the run plan holds what was resolved)."""
        cfg = self.cfg
        if not self.ctx.is_main:
            return
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run.dir) / "config.toml").write_text(config_mod.to_toml(cfg), encoding="utf-8")

    def _log_start(self, end: int) -> None:
        ctx, t = self.ctx, self.plan.train
        tokens_per_step = self.data.global_batch * self.cfg.model.block_size
        log(ctx, f"training: {self.params}, world {ctx.world_size} "
                 f"[{self.mesh.dims.describe()}] "
                 f"({ctx.backend}, {ctx.threads} threads/rank, {mpi_library()}), "
                 f"{ctx.n_nodes} node(s), rendezvous {ctx.master_addr}:{ctx.master_port}"
                 f"{f' via {ctx.iface}' if ctx.iface else ''}, "
                 f"{tokens_per_step} tokens/step, {t.precision}"
                 f"{' (auto)' if self.plan.precision_given == 'auto' else ''}"
                 f"{' (tf32 matmuls)' if self.plan.tf32 else ''}{f', torch.compile ({self.layout.compiled})' if t.compile else ''}, "
                 f"steps {self.step} -> {end} of {t.steps}{self.sync.describe()}")
        if t.global_batch:  # how the global batch splits on this world (elastic restarts)
            log(ctx, global_batch_line(t, self.plan.dp_size))
        if self.fp8_line:
            log(ctx, self.fp8_line)

    def _peak_flops(self) -> MfuMeter:
        """MFU of each step against the job's peak (hpctrain/metrics/peak.py), said once."""
        meter, line = job_meter(self.ctx, self.plan.precision, self.flops_per_token,
                                self.sync.ranks_per_record)
        log(self.ctx, line)
        return meter


def _next_multiple(step: int, every: int) -> int:
    return (step // every + 1) * every


def train(cfg: Config, ctx: DistContext, trainer_class: type = Trainer) -> int:
    """`trainer_class`: Trainer, or a subclass of it for another train.objective (train/dpo.py)."""
    check_model_fits(cfg, ctx)  # a model no layout of this job could hold: named before building
    with watch_peers(ctx, cfg.dist.heartbeat_timeout_s, cfg.run.dir, cfg.dist.stall_timeout_s), \
            run_lock.hold(cfg.run.dir, ctx):
        # a lost rank ends the job, named; one job per run.dir
        return trainer_class(cfg, ctx).fit()
