"""CPU offload in the planner (parallel.offload, hpctrain/parallel/offload.py): what it takes off
each GPU, what it puts in each node's host memory, and what it adds to a step.

    optimizer  AdamW's moments leave the GPU; per rank the host holds them (8 B per local
               parameter), an fp32 master copy (4 B) and a gradient buffer (4 B): 16 B
    all        the parameters, gradients and moments leave the GPU (FSDP2 still all-gathers each
               block's parameters onto it, and reduce-scatters its gradients there first); per
               rank the host holds the same 16 B per local parameter
Time per step, on the critical path (none of it hides under compute in the "optimizer" mode: the
step runs after the backward; in "all" mode FSDP2's host -> device copies of the parameters run
ahead like its all-gathers, so only what exceeds the compute is exposed):
    PCIe    optimizer: gradients down + parameters up, 8 B per local parameter; all: the fp32
            shards up before each forward and backward all-gather and the gradient shards down
            per micro-batch, 12 B per local parameter and micro-batch; at Job.pcie_bw per GPU
    CPU     AdamW on the host reads p, g, m, v and writes p, m, v: 28 B per local parameter at
            the node's host memory bandwidth (Job.host_memory_bw) shared by its ranks
Owns these numbers. It must never judge a layout (search.py) or format text (recommend.py).
"""
from __future__ import annotations

from hpctrain.plan.layout import Job

OFFLOADED_PARTS = {  # the memory.py parts that leave the GPU under each mode
    "none": (),
    "optimizer": ("AdamW m, v (fp32)",),
    "all": ("parameters (fp32)", "gradients (fp32)", "AdamW m, v (fp32)",
            "FSDP accumulated grads (grad_accum > 1)"),
}
HOST_BYTES_PER_PARAM = 16   # moments 8 + master / parameter 4 + gradient 4, in both modes
ADAM_HOST_BYTES = 28        # read p, g, m, v (16) + write p, m, v (12) per parameter
HOST_SHARE = 0.8            # of a node's RAM offload may take (the data cache, page cache, MPI)


def device_parts(parts: dict, job: Job) -> dict:
    """`parts` (memory.py, bytes per GPU) with what the job offloads set to 0."""
    return {k: 0 if k in OFFLOADED_PARTS[job.offload] else v for k, v in parts.items()}


def host_bytes_per_rank(parts: dict, job: Job) -> int:
    """Host bytes one rank's offloaded state takes (0 without offload): 16 B per parameter it
    holds (the fp32 parameter shard is 4 B of them)."""
    if job.offload == "none":
        return 0
    return parts["parameters (fp32)"] // 4 * HOST_BYTES_PER_PARAM


def host_need_and_room(host: int, job: Job) -> tuple[int, int]:
    """(host bytes a node's ranks need for their offloaded state, `host` per rank
    (RankMemory.host); the bytes of its RAM offload may take)."""
    return host * job.gpus_per_node, int(job.node_memory * HOST_SHARE)


def pcie_bytes(host: int, job: Job) -> int:
    """Bytes one rank moves between host and GPU per step for offload (`host`: RankMemory.host)."""
    local = host // HOST_BYTES_PER_PARAM
    return {"none": 0, "optimizer": 8 * local, "all": 12 * local * job.grad_accum}[job.offload]


def exposed_seconds(host: int, job: Job, compute: float) -> tuple[float, float]:
    """(PCIe seconds, CPU AdamW seconds) offload adds to a step on the critical path."""
    if job.offload == "none":
        return 0.0, 0.0
    pcie = pcie_bytes(host, job) / job.pcie_bw
    if job.offload == "all":  # copied ahead of use, as FSDP2 prefetches its all-gathers
        pcie = max(0.0, pcie - compute)
    adam = ADAM_HOST_BYTES * (host // HOST_BYTES_PER_PARAM) / (job.host_memory_bw / job.gpus_per_node)
    return pcie, adam
