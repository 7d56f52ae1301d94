"""`hpctrain train --dry-run N`: the real model on the real layout of N GPU ranks, in this one process.

    config -> torch's fake process group of N ranks (rank r) -> the mesh -> under FakeGpu
    (train/fake_device.py: fake "gpu:0" tensors, shapes only) the model built on the meta device,
    parallelized by the real apply_* calls, its shards allocated (never initialized) -> the
    optimizer -> the step engine's real steps (forward/backward over the micro-batches, clip,
    AdamW) -> bytes this rank holds: parameters, gradients, optimizer state, the peak of a step
    and what made it (activations and temporaries).

Owns: that sequence for one rank at a time (rank 0, and the last pipeline stage's first rank, in a
fresh process of its own: DTensor's caches outlive a process group) and the byte counts. Under a
pipeline the stage's peers' answers come from train/dry_run_pipeline.py. Nothing is read or written: no data, no checkpoint, no MPI, no real process
group. What a GPU job would fail at on the way (a CPU tensor in a collective or meeting a CUDA
tensor) is one `error:` line naming the op; an op the fake device cannot run, one line naming it.
It must never decide a layout (the config does), format the report (train/dry_run_report.py),
or run on a real device.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpctrain.config import Config
from hpctrain.config_rules import resolve_grad_accum
from hpctrain.distributed.bootstrap import DistContext
from hpctrain.distributed.dtensor import is_dtensor
from hpctrain.distributed.mesh import Mesh, ParallelDims
from hpctrain.errors import UserError
from hpctrain.model import spec as model_spec
from hpctrain.model.optim import build_optimizer, undecayed_matrices
from hpctrain.parallel import build_runner
from hpctrain.parallel.offload import adamw_class
from hpctrain.step_faults import step_faults
from hpctrain.train.dry_run_pipeline import boundary_tensor, stage_peers
from hpctrain.train.engine import StepEngine
from hpctrain.train.fake_device import DEVICE, DeviceMixError, FakeGpu, init_fake_world
from hpctrain.train.model_setup import build_model
from hpctrain.train.precision import half_dtype

STEPS = 2           # the second step runs with the optimizer state the first one made
GPUS_PER_NODE = 8   # the node a rank's DistContext describes (local ranks; no effect on bytes)


@dataclass
class RankBytes:
    """What one rank holds on the GPU, in bytes (local shards: a DTensor counts its local tensor);
    `in_host_memory`: what parallel.offload keeps in host memory instead."""
    rank: int
    coords: dict
    parameters: int = 0
    gradients: int = 0            # after the backward, before the optimizer step
    optimizer: int = 0            # AdamW's state after a step
    peak: int = 0                 # of every fake CUDA allocation during the steps
    peak_parts: dict = field(default_factory=dict)  # at the peak: parameters, gradients, ... , other
    micro_batches: int = 0        # run per step (of grad_accum: `dry_micro_batches`)
    grad_accum: int = 0
    host_reads: int = 0           # .item() / .tolist() values a step reads on the host
    fp8: str = ""                 # train.precision = fp8: the Linear layers converted (parallel/float8.py)
    in_host_memory: dict = field(default_factory=dict)  # parallel.offload: bytes kept on the host
    host_gradients: int = 0       # of `gradients` before the step, those in host memory
    seconds: float = 0.0


def dry_micro_batches(grad_accum: int, pp: int) -> int:
    """Micro-batches a dry step runs: all of grad_accum up to 2 x pp (at least 3). The peak is
    reached by then: a 1F1B pipeline holds at most pp in flight, FSDP's accumulated gradients
    are all there from the second micro-batch on; later ones repeat the same bytes."""
    return min(grad_accum, max(3, 2 * pp))


def fake_context(rank: int, world: int) -> DistContext:
    per_node = min(world, GPUS_PER_NODE)
    return DistContext(rank=rank, world_size=world, local_rank=rank % per_node, local_size=per_node,
                       node_rank=rank // per_node, n_nodes=-(-world // per_node), backend="nccl",
                       device=torch.device(DEVICE, 0), threads=1, master_addr="", master_port=0,
                       comm=None, node_comm=None)


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if is_dtensor(t) else t
    return t.numel() * t.element_size()


def _on_host(t: torch.Tensor | None) -> bool:
    return t is not None and (t.to_local() if is_dtensor(t) else t).device.type == "cpu"


def _host_parts(model: torch.nn.Module, optimizer, out: RankBytes) -> dict:
    """Bytes of parameters, gradients (as last noted) and optimizer state in host memory
    (parallel.offload); an OffloadedAdamW's master copies and gradient buffers beside them."""
    host = getattr(optimizer, "host_bytes", None)
    return {"parameters": sum(_local_bytes(p) for p in model.parameters() if _on_host(p)),
            "gradients": out.host_gradients,
            "optimizer": host() if host else sum(_local_bytes(t) for t in _optimizer_tensors(optimizer)
                                                 if _on_host(t))}


