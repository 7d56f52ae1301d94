"""DiLoCo: H local steps per data-parallel replica, then an outer Nesterov-SGD step on the averaged
pseudo-gradient (Douillard et al. 2023), optionally overlapped with the next round and fragmented.

Owns: the global model (`anchor`), the outer optimizer's momentum, the round schedule of each
fragment, the in-flight/pending averages of the overlapped variant, each replica's round start
point, and their checkpoint state. It must never touch gradients or the inner optimizer (the
trainer steps those as usual) and never do the inner steps' collectives.

Round of fragment f (parameters P_f), every H inner steps at its offset f * H // F:
    delta    = start - local                     (pseudo-gradient: what the replica moved)
    avg      = mean over replicas of delta       (compress.average, fp32 | bf16 | int8 on the wire)
    m        = mu * m + avg;  anchor -= lr * (avg + mu * m)     (Nesterov; mu = 0: plain SGD)
    lr       = sync.outer_lr, or with sync.outer_final_lr a cosine to it over train.steps (outer_lr_at)
    local    = start = anchor                    (every replica starts the next round equal)
With sync.overlap, `avg` of round k is computed in a background thread on its own process group
(on GPUs a gloo group over host copies: no NCCL from a second thread, `averages_on_host`)
while round k+1 runs, and applied to the anchor at the end of round k+1 (one round late). So that
round k+1 neither waits for it nor redoes round k's progress, each replica starts round k+1 from an
eager estimate (after Kale, Douillard & Donchev 2025, "Eager updates"): the outer step taken with
its *own* delta in place of the unknown average,
    e_r      = start_r - anchor                  (how far replica r's last start was off the anchor)
    start_r  = anchor - lr * (d_r + mu * (mu * m + d_r)),   d_r = delta_r - e_r / 2
and round k+1's pseudo-gradient is measured from start_r. The estimate is affine in d_r and the
e_r average to zero, so the replicas' start points average exactly to the anchor the real average
produces. The e_r / 2 term keeps the replica-specific part from growing: a replica walks back some
fraction c in [0, 1] of its offset during a round, so with d_r = delta_r its next offset would be
lr (1 + mu) c e_r (x1.33 for the defaults, growing round after round when c ~ 1, which stalls
training); with e_r / 2 taken out it is lr (1 + mu) (c - 1/2) e_r, at most 0.67 e_r. The last step
of training (train.steps) flushes every fragment synchronously, so the final model holds all work
and every replica ends equal to it.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hpctrain.config import SyncConfig
from hpctrain.distributed.bootstrap import new_group
from hpctrain.distributed.flight_recorder import RECORDER
from hpctrain.distributed.mesh import Mesh
from hpctrain.errors import ConfigError
from hpctrain.plan.wire import bytes_sent
from hpctrain.sync.compress import average
from hpctrain.sync.strategy import SyncStrategy


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def split_fragments(sizes: list[int], n: int) -> list[list[int]]:
    """Contiguous groups of parameter indices with about equal element counts: parameter i goes to
    the group its cumulative midpoint falls in. Empty groups (one huge parameter) are dropped."""
    total, acc, groups = max(1, sum(sizes)), 0, [[] for _ in range(n)]
    for i, size in enumerate(sizes):
        groups[min(n - 1, int((acc + size / 2) * n / total))].append(i)
        acc += size
    return [g for g in groups if g]


def averages_on_host(device: torch.device, overlap: bool) -> bool:
    """With sync.overlap on a GPU the averages run over host copies on a gloo group: the pool
    thread never issues NCCL collectives beside the main thread's (two threads' NCCL kernels,
    queued in an order that can differ between ranks, can deadlock). Without overlap, or on CPU
    (gloo already), the average stays where the parameters are."""
    return overlap and device.type == "cuda"


def _use_device(device: torch.device) -> None:
    """The pool thread's CUDA calls go to this rank's GPU, not device 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _dp_group(mesh: Mesh, backend: str | None = None):
    """A process group used only by DiLoCo (a background thread may drive it): my position in every
    replica (my dp ranks; in a hierarchical layout the same rank of every group of nodes)."""
    mine = None
    for ranks in mesh.dims.outer_groups():
        group = new_group(ranks, **({"backend": backend} if backend else {}))
        if mesh.rank in ranks:
            mine = group
    return mine


