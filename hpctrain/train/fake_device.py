"""A GPU that is not there: fake device tensors and torch's fake process group, for the dry run.

    register_fake_gpu()               # once per process: the "gpu" device (torch's PrivateUse1)
    with FakeGpu() as watch:          # torch's FakeTensorMode: tensors on "gpu:0", shapes only
        ... build, parallelize, step ...
    watch.peak_bytes, watch.sizes()   # of the fake device memory, every allocation counted

Why "gpu" and not "cuda": a CPU-only torch has no CUDA device guard, hooks or autocast for
fake CUDA tensors (autograd's engine refuses a CUDA tensor: "Cannot access accelerator device
when none is available"), while a Python-registered PrivateUse1 device has all three. So the dry
run's tensors live on "gpu": a device that is not the CPU (a CPU tensor meeting one is caught as
on CUDA), with CUDA's autocast rules (`AUTOCAST_16BIT` / `AUTOCAST_FP32`: the ops our models run)
registered for it and NCCL's rule for collectives (device tensors only). Code that asks for CUDA
by name (`device.type == "cuda"`: MoE's grouped matmul, compile of the whole model) takes its
non-CUDA path in a dry run.

Owns: that device, the values a host sync would read (`.item()`: what a healthy step reads, 0 or
True: no NaN flag, no overflow; a data-dependent size: its largest), attention as an H100 runs it
(`_fused_attention`), the live and peak bytes of fake device storage, and the checks
a GPU job fails at: a CPU tensor in a collective, or a CPU tensor (not a 0-dim scalar) meeting a
device tensor in an op, raises `DeviceMixError` naming the op. It must never build a model or run
a step (train/dry_run.py does), nor start a real process group.
"""
from __future__ import annotations

import contextlib
import weakref
from unittest import mock

import torch
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.nn.parallel import distributed as ddp_module
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map

from hpctrain.errors import UserError

DEVICE = "gpu"
FAKE_CAPABILITY = (9, 0)  # what torch.cuda.get_device_capability says of an H100
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# CUDA autocast's lists (torch's autocast_mode.cpp), the ops our models and losses reach
AUTOCAST_16BIT = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "einsum",
                  "scaled_dot_product_attention", "_grouped_mm")
AUTOCAST_FP32 = ("log_softmax", "softmax", "cross_entropy_loss", "nll_loss", "layer_norm",
                 "native_layer_norm", "group_norm", "rsqrt", "exp", "log", "pow", "sum", "prod",
                 "cumsum", "logsumexp", "mse_loss", "norm", "rms_norm")


class DeviceMixError(UserError):
    """A CPU tensor where the GPU job would need a device one (NCCL refuses it, or the op fails)."""


class _FakeStream(torch.cpu.Stream):
    """The CPU's no-op stream, but recording an event returns one (a CPU stream's returns None,
    which FSDP2's HSDP all-reduce refuses on a non-CPU device: parallel.dp_shard)."""

    def record_event(self, event=None):
        return event if event is not None else torch.cpu.Event()


class _FakeGpuModule:
    """torch.gpu: what torch asks of a device's module (streams behave as the CPU's: no-ops)."""
    Stream, Event = _FakeStream, torch.cpu.Event
    stream, current_stream = staticmethod(torch.cpu.stream), staticmethod(torch.cpu.current_stream)

    def get_amp_supported_dtype(self):
        return [torch.float16, torch.bfloat16]

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device) -> None:
        pass

    def synchronize(self, device=None) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)

    def set_rng_state(self, state, device=None) -> None:
        pass


def _autocast_kernel(op, cast_to):
    """Autocast for the fake device: floating inputs cast as CUDA's autocast casts them, then
    the op below autocast (the casts are recorded by autograd, as on CUDA)."""
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype(DEVICE) if cast_to is None else cast_to
        cast = lambda t: t.to(dtype) if (isinstance(t, torch.Tensor) and t.is_floating_point()  # noqa: E731
                                         and t.device.type == DEVICE) else t
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)):
            return op(*tree_map(cast, args), **tree_map(cast, kwargs))
    return kernel


_registered: list = []