def _storages(tensors) -> set[int]:
    out = set()
    for t in tensors:
        if t is not None:
            out.add(id((t.to_local() if is_dtensor(t) else t).untyped_storage()))
    return out


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


class _PeakParts:
    """At each new peak, which storages were alive (classified once the step is over)."""

    def __init__(self):
        self.snapshot: dict[int, int] = {}

    def __call__(self, watch) -> None:
        self.snapshot = watch.sizes()

    def split(self, model: torch.nn.Module, grads: set[int], optimizer) -> dict:
        params = _storages(p for p in model.parameters() if not _on_host(p))
        opt = _storages(t for t in _optimizer_tensors(optimizer) if not _on_host(t))
        parts = {"parameters": 0, "gradients": 0, "optimizer": 0, "activations and temporaries": 0}
        for key, nbytes in self.snapshot.items():
            part = ("parameters" if key in params else "gradients" if key in grads
                    else "optimizer" if key in opt else "activations and temporaries")
            parts[part] += nbytes
        return parts


def _step_inputs(cfg: Config, n: int) -> list[torch.Tensor]:
    shape = (cfg.train.micro_batch_size, cfg.model.block_size + 1)
    return [torch.zeros(shape, dtype=torch.long, device=DEVICE) for _ in range(n)]


def _run_steps(cfg: Config, rank: int, world: int, out: RankBytes) -> None:
    """Build this rank's part of the model and run STEPS steps under the fake device."""
    ctx = fake_context(rank, world)
    mesh = Mesh(ParallelDims.from_config(world, cfg.parallel), ctx)  # real bookkeeping, fake groups
    out.coords = {axis: mesh.coord(axis) for axis in ("pp", "dp", "tp")}
    out.grad_accum = resolve_grad_accum(cfg.train, mesh.dp_size)
    out.micro_batches = dry_micro_batches(out.grad_accum, mesh.pp_size)
    precision = "bf16" if cfg.train.precision == "auto" else cfg.train.precision
    train = dataclasses.replace(cfg.train, grad_accum=out.micro_batches, precision=precision)
    peak = _PeakParts()
    with FakeGpu() as watch:
        watch.peak_listeners.append(peak)
        watch.cpu_collectives = cfg.parallel.offload == "all"  # Gloo beside NCCL (bootstrap.py)
        built = build_model(cfg, mesh, ctx.device, precision, initialize=False)
        layout, out.fp8 = built.layout, built.fp8
        if layout.dp_reduce == "ddp" and cfg.dist.grad_allreduce in ("auto", "backend"):
            layout.forward_modules[0].register_comm_hook(None, _bucket_as_reduced)
        model = layout.module
        optimizer = build_optimizer(model, train, undecayed_matrices(cfg.model),
                                    adamw_class(cfg.parallel.offload))
        runner = build_runner(layout, cfg, out.micro_batches)
        engine = StepEngine(runner, optimizer, train, step_faults(), ctx.device, rank, world, agreed=True)
        grads: set[int] = set()
        optimizer.register_step_pre_hook(lambda *_: _note_grads(model, out, grads))
        with _pipeline_peers(cfg, mesh, precision):
            for step in range(1, STEPS + 1):
                engine.step(_step_inputs(cfg, out.micro_batches), step, cfg.train.grad_clip,
                            time.perf_counter())
        out.in_host_memory = _host_parts(model, optimizer, out)
        out.parameters = sum(_local_bytes(p) for p in model.parameters() if not _on_host(p))
        out.optimizer = sum(_local_bytes(t) for t in _optimizer_tensors(optimizer) if not _on_host(t))
        out.gradients -= out.in_host_memory["gradients"]
        out.peak, out.host_reads = watch.peak_bytes, watch.host_reads
        out.peak_parts = peak.split(model, grads, optimizer)


