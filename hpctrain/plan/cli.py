"""`python -m hpctrain plan`: the command line of the scale planner.

Owns: the options (every one explained in --help), reading a training TOML's [model], [parallel],
[train], [sync], [data] and [checkpoint] keys as defaults, sizes like "80GB" / "1e12", and turning
a bad value into one line naming the option; the layout options also under train's spelling
(--parallel.tp=2), so a `recommended:` line pastes back; the order of the report (the advice
first when your layout does not fit); --sbatch's options (the script: plan/sbatch.py); CPU nodes
(--gpus-per-node 0 --ranks-per-node R: layout.on_cpu_nodes). It must never compute a figure.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys

from hpctrain import logs
from hpctrain.config_schema import ModelConfig, key_choices
from hpctrain.plan import recommend, sbatch, search
from hpctrain.plan.layout import Job, on_cpu_nodes
from hpctrain.plan.report import SUMMARY_HEAD, make_plan, render, summary_row, title
from hpctrain.plan.shape import PRESET_CONFIGS, PRESETS, ModelShape

_UNITS = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12, "p": 10 ** 15,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "pb": 10 ** 15,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "b": 1}


def size(text: str) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2^30, '1e12' -> 10^12 (an argparse type)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number with an optional unit "
                                         f"(1e12, 80GB, 80GiB, 3.84TB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


MODEL_KEYS = ("n_layer", "n_embd", "n_head", "vocab_size", "block_size")
# llama's keys also as options (all of shape.py's come from --config's [model] or --preset)
ARCH_OPTIONS = {"n_kv_head": "model.n_kv_head (llama: key/value heads; 0 = n_head)",
                "ffn_hidden": "model.ffn_hidden (llama: SwiGLU width; 0 = Llama's rule)",
                **{f"moe_{k}": f"model.moe_{k} (llama mixture of experts: plan/moe.py)"
                   for k in ("experts", "top_k", "expert_hidden", "shared_experts", "shared_hidden",
                             "every", "first_dense")}}
# option -> (config section, key) read from --config
FROM_CONFIG = {"dp": ("parallel", "dp"), "tp": ("parallel", "tp"), "pp": ("parallel", "pp"),
               "cp": ("parallel", "cp"), "cp_attention": ("parallel", "cp_attention"),
               "ep": ("parallel", "ep"),
               "data_parallel": ("parallel", "data_parallel"), "dp_shard": ("parallel", "dp_shard"),
               "offload": ("parallel", "offload"),
               "pp_schedule": ("parallel", "pp_schedule"),
               "pp_virtual_stages": ("parallel", "pp_virtual_stages"),
               "activation_checkpoint": ("parallel", "activation_checkpoint"),
               "ac_every": ("parallel", "ac_every"), "micro_batch": ("train", "micro_batch_size"),
               "grad_accum": ("train", "grad_accum"),
               "global_batch": ("train", "global_batch"), "precision": ("train", "precision"),
               "loss_chunk": ("train", "loss_chunk"),
               "sync_mode": ("sync", "mode"), "inner_steps": ("sync", "inner_steps"),
               "compression": ("sync", "compression"), "overlap": ("sync", "overlap"),
               "replica_nodes": ("sync", "replica_nodes"), "ps_servers": ("sync", "ps_servers"),
               "pull_compression": ("sync", "pull_compression"),
               "error_feedback": ("sync", "error_feedback"),
               "cache_bytes": ("data", "cache_bytes"), "prefetch": ("data", "prefetch"),
               "shuffle": ("data", "shuffle"), "shuffle_block_shards": ("data", "shuffle_block_shards"),
               "checkpoint_keep": ("checkpoint", "keep"),
               "checkpoint_layout": ("checkpoint", "layout"), "meta_init": ("parallel", "meta_init"),
               "backend": ("dist", "backend")}
HELP = {
    "nodes": "nodes in the job", "gpus_per_node": "GPUs (= ranks) per node; 0: CPU nodes of "
                                                   "--ranks-per-node ranks",
    "tokens": "training corpus size in tokens (1e12, 15e12)",
    "gpu_memory": "memory per GPU (80GB; 'GiB' units too)", "node_memory": "host RAM per node",
    "node_disk": "node-local disk per node (where the node cache lives)",
    "cache_bytes": "data.cache_bytes: node cache budget (0 = 90%% of --node-disk)",
    "prefetch": "data.prefetch: steps ahead the node leader stages shards",
    "shard_tokens": "tokens per shard (data_tools shard --shard-tokens)",
    "shuffle": "data.shuffle: block | global (sample order)",
    "shuffle_block_shards": "data.shuffle_block_shards: shards per block of the block order",
    "dp": "parallel.dp (0 = world / (tp x pp))", "tp": "parallel.tp (tensor parallel, in node)",
    "pp": "parallel.pp (pipeline stages)",
    "cp": "parallel.cp (context parallelism: each sequence split over cp ranks inside a node, "
          "2 cp zig-zag chunks; the weights replicated like dp's, FSDP shards over dp x cp). The "
          "search tries cp > 1 when a sequence's activations bind: nothing fits at cp 1, or only "
          "with every block checkpointed",
    "cp_attention": "parallel.cp_attention: ring | ulysses (all-to-all; cp divides each tp rank's "
                    "heads); the search takes the faster",
    "ep": "parallel.ep (MoE: experts split over ep of the dp ranks; divides dp and the experts)",
    "data_parallel": "parallel.data_parallel: ddp | fsdp",
    "dp_shard": "parallel.dp_shard: HSDP (fsdp): shard over dp_shard ranks, replicate over dp / "
                "dp_shard (0 = all of dp); the search tries one node's dp ranks on > 1 node",
    "offload": "parallel.offload: none | optimizer | all (fsdp): CPU offload (plan/offload.py); the "
               "search tries it where the same layout without it does not fit",
    "pcie_bw": "bytes/s per GPU between host memory and the GPU (offload's copies)",
    "host_memory_bw": "host memory bytes/s per node (offload's AdamW on the CPU)",
    "pp_schedule": "parallel.pp_schedule: gpipe | 1f1b | interleaved",
    "pp_virtual_stages": "parallel.pp_virtual_stages (interleaved only)",
    "micro_batch": "train.micro_batch_size: sequences per rank per forward",
    "grad_accum": "train.grad_accum: micro-batches per optimizer step",
    "global_batch": "train.global_batch: sequences per step (0 = micro-batch x grad_accum x dp); the "
                    "layout search keeps the job's global batch",
    "memory_margin": "share of --gpu-memory kept free (CUDA context, NCCL buffers, fragmentation)",
    "gpu_tflops": "peak dense TFLOP/s per GPU at the training precision (989: H100 SXM bf16)",
    "mfu": "model FLOPs utilization the step-time model assumes for compute",
    "intra_node_bw": "bytes/s per GPU for collectives inside a node (NVLink)",
    "inter_node_bw": "bytes/s per GPU for collectives across nodes (the NIC per GPU)",
    "activation_checkpoint": "parallel.activation_checkpoint: none | full | selective | selective_op",
    "ac_every": "parallel.ac_every: selective checkpoints blocks 0, N, 2N, ...",
    "precision": "train.precision: fp32 | bf16 | fp16 (auto = bf16 on GPUs)",
    "loss_chunk": "train.loss_chunk: tokens per chunk of the chunked loss (0 = full logits)",
    "sync_mode": "sync.mode: sync | diloco | async_diloco (replicas push to --ps-servers server "
                 "ranks as their rounds end: bytes per arrival, server host memory)",
    "inner_steps": "sync.inner_steps (diloco, async_diloco: steps per round)",
    "compression": "sync.compression (diloco, async_diloco push wire format): none | bf16 | int8 | int4",
    "ps_servers": "sync.ps_servers (async_diloco: server ranks, the last ranks; a multiple of tp x "
                  "pp, or of a group's ranks with --replica-nodes)",
    "pull_compression": "sync.pull_compression (async_diloco: wire format of the pulls): same | "
                        "bf16 | int8 | int4",
    "error_feedback": "sync.error_feedback (async_diloco, int8 | int4: each pusher keeps its push "
                      "residual)",
    "overlap": "sync.overlap (diloco: start point + pending average kept)",
    "replica_nodes": "sync.replica_nodes (diloco, async_diloco: DDP inside groups of this many "
                     "nodes, DiLoCo / the servers across them; 0 = off)",
    "checkpoint_keep": "checkpoint.keep: committed checkpoints kept on the PFS",
    "checkpoint_layout": "checkpoint.layout: rank (a data file per rank) | node (one per node)",
    "pfs_files_limit": "warn above this many files per checkpoint directory",
    "meta_init": "parallel.meta_init: build only this rank's shards (false: the whole fp32 model "
                 "on every rank first)",
    "backend": "dist.backend: nccl | gloo (CPU: each FSDP reduce-scatter also clones its fp32 "
               "input); auto counts as nccl",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpctrain plan", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Per-rank memory, communication, checkpoint and data-pipeline figures of a "
                    "model shape (gpt2 or llama) and parallel layout on a cluster (arithmetic over "
                    "this code's layouts; docs/scale.md). Sizes take units: 80GB, 80GiB, 1e12.",
        epilog="Precedence: --preset or --config give the defaults, explicit options override them. "
               "Warnings name the budget option that is exceeded. The layout options also take "
               "train's spelling (--parallel.tp=2, --train.micro_batch_size=1): a `recommended:` "
               "line's flags paste back.")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model shape: gpt2 1b (24 x 2048), 7b "
                   "(32 x 4096), 70b (80 x 8192; ~65B parameters), vocab 50304, block 2048; Meta's "
                   "llama3-8b (32 x 4096) and llama3-70b (80 x 8192): 8 kv heads, vocab 128256, "
                   "untied, block 8192, with their shipped configs' (configs/llama3_*.toml) global batch "
                   "512, micro-batch 1, bf16 and loss_chunk 1024, as --config of them plans; "
                   "mixtral-8x7b: 8 experts top 2 (46.7B, 12.7B active; split them with --ep)")
    p.add_argument("--config", help="a training TOML: its [model], [parallel], [train], [sync], "
                   "[data] and [checkpoint] keys (train.precision auto counts as bf16)")
    for key in MODEL_KEYS:
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, help=f"model.{key}")
    p.add_argument("--arch", choices=key_choices(ModelConfig, "arch"), help="model.arch (default gpt2)")
    for key, text in ARCH_OPTIONS.items():
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, help=text)
    p.add_argument("--summary", action="store_true", help="print one Markdown table row (with its "
                   "header) instead of the full report")
    p.add_argument("--json", action="store_true", help="print the layout search as JSON: the "
                   "assumptions, your layout, the recommended one with its train command, every "
                   "candidate with fits / why / peak / step time")
    p.add_argument("--top", type=int, default=5, help="fitting layouts shown (default 5)")
    p.add_argument("--ranks-per-node", type=int, help="with --gpus-per-node 0 (CPU nodes): ranks per "
                   "node; each rank's memory budget is its share of --node-memory unless "
                   "--gpu-memory gives it, auto precision counts as fp32 and auto backend as gloo; the step "
                   "times use --gpu-tflops and the --*-bw options as given (per rank): give your "
                   "CPUs' figures")
    _script_options(p)
    defaults = Job()
    for f in dataclasses.fields(Job):
        typ = size if f.name in ("tokens", "gpu_memory", "node_memory", "node_disk", "cache_bytes",
                                 "shard_tokens", "intra_node_bw", "inter_node_bw", "pcie_bw",
                                 "host_memory_bw") else type(f.default)
        if typ is bool:
            typ = _boolean
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=typ, default=None,
                       help=f"{HELP[f.name]} (default {_show(f.name, getattr(defaults, f.name))})")
        if f.name in FROM_CONFIG:  # `train` spellings, so a `recommended:` line's flags paste back
            section, key = FROM_CONFIG[f.name]
            p.add_argument(f"--{section}.{key}", dest=f.name, type=typ, default=None,
                           help=argparse.SUPPRESS)
    p.add_argument("--verify", action="store_true",
                   help="after the report, dry-run the recommended layout of --config (or a "
                        "--preset's config) at its world size in this one process (`hpctrain "
                        "train --dry-run`): the parameter, gradient, optimizer and peak bytes of a "
                        "real step beside this plan's (with --json: a second JSON line)")
    return p


def _script_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job script (--sbatch)", "Write the recommended layout as a batch script "
                             "to submit as it is: slurm/train.sbatch with its #SBATCH lines for this "
                             "job (--nodes, --ntasks-per-node = ranks per node, --gpus-per-node, "
                             "--cpus-per-task, --time, the template's --signal=B:USR1@300) and the "
                             "config + the layout's flags baked in; its preemption, requeue and "
                             "node-loss relaunch are the template's.")
    g.add_argument("--sbatch", metavar="FILE", help="write the job script here (atomically, mode "
                   "0755; an existing FILE only with --force) and print the sbatch command; needs "
                   "--config, or a --preset with a shipped config (llama3-8b, llama3-70b)")
    g.add_argument("--sbatch-template", metavar="FILE", help="the template (default: this checkout's "
                   "slurm/train.sbatch; give your edited copy with its ENVIRONMENT block)")
    g.add_argument("--force", action="store_true", help="--sbatch replaces an existing FILE")
    g.add_argument("--time", help="#SBATCH --time, Slurm's [days-]hours:minutes:seconds (default: "
                   "the template's, 04:00:00); more than the --signal lead")
    g.add_argument("--cpus-per-task", type=int, help="#SBATCH --cpus-per-task: CPU cores per rank, "
                   "torch's threads (default: the template's, 1; typically cores per node / ranks)")
    g.add_argument("--partition", help="#SBATCH --partition (default: none, the site's default)")
    g.add_argument("--account", help="#SBATCH --account (default: none)")


def _show(name: str, value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected true or false")
    return text.lower() in ("true", "1", "yes")


def shape_and_job(args: argparse.Namespace) -> tuple[ModelShape, Job]:
    """The model and job: --preset (with its shipped config's batch keys) or --config, then the
    explicit options over them."""
    model, job = {}, {}
    if args.preset:
        model = dataclasses.asdict(PRESETS[args.preset])
        job.update(PRESET_CONFIGS.get(args.preset, (None, {}))[1])
    if args.config:
        from hpctrain import config

        cfg = config.load(args.config)  # a training config: its errors name the key
        model = dataclasses.asdict(ModelShape.of_model_config(cfg.model))
        for opt, (section, key) in FROM_CONFIG.items():
            # a config (or a schema) without parallel.cp / cp_attention: the Job's 1 / "ring"
            job[opt] = getattr(getattr(cfg, section), key, getattr(Job, opt))
    for key in (*MODEL_KEYS, "arch", *ARCH_OPTIONS):
        if getattr(args, key) is not None:
            model[key] = getattr(args, key)
    missing = [k for k in MODEL_KEYS if k not in model]
    if missing:
        raise ValueError(f"--{missing[0].replace('_', '-')} is required (or --preset / --config)")
    for f in dataclasses.fields(Job):
        if getattr(args, f.name) is not None:
            job[f.name] = getattr(args, f.name)
    if args.grad_accum is not None and args.global_batch is None:
        job["global_batch"] = 0  # an explicit accumulation over the config's / preset's batch
    return ModelShape(**model), Job(**_on_the_nodes(args, job))


def _on_the_nodes(args: argparse.Namespace, job: dict) -> dict:
    """`auto` precision / backend for GPU nodes, or the CPU nodes of --gpus-per-node 0."""
    if args.gpus_per_node == 0:
        return on_cpu_nodes(job, args.ranks_per_node or 0)
    if args.ranks_per_node is not None:
        raise ValueError("--ranks-per-node is for CPU nodes (--gpus-per-node 0): on GPU nodes "
                         "the ranks are the GPUs (--gpus-per-node)")
    auto = {"precision": "bf16", "backend": "nccl"}  # what `auto` is on GPUs
    return {**job, **{k: v for k, v in auto.items() if job.get(k) == "auto"}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        script = _script_inputs(args)
        shape, job = shape_and_job(args)
        advice = None if args.summary and not args.sbatch else recommend.advise(shape, job)
        # a layout for another world size (a config's, for more nodes) has no figures of its own
        plan = make_plan(shape, job) if args.summary or not job.world_problem() else None
        config = args.config or PRESET_CONFIGS.get(args.preset, (None,))[0]
        written = _write_sbatch(args, argv, script, job, advice) if script else None
    except ValueError as e:
        logs.error(f"error: {e}")
        return 2
    if args.json:
        print(json.dumps({**recommend.as_json(advice, config), **(written or {})}))
    elif args.summary:
        print("| " + " | ".join(SUMMARY_HEAD) + " |\n|" + "---|" * len(SUMMARY_HEAD))
        print("| " + " | ".join(str(c) for c in summary_row(plan)) + " |")
    else:
        print(_report(shape, job, plan, advice, args.top, config), end="")
    if written and not args.json:
        print(f"\nwrote {written['sbatch']['file']}: {written['sbatch']['what']}\n"
              f"submit it{written['sbatch']['where']}: {written['sbatch']['submit']}")
    return 0


def _report(shape: ModelShape, job: Job, plan, advice, top: int, config: str | None) -> str:
    """Your layout's figures, then the advice; when your layout does not fit, the advice first."""
    if advice.user.fits:
        return render(plan) + recommend.render(advice, top, config)
    rest = ("" if plan is None else "\n## Your layout, which does not fit: its figures\n\n"
            + render(plan, head=False))
    return title(shape, job).rstrip("\n") + "\n" + recommend.render(advice, top, config) + rest


def _script_inputs(args: argparse.Namespace) -> tuple | None:
    """(target, template, config path) of --sbatch, checked before anything is computed."""
    if not args.sbatch:
        return None
    target = sbatch.check_target(args.sbatch, args.force)
    template = sbatch.read_template(args.sbatch_template)
    shipped = PRESET_CONFIGS.get(args.preset, (None,))[0]
    return target, template, sbatch.config_path(args.config, args.preset, shipped)


def _write_sbatch(args: argparse.Namespace, argv: list[str], script: tuple, job: Job, advice) -> dict:
    target, template, config = script
    best = advice.best
    if best is None:
        raise ValueError(f"--sbatch {args.sbatch}: no layout fits {job.nodes} node(s) here (see "
                         f"`hpctrain plan` without --sbatch for the node count that does); nothing written")
    spec = sbatch.Script(nodes=best.job.nodes, ranks_per_node=best.job.gpus_per_node,
                         gpus_per_node=0 if args.gpus_per_node == 0 else best.job.gpus_per_node,
                         config=config, flags=search.train_flags(best.job), layout=best.job.layout_name,
                         cpus_per_task=args.cpus_per_task, time=args.time, partition=args.partition,
                         account=args.account)
    source = args.sbatch_template or "slurm/train.sbatch"
    text = sbatch.render(spec, template, args.sbatch, source, shlex.join(argv))
    sbatch.write(target, text, args.force)
    what = (f"{source} with #SBATCH "
            f"{' '.join(sbatch.directives(text))}, training {config} with the recommended "
            f"{best.job.layout_name}")
    where = "" if os.path.isabs(config) else f" from {os.getcwd()} (the config's path is relative)"
    return {"sbatch": {"file": args.sbatch, "what": what, "where": where,
                       "submit": f"sbatch {shlex.quote(args.sbatch)}"}}
