"""How DDP reduces gradients, per `dist.grad_allreduce`: through MPI instead of Gloo (a comm hook;
CPU training, "auto" there), torch's PowerSGD low-rank compression (a comm hook, "powersgd", see
docs/communication.md), or DDP's own C++ all-reduce with no hook at all ("backend", and "auto" on
GPUs: NCCL without a Python call per bucket, the division by the group size fused into DDP's copy
into the bucket). Only those two features need a hook. Every hook is registered wrapped
(`register_timed_hook`) so that the step's WaitClock learns when this rank has handed each gradient
bucket over; without a hook, `time_ddp_allreduce` marks the end of backward's compute instead (an
autograd callback, before DDP's own waits for its buckets). What follows until the end of
backward is waiting for peers (hpctrain/metrics/wait_clock.py, the straggler detector's busy time).

On CPU clusters the MPI library is the fastest path between ranks: it knows the interconnect and uses
shared memory inside a node, while Gloo goes through TCP sockets. Measured here (PLATFORM.md): an
in-place mpi4py Allreduce is ~2x faster than Gloo at 64 MiB and 3-6x at 1-16 MiB.

Owns: building an MPI communicator with exactly the ranks of a torch process group, and a DDP comm
hook that reduces each gradient bucket with it. Numerics mirror DDP's default hook (divide by the
group size, then sum), so fp32 losses are bit-identical to the Gloo path on 2 ranks (where a sum of
two values has only one possible order). With `prescaled`, the caller has already divided the loss
by the group size, so the gradients arrive divided and the hook saves a pass over every bucket (a
tenth of the sync time at 32 MiB here); backward is linear in its incoming gradient, so for a
power-of-two group size this gives exactly the same bits as dividing the gradients.
The MPI hook must never be used for CUDA tensors (NCCL is faster there).
"""
import contextlib

import torch
import torch.distributed as dist
from hpctrain.metrics.wait_clock import WaitClock

# dtypes MPI can reduce natively through mpi4py's buffer protocol (numpy views of the bucket)
_MPI_DTYPES = (torch.float32, torch.float64)


def mpi_comm_for_group(group: dist.ProcessGroup, world_comm):
    """An MPI communicator holding the same ranks as `group`, in the same order (collective over
    the world: every rank calls it, each with its own group)."""
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    return world_comm.Split(color=min(ranks), key=ranks.index(me))


class MPIHookState:
    def __init__(self, comm, prescaled: bool = False, clock: WaitClock | None = None):
        self.comm = comm
        self.size = comm.Get_size()
        self.prescaled = prescaled  # the loss was divided by `size`: gradients arrive averaged-ready
        self.clock = clock      # the blocking Allreduce is waiting (peers + transfer)

    def blocked(self):
        return self.clock.blocked() if self.clock is not None else contextlib.nullcontext()


def register_timed_hook(ddp_model, state, hook, clock: WaitClock | None) -> None:
    """Register `hook` on a DDP model; with a clock, wrapped so that each call marks the moment
    this rank has handed the bucket over (the hook has returned its future)."""
    if clock is None:
        ddp_model.register_comm_hook(state, hook)
        return

    def hand_over_and_mark(state, bucket):  # DDP requires the parameter name `bucket`
        future = hook(state, bucket)
        clock.handed_over()
        return future

    hand_over_and_mark.__qualname__ = f"timed_{getattr(hook, '__qualname__', 'hook')}"
    ddp_model.register_comm_hook(state, hand_over_and_mark)


# (no `from __future__ import annotations`: DDP checks these annotations at registration)
def mpi_allreduce_hook(state: MPIHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one gradient bucket over the group with MPI Allreduce (in place)."""
    from mpi4py import MPI

    buf = bucket.buffer()
    fut: torch.futures.Future = torch.futures.Future()
    if buf.device.type != "cpu" or buf.dtype not in _MPI_DTYPES:
        raise TypeError(f"MPI gradient sync needs fp32/fp64 CPU gradients, got {buf.dtype} on {buf.device}")
    if not state.prescaled:
        buf.div_(state.size)
    with state.blocked():
        state.comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
    fut.set_result(buf)
    return fut


def use_mpi_grad_allreduce(ddp_model, group: dist.ProcessGroup, world_comm, prescaled: bool = False,
                           clock: WaitClock | None = None) -> "MPIHookState":
    """Register the MPI hook on a DDP model; returns the hook state (holds the communicator).
    prescaled=True: the caller divides the loss by the group size before backward."""
    state = MPIHookState(mpi_comm_for_group(group, world_comm), prescaled, clock)
    register_timed_hook(ddp_model, state, mpi_allreduce_hook, clock)
    return state


def time_ddp_allreduce(ddp_model, clock: WaitClock | None) -> None:
    """DDP's own all-reduce, no comm hook, timed for the clock: a forward hook on the DDP module
    puts a gradient hook on its output (the first tensor of it that needs a gradient), which, on a
    backward that syncs, queues an autograd callback marking the hand-over. Callbacks run in the
    order queued once backward's compute is done; DDP queues its own (which waits for every
    bucket's reduction) when its last bucket is ready, always after this output's gradient, so the
    mark falls between the last gradient computed and DDP's wait: the time from it to the end of
    backward is waiting (on CUDA a CUDA event on the current stream, as for the hooks)."""
    if clock is None:
        return
    from torch.autograd import Variable

    def queue_mark(grad):
        Variable._execution_engine.queue_callback(clock.handed_over)

    def on_output(module, args, output):
        if torch.is_grad_enabled() and module.require_backward_grad_sync:
            tensor = first_grad_tensor(output)
            if tensor is not None:
                tensor.register_hook(queue_mark)

    ddp_model.register_forward_hook(on_output)


def first_grad_tensor(output) -> torch.Tensor | None:
    """The first tensor that needs a gradient in a module's output (a tensor, tuple, list or dict)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, dict):
        output = list(output.values())
    items = output if isinstance(output, (tuple, list)) else ()
    return next((t for t in map(first_grad_tensor, items) if t is not None), None)


def use_powersgd(ddp_model, group: dist.ProcessGroup, rank: int, clock: WaitClock | None = None):
    """torch's PowerSGD DDP hook: rank-`rank` low-rank factors of each gradient matrix are
    all-reduced instead of the matrix (error feedback keeps what the approximation dropped).
    Plain all-reduce for the first 2 steps (warm start); vectors/biases are sent uncompressed.
    The hook's error-feedback state is not checkpointed: a resume re-warms it (not bit-exact)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=2, min_compression_rate=1.0,
                                   use_error_feedback=True, warm_start=True, random_seed=0)
    register_timed_hook(ddp_model, state, powersgd.powerSGD_hook, clock)
    return state
