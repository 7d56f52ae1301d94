"""The schema of how a run lives on a cluster: its checkpoints and peer snapshots, process groups
and failure detection, Slurm's signals and wall time, how replicas synchronize, and where its
metrics go (the [checkpoint], [dist], [slurm], [sync] and [metrics] sections, every key with its
type, default and `help`). Part of config_schema.py, which re-exports them with the other sections.

It must never import torch or read files.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class CheckpointConfig:
    interval: int = field(default=100, metadata={"help": "save every N steps (and always at the end / stop)"})
    keep: int = field(default=3, metadata={"help": "committed checkpoints to keep (newest)"})
    dir: str = field(default="", metadata={"help": "checkpoint root (default: <run.dir>/checkpoints)"})
    async_save: bool = field(default=False, metadata={
        "help": "write checkpoints in the background (the step loop pays only a copy to host memory)"})
    async_cpu_share: float = field(default=0.1, metadata={
        "help": "with async: the background writer's duty cycle (0-1]; it sleeps between chunks so "
                "steps overlapping a write stay within ~this fraction of their time; the write "
                "takes ~1/share as long; a stop or the end lifts the limit (1 = unpaced)"})
    full_checksums: bool = field(default=True, metadata={
        "help": "record an xxh3-128 checksum of every tensor data file (each rank hashes what it "
                "writes, while writing); loading checks them (ranks in parallel) and a mismatch "
                "falls back to the previous checkpoint; `hpctrain ckpt verify` checks them. false: "
                "sizes only for data files"})
    layout: Literal["rank", "node"] = field(default="rank", metadata={
        "help": "tensor data files: rank (one __<rank>_0.distcp per rank) | node (one __node<k>.distcp "
                "per node: the node's ranks hand their bytes to its lowest rank, which writes them; "
                "fewer files and metadata operations on a parallel filesystem). Loading reads either"})
    stripe_count: int = field(default=0, metadata={
        "help": "on Lustre: rank 0 runs `lfs setstripe -c N -S stripe_size` on the checkpoint dir "
                "once per run (a failure is a warning); 0 = auto: 1 with layout rank (the files "
                "spread over OSTs), 4 with layout node (one stream per node file); -1 = all OSTs; "
                "else 1 to 2000 (Lustre's most)"})
    stripe_size: str = field(default="4M", metadata={
        "help": "on Lustre: the stripe size for `lfs setstripe -S`, checked at start as lfs takes it: "
                "bytes with an optional k, M or G suffix, a multiple of 64k below 4G (e.g. 1M, 4M, "
                "16M), or 0 for the file system's default"})
    snapshot_interval: int = field(default=50, metadata={
        "help": "every N steps a peer snapshot: each rank's state into node-local memory on its "
                "node and on a buddy node, in the background; a relaunch after losing one node "
                "resumes from it without reading the PFS checkpoint (docs/checkpoints.md; 0 = off; "
                "50: ~1% of step time measured, docs/benchmarks.md)"})
    snapshot_dir: str = field(default="auto", metadata={
        "help": "node-local folder of the peer snapshots: auto ($SLURM_TMPDIR, else /dev/shm) or a "
                "path; '{node}' is replaced by the node's index. Never empty: snapshots are turned "
                "off by checkpoint.snapshot_interval = 0"})


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = field(default="auto", metadata={"help": "auto (nccl if CUDA, else gloo) | nccl | gloo"})
    timeout_s: float = field(default=300.0, metadata={"help": "collective timeout in seconds"})
    grad_allreduce: Literal["auto", "mpi", "backend", "powersgd"] = field(default="auto", metadata={
        "help": "DDP gradient all-reduce: auto (mpi on CPU, the backend on GPU) | mpi | backend | "
                "powersgd (torch's low-rank PowerSGD DDP hook, rank dist.powersgd_rank)"})
    powersgd_rank: int = field(default=4, metadata={
        "help": "with grad_allreduce = 'powersgd': rank of the low-rank gradient approximation"})
    heartbeat_timeout_s: float = field(default=8.0, metadata={
        "help": "a rank whose process is dead or stopped, or whose node is unreachable, this long "
                "ends the job with an error naming it (0 = off, else 1 to 86400 s); beats come from "
                "a sidecar process per rank, so slow steps, long saves or C calls holding the GIL "
                "are no silence"})
    stall_timeout_s: float = field(default=60.0, metadata={
        "help": "a rank inside one collective longer than this, or 4 x the median step time when "
                "that is longer, while every peer is alive, is a stall: forensics files and a "
                "warning (the job goes on)"})


@dataclass
class SlurmConfig:
    requeue: Literal["auto", "true", "false"] = field(default="auto", metadata={
        "help": "after a stop on a signal or the wall-time guard (checkpoint saved): auto (scontrol "
                "requeue when in a batch job that allows requeue) | true | false (exit status 75)"})
    signals: str = field(default="USR1,TERM,INT", metadata={
        "help": "comma-separated signals that mean: checkpoint at the next step boundary and stop "
                "(all ranks agree on the step; '' = none)"})
    time_margin_s: float = field(default=300.0, metadata={
        "help": "inside a Slurm job: stop with a checkpoint when less wall time than this is left "
                "(0 = off)"})
    time_check_s: float = field(default=60.0, metadata={
        "help": "how often rank 0 asks Slurm for the remaining wall time (seconds)"})


@dataclass
class SyncConfig:
    mode: Literal["sync", "diloco", "async_diloco", "ps"] = field(default="sync", metadata={
        "help": "sync (all-reduce gradients every step) | diloco (each dp replica takes inner_steps "
                "local steps, then the averaged pseudo-gradient feeds an outer Nesterov SGD) | "
                "async_diloco (each replica pushes its pseudo-gradient to the global model on "
                "server ranks as soon as its round ends and goes on: no replica waits for another) "
                "| ps (asynchronous SGD against parameter-server ranks holding MPI one-sided windows)"})
    inner_steps: int = field(default=16, metadata={
        "help": "diloco: local optimizer steps per round (H). The paper uses 500 at scale; 16 keeps "
                "runs of ~10^3 steps within ~1-2% of DDP (16x fewer bytes; 63x with int8)"})
    outer_lr: float = field(default=0.7, metadata={"help": "diloco: outer SGD learning rate (paper: 0.7)"})
    outer_final_lr: float = field(default=0.0, metadata={
        "help": "diloco: > 0: the outer lr goes from sync.outer_lr to this by a cosine over "
                "train.steps, as the inner lr does (below it: decays; above: rises as the "
                "pseudo-gradients shrink; docs/benchmarks.md); 0 = a constant sync.outer_lr"})
    outer_momentum: float = field(default=0.5, metadata={
        "help": "diloco: outer Nesterov momentum (paper: 0.9 over hundreds of rounds; 0.5 is best "
                "measured for tens of rounds; 0 = plain SGD)"})
    overlap: bool = field(default=False, metadata={
        "help": "diloco: average round k's pseudo-gradient in the background during round k+1 and "
                "apply it one round late (hides the all-reduce behind compute)"})
    fragments: int = field(default=1, metadata={
        "help": "diloco: split the parameters into this many fragments synced at staggered steps "
                "(spreads the traffic over the round, as in Streaming DiLoCo)"})
    streaming: bool = field(default=False, metadata={
        "help": "diloco: Streaming DiLoCo (arXiv 2501.18512): the sync.fragments are contiguous "
                "groups of transformer blocks, fragment p synced at steps p*H/P + kH; with "
                "sync.overlap its average is merged sync.overlap_steps later, mixed by sync.mix_alpha"})
    overlap_steps: int = field(default=1, metadata={
        "help": "diloco with streaming and overlap: inner steps a fragment's average may take "
                "before it is merged (the paper's tau; at most inner_steps / fragments)"})
    mix_alpha: float = field(default=0.5, metadata={
        "help": "diloco with streaming and overlap: the merged fragment is alpha * local + "
                "(1 - alpha) * global (the paper's alpha, default 0.5 as there)"})
    compression: Literal["none", "bf16", "int8", "int4"] = field(default="none", metadata={
        "help": "diloco, async_diloco: pseudo-gradient wire format none (fp32) | bf16 | int8 | int4 (scaled per block; async_diloco: the servers then apply the arrivals)"})
    int8_block: int = field(default=256, metadata={
        "help": "with compression = 'int8' | 'int4': elements per scale (0 = one scale per tensor chunk)"})
    error_feedback: bool = field(default=False, metadata={
        "help": "diloco with streaming and compression = 'int8' | 'int4': what the codes left out of "
                "a fragment's pseudo-gradient (and of the average a rank re-encodes) is added to that "
                "fragment's next round (error feedback; the residuals are checkpointed); "
                "async_diloco with compression = 'int8' | 'int4': what a replica's encoded push "
                "left out is added to its next push (its pulls always have error feedback)"})
    pull_compression: Literal["same", "bf16", "int8", "int4"] = field(default="same", metadata={
        "help": "async_diloco with compression: wire format of the pulls (the global model's change, "
                "with error feedback): same (as sync.compression) | bf16 | int8 | int4"})
    defer_momentum_pull: bool = field(default=False, metadata={
        "help": "async_diloco with compression and delayed_nesterov: an arrival that takes the "
                "momentum step pulls nothing either; the replica adds its own share and the "
                "momentum step comes with its next pull (at most one step owed)"})
    outer_optimizer: Literal["delayed_nesterov", "nesterov", "sgd"] = field(
        default="delayed_nesterov", metadata={
            "help": "async_diloco: the global model's update per arrival: delayed_nesterov (plain "
                    "SGD on every arrival, momentum once per sync.nesterov_delay arrivals; Liu et al. "
                    "2024) | nesterov (momentum on every arrival: the naive baseline) | sgd"})
    nesterov_delay: int = field(default=0, metadata={
        "help": "async_diloco with delayed_nesterov: arrivals per momentum update (0 = the number "
                "of replicas)"})
    local_steps: Literal["fixed", "dynamic"] = field(default="fixed", metadata={
        "help": "async_diloco: fixed (every replica takes sync.inner_steps per round) | dynamic "
                "(a replica's steps per round follow its measured step time relative to the "
                "fastest replica, in [1, inner_steps], so rounds end at about the same time)"})
    catch_up: bool = field(default=True, metadata={
        "help": "async_diloco: a replica adds the updates that other replicas' arrivals made to "
                "the global model to its own weights at its next step (reads theta, no waiting), "
                "instead of only at its own next arrival; false = Liu et al.'s algorithm as published"})
    momentum_per_lr: bool = field(default=False, metadata={
        "help": "async_diloco with delayed_nesterov: keep the momentum per unit of inner learning "
                "rate (early, large pseudo-gradients then weigh less in late momentum steps; "
                "steadier in short runs without catch-up, 0.3% worse loss per token with it)"})
    replica_nodes: int = field(default=0, metadata={
        "help": "diloco: nodes per replica (hierarchical layout): DDP or FSDP (parallel.data_parallel) "
                "inside each group of this many nodes, DiLoCo across the groups between corresponding "
                "ranks; async_diloco: DDP or FSDP inside each group, async_diloco across them, the "
                "servers (sync.ps_servers: a whole number of groups) on the last group(s); with FSDP "
                "every rank pushes / pulls its own shard to the server rank at its place in the "
                "server group (the global model is sharded like the replicas); 0 = a replica is "
                "one dp rank's tp x pp group (nodes: the launcher's, or HPCTRAIN_RANKS_PER_NODE's)"})
    ps_servers: int = field(default=1, metadata={
        "help": "ps / async_diloco: ranks that hold the parameters (the last ones); the others "
                "are workers (replicas)"})
    staleness: int = field(default=-1, metadata={
        "help": "ps: a worker may run at most this many steps ahead of the slowest one "
                "(0 = lockstep, -1 = unbounded)"})


@dataclass
class MetricsConfig:
    wandb: bool = field(default=False, metadata={
        "help": "also log every metrics.jsonl record (loss, lr, grad_norm, tokens_per_s, mfu, val_loss, "
                "...; the TensorBoard tags) to Weights & Biases from rank 0, step = training step; needs "
                "`pip install 'hpctrain[wandb]'`. WANDB_MODE=offline (compute nodes without network) "
                "writes RUN_DIR/wandb/offline-run-* (or under $WANDB_DIR): upload it with `wandb "
                "sync`. The W&B run id is kept in RUN_DIR/wandb_run.json: a resume or requeue "
                "continues the same W&B run, each step logged once"})
    wandb_project: str = field(default="hpctrain", metadata={"help": "W&B project"})
    wandb_entity: str = field(default="", metadata={"help": "W&B team or user ('' = your default entity)"})
    wandb_run_name: str = field(default="", metadata={"help": "W&B run name ('' = the run dir's name)"})
    wandb_group: str = field(default="auto", metadata={
        "help": "W&B group: auto (the Slurm job array's id, else the Slurm job id, kept from the "
                "run's first job; none outside Slurm) | '' (none) | a name"})
    profile_steps: str = field(default="", metadata={
        "help": "'A-B': torch.profiler over training steps A..B (one warmup step before A), a Chrome "
                "trace per training rank in RUN_DIR/profile/rank_<r>_steps_A-B.json (chrome://tracing, "
                "Perfetto); CPU + CUDA activities on GPUs; nothing outside the range ('' = off)"})
    profile_record_shapes: bool = field(default=False, metadata={"help": "profile_steps: record operator input shapes"})
    profile_with_stack: bool = field(default=False, metadata={
        "help": "profile_steps: record Python stacks of operators (larger traces, slower steps in the range)"})
    memory_snapshot_steps: str = field(default="", metadata={
        "help": "'A-B': CUDA allocator history over steps A..B dumped after step B to "
                "RUN_DIR/profile/memory_rank_<r>_steps_A-B.pickle (drag into pytorch.org/memory_viz); "
                "needs CUDA: a run on CPUs refuses it at start ('' = off)"})