def _pipeline_peers(cfg: Config, mesh: Mesh, precision: str):
    """Under a pipeline, what the stage's peers would send (train/dry_run_pipeline.py): the
    residual stream of a micro-batch, sequence-sharded under tp with sp, in the blocks' dtype
    (16-bit where FSDP all-gathers 16-bit parameters, else fp32: autocast keeps the residual)."""
    if mesh.pp_size == 1:
        return contextlib.nullcontext()
    half = half_dtype(precision)
    fsdp16 = half is not None and cfg.parallel.data_parallel == "fsdp" and mesh.dp_size > 1
    tokens = cfg.model.block_size // (mesh.tp_size if cfg.parallel.sp else 1)
    boundary = boundary_tensor(cfg.train.micro_batch_size, tokens, cfg.model.n_embd,
                               half if fsdp16 else torch.float32, DEVICE)
    return stage_peers(boundary)


def _bucket_as_reduced(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own all-reduce (no hook, on GPUs) waits for the group's future, which a fake group
    leaves without a value: this hook hands the bucket back as reduced in place, the same bytes."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


# DDP checks a hook's annotations as types (this module's are strings: __future__ annotations)
_bucket_as_reduced.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                      "return": torch.futures.Future[torch.Tensor]}


def _note_grads(model: torch.nn.Module, out: RankBytes, grads: set[int]) -> None:
    """Before the optimizer step (the backward done): the gradients' bytes and storages."""
    held = [p.grad for p in model.parameters() if p.grad is not None]
    out.gradients = sum(_local_bytes(g) for g in held)
    out.host_gradients = sum(_local_bytes(g) for g in held if _on_host(g))
    grads.update(_storages(held))


def ranks_to_run(cfg: Config, world: int) -> list[int]:
    """Rank 0, and with a pipeline the first rank of the last stage (it holds the head)."""
    dims = ParallelDims.from_config(world, cfg.parallel)
    return [0] if dims.pp == 1 else [0, dims.rank_of(dims.pp - 1, 0, 0)]


def unsupported(cfg: Config) -> str | None:
    """Why this config cannot be dry-run (None: it can), in one line naming the key."""
    if model_spec.get(cfg.model.arch).n_experts(cfg.model) > 0:
        return ("config key 'model.moe.experts': a dry run of mixture-of-experts layers is not "
                "supported yet (their routing reads token counts on the host, which fake tensors "
                "do not hold)")
    if cfg.parallel.cp > 1:
        return ("config key 'parallel.cp': a dry run of context parallelism is not supported yet "
                "(its ring exchanges need real process groups); dry-run with parallel.cp = 1")
    return None


def dry_run(cfg: Config, world: int, ranks: list[int] | None = None) -> list[RankBytes]:
    """The dry run of `cfg` on `world` ranks: one RankBytes per rank run (`ranks_to_run`). The
    first rank runs in this process, each other one in a fresh process of its own: DTensor's
    caches would hand a later rank the meshes of the one before, whose groups are destroyed."""
    why = unsupported(cfg)
    if why:
        raise UserError(f"dry run: {why}")
    first, *others = ranks if ranks is not None else ranks_to_run(cfg, world)
    results = [dry_run_rank(cfg, world, first)]
    if others:
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn, max_tasks_per_child=1) as pool:
            results += [pool.submit(dry_run_rank, cfg, world, r).result() for r in others]
    return results


def dry_run_rank(cfg: Config, world: int, rank: int) -> RankBytes:
    """One rank's dry run, in this process (its fake world made and destroyed here)."""
    t0, out = time.perf_counter(), RankBytes(rank=rank, coords={})
    init_fake_world(rank, world)
    try:
        with warnings.catch_warnings():  # the fake groups take no timeout: torch says so per group
            warnings.filterwarnings("ignore", message="Set timeout is now only supported")
            _run_steps(cfg, rank, world, out)
    except DeviceMixError:
        raise
    except (NotImplementedError, RuntimeError) as e:  # an op the fake device cannot run
        raise UserError(f"dry run: rank {rank} stopped in an op the fake GPU does not "
                        f"support: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    finally:
        dist.destroy_process_group()
    out.seconds = time.perf_counter() - t0
    return out