def register_fake_gpu() -> None:
    """The "gpu" device, its module and autocast rules (once per process; cannot be undone)."""
    if _registered:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(DEVICE, backend_module=_FakeGpuModule())
    lib = torch.library.Library("_", "IMPL", "AutocastPrivateUse1")
    lib.fallback(torch.library.fallthrough_kernel)
    ops = torch.library.Library("aten", "IMPL", "AutocastPrivateUse1")
    for names, cast_to in ((AUTOCAST_16BIT, None), (AUTOCAST_FP32, torch.float32)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            for overload in (packet.overloads() if packet is not None else ()):
                ops.impl(f"{name}.{overload}" if overload != "default" else name,
                         _autocast_kernel(getattr(packet, overload), cast_to))
    _registered.extend([lib, ops])


def init_fake_world(rank: int, world: int) -> None:
    """torch's fake process group (no peers, no communication) as the default group of `world`
    ranks, for the CPU and the fake device."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    register_fake_gpu()
    dist.init_process_group(f"cpu:fake,{DEVICE}:fake", store=FakeStore(), rank=rank, world_size=world)


def _is_device(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE


def _nonzero(x: torch.Tensor) -> torch.Tensor:
    """Every element taken: a data-dependent size at its largest."""
    return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)


def _mask_positions(indices: list) -> list:
    """Boolean masks among index tensors as their positions (nonzero(), one tensor per dim)."""
    out = []
    for i in indices:
        out.extend(_nonzero(i).unbind(1) if i is not None and i.dtype == torch.bool else [i])
    return out


aten = torch.ops.aten
DATA_DEPENDENT = {aten.nonzero.default: _nonzero,
                  aten.masked_select.default: lambda x, mask: x.new_empty(
                      torch.broadcast_shapes(x.shape, mask.shape).numel())}
TRANSFERS = (aten.copy_.default, aten._to_copy.default)  # host <-> device copies: allowed
INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
            aten._index_put_impl_.default)


class Watch(TorchDispatchMode):
    """Above FakeTensorMode: real CPU work stays real, device work goes fake and is counted."""

    def __init__(self, fake_mode: FakeTensorMode):
        super().__init__()
        self.fake_mode = fake_mode
        self.live: dict[int, weakref.ref] = {}  # id(storage) -> the fake device storage, alive now
        self.peak_bytes = 0
        self.host_reads = 0             # .item() / .tolist() values a GPU step would sync for
        self.peak_listeners: list = []
        self.paused = 0                 # > 0: inside DTensor's shape propagation (no job memory)
        self.cpu_collectives = False    # the job adds Gloo for host tensors (parallel.offload = all)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if any(is_traceable_wrapper_subclass(t) for t in tensors):
            return NotImplemented  # a DTensor: it dispatches its local tensors, seen here next
        self._check_devices(func, tensors)
        if not any(isinstance(t, FakeTensor) for t in tensors) and not _is_device(kwargs.get("device")):
            with unset_fake_temporarily():  # the CPU side of the job (meshes, the host's numbers)
                return func(*args, **kwargs)
        real = lambda t: (self.fake_mode.from_tensor(t)  # noqa: E731  (no constant: no real op)
                          if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t)
        args, kwargs = tree_map(real, args), tree_map(real, kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.host_reads += 1
            dtype = args[0].dtype
            return True if dtype == torch.bool else (0.0 if dtype.is_floating_point else 0)
        if func in DATA_DEPENDENT:
            return DATA_DEPENDENT[func](*args, **kwargs)
        if func in INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1]):
            args = (args[0], _mask_positions(args[1]), *args[2:])
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, FakeTensor) and t.device.type == DEVICE:
                self._track(t)
        return out

    def _check_devices(self, func, tensors) -> None:
        cpu = [t for t in tensors if t.device.type == "cpu"]
        if not cpu:
            return
        name = f"{func.namespace}.{func._opname}"
        if func.namespace in COLLECTIVE_NAMESPACES and not (self.cpu_collectives and len(cpu) == len(tensors)):
            raise DeviceMixError(f"dry run: a CPU tensor {tuple(cpu[0].shape)} reaches the collective "
                                 f"{name}: NCCL takes device tensors only (keep it on the GPU)")
        big = [t for t in cpu if t.dim() > 0]
        if big and func not in TRANSFERS and any(t.device.type == DEVICE for t in tensors):
            raise DeviceMixError(f"dry run: a CPU tensor {tuple(big[0].shape)} meets a GPU tensor in "
                                 f"{name}: move it to the device")

    def _track(self, t: torch.Tensor) -> None:
        """Count `t`'s storage from now until torch frees it; a new peak tells the listeners."""
        if self.paused:
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = weakref.ref(storage)
        weakref.finalize(storage, self.live.pop, key, None)
        total = self.live_bytes()
        if total > self.peak_bytes:
            self.peak_bytes = total
            for listener in self.peak_listeners:
                listener(self)

    def live_bytes(self) -> int:
        return sum(self.sizes().values())

    def sizes(self) -> dict[int, int]:
        """{id(storage): bytes now}: a storage's size is read each time, as FSDP2 frees and
        re-allocates its unsharded parameters by resizing their storage (`resize_(0)`)."""
        out = {}
        for key, ref in self.live.items():
            storage = ref()
            if storage is not None:
                out[key] = storage.nbytes()
        return out


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """SDPA as CUDA runs it on an H100 (flash for 16-bit, memory-efficient for fp32: both save
    q, k, v, the output and an fp32 logsumexp, never the s x s scores); the fake device would
    otherwise take the math path, which saves them."""
    if attn_mask is not None:
        return None
    if q.dtype in (torch.bfloat16, torch.float16):
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal,
                                                        scale=scale)[0]


