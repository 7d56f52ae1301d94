"""The job the planner describes: cluster, parallel layout, batch, precision, sync mode, budgets.

Owns: `Job` (everything `hpctrain plan` is asked about besides the model shape) and its checks,
which mirror what `train` refuses (dp x cp x tp x pp = world, tp divides n_head, n_kv_head, the
SwiGLU width and block_size, no more pipeline stages than blocks, block_size a multiple of 2 cp,
Ulysses' cp dividing each tp rank's heads; async_diloco's server layout: plan/async_model.py),
each one line naming the option. Context parallelism (parallel.cp): cp ranks hold the same weights
and one sequence's parts, so a step's batch is dp's (`data_ranks`) and gradients are reduced over
dp x cp (`grad_ranks`). It must never compute bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hpctrain.config_schema import (CheckpointConfig, DataConfig, DistConfig, ParallelConfig,
                                    SyncConfig, TrainConfig, key_choices)
from hpctrain.plan import async_model
from hpctrain.plan.shape import ModelShape

GB = 10 ** 9
GiB = 1 << 30


# The values each option takes: the config's own (its Literal types), less what a plan cannot
# assume ("auto" precision / backend) or does not model (sync.mode ps).
CHOICES = {"data_parallel": key_choices(ParallelConfig, "data_parallel"),
           "pp_schedule": key_choices(ParallelConfig, "pp_schedule"),
           "activation_checkpoint": key_choices(ParallelConfig, "activation_checkpoint"),
           "precision": tuple(c for c in key_choices(TrainConfig, "precision") if c != "auto"),
           "sync_mode": tuple(c for c in key_choices(SyncConfig, "mode") if c != "ps"),
           "compression": key_choices(SyncConfig, "compression"),
           "pull_compression": key_choices(SyncConfig, "pull_compression"),
           "shuffle": key_choices(DataConfig, "shuffle"),
           "backend": tuple(c for c in key_choices(DistConfig, "backend") if c != "auto"),
           "checkpoint_layout": key_choices(CheckpointConfig, "layout"),
           "cp_attention": ("ring", "ulysses"),  # parallel.cp_attention
           "offload": key_choices(ParallelConfig, "offload")}


@dataclass(frozen=True)
class Job:
    nodes: int = 8
    gpus_per_node: int = 8              # ranks per node
    tokens: float = 1e12                # training corpus size (tokens)
    gpu_memory: int = 80 * GB           # per GPU (rank)
    memory_margin: float = 0.05         # share of gpu_memory kept free (CUDA context, NCCL, fragments)
    gpu_tflops: float = 989.0           # peak dense TFLOP/s per GPU at the precision (H100 SXM bf16)
    mfu: float = 0.4                    # model FLOPs utilization the step-time model assumes
    intra_node_bw: int = 360 * GB       # bytes/s per GPU inside a node (NVLink all-reduce bus bw)
    inter_node_bw: int = 40 * GB        # bytes/s per GPU between nodes (a 400 Gb/s NIC per GPU)
    node_memory: int = 1024 * GB        # host RAM per node
    node_disk: int = 3_840 * GB         # node-local disk (the cache's file system)
    cache_bytes: int = 0                # data.cache_bytes: 0 = 90% of node_disk
    prefetch: int = 4                   # data.prefetch
    shard_tokens: int = 100_000_000     # data_tools shard --shard-tokens
    shuffle: str = "block"              # data.shuffle: block | global
    shuffle_block_shards: int = 64      # data.shuffle_block_shards
    dp: int = 0                         # 0 = world / (tp * pp)
    tp: int = 1
    pp: int = 1
    cp: int = 1                         # parallel.cp: one sequence split over cp ranks (zig-zag chunks)
    cp_attention: str = "ring"          # parallel.cp_attention: ring | ulysses (cp divides the heads)
    ep: int = 1                         # parallel.ep: MoE experts split over ep of the dp ranks
    data_parallel: str = "ddp"          # ddp | fsdp
    dp_shard: int = 0                   # parallel.dp_shard: HSDP's shard group (fsdp; 0 = all of dp)
    offload: str = "none"               # parallel.offload: none | optimizer | all (fsdp): plan/offload.py
    pcie_bw: int = 25 * GB              # bytes/s per GPU between host memory and the GPU (offload)
    host_memory_bw: int = 200 * GB      # host memory bytes/s per node (offload's CPU AdamW)
    pp_schedule: str = "1f1b"           # gpipe | 1f1b | interleaved
    pp_virtual_stages: int = 2
    micro_batch: int = 1
    grad_accum: int = 1
    global_batch: int = 0               # train.global_batch: 0 = micro_batch x grad_accum x dp
    activation_checkpoint: str = "none"  # none | full | selective | selective_op
    ac_every: int = 2
    precision: str = "bf16"             # fp32 | bf16 | fp16
    loss_chunk: int = 0                 # train.loss_chunk: 0 = full logits, else tokens per chunk
    sync_mode: str = "sync"             # sync | diloco | async_diloco (plan/async_model.py)
    inner_steps: int = 16
    compression: str = "none"           # none | bf16 | int8 | int4 (diloco, async_diloco pushes)
    overlap: bool = False               # diloco
    replica_nodes: int = 0              # diloco: DDP inside replicas of this many nodes (0 = off)
    ps_servers: int = 1                 # async_diloco: server ranks (the last ranks / groups of nodes)
    pull_compression: str = "same"      # async_diloco: wire format of the pulls
    error_feedback: bool = False        # async_diloco (int8 / int4): push residual kept
    checkpoint_keep: int = 3
    checkpoint_layout: str = "rank"     # checkpoint.layout: rank (a file per rank) | node (per node)
    meta_init: bool = True              # parallel.meta_init: only each rank's shards are built
    backend: str = "nccl"               # dist.backend: nccl (GPUs) | gloo (CPU: FSDP reduce-scatter clones)
    pfs_files_limit: int = 1000         # files per checkpoint directory before we warn

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp_size(self) -> int:
        return self.dp or self.world // (self.tp * self.pp * self.cp)

    @property
    def grad_ranks(self) -> int:
        """Ranks holding the same weights whose gradients are reduced together: dp x cp (FSDP
        shards over them)."""
        return self.dp_size * self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP shards parameters, gradients and AdamW state over: dp x cp, or with HSDP
        (parallel.dp_shard) dp_shard x cp; the gradient shards are then all-reduced over
        dp_replicate = dp / dp_shard such groups."""
        return self.dp_shard * self.cp if self.dp_shard else self.grad_ranks

    @property
    def dp_replicate(self) -> int:
        return self.grad_ranks // self.shard_ranks

    @property
    def sharding(self) -> str:
        """'ddp', 'fsdp', or HSDP's 'hsdp 2x8' (dp_replicate x dp_shard)."""
        return f"hsdp {self.dp_replicate}x{self.dp_shard}" if self.dp_shard else self.data_parallel

    @property
    def replicas(self) -> int:
        """DiLoCo replicas of sync.replica_nodes nodes (0: not hierarchical)."""
        return self.nodes // self.replica_nodes if self.replica_nodes else 0

    @property
    def virtual(self) -> int:
        return self.pp_virtual_stages if self.pp_schedule == "interleaved" else 1

    @property
    def data_ranks(self) -> int:
        """Ranks that share one step's batch: dp; async_diloco: one replica's inner dp (a step is
        a batch one replica claims)."""
        if self.sync_mode != "async_diloco":
            return self.dp_size
        return self.replica_nodes * self.gpus_per_node // (self.tp * self.pp) if self.replica_nodes else 1

    @property
    def batch(self) -> int:
        """Sequences per optimizer step (micro_batch x grad_accum x dp)."""
        return self.micro_batch * self.grad_accum * self.data_ranks

    @property
    def layout_name(self) -> str:
        cp = f" cp{self.cp}" + (" ulysses" if self.cp_attention == "ulysses" else "") if self.cp > 1 else ""
        off = f" offload={self.offload}" if self.offload != "none" else ""
        return (f"{self.sharding} dp{self.dp_size}{cp} tp{self.tp} pp{self.pp} "
                f"mb{self.micro_batch}x{self.grad_accum} ac={self.activation_checkpoint}{off}")

    @property
    def usable_memory(self) -> int:
        return int(self.gpu_memory * (1 - self.memory_margin))

    @property
    def cache_budget(self) -> int:
        return self.cache_bytes or int(0.9 * self.node_disk)

    @property
    def half(self) -> bool:
        return self.precision in ("bf16", "fp16")

    def world_problem(self) -> str:
        """Why dp x cp x tp x pp is not the world size ('' when it is): a layout of another node
        count, as a config's [parallel] for more nodes."""
        if self.tp < 1 or self.pp < 1 or self.cp < 1 or self.grad_ranks * self.tp * self.pp == self.world:
            return ""
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        return (f"--dp/--tp/--pp{'/--cp' * bool(cp)}: dp={self.dp_size}{cp} x tp={self.tp} x pp={self.pp} "
                f"does not match the world size {self.world} (nodes x gpus per node)")

    def check(self, shape: ModelShape) -> "Job":
        """The job with train.global_batch resolved into grad_accum, or one line naming the option."""
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"--{key.replace('_', '-')} {getattr(self, key)!r}: expected one of "
                                 f"{', '.join(allowed)}")
        for key in ("nodes", "gpus_per_node", "tp", "pp", "cp", "micro_batch", "grad_accum",
                    "inner_steps", "ac_every", "pp_virtual_stages", "shard_tokens",
                    "shuffle_block_shards"):
            if getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if self.world_problem():
            raise ValueError(self.world_problem())
        if self.ep < 1 or self.grad_ranks % self.ep or (self.ep > 1 and (shape.moe_experts % self.ep
                                                                           or not shape.moe_experts)):
            raise ValueError(f"--ep {self.ep} must divide dp x cp {self.grad_ranks} (ep is borrowed "
                             f"from them) and model.moe_experts {shape.moe_experts} (a "
                             f"mixture-of-experts model's experts per rank)")
        problem = shape.tp_problem(self.tp)
        if problem:
            raise ValueError(f"--tp {self.tp} {problem}")
        self.check_cp(shape)
        if self.pp * self.virtual > shape.n_layer:
            raise ValueError(f"--pp {self.pp} x {self.virtual} virtual stages > n_layer {shape.n_layer}")
        if self.dp_shard and (self.data_parallel != "fsdp" or self.dp_shard < 0
                              or self.dp_size % self.dp_shard):
            raise ValueError(f"--dp-shard {self.dp_shard}: HSDP shards FSDP over dp_shard ranks: "
                             f"needs --data-parallel fsdp and a divisor of dp {self.dp_size}")
        if self.offload == "all" and self.data_parallel != "fsdp" or self.offload != "none" and self.sync_mode != "sync":
            raise ValueError(f"--offload {self.offload}: 'all' needs --data-parallel fsdp; "
                             f"offload needs --sync-mode sync")
        if self.sync_mode == "diloco" and self.data_parallel == "fsdp":
            raise ValueError("--sync-mode diloco: replicas train apart; use --data-parallel ddp")
        if self.replica_nodes and (self.sync_mode == "sync" or self.replica_nodes < 0
                                   or self.nodes % self.replica_nodes
                                   or self.replica_nodes * self.gpus_per_node % (self.tp * self.pp)):
            raise ValueError(f"--replica-nodes {self.replica_nodes}: needs --sync-mode diloco or async_diloco, "
                             f"a divisor of --nodes {self.nodes} and replicas whose ranks tp x pp "
                             f"= {self.tp * self.pp} divides")
        async_model.check(self)
        if self.tokens < shape.block_size + 1:
            raise ValueError(f"--tokens {self.tokens:g} holds no window of block_size+1 tokens")
        for key in ("memory_margin", "mfu"):
            if not 0 <= getattr(self, key) < 1 or (key == "mfu" and self.mfu == 0):
                raise ValueError(f"--{key.replace('_', '-')} {getattr(self, key)}: expected a fraction "
                                 f"in {'(0, 1)' if key == 'mfu' else '[0, 1)'}")
        for key in ("gpu_tflops", "intra_node_bw", "inter_node_bw"):
            if getattr(self, key) <= 0:
                raise ValueError(f"--{key.replace('_', '-')} must be > 0, got {getattr(self, key)}")
        return self.resolve_global_batch()

    def check_cp(self, shape: ModelShape) -> None:
        """parallel.cp's rules, each one line naming the option."""
        if self.cp == 1:
            return
        if shape.block_size % (2 * self.cp):
            raise ValueError(f"--cp {self.cp}: block_size {shape.block_size} must be a multiple of 2 x cp "
                             f"= {2 * self.cp} (the zig-zag chunks)")
        if self.pp > 1:
            raise ValueError(f"--cp {self.cp} with --pp {self.pp}: the planner does not model context "
                             f"parallelism with pipeline stages yet (train runs it); plan with --pp 1")
        heads, kv = shape.n_head // self.tp, shape.kv_heads // self.tp
        if self.cp_attention == "ulysses" and (heads % self.cp or kv % self.cp):
            raise ValueError(f"--cp-attention ulysses: cp {self.cp} must divide each tp rank's "
                             f"{heads} query and {kv} key/value heads; use ring")

    def resolve_global_batch(self) -> "Job":
        """config_rules.resolve_grad_accum: grad_accum = global_batch / (micro_batch x dp)."""
        if self.global_batch <= 0:
            return self
        if self.grad_accum != 1:
            raise ValueError(f"--global-batch {self.global_batch} with --grad-accum {self.grad_accum}: "
                             f"give one of them (train.global_batch derives the accumulation)")
        per_step = self.micro_batch * self.data_ranks
        if self.global_batch % per_step:
            raise ValueError(f"--global-batch {self.global_batch} is not a multiple of micro_batch "
                             f"{self.micro_batch} x dp {self.data_ranks} = {per_step}")
        return replace(self, grad_accum=self.global_batch // per_step, global_batch=0)


def on_cpu_nodes(given: dict, ranks_per_node: int) -> dict:
    """`--gpus-per-node 0 --ranks-per-node R`: nodes of R CPU ranks. The Job's keys for them: R
    ranks per node, each rank's memory budget its share of --node-memory (--gpu-memory, when
    given, is the budget per rank), `auto` precision as fp32 (train measures it on a CPU: fp32
    unless bf16 is faster) and `auto` backend as gloo (train's on a CPU)."""
    if ranks_per_node < 1:
        raise ValueError(f"--ranks-per-node {ranks_per_node}: --gpus-per-node 0 (CPU nodes) needs "
                         f"--ranks-per-node N >= 1, the ranks each node runs")
    out = {"gpu_memory": given.get("node_memory", Job.node_memory) // ranks_per_node, **given,
           "gpus_per_node": ranks_per_node}
    out["precision"] = "fp32" if out.get("precision", "auto") == "auto" else out["precision"]
    out["backend"] = "gloo" if out.get("backend", "auto") == "auto" else out["backend"]
    return out
