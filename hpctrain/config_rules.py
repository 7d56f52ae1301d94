"""The rules a run's settings must follow: value ranges per key, and the cross-key rules that need
no world size (the mesh checks dp x cp x tp x pp against the world size at start-up); once dp is known,
`resolve_grad_accum` turns train.global_batch into the accumulation.

Owns: every check `validate` runs (config.from_dict calls it); each failure is one `ConfigError` naming the key.
It must never import torch or look at anything but the config's values.
"""
from __future__ import annotations

import dataclasses
import re
import typing

from hpctrain.config_schema import (CheckpointConfig, Config, DataConfig, ModelConfig, ParallelConfig,
                                    SlurmConfig, SyncConfig, TrainConfig, sections)
from hpctrain.config_rules_cp import validate_context_parallel
from hpctrain.config_rules_fp8 import validate_fp8
from hpctrain.config_rules_offload import validate_offload
from hpctrain.config_tables import validate_eval_sets
from hpctrain.errors import ConfigError
from hpctrain.model import spec as model_spec
from hpctrain.model.llama.args import llama_ffn_hidden  # noqa: F401 (the name plan/shape.py imported)


def validate(cfg: Config) -> Config:
    """`cfg`, or raise ConfigError naming the first key whose value breaks a rule."""
    m, t = cfg.model, cfg.train
    _validate_model(m)
    _check(cfg.parallel.ep == 1 or cfg.sync.mode == "sync", "parallel.ep",
           f"{cfg.parallel.ep} with sync.mode = {cfg.sync.mode!r}: expert parallelism needs "
           f"sync.mode = 'sync' (or parallel.ep = 1)")
    _check(not cfg.parallel.deterministic_experts or cfg.sync.mode == "sync",
           "parallel.deterministic_experts", f"needs sync.mode = 'sync' (got {cfg.sync.mode!r}); set it to false")
    _check(t.steps >= 1, "train.steps", "must be >= 1")
    _check(0 <= t.seed <= MAX_SEED, "train.seed", f"{t.seed}: must be in [0, {MAX_SEED}]")
    _check(0 <= t.stop_at_step <= t.steps, "train.stop_at_step", f"must be in [0, train.steps={t.steps}]")
    _check(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
    _check(t.grad_accum >= 1, "train.grad_accum", "must be >= 1")
    _check(t.loss_chunk >= 0, "train.loss_chunk", f"{t.loss_chunk}: must be >= 0 (0 = plain loss)")
    _check(t.global_batch >= 0, "train.global_batch", "must be >= 0 (0 = off)")
    _check(t.global_batch == 0 or t.grad_accum == 1, "train.global_batch",
           f"{t.global_batch} with train.grad_accum={t.grad_accum}: give one of them (with "
           f"global_batch the accumulation is derived from the data-parallel size)")
    _check(t.global_batch % max(t.micro_batch_size, 1) == 0, "train.global_batch",
           f"{t.global_batch} is not a multiple of train.micro_batch_size={t.micro_batch_size}")
    _check(t.precision != "fp16" or cfg.sync.mode not in ("ps", "async_diloco"), "train.precision",
           f"fp16 needs loss scaling agreed by every rank each step, which sync.mode="
           f"'{cfg.sync.mode}' workers do not do: use fp32 or bf16 there")
    validate_fp8(cfg, _check)
    _check(t.loss_scale_init > 0, "train.loss_scale_init", "must be > 0")
    _check(t.loss_scale_growth_interval >= 1, "train.loss_scale_growth_interval", "must be >= 1")
    _check(0 <= t.warmup_steps <= t.steps, "train.warmup_steps",
           f"{t.warmup_steps}: must be in [0, train.steps={t.steps}]")
    _validate_checkpoint(cfg.checkpoint)
    validate_eval_sets(cfg)
    _check(t.max_bad_steps >= 1, "train.max_bad_steps", "must be >= 1")
    _check(t.straggler_window >= 2, "train.straggler_window", "must be >= 2")
    hb = cfg.dist.heartbeat_timeout_s
    _check(hb == 0 or MIN_HEARTBEAT_S <= hb <= MAX_HEARTBEAT_S, "dist.heartbeat_timeout_s",
           f"{hb:g}: must be 0 (off) or in [{MIN_HEARTBEAT_S:g}, {MAX_HEARTBEAT_S:g}] seconds")
    _check(cfg.dist.stall_timeout_s > 0, "dist.stall_timeout_s", "must be > 0")
    _validate_data(cfg.data)
    _validate_lora(cfg)
    _check(cfg.dist.powersgd_rank >= 1, "dist.powersgd_rank", "must be >= 1")
    _check(0.0 <= t.momentum < 1.0, "train.momentum", "must be in [0, 1)")
    _check(not t.nesterov or (t.optimizer == "sgd" and t.momentum > 0), "train.nesterov",
           "needs train.optimizer = 'sgd' and train.momentum > 0")
    _check(cfg.dist.timeout_s > 0, "dist.timeout_s", "must be > 0")
    _validate_optimizer(t)
    _validate_intervals(t)
    _validate_sync(cfg.sync, cfg.parallel)
    _validate_parallel(cfg.parallel, m, t.compile)
    validate_context_parallel(cfg, _check)
    validate_offload(cfg, _check)
    _validate_compile_scope(t, cfg.parallel)
    _validate_slurm(cfg.slurm)
    _validate_seconds(cfg)
    for key in ("profile_steps", "memory_snapshot_steps"):  # 'A-B' within the run, or '' (off)
        text = getattr(cfg.metrics, key)
        _check(text == "" or step_range(text, t.steps) is not None, f"metrics.{key}",
               f"{text!r}: expected 'A-B', training steps 1 <= A <= B <= train.steps={t.steps} (e.g. "
               f"'10-12'), or '' (off)")
    return cfg


# Every float key in seconds (its name ends in `_s`): a wait longer than a week is a typo (1e300
# overflowed the timedelta of the first collective, with a traceback); the heartbeat's own range:
# below 1 s its beats (every timeout / 10, at least 0.2 s) leave no slack; above a day it is off.
MAX_SECONDS = 7 * 24 * 3600
MIN_HEARTBEAT_S, MAX_HEARTBEAT_S = 1.0, 86400.0
MAX_SEED = 2**32 - 1  # torch.manual_seed(seed * 1_000_003 + rank + 1) must fit 64 bits
# `lfs setstripe -S`: bytes with an optional k/M/G suffix, a multiple of 64 KiB below 4 GiB, 0 = default
STRIPE_UNIT, STRIPE_MAX = 64 << 10, (4 << 30) - (64 << 10)
MAX_STRIPE_COUNT = 2000  # Lustre's LOV_MAX_STRIPE_COUNT


def _validate_lora(cfg: Config) -> None:
    """[lora]: on with rank > 0; the layouts it is tested with (DDP, FSDP2 over dp, sync mode)."""
    lo, p = cfg.lora, cfg.parallel
    _check(lo.rank >= 0, "lora.rank", f"{lo.rank}: must be >= 0 (0 = off)")
    if lo.rank == 0:
        return
    _check(lo.alpha > 0, "lora.alpha", f"{lo.alpha:g}: must be > 0")
    _check(0.0 <= lo.dropout < 1.0, "lora.dropout", f"{lo.dropout:g}: must be in [0, 1)")
    _check(any(t.strip() for t in lo.targets.split(",")), "lora.targets",
           "is empty: name the layers that get adapters, e.g. 'wq,wk,wv,wo'")
    for key, value in (("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.cp", p.cp),
                       ("parallel.ep", p.ep)):
        _check(value == 1, key, f"{value} with lora.rank = {lo.rank}: LoRA runs on DDP or FSDP2 "
                                f"over dp only; set {key} = 1")
    _check(cfg.sync.mode == "sync", "lora.rank", f"{lo.rank} with sync.mode = {cfg.sync.mode!r}: "
                                                 f"LoRA trains with sync.mode = 'sync' only")
    _check(cfg.train.precision != "fp8", "lora.rank", f"{lo.rank} with train.precision = 'fp8': "
                                                     f"float8 layers replace the adapted ones; use bf16")
    _check(not cfg.train.compile, "lora.rank", f"{lo.rank} with train.compile = true: not tested "
                                               f"together; set train.compile = false")


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _check(c.interval >= 1, "checkpoint.interval", "must be >= 1")
    _check(c.keep >= 1, "checkpoint.keep", "must be >= 1")
    _check(0 < c.async_cpu_share <= 1, "checkpoint.async_cpu_share", "must be in (0, 1]")
    _check(c.snapshot_interval >= 0, "checkpoint.snapshot_interval", "must be >= 0 (0 = off)")
    _check(c.snapshot_dir.strip() != "", "checkpoint.snapshot_dir",
           f"{c.snapshot_dir!r} is empty: give 'auto' ($SLURM_TMPDIR, else /dev/shm) or a path (may "
           f"contain {{node}}); to turn peer snapshots off, set checkpoint.snapshot_interval = 0")
    _check(-1 <= c.stripe_count <= MAX_STRIPE_COUNT, "checkpoint.stripe_count",
           f"{c.stripe_count}: must be -1 (all OSTs), 0 (auto) or in [1, {MAX_STRIPE_COUNT}]")
    _check(stripe_size_bytes(c.stripe_size) is not None, "checkpoint.stripe_size",
           f"{c.stripe_size!r}: expected what `lfs setstripe -S` takes: bytes with an optional k, "
           f"M or G suffix, a multiple of 64k below 4G (e.g. 1M, 4M, 16M), or 0 for the file "
           f"system's default")


def stripe_size_bytes(text: str) -> int | None:
    """checkpoint.stripe_size in bytes (0: the file system's default), None if lfs would refuse it."""
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", text.strip())
    if m is None:
        return None
    size = int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
    ok = size == 0 or (size % STRIPE_UNIT == 0 and size <= STRIPE_MAX)
    return size if ok else None


def step_range(text: str, steps: int) -> tuple[int, int] | None:
    """metrics.profile_steps / memory_snapshot_steps 'A-B' as (A, B); None unless 1 <= A <= B <= steps."""
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    first, last = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    return (first, last) if 1 <= first <= last <= steps else None


def _validate_seconds(cfg: Config) -> None:
    """Every float key in seconds, generically (a new one is covered): at most MAX_SECONDS, and
    not negative (each key's own rule may ask more, e.g. > 0); nan and inf never parse (coerce)."""
    for section, cls in sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name.endswith("_s") and hints[f.name] is float:
                value, key = getattr(getattr(cfg, section), f.name), f"{section}.{f.name}"
                _check(value >= 0, key, f"{value:g}: must be >= 0 seconds")
                _check(value <= MAX_SECONDS, key, f"{value:g}: must be at most {MAX_SECONDS} "
                       f"seconds (7 days)")


# The largest train.lr accepted: AdamW moves every weight by about lr per step, so above this a
# run diverges in its first step whatever the model; larger values are typos (3e3 for 3e-3).
MAX_LR = 10.0


def _validate_model(m: ModelConfig) -> None:
    _check(m.n_layer >= 1, "model.n_layer", "must be >= 1")
    _check(m.n_embd >= 1, "model.n_embd", "must be >= 1")
    _check(m.n_head >= 1 and m.n_embd % m.n_head == 0, "model.n_head",
           f"n_embd={m.n_embd} must be divisible by n_head={m.n_head}")
    _check(m.block_size >= 1, "model.block_size", "must be >= 1")
    _check(m.max_positions == 0 or m.max_positions >= m.block_size, "model.max_positions",
           f"{m.max_positions}: must be 0 (= block_size) or >= model.block_size={m.block_size} "
           f"(the positions a training sequence uses)")
    _check(m.vocab_size >= 1, "model.vocab_size", "must be >= 1")
    _check(0.0 <= m.dropout < 1.0, "model.dropout", "must be in [0, 1)")
    _validate_family(m)


def _validate_family(m: ModelConfig) -> None:
    """The keys of model.arch's family (its ModelSpec's rules); another family's keys set away
    from their defaults are refused (they would be silently ignored)."""
    spec = model_spec.get(m.arch)
    owned = model_spec.owned_keys(spec)
    for f in dataclasses.fields(ModelConfig):
        if f.name not in owned and getattr(m, f.name) != f.default:
            families = [s.name for s in map(model_spec.get, model_spec.names()) if f.name in model_spec.owned_keys(s)]
            _check(False, f"model.{f.name}", f"{getattr(m, f.name)!r} is a key of model.arch "
                   f"{' / '.join(repr(x) for x in families)}, not of {m.arch!r}; set model.arch or remove it")
    spec.check_config(m, _check)


def _validate_optimizer(t: TrainConfig) -> None:
    """The learning-rate schedule and the optimizer's hyper-parameters (torch would refuse most of
    these only at the first step, with a traceback)."""
    _check(0 < t.lr <= MAX_LR, "train.lr", f"{t.lr}: must be in (0, {MAX_LR:g}]")
    _check(t.min_lr >= 0, "train.min_lr", f"{t.min_lr}: must be >= 0")
    _check(0.0 <= t.beta1 < 1.0, "train.beta1", f"{t.beta1}: must be in [0, 1)")
    _check(0.0 <= t.beta2 < 1.0, "train.beta2", f"{t.beta2}: must be in [0, 1)")
    _check(t.weight_decay >= 0, "train.weight_decay", f"{t.weight_decay}: must be >= 0")
    _check(t.grad_clip >= 0, "train.grad_clip", f"{t.grad_clip}: must be >= 0 (0 = off)")


def _validate_intervals(t: TrainConfig) -> None:
    _check(t.eval_interval >= 0, "train.eval_interval", f"{t.eval_interval}: must be >= 0 (0 = never)")
    _check(t.eval_batches >= 1, "train.eval_batches", f"{t.eval_batches}: must be >= 1")
    _check(t.log_interval >= 1, "train.log_interval", f"{t.log_interval}: must be >= 1")


def _validate_slurm(sl: SlurmConfig) -> None:
    from hpctrain.signals import parse  # standard library only

    try:
        parse(sl.signals)
    except ValueError as e:
        raise ConfigError(f"config key 'slurm.signals': {e} (expected e.g. USR1,TERM)") from None
    _check(sl.time_margin_s >= 0, "slurm.time_margin_s", "must be >= 0")
    _check(sl.time_check_s > 0, "slurm.time_check_s", "must be > 0")

def _validate_sync(s: SyncConfig, p: ParallelConfig) -> None:
    _check(s.inner_steps >= 1, "sync.inner_steps", "must be >= 1")
    _check(s.outer_lr > 0, "sync.outer_lr", "must be > 0")
    _check(0.0 <= s.outer_momentum < 1.0, "sync.outer_momentum", "must be in [0, 1)")
    _check(s.outer_final_lr >= 0, "sync.outer_final_lr", "must be >= 0 (0 = a constant outer lr)")
    _check(not s.outer_final_lr or s.mode == "diloco", "sync.outer_final_lr",
           f"decays DiLoCo's outer lr: use sync.mode = 'diloco' (not '{s.mode}') or leave it 0")
    _check(1 <= s.fragments <= s.inner_steps, "sync.fragments", "must be in [1, sync.inner_steps]")
    _check(s.int8_block >= 0, "sync.int8_block", "must be >= 0")
    _check(s.ps_servers >= 1, "sync.ps_servers", "must be >= 1")
    _check(s.staleness >= -1, "sync.staleness", "must be >= -1 (-1 = unbounded)")
    if s.mode == "diloco":
        _check(p.data_parallel == "ddp" or s.replica_nodes > 0, "parallel.data_parallel",
               "sync.mode = 'diloco' replicates over dp: use 'ddp', or set sync.replica_nodes for "
               "FSDP inside a replica of nodes")
    _check(p.dp_shard == 0 or s.mode == "sync", "parallel.dp_shard",
           f"HSDP runs with sync.mode = 'sync' (not '{s.mode}'): leave parallel.dp_shard = 0")
    _check(s.replica_nodes >= 0, "sync.replica_nodes", f"{s.replica_nodes}: must be >= 0 (0 = off)")
    _check(s.replica_nodes == 0 or s.mode in ("diloco", "async_diloco"), "sync.replica_nodes",
           f"forms DiLoCo / async_diloco replicas of nodes: use sync.mode = 'diloco' or 'async_diloco' "
           f"(not '{s.mode}') or leave it 0")
    _check(s.compression == "none" or s.mode in ("diloco", "async_diloco"), "sync.compression",
           f"compresses pseudo-gradients, which only sync.mode = 'diloco' or 'async_diloco' send "
           f"(sync.mode = '{s.mode}' would ignore it): leave it 'none'")
    _check(s.pull_compression == "same" or (s.mode == "async_diloco" and s.compression != "none"),
           "sync.pull_compression", f"sets the format of async_diloco's compressed pulls: use sync.mode = "
           f"'async_diloco' with sync.compression bf16 | int8 | int4 (not '{s.mode}' / "
           f"'{s.compression}'), or leave it 'same'")
    _check(not s.defer_momentum_pull or (s.mode == "async_diloco" and s.compression != "none"
                                         and s.outer_optimizer == "delayed_nesterov"),
           "sync.defer_momentum_pull", "defers delayed Nesterov's momentum step to async_diloco's "
           "next compressed pull: use sync.mode = 'async_diloco', sync.compression bf16 | int8 | int4 "
           "and sync.outer_optimizer = 'delayed_nesterov', or leave it false")
    _check(not s.streaming or s.mode == "diloco", "sync.streaming",
           f"is a DiLoCo variant: use sync.mode = 'diloco' (not '{s.mode}') or leave it false")
    _check(1 <= s.overlap_steps <= max(1, s.inner_steps // s.fragments), "sync.overlap_steps",
           "must be in [1, sync.inner_steps / sync.fragments]: a fragment's average must arrive "
           "before the next fragment is sent")
    _check(0.0 <= s.mix_alpha < 1.0, "sync.mix_alpha", "must be in [0, 1)")
    _check(not s.error_feedback or ((s.streaming or s.mode == "async_diloco") and s.compression in ("int8", "int4")),
           "sync.error_feedback", f"keeps Streaming DiLoCo's or async_diloco's push quantization residuals: "
           f"use sync.streaming = true or sync.mode = 'async_diloco', with sync.compression int8 | int4 "
           f"(not {str(s.streaming).lower()} / '{s.mode}' / '{s.compression}'), or leave it false")
    _check(s.nesterov_delay >= 0, "sync.nesterov_delay", "must be >= 0 (0 = the number of replicas)")
    _check(not s.momentum_per_lr or (s.mode == "async_diloco" and s.outer_optimizer == "delayed_nesterov"),
           "sync.momentum_per_lr", "applies to sync.mode = 'async_diloco' with sync.outer_optimizer = "
           "'delayed_nesterov' only: leave it false")
    if s.mode == "async_diloco":
        _check(p.dp == 0, "sync.mode",
               "'async_diloco' counts replicas from the ranks left after sync.ps_servers (tp x pp "
               "each, or sync.replica_nodes nodes each): leave parallel.dp at its default")
        _check(p.data_parallel == "ddp" or s.replica_nodes > 0, "parallel.data_parallel",
               "'fsdp' with sync.mode = 'async_diloco' shards a replica of nodes: set "
               "sync.replica_nodes (FSDP inside each group of nodes), or use 'ddp'")
    if s.mode == "ps":
        _check(p.tp == 1 and p.pp == 1 and p.dp == 0 and p.data_parallel == "ddp", "sync.mode",
               "'ps' runs one model copy per worker rank: leave parallel.dp/tp/pp and "
               "parallel.data_parallel at their defaults")


def _validate_data(d: DataConfig) -> None:
    _check(d.cache_bytes >= 0, "data.cache_bytes", "must be >= 0 (0 = auto)")
    _check(d.prefetch >= 0, "data.prefetch", "must be >= 0")
    _check(d.prefetch_blocks >= 0, "data.prefetch_blocks", "must be >= 0 (0 = off)")
    _check(d.shuffle_block_shards >= 1, "data.shuffle_block_shards", "must be >= 1")
    _check(d.document_mask or not d.document_positions, "data.document_positions",
           "needs data.document_mask = true (positions restart where attention does)")


def _validate_compile_scope(t: TrainConfig, p: ParallelConfig) -> None:
    """train.compile_scope = model compiles the whole forward in place: under FSDP2, TP, PP or EP
    the layout's hooks and DTensors sit between the blocks, where only per-block regions work."""
    whole_model_layout = (p.data_parallel != "fsdp" and p.tp == 1 and p.pp == 1 and p.ep == 1
                          and not p.deterministic_experts)
    _check(t.compile_scope != "model" or whole_model_layout, "train.compile_scope",
           "'model' needs 1 rank or DDP (not parallel.data_parallel = fsdp, tp, pp or ep > 1); "
           "use 'blocks' or 'auto'")


def _validate_parallel(p: ParallelConfig, m: ModelConfig, compile: bool = False) -> None:
    """Layout checks that need no world size (the mesh checks dp * tp * pp == world)."""
    _check(p.dp >= 0, "parallel.dp", f"{p.dp}: must be >= 0 (0 = derived from the world size)")
    _check(p.tp >= 1, "parallel.tp", f"{p.tp}: must be >= 1")
    _check(p.dp_shard >= 0, "parallel.dp_shard", f"{p.dp_shard}: must be >= 0 (0 = all of dp)")
    _check(p.dp_shard == 0 or p.data_parallel == "fsdp", "parallel.dp_shard",
           f"{p.dp_shard} shards FSDP's parameters (HSDP): set parallel.data_parallel = 'fsdp' or "
           f"leave parallel.dp_shard = 0")
    _check(p.dp_shard == 0 or p.dp == 0 or p.dp % p.dp_shard == 0, "parallel.dp_shard",
           f"{p.dp_shard} must divide parallel.dp={p.dp} (dp = dp_replicate x dp_shard)")
    _check(p.pp >= 1, "parallel.pp", f"{p.pp}: must be >= 1")
    _check(p.pp_virtual_stages >= 1, "parallel.pp_virtual_stages", "must be >= 1")
    _check(p.ac_every >= 1, "parallel.ac_every", "must be >= 1")
    _check(p.ep >= 1, "parallel.ep", f"{p.ep}: must be >= 1")
    experts = model_spec.get(m.arch).n_experts(m)
    _check(p.ep == 1 or experts > 0, "parallel.ep",
           f"{p.ep} needs a mixture-of-experts model (model.moe_experts > 0); use parallel.ep = 1")
    _check(p.ep == 1 or experts % p.ep == 0, "parallel.ep",
           f"{p.ep} must divide model.moe_experts={experts} (each rank holds experts / ep)")
    _check(p.ep == 1 or p.dp == 0 or p.dp * p.cp % p.ep == 0, "parallel.ep",  # dp x cp: #51
           f"{p.ep} must divide parallel.dp={p.dp} x parallel.cp={p.cp} (the ep ranks are borrowed "
           f"from dp x cp)")
    _check(not p.deterministic_experts or (experts > 0 and p.tp == 1), "parallel.deterministic_experts",
           "needs a mixture-of-experts model (model.moe_experts > 0) and parallel.tp = 1; set it to false")
    _check(not p.deterministic_experts or all(n & (n - 1) == 0 for n in (p.ep, p.dp * p.cp)),
           "parallel.deterministic_experts", f"needs a power-of-two parallel.ep and parallel.dp x "
           f"parallel.cp (got ep={p.ep}, dp={p.dp}, cp={p.cp}: its summation tree pairs ranks); set "
           f"it to false")
    _check(not (compile and p.pp > 1), "train.compile",
           "not supported with pipeline parallelism (parallel.pp > 1): the pipeline schedule runs "
           "stage modules directly; set train.compile = false")
    _check(m.n_head % p.tp == 0, "parallel.tp",
           f"tp={p.tp} must divide model.n_head={m.n_head} (each rank holds n_head / tp heads)")
    model_spec.get(m.arch).check_tp(m, p.tp, _check)
    _check(not p.sp or m.block_size % p.tp == 0, "parallel.tp",
           f"tp={p.tp} must divide model.block_size={m.block_size} (sequence parallelism)")
    stages = p.pp * (p.pp_virtual_stages if p.pp_schedule == "interleaved" and p.pp > 1 else 1)
    _check(stages <= m.n_layer, "parallel.pp",
           f"pp={p.pp} x virtual stages gives {stages} pipeline stages but model.n_layer={m.n_layer}: "
           f"every stage needs at least one block")


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}': {msg}")


def resolve_grad_accum(t: TrainConfig, dp: int) -> int:
    """Micro-batches per optimizer step once the data-parallel size is known: train.grad_accum, or
    with train.global_batch > 0, global_batch / (micro_batch_size x dp). A ConfigError naming the
    key and the dp sizes that would work when it does not split evenly."""
    if t.global_batch <= 0:
        return t.grad_accum
    per_step = t.micro_batch_size * dp
    if dp < 1 or t.global_batch % per_step:
        n = t.global_batch // t.micro_batch_size  # validate() made it a multiple of micro_batch_size
        ok = ", ".join(str(d) for d in _divisors(n))
        raise ConfigError(f"config key 'train.global_batch': {t.global_batch} sequences per step do "
                          f"not split over dp={dp} ranks x micro_batch_size {t.micro_batch_size}; "
                          f"use a world whose dp divides {n} ({ok}) or change train.global_batch")
    return t.global_batch // per_step


def global_batch_line(t: TrainConfig, dp: int) -> str:
    """The start-up log line: 'train.global_batch 24 = micro_batch 4 x grad_accum 3 x dp 2'."""
    return (f"train.global_batch {t.micro_batch_size * t.grad_accum * dp} = micro_batch "
            f"{t.micro_batch_size} x grad_accum {t.grad_accum} x dp {dp}")


def check_resume_batch(saved: int, t: TrainConfig, dp: int, where) -> None:
    """A resume may change dp (another node count), never the global batch: the sampler's order
    and the LR schedule are per optimizer step. `t.grad_accum` is the resolved one."""
    now = t.micro_batch_size * t.grad_accum * dp
    if saved == now:
        return
    if t.global_batch:
        raise ConfigError(f"config key 'train.global_batch': {t.global_batch} differs from "
                          f"checkpoint {where} ({saved} sequences per step); set "
                          f"train.global_batch = {saved} to resume it")
    hint = (f"set train.global_batch = {saved} (the accumulation then follows dp)"
            if saved % t.micro_batch_size == 0 else
            f"adjust micro_batch_size / grad_accum so the global batch stays {saved}")
    raise ConfigError(f"config keys 'train.micro_batch_size' x 'train.grad_accum' x dp: global batch "
                      f"{t.micro_batch_size} x {t.grad_accum} x {dp} = {now} differs from checkpoint "
                      f"{where} ({saved} sequences per step); {hint}")


def stop_at_step_line(t, step: int, resumed: bool = False) -> str:
    """What a run stopped by train.stop_at_step says: how to go on (the same command would stop
    at once again)."""
    what = (f"nothing to train: resumed at step {step} >= train.stop_at_step={t.stop_at_step}" if resumed
            else f"stopped at train.stop_at_step={t.stop_at_step}: step {step}")
    return (f"{what} of train.steps={t.steps}; to go on, raise or remove train.stop_at_step and run "
            f"again: it resumes from step {step}")


_MAY_CHANGE_ON_RESUME = ("dropout", "moe_warn_ratio", "moe_warn_steps")  # not the model's shape


def check_same_model(saved: dict, current: dict, path) -> None:
    """A resume trains the model the checkpoint holds: `saved` / `current` are model sections."""
    # a key the checkpoint predates (model.arch and the families' own) had its default then
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    saved = {**defaults, **saved}
    diff = [k for k in current if saved.get(k) != current[k] and k not in _MAY_CHANGE_ON_RESUME]
    if diff and diff[0] == "block_size":  # a training length, but the data order is in its windows
        raise ConfigError(f"config key 'model.block_size': {current['block_size']!r} differs from "
                          f"checkpoint {path} ({saved['block_size']!r}): its sample order counts "
                          f"windows of block_size + 1 tokens, so it resumes only at that length; to "
                          f"train at another, `hpctrain export` this run and start a new run.dir "
                          f"with init.from = the export")
    if diff:
        k = diff[0]
        raise ConfigError(f"config key 'model.{k}': {current[k]!r} differs from checkpoint {path} "
                          f"({saved.get(k)!r}); use a new run.dir to train a different model")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