def _attention(sdpa):
    """F.scaled_dot_product_attention, on fake device tensors `_fused_attention` (a patch of the
    function, not a mode: activation checkpointing recomputes inside autograd's backward).
    Grouped-query attention: CUDA's flash kernel takes k and v with their own (kv) heads
    (sdp_utils.cpp: `check_batch_size_and_num_heads_dense<true /*supports GQA*/>`), so 16-bit
    saves them kv-wide; the memory-efficient kernel does not, so fp32's are repeated first."""
    def attention(q, k, v, *args, **kwargs):
        if not (isinstance(q, FakeTensor) and q.device.type == DEVICE):
            return sdpa(q, k, v, *args, **kwargs)
        grouped = kwargs.pop("enable_gqa", False) and k.shape[-3] != q.shape[-3]
        if grouped and q.dtype not in (torch.bfloat16, torch.float16):  # kv heads per group
            k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
        out = _fused_attention(q, k, v, *args, **kwargs)
        if out is not None:
            return out
        return sdpa(q, k, v, *args, enable_gqa=k.shape[-3] != q.shape[-3], **kwargs)
    return attention


class FakeGpu(contextlib.ExitStack):
    """The fake device's modes (module docstring); entering gives the `Watch`."""

    def __enter__(self) -> Watch:
        register_fake_gpu()
        super().__enter__()
        # torch.tensor(data, device="gpu"): made on the CPU, lifted, then moved (by dispatched ops)
        lift_cpu_only = torch._C._only_lift_cpu_tensors()
        torch._C._set_only_lift_cpu_tensors(True)
        self.callback(torch._C._set_only_lift_cpu_tensors, lift_cpu_only)
        # DDP compares every rank's parameter shapes through the group: a fake group has no peers
        self.enter_context(mock.patch.object(ddp_module, "_verify_param_shape_across_processes",
                                             lambda *args, **kwargs: None))
        # backward on this thread: a device thread of autograd's engine could still be dropping the
        # graph's Python objects as the process exits, and taking the GIL while Python finalizes
        # ends the process in std::terminate (exit -6 after a complete dry run; 4 of 41 runs)
        self.enter_context(torch.autograd.set_multithreading_enabled(False))
        fake_mode = self.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        watch = self.enter_context(Watch(fake_mode))
        self.enter_context(mock.patch.object(torch.nn.functional, "scaled_dot_product_attention",
                                             _attention(torch.nn.functional.scaled_dot_product_attention)))
        self.enter_context(mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached",
                                             _untracked(watch, ShardingPropagator._propagate_tensor_meta_non_cached)))
        return watch


def _untracked(watch: Watch, method):
    """`method` with `watch` not counting: DTensor's sharding propagation makes (and caches)
    global-shape tensors to learn an op's output shapes; on a GPU they are fake tensors too."""
    def untracked(*args, **kwargs):
        watch.paused += 1
        try:
            return method(*args, **kwargs)
        finally:
            watch.paused -= 1
    return untracked
