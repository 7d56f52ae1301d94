"""The schema of a run's settings: one dataclass per TOML section, every key with its type, default
and meaning (the `help` that `hpctrain train --help` prints).

Owns: the keys. Reading TOML and `--section.key=value` overrides into these lives in config.py, the
rules on values in config_rules.py. The sections of how a run lives on a cluster are in
config_cluster.py, a value's coercion into its key's type (`coerce`) and a Literal key's choices in
config_values.py; both re-exported here; the [model] keys are the model families'
(hpctrain/model/spec.py and each family's args). It must never import torch or read files. Test-only
faults are no keys of it: hpctrain/step_faults.py (HPCTRAIN_TEST_FAULTS).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hpctrain.config_cluster import (CheckpointConfig, DistConfig, MetricsConfig, SlurmConfig,  # noqa: F401
                                     SyncConfig)
from hpctrain.config_values import INT_MAX, INT_MIN, choices, coerce, key_choices, type_name  # noqa: F401
from hpctrain.model import spec as model_spec

REQUIRED = dataclasses.MISSING


@dataclass
class RunConfig:
    dir: str = field(metadata={"help": "run directory: checkpoints/, metrics.jsonl, config.toml live here"})


@dataclass
class DataConfig:
    path: str = field(metadata={"help": "dataset directory made by `data_tools shard`, or a blend of "
                                       "datasets made by `data_tools blend` (has manifest.json)"})
    train_split: str = field(default="train", metadata={"help": "split used for training"})
    val_split: str = field(default="val", metadata={"help": "split used for validation loss"})
    verify: Literal["checksum", "size"] = field(default="checksum", metadata={
        "help": "check shards at start: 'checksum' (sha256, spread over ranks) or 'size' (fast); "
                "with the node cache, each shard's sha256 is checked once per node as it is staged"})
    cache_dir: str = field(default="auto", metadata={
        "help": "node-local shard cache: one rank per node copies each shard there once, the node's "
                "ranks read the copy; 'auto' = $SLURM_TMPDIR or $TMPDIR if set, else off; 'off'; a "
                "path (may contain {node}; /dev/shm works)"})
    cache_bytes: int = field(default=0, metadata={
        "help": "node cache budget in bytes; least-recently-used shards are evicted beyond it "
                "(0 = 90% of the cache file system's free space)"})
    prefetch: int = field(default=4, metadata={
        "help": "steps ahead of the fastest local rank that the node leader stages shards"})
    prefetch_blocks: int = field(default=1, metadata={
        "help": "with data.shuffle = 'block': blocks of the order after the current one whose "
                "shards (those the node's ranks read) the node leader stages in the background "
                "once the next data.prefetch steps are staged, only if they fit data.cache_bytes "
                "with what the node still needs (so a block boundary does not wait on the shared "
                "file system); 0 = off"})
    shuffle: Literal["block", "global"] = field(default="block", metadata={
        "help": "sample order of a sharded dataset: 'block' = shards in a seeded order per epoch, "
                "windows shuffled inside blocks of shuffle_block_shards shards (memory 8 B x shards "
                "+ two blocks' windows; a node reads one block's shards at a time; a dataset of at "
                "most shuffle_block_shards shards gets exactly the 'global' order); 'global' = one "
                "permutation of every window per epoch (8 B x windows per rank). A resume keeps "
                "the order its checkpoint was saved with. A blend orders each component's windows "
                "this way over that component's own shards"})
    shuffle_block_shards: int = field(default=64, metadata={
        "help": "shards per block of data.shuffle = 'block' (two blocks' shards should fit "
                "data.cache_bytes; see docs/scale.md)"})
    document_mask: bool = field(default=False, metadata={
        "help": "attention never crosses a document boundary inside a window (a block-diagonal "
                "causal mask from the shards' doc_offsets, which `data_tools shard` writes); the "
                "loss stays on every token; false = today's windows of concatenated documents "
                "(bit-identical numbers); every layout, pipelines included (docs/data.md)"})
    document_positions: bool = field(default=False, metadata={
        "help": "with data.document_mask: positions (rotary or learned) restart at 0 at each "
                "document's first token in a window, as if each document were run alone"})


def _model_config_class() -> type:
    """ModelConfig: the flat [model] keys, from the model families' registry (model/spec.py):
    the common keys, `arch` (a Literal of the registered families), then each family's own keys
    (a [model.moe] table's keys are the moe_* ones without the prefix: config.py)."""
    fields = [(name, typ, field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
              for name, typ, f in model_spec.model_fields()]
    cls = dataclasses.make_dataclass("ModelConfig", fields)
    cls.__module__ = __name__
    return cls


ModelConfig = _model_config_class()


@dataclass
class TrainConfig:
    steps: int = field(metadata={"help": "optimizer steps: the length of the LR schedule"})
    micro_batch_size: int = field(metadata={"help": "sequences per rank per forward/backward"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step (one all-reduce per step)"})
    global_batch: int = field(default=0, metadata={
        "help": "sequences per optimizer step over the whole job (0 = off: micro_batch_size x "
                "grad_accum x dp); when set, leave grad_accum at 1: it is derived at start as "
                "global_batch / (micro_batch_size x dp), so the same job resumes on another node "
                "count (elastic restart) with the same batch; dp must divide "
                "global_batch / micro_batch_size"})
    stop_at_step: int = field(default=0, metadata={
        "help": "checkpoint and exit cleanly at this step without changing the schedule (0 = run to `steps`)"})
    seed: int = field(default=1337, metadata={"help": "seed for init, data order and dropout (0 to 2^32 - 1)"})
    precision: Literal["fp32", "bf16", "fp16", "fp8", "auto"] = field(default="fp32", metadata={
        "help": "fp32 | bf16 | fp16 | fp8 | auto (autocast; master weights stay fp32). fp16 is for GPUs "
                "without bf16 (V100, T4): dynamic loss scaling, overflow steps skipped and counted. "
                "fp8: bf16 plus torchao float8 matmuls in the Linear layers ([fp8]; GPUs of compute "
                "capability >= 8.9: H100, H200, L40; pip install 'hpctrain[fp8]'). "
                "auto: bf16 on GPUs that have it; on CPUs bf16 where a matmul of the model's shape "
                "measures >= 1.3x faster than fp32 at start, else fp32"})
    tf32: bool = field(default=True, metadata={
        "help": "CUDA GPUs with TF32 (A100, H100, ...): fp32 matmuls on tensor cores "
                "(torch.set_float32_matmul_precision('high')); false keeps full fp32. No effect on CPUs"})
    loss_scale_init: float = field(default=65536.0, metadata={
        "help": "fp16: the initial loss scale (torch.amp.GradScaler init_scale); it halves on every "
                "overflow and doubles after loss_scale_growth_interval clean steps"})
    loss_scale_growth_interval: int = field(default=2000, metadata={
        "help": "fp16: clean steps before the loss scale doubles"})
    compile: bool = field(default=False, metadata={
        "help": "torch.compile the model in place (per block or whole: train.compile_scope; "
                "parameter names, DDP/FSDP hooks and checkpoints unchanged) and, with "
                "train.loss_chunk, each chunk's loss math; fuses elementwise ops "
                "(docs/benchmarks.md); costs ~10-30 s of compilation at start; not with "
                "parallel.pp > 1"})
    compile_scope: Literal["auto", "blocks", "model"] = field(default="auto", metadata={
        "help": "what one torch.compile covers with train.compile: blocks (each transformer block "
                "apart: any layout, one compile serves every block) | model (the whole forward in "
                "place, names unchanged: fuses across blocks, the embeddings and the head; 1.16-1.20x "
                "the blocks' speed on an H200, ~2x the compile time; 1 rank or DDP only, not FSDP, "
                "tp, pp or ep) | auto (model on CUDA where the layout allows and the model has no "
                "experts, else blocks)"})
    lr: float = field(default=1e-3, metadata={
        "help": "peak learning rate, in (0, 10] (AdamW moves each weight by ~lr per step: above 10 "
                "a run diverges at once, so a larger value is a typo such as 3e3 for 3e-3)"})
    min_lr: float = field(default=1e-4, metadata={
        "help": "learning rate at the end of cosine decay; above train.lr it is taken as train.lr "
                "(a constant rate after warmup: a search over train.lr may keep one min_lr)"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW decoupled weight decay (matrices only)"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    optimizer: Literal["adamw", "sgd"] = field(default="adamw", metadata={
        "help": "adamw | sgd (plain SGD with train.momentum; the inner optimizer under sync.mode)"})
    momentum: float = field(default=0.0, metadata={"help": "with optimizer = 'sgd': momentum (0 = none)"})
    nesterov: bool = field(default=False, metadata={"help": "with optimizer = 'sgd' and momentum > 0: Nesterov momentum"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip global grad norm to this (0 = off; < 0 is refused)"})
    loss_chunk: int = field(default=0, metadata={
        "help": "tokens per chunk of the chunked linear + cross-entropy (0 = the plain path: the "
                "whole [tokens x vocab] logits and their gradient live at once). Turn it on (e.g. "
                "128) for large vocabularies (GPT-2's 50k, Llama's 128k): the logits of one chunk "
                "at a time, same loss and gradients, 2.2x the tokens/s and 7.5x less memory per "
                "micro-batch at 50k on CPU (docs/benchmarks.md); works with DDP, FSDP, TP and PP"})
    objective: Literal["pretrain", "sft", "dpo"] = field(default="pretrain", metadata={
        "help": "pretrain (next-token loss on every token) | sft (a chat dataset from `data_tools "
                "shard --format chat`: the loss on assistant tokens only, the mean over the global "
                "batch's trained tokens; README 'Fine-tuning on conversations (SFT)') | dpo (Direct "
                "Preference Optimization on a `shard --format preference` dataset, against the "
                "initial model's log-probs: the [dpo] section, README 'DPO')"})
    eval_interval: int = field(default=50, metadata={"help": "validation every N steps and at the end (0 = never)"})
    eval_batches: int = field(default=8, metadata={"help": "micro-batches per rank per validation"})
    log_interval: int = field(default=10, metadata={"help": "print a progress line every N steps (rank 0)"})
    straggler_window: int = field(default=10, metadata={
        "help": "flag a rank whose busy time exceeds 1.25x the median in this many consecutive steps"})
    max_bad_steps: int = field(default=5, metadata={
        "help": "a non-finite loss or grad norm skips the step; this many in a row stops the run "
                "(the last checkpoint stays the newest)"})


@dataclass
class ParallelConfig:
    dp: int = field(default=0, metadata={
        "help": "data-parallel size (0 = world / (tp * pp), / cp too with parallel.cp > 1); dp * cp * tp * pp "
                "must equal the world size"})
    tp: int = field(default=1, metadata={
        "help": "tensor-parallel size (innermost mesh axis: keep it <= GPUs per node); divides n_head"})
    sp: bool = field(default=True, metadata={
        "help": "with tp > 1: sequence parallelism (the residual stream, norms and MoE layers "
                "sequence-sharded over tp; false: whole on every tp rank, all-reduces instead of "
                "reduce-scatters)"})
    pp: int = field(default=1, metadata={"help": "pipeline-parallel stages (outermost mesh axis)"})
    cp: int = field(default=1, metadata={
        "help": "context-parallel size: each sequence split over cp ranks (zig-zag chunks; the ranks "
                "of a cp group share one dp rank's batches and the weights; gradients averaged over "
                "dp x cp); world = pp x dp x cp x tp; model.block_size a multiple of 2 x cp; not with "
                "pp, ep, dropout, compile or sync.mode other than 'sync' (docs/parallelism.md)"})
    cp_attention: Literal["ring", "ulysses"] = field(default="ring", metadata={
        "help": "with cp > 1: ring (K/V blocks passed round the cp ranks, any head count) | ulysses "
                "(all-to-all to whole sequences of heads / cp; cp must divide the query and key/value "
                "heads per tp rank)"})
    ep: int = field(default=1, metadata={
        "help": "expert-parallel size: each MoE layer's experts sharded over ep consecutive "
                "data-parallel ranks (tokens exchanged with all-to-all); divides dp and "
                "model.moe_experts"})
    deterministic_experts: bool = field(default=False, metadata={
        "help": "MoE: expert weight gradients summed in one binary-tree order over the dp index "
                "whatever ep is (each kept per source rank, then pairwise, then recursive doubling "
                "over the ep replicas), so a run resumed with another ep at the same dp gives "
                "bit-equal losses; ep = 1 then shards over a 1-rank ep group too (DDP / FSDP leave "
                "the experts out). Costs an [ep, ...] gradient buffer per expert weight (the whole "
                "layer's experts per rank) and log2(dp / ep) point-to-point exchanges instead of "
                "one all-reduce. On CUDA also turns on torch's deterministic algorithms (attention's backward "
                "adds in one order; slower). Power-of-two dp and ep, tp = 1"})
    data_parallel: Literal["ddp", "fsdp"] = field(default="ddp", metadata={
        "help": "ddp (replicated weights, all-reduce) | fsdp (FSDP2 fully_shard: sharded weights, "
                "grads and optimizer state over dp)"})
    dp_shard: int = field(default=0, metadata={
        "help": "fsdp: ranks each parameter is sharded over (HSDP: shard within dp_shard consecutive "
                "dp ranks, replicate over dp / dp_shard groups; dp_shard x tp x cp ranks per node "
                "keeps the parameter all-gathers inside a node); 0 = all of dp (plain FSDP)"})
    offload: Literal["none", "optimizer", "all"] = field(default="none", metadata={
        "help": "CPU offload: none | optimizer (AdamW's state and step in host memory, parameters "
                "and gradients on the device; any data_parallel; train.optimizer = 'adamw') | all "
                "(FSDP2's CPUOffloadPolicy: parameters, gradients and AdamW's state in host memory "
                "between uses; data_parallel = 'fsdp'). docs/parallelism.md"})
    pp_schedule: Literal["gpipe", "1f1b", "interleaved"] = field(default="1f1b", metadata={
        "help": "gpipe | 1f1b | interleaved (micro-batches per step = train.grad_accum)"})
    pp_virtual_stages: int = field(default=2, metadata={
        "help": "model chunks per pipeline rank with pp_schedule = 'interleaved'"})
    activation_checkpoint: Literal["none", "full", "selective", "selective_op"] = field(default="none", metadata={
        "help": "none | full (recompute every block in backward) | selective (every ac_every-th "
                "block) | selective_op (every block keeps its matmul and attention outputs, "
                "recomputes the rest: docs/parallelism.md)"})
    ac_every: int = field(default=2, metadata={
        "help": "with activation_checkpoint = 'selective': checkpoint blocks 0, N, 2N, ..."})
    meta_init: bool = field(default=True, metadata={
        "help": "build the model on the meta device, apply the layout, then materialize and "
                "initialize only this rank's shards (memory: its shards + the largest parameter); "
                "initial weights bit-identical to false (build the whole fp32 model on every rank "
                "first, then shard it: 4 bytes x all parameters per rank)"})


@dataclass
class DpoConfig:
    beta: float = field(default=0.1, metadata={
        "help": "train.objective = 'dpo': how far the policy may move from the reference (the "
                "initial model); the loss is -log sigmoid(beta x (chosen - rejected log-ratio))"})
    loss_type: Literal["sigmoid"] = field(default="sigmoid", metadata={
        "help": "sigmoid: the DPO paper's loss (TRL's loss_type 'sigmoid')"})


@dataclass
class InitConfig:
    from_dir: str = field(default="", metadata={
        "help": "a local Hugging Face model folder (config.json + model.safetensors or shards with "
                "model.safetensors.index.json; Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE or GPT-2; "
                "fp32, bf16 or fp16) to start a fresh run from: its config.json fills [model] (a conflicting key "
                "is an error), each rank reads only its part of the weights. Seeds a fresh run "
                "only: a checkpoint in the run dir takes precedence on resume ('' = random init)"})


@dataclass
class Fp8Config:
    recipe: Literal["tensorwise", "rowwise"] = field(default="tensorwise", metadata={
        "help": "train.precision = fp8: torchao's scaling granularity: one scale per tensor "
                "(fastest) or one per row (more accurate with outliers; no float8 all-gather)"})
    fsdp_all_gather: bool = field(default=False, metadata={
        "help": "fp8 + FSDP, tensorwise only: FSDP all-gathers the converted layers' weights in "
                "float8 (half of bf16's bytes; torchao enable_fsdp_float8_all_gather)"})
    skip: str = field(default="lm_head", metadata={
        "help": "comma-separated: Linear layers whose name contains one of these stay in bf16 (the "
                "output head: its logits need the precision; '' = none); layers with a dimension "
                "not a multiple of 16 always do (float8 tensor cores need it)"})
    emulate: bool = field(default=False, metadata={
        "help": "fp8 on any device (CPUs, GPUs older than 8.9) with torchao's emulated float8 "
                "matmuls: the numbers of fp8, none of its speed; for tests"})


@dataclass
class LoraConfig:
    rank: int = field(default=0, metadata={
        "help": "LoRA: rank of the low-rank adapters B A added to each target layer (0 = off: every "
                "parameter trains); only the adapters train and are checkpointed (docs/lora in README)"})
    alpha: float = field(default=16.0, metadata={
        "help": "LoRA scale numerator: a layer computes W x + (alpha / rank) B A x"})
    targets: str = field(default="wq,wk,wv,wo", metadata={
        "help": "comma-separated names of the nn.Linear layers that get adapters (the last part of "
                "their name: wq, wk, wv, wo; llama's MLP gate, up, proj; gpt2's fc, proj)"})
    dropout: float = field(default=0.0, metadata={
        "help": "dropout on the adapters' input (PEFT's lora_dropout), in [0, 1)"})


@dataclass
class EvalSetConfig:
    """One `[[eval]]` table: a named validation set evaluated during training."""
    name: str = field(metadata={
        "help": "the set's name in the metrics: eval/<name>/loss and eval/<name>/bpb (letters, "
                "digits, '_', '-', '.'; unique among the [[eval]] tables)"})
    data: str = field(metadata={
        "help": "a dataset directory made by `data_tools shard` with the training data's tokenizer"})
    split: str = field(default="val", metadata={"help": "the split of `data` evaluated"})
    interval: int = field(default=0, metadata={
        "help": "evaluate every N steps and at the end (0 = train.eval_interval); at step 0 "
                "too where the val split is (train.eval_interval > 0)"})
    max_batches: int = field(default=0, metadata={
        "help": "micro-batches of train.micro_batch_size windows per data-parallel rank "
                "(0 = train.eval_batches)"})
    max_tokens: int = field(default=0, metadata={
        "help": "at most this many predicted tokens over all ranks (0 = no cap beyond max_batches)"})


@dataclass
class Config:
    run: RunConfig
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    init: InitConfig = field(default_factory=InitConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    lora: LoraConfig = field(default_factory=LoraConfig)
    eval: list[EvalSetConfig] = field(default_factory=list)  # the [[eval]] tables, in order

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.run.dir) / "checkpoints"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def sections() -> dict[str, type]:
    """The [section] tables of a config and their classes (no [[list]] tables: table_lists)."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)
            if typing.get_origin(hints[f.name]) is not list}


def table_lists() -> dict[str, type]:
    """The [[name]] tables of a config (a list of tables each): name -> the class of one table."""
    hints = typing.get_type_hints(Config)
    return {f.name: typing.get_args(hints[f.name])[0] for f in dataclasses.fields(Config)
            if typing.get_origin(hints[f.name]) is list}