def outer_lr_at(cfg: SyncConfig, step: int, total_steps: int) -> float:
    """The outer lr of a round ending after inner step `step`: sync.outer_lr, or with
    sync.outer_final_lr > 0 a cosine from sync.outer_lr (step 0) to it (step total_steps), as the
    inner lr decays: a constant outer lr amplified the late rounds' noise (docs/benchmarks.md)."""
    if not cfg.outer_final_lr:
        return cfg.outer_lr
    progress = min(1.0, step / max(1, total_steps))
    return cfg.outer_final_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.outer_lr - cfg.outer_final_lr)


class DiLoCo(SyncStrategy):
    """The sync strategy of sync.mode = "diloco" (hooks: hpctrain/sync/strategy.py)."""
    mode = "diloco"
    streaming = False  # StreamingDiLoCo (hpctrain/sync/streaming.py): fragments by blocks, tau, alpha
    global_each_step = False  # inner steps: replicas differ; a non-finite step is voted on

    def __init__(self, module: nn.Module, mesh: Mesh, cfg: SyncConfig, total_steps: int):
        self.module, self.cfg, self.total_steps = module, cfg, total_steps
        self.replicas, self.replica = mesh.replicas, mesh.replica_index
        self.hierarchical = mesh.dims.hierarchical  # sync.replica_nodes: DDP / FSDP inside a replica
        self.params = list(module.parameters())  # tied weights once
        self.device = device = _local(self.params[0]).device
        self.on_host = averages_on_host(device, cfg.overlap)
        self.group = _dp_group(mesh, "gloo" if self.on_host else None)
        with torch.no_grad():
            self.anchor = [p.detach().clone() for p in self.params]
            self.momentum = [torch.zeros_like(p) for p in self.params]
            self.pending = [torch.zeros_like(p) for p in self.params] if cfg.overlap else []
            # where this replica began the current round (eager start points differ per replica);
            # without overlap every replica starts from the anchor itself
            self.start = [p.detach().clone() for p in self.params] if cfg.overlap else self.anchor
        self.fragments = split_fragments([_local(p).numel() for p in self.params], cfg.fragments)
        self.offsets = [f * cfg.inner_steps // len(self.fragments) for f in range(len(self.fragments))]
        self.has_pending = [False] * len(self.fragments)
        self.inflight: list[Future | None] = [None] * len(self.fragments)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="diloco", initializer=_use_device,
                                       initargs=(device,)) if cfg.overlap else None
        self.bytes_sent = 0  # by this rank, cumulative (restored on resume)
        self.syncs = 0
        self.is_main = mesh.rank == 0  # measures what its round line says
        self.step = 0  # inner steps done (after_step): the outer lr's schedule
        self.round_log: dict = {}  # since the last round line: the last norm, the summed waits
        self.logged_step = 0
        self._from_synchronous = False  # before_load: the checkpoint was written with sync.mode='sync'

    # ---- the schedule -----------------------------------------------------------------------
    def due(self, step: int) -> list[int]:
        """Fragments that end a round after inner step `step` (1-based count of steps done)."""
        if step >= self.total_steps:
            return list(range(len(self.fragments)))
        return [f for f, off in enumerate(self.offsets) if step > 0 and step % self.cfg.inner_steps == off]

    def after_step(self, step: int) -> None:
        """Ends a round (average + outer step) for each fragment due after inner step `step`."""
        self.step, final = step, step >= self.total_steps
        if final:  # the last rounds average on this thread: no average may still be running on the
            for f in range(len(self.fragments)):  # pool's thread over the same group (gloo would
                self._resolve(f)  # match the two threads' collectives differently on each rank)
        for f in self.due(step):
            self._round(f, flush=final)

    # ---- one round --------------------------------------------------------------------------
    @torch.no_grad()
    def _round(self, f: int, flush: bool) -> None:
        idx = self.fragments[f]
        delta = torch.cat([(_local(self.start[i]) - _local(self.params[i])).flatten().float()
                           for i in idx])
        self.bytes_sent += bytes_sent(delta.numel(), self.replicas, self.cfg.compression,
                                      self.cfg.int8_block)
        self.syncs += 1
        if self.is_main:  # this rank's part of its replica's pseudo-gradient
            # on the device: read only when round_line prints it (a host read per round otherwise)
            self.round_log = {"norm": delta.norm(), "wait_s": self.round_log.get("wait_s", 0.0)}
        t0 = time.perf_counter()
        dp = f"dp({self.replicas})"  # the flight recorder's group name (main thread only)
        if self.cfg.overlap:
            with RECORDER.collective("diloco_round_wait (average in flight)", dp):
                self._resolve(f)
            self._waited(t0)
            if self.has_pending[f]:  # round k-1's average, one round late
                self._outer_step(idx, [_local(self.pending[i]) for i in idx])
                self.has_pending[f] = False
            if not flush:
                self.inflight[f] = self.pool.submit(self._average, self._to_wire(delta))
                # eager start of the next round: the outer step with this replica's own delta,
                # less half of its previous start's offset from the anchor (module docstring)
                for i, d in zip(idx, self._unflatten(idx, delta)):
                    start, anchor = _local(self.start[i]), _local(self.anchor[i])
                    start.copy_(self._outer_step_value(i, d - 0.5 * (start - anchor)))
                    _local(self.params[i]).copy_(start)
                return
        with RECORDER.collective("diloco_round_allreduce", dp):
            avg = self._average(self._to_wire(delta))
        self._waited(t0)
        self._outer_step(idx, self._unflatten(idx, avg))
        for i in idx:  # the next round starts from the global model
            _local(self.params[i]).copy_(_local(self.anchor[i]))
            if self.start is not self.anchor:
                _local(self.start[i]).copy_(_local(self.anchor[i]))

    def _waited(self, t0) -> None:
        if self.is_main:
            self.round_log["wait_s"] = self.round_log.get("wait_s", 0.0) + time.perf_counter() - t0

    def describe(self) -> str:
        c = self.cfg
        outer = f"nesterov m={c.outer_momentum:g}" if c.outer_momentum else "sgd"
        return (f", sync diloco H={c.inner_steps} outer={outer} lr={c.outer_lr:g}"
                f"{f' cosine to {c.outer_final_lr:g}' if c.outer_final_lr else ''} "
                f"compression={c.compression} overlap={'on' if c.overlap else 'off'} "
                f"fragments={len(self.fragments)} replicas={self.replicas}")

    def round_line(self, step: int, log_interval: int) -> str | None:
        if "norm" not in self.round_log or not (step >= self.total_steps or  # (a merge alone: no round)
                                      step // log_interval > self.logged_step // log_interval):
            return None
        line = (f"diloco round {self.syncs} at step {step}: pseudo-grad norm "
                f"{float(self.round_log['norm']):.4g} (rank 0's part), {self.bytes_sent / 2**20:.3g} MiB sent "
                f"so far, waited {self.round_log['wait_s']:.3f} s for averages")
        self.round_log, self.logged_step = {}, step
        return line

    def _to_wire(self, delta: torch.Tensor) -> torch.Tensor:
        """The pseudo-gradient as the average's group takes it (host memory: averages_on_host),
        copied on the main thread: the pool thread runs no CUDA work of its own."""
        return delta.cpu() if self.on_host else delta

    def _average(self, delta: torch.Tensor) -> torch.Tensor:
        return average(delta, self.group, self.cfg.compression, self.cfg.int8_block)

    def _unflatten(self, idx: list[int], flat: torch.Tensor) -> list[torch.Tensor]:
        shapes = [_local(self.params[i]) for i in idx]
        return [v.view_as(s) for v, s in zip(flat.split([s.numel() for s in shapes]), shapes)]

    def outer_lr(self) -> float:
        return outer_lr_at(self.cfg, self.step, self.total_steps)

    def _outer_step_value(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """anchor_i after an outer step with pseudo-gradient g, without changing any state."""
        lr, mu = self.outer_lr(), self.cfg.outer_momentum
        a, m = _local(self.anchor[i]), _local(self.momentum[i])
        g = g.to(a.device, a.dtype)
        return a - lr * (g + mu * (mu * m + g)) if mu else a - lr * g

    def _outer_step(self, idx: list[int], grads: list[torch.Tensor]) -> None:
        lr, mu = self.outer_lr(), self.cfg.outer_momentum
        for i, g in zip(idx, grads):
            a, m = _local(self.anchor[i]), _local(self.momentum[i])
            g = g.to(a.device, a.dtype)
            if mu:
                m.mul_(mu).add_(g)
                a.sub_(g.add(m, alpha=mu), alpha=lr)
            else:
                a.sub_(g, alpha=lr)

    def _resolve(self, f: int) -> None:
        """Wait for fragment f's in-flight average and park it in `pending` (applied next round)."""
        future, self.inflight[f] = self.inflight[f], None
        if future is not None:
            idx = self.fragments[f]
            for i, v in zip(idx, self._unflatten(idx, future.result())):
                _local(self.pending[i]).copy_(v)
            self.has_pending[f] = True

    def comm_bytes(self, step: int) -> int:
        return self.bytes_sent

    def mean_over_replicas(self, value: float | torch.Tensor) -> float | torch.Tensor:
        """In a hierarchical layout the layout averaged a loss over its replica only: the mean
        over every rank (one scalar on the world group, main thread; replicas are equal-sized).
        A tensor (a step's loss) stays on the device: its fp32 sum divided in float64, the same
        number as the float's path."""
        if not self.hierarchical or self.replicas == 1:
            return value
        if isinstance(value, torch.Tensor):
            t = value.detach().reshape(1).to(torch.float32).clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            return t.reshape(()).double() / dist.get_world_size()
        t = torch.tensor([value], dtype=torch.float32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t) / dist.get_world_size()

    def step_loss(self, loss: float) -> float:
        return self.mean_over_replicas(loss)

    def close(self) -> None:
        for f in range(len(self.fragments)):
            self._resolve(f)
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    # ---- checkpoint state -------------------------------------------------------------------
    def checkpoint_states(self, saved: dict | None = None) -> dict:
        """The checkpoint's entries: "model" is the global model (what export/sample read) and
        "sync" this object: outer momentum and pending averages (same on all replicas), and this
        replica's local weights + inner optimizer (+ with overlap its round start point) under
        "replica.<dp index>". `saved`: the "sync" entry of a checkpoint about to be loaded; one
        written with sync.mode='sync' loads as it was saved and DiLoCo starts from it (before_load)."""
        if saved is not None and saved.get("mode", "sync") != "diloco":
            return {"model": self.local_model, "optim": self.local_optim}
        if saved is not None:
            self._check_saved(saved)
        return {"model": _GlobalModel(self), "sync": self}

    def before_load(self, saved: dict) -> None:
        self._from_synchronous = saved.get("mode", "sync") != "diloco"

    def _check_saved(self, saved: dict) -> None:
        if saved.get("replicas") != self.replicas or bool(saved.get("hierarchical")) != self.hierarchical:
            key = "sync.replica_nodes" if self.hierarchical or saved.get("hierarchical") else "parallel.dp"
            raise ConfigError(f"config key '{key}': {self.replicas} DiLoCo replicas"
                              f"{' of nodes' if self.hierarchical else ''}, but the checkpoint has "
                              f"{saved.get('replicas')}{' of nodes' if saved.get('hierarchical') else ''}; "
                              f"resume with the same layout")
        if bool(saved.get("streaming")) != self.streaming:
            raise ConfigError(f"config key 'sync.streaming': {str(self.streaming).lower()}, but the "
                              f"checkpoint was written with {str(not self.streaming).lower()}; keep "
                              f"it for the run's lifetime")
        if saved.get("overlap") != self.cfg.overlap or saved.get("fragments") != len(self.fragments):
            raise ConfigError(f"config keys 'sync.overlap' / 'sync.fragments' differ from the "
                              f"checkpoint ({saved.get('overlap')} / {saved.get('fragments')}); keep "
                              f"them for the run's lifetime")

    def _by_name(self, tensors: list[torch.Tensor], model_state: dict) -> dict:
        """{fqn: tensors[i]} for the parameters among `model_state`'s keys (tied weights once)."""
        names = dict(self.module.named_parameters(remove_duplicate=False))
        pos = {id(p): i for i, p in enumerate(self.params)}
        return {k: tensors[pos[id(names[k])]] for k in model_state
                if k in names and id(names[k]) in pos}

    def state_dict(self) -> dict:
        for f in range(len(self.fragments)):
            self._resolve(f)  # an in-flight average is part of the state: finish it first
        model, optim = self.local_model, self.local_optim
        local = model.state_dict()
        replica = {"model": local, "optim": optim.state_dict()}
        outer = {"momentum": self._by_name(self.momentum, local)}
        if self.cfg.overlap:
            outer["pending"] = self._by_name(self.pending, local)
            replica["start"] = self._by_name(self.start, local)
        hierarchy = {"hierarchical": True} if self.hierarchical else {}
        return {"mode": "diloco", "replicas": self.replicas, **hierarchy, "overlap": self.cfg.overlap,
                "fragments": len(self.fragments), "has_pending": list(self.has_pending),
                "bytes_sent": self.bytes_sent, "syncs": self.syncs,
                "outer": outer, "replica": {str(self.replica): replica}}

    def load_state_dict(self, state: dict) -> None:
        """Tensors (anchor, momentum, pending, start) were loaded in place; the local model and
        inner optimizer go through their own objects."""
        model, optim = self.local_model, self.local_optim
        replica = state["replica"][str(self.replica)]
        model.load_state_dict(replica["model"])
        optim.load_state_dict(replica["optim"])
        self.has_pending = list(state["has_pending"])
        self.bytes_sent, self.syncs = int(state["bytes_sent"]), int(state["syncs"])

    def after_load(self, step: int) -> None:
        if self._from_synchronous:  # continue a synchronous run with DiLoCo
            self.reset_from_model()
            self._from_synchronous = False

    @torch.no_grad()
    def reset_from_model(self) -> None:
        """Start DiLoCo from the current weights (e.g. a checkpoint written with sync.mode='sync')."""
        for a, p, m, s in zip(self.anchor, self.params, self.momentum, self.start):
            _local(a).copy_(_local(p))
            _local(s).copy_(_local(p))
            _local(m).zero_()
        self.has_pending = [False] * len(self.fragments)


class _GlobalModel:
    """The checkpoint's "model" entry under DiLoCo: the anchor, keyed like the local model."""

    def __init__(self, diloco: DiLoCo):
        self.diloco = diloco

    def state_dict(self) -> dict:
        local = self.diloco.local_model.state_dict()
        return {**local, **self.diloco._by_name(self.diloco.anchor, local)}

    def load_state_dict(self, state: dict) -> None:
        pass  # loaded in place into the anchor
