"""The model (GPT or Llama) in this job's layout, initialized from the seed: `build_model(cfg, mesh, device)`.

Owns: which way the model is built. parallel.meta_init (default): on the meta device, laid out,
then only this rank's shards materialized and initialized (hpctrain/parallel/meta_init.py);
otherwise whole in fp32 on every rank, moved to the device, then laid out. Both give bit-identical
initial weights for a seed (tests/mpi/test_meta_init.py). It must never apply a layout itself
(parallelize does) or know how a layout shards a tensor (meta_init does). With init.from, a Hugging
Face model's weights replace the initial ones after that (hpctrain/interop/hf_import.py), unless
the run has checkpoints (it resumes from them): the folder's tensors are checked against [model]
before anything is built (hpctrain/interop/hf_weights.py), its values for NaN / inf once loaded.
`check_model_fits` refuses, before anything is built, a [model] whose training state alone would
not fit in the memory of the whole job (a typo such as n_layer = 1000000000 would otherwise build
for minutes).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hpctrain.config import Config
from hpctrain.distributed import DistContext
from hpctrain.distributed.mesh import Mesh
from hpctrain.errors import ConfigError, UserError
from hpctrain.interop import hf_import
from hpctrain.interop.hf_weights import WeightFiles, open_checked
from hpctrain.model import build_model_from_section
from hpctrain.model.params import hf_param_counts, params_words
from hpctrain.parallel import Layout, parallelize
from hpctrain.parallel.float8 import apply_float8
from hpctrain.parallel.lora import apply_lora, init_adapters, is_adapter
from hpctrain.parallel.meta_init import _held_params, allocate, build_on_meta, materialize
from hpctrain.parallel.loss import use_chunked_head
from hpctrain.plan.report import fmt_bytes
from hpctrain.plan.shape import STATE_BYTES_PER_PARAM, ModelShape
from hpctrain.train.bad_steps import first_nonfinite
from hpctrain.train.precision import cuda_capability


@dataclass(frozen=True)
class BuiltModel:
    layout: Layout
    n_params: int            # of the whole model, without position embeddings (GPT.num_params)
    flops_per_token: float   # of the whole model
    params: str = ""         # the start-up line's counts, as transformers counts them (model/params.py)
    fp8: str = ""            # train.precision = fp8: which Linear layers were converted (parallel/float8.py)


def build_model(cfg: Config, mesh: Mesh, device: torch.device, precision: str,
                initialize: bool = True) -> BuiltModel:
    """The GPT of cfg.model in cfg.parallel's layout; weights as `torch.manual_seed(seed);
    GPT(...)` makes them, on every rank (the same values before sharding), or init.from's.
    `precision`: the resolved train.precision (FSDP's mixed precision). `initialize=False` (the
    dry run, train/dry_run.py): this rank's shards allocated, never written (no init.from read)."""
    section = dataclasses.asdict(cfg.model)  # model.arch picks the family (hpctrain/model/spec.py)
    seed, lora = cfg.train.seed, cfg.lora if cfg.lora.rank else None
    # init.from seeds a fresh run only (on resume the checkpoint's weights replace the seed's:
    # the folder is not read, it may be gone), but with LoRA it is the base on resume too (the
    # checkpoint holds only the adapters); its tensors checked before anything is built
    reads_base = lora is not None or not hf_import.run_has_checkpoints(cfg.checkpoint_dir)
    hf_files = (open_checked(cfg.init.from_dir, section)
                if initialize and cfg.init.from_dir and reads_base else None)
    # parallel.offload = "all": FSDP2 keeps the shards in host memory, so they are made there
    shards_on = torch.device("cpu") if cfg.parallel.offload == "all" else device

    def factory():  # the family's model; LoRA's adapters added from outside (parallel/lora.py)
        model = build_model_from_section(section)
        if lora is not None:
            apply_lora(model, lora)
        return model
    if not initialize:
        model = build_on_meta(factory)[1]
        init = lambda m: allocate(m, shards_on)  # noqa: E731
    elif cfg.parallel.meta_init:
        recipe, model = build_on_meta(factory)
        init = lambda m: materialize(m, recipe, seed, shards_on)  # noqa: E731
    else:
        torch.manual_seed(seed)  # identical initial weights on every rank
        model, init = factory().to(device), None
    n_params, flops = model.num_params(), model.flops_per_token()  # before a pipeline split
    params = params_words(*hf_param_counts(model))
    if cfg.train.loss_chunk:
        use_chunked_head(model)  # lm_head hands hidden states to the chunked loss (parallel/loss.py)
    if hf_files is not None:  # each rank reads its part of the Hugging Face weights instead
        init = load_hf_weights(hf_files, section, shards_on if cfg.parallel.meta_init else None)
    # float8 Linear layers before any layout (FSDP2 then shards, and may all-gather, float8 weights)
    fp8 = apply_float8(model, cfg.fp8, cuda_capability(device)).line() if precision == "fp8" else ""
    if lora is not None and initialize:  # A's values once materialized, before DDP's broadcast
        init = with_adapters(init, lora, seed)
    layout = parallelize(model, mesh, cfg, precision, materialize=init)
    if hf_files is not None:
        check_loaded_weights(layout.module, hf_files, section, device)
    return BuiltModel(layout, n_params, flops, params, fp8)


def lora_base(cfg: Config) -> str:
    """With LoRA, what the checkpoint records of the frozen base its adapters belong to: init.from's
    folder, with its config.json's sha256 and the sizes of its weight files, or the seed that
    initialized it ("" without LoRA). Weights are not hashed: an 8B model's 16 GB per save."""
    if not cfg.lora.rank:
        return ""
    if not cfg.init.from_dir:
        return f"seed {cfg.train.seed}"
    folder = Path(cfg.init.from_dir).resolve()
    config = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()[:16]
    sizes = sum(f.stat().st_size for f in sorted(folder.glob("*.safetensors")))
    return f"init.from {folder} (config.json sha256 {config}..., {sizes} bytes of safetensors)"


def with_adapters(init, lora, seed: int):
    """The materialize step `init` (None: the model is built already), then LoRA's A values."""
    def materialize_and_init(model: torch.nn.Module) -> None:
        if init is not None:
            init(model)
        init_adapters(model, lora, seed)
    return materialize_and_init


def load_hf_weights(files: WeightFiles, section: dict, meta_device: torch.device | None):
    """The materialize step for init.from: a meta-built model's shards are allocated on
    `meta_device` without replaying the seed's init (every parameter is overwritten), then the
    folder's weights are copied into the parts this rank holds (hpctrain/interop/hf_import.py)."""
    def allocate_and_load(model: torch.nn.Module) -> None:
        if meta_device is not None:
            allocate(model, meta_device)
        hf_import.load_weights(model, files, section, skip=is_adapter)  # adapters: init_adapters
    return allocate_and_load


def check_loaded_weights(model: torch.nn.Module, files: WeightFiles, section: dict,
                         device: torch.device) -> None:
    """Collective: UserError naming the first init.from tensor (and its file) holding NaN or inf."""
    held = _held_params(model)
    bad = first_nonfinite(held, device)
    if bad is not None:
        raise UserError(f"{hf_import.source_words(files, bad, held.get(bad), section)} holds NaN "
                        f"or inf values (init.from): a damaged or diverged model; fix or replace "
                        f"its weights")


def job_memory(ctx: DistContext) -> tuple[int, str]:
    """(bytes, in words) of the memory every rank of the job holds together: each rank's GPU on
    CUDA, else each node's host memory (0: unknown)."""
    if ctx.device.type == "cuda":
        gpu = torch.cuda.get_device_properties(ctx.device).total_memory
        return gpu * ctx.world_size, f"{ctx.world_size} GPU(s) x {fmt_bytes(gpu)}"
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 0, "unknown"
    return host * ctx.n_nodes, f"{ctx.n_nodes} node(s) x {fmt_bytes(host)} of host memory"


def check_model_fits(cfg: Config, ctx: DistContext) -> None:
    """Before anything is built: `size_error` against all the memory of this job (`job_memory`)."""
    have, words = job_memory(ctx)
    hf_folder = cfg.init.from_dir if cfg.init.from_dir and \
        not hf_import.run_has_checkpoints(cfg.checkpoint_dir) else None
    error = size_error(cfg.model, have, words, hf_folder)
    if error is not None:
        raise error


def size_error(model, have: int, words: str, hf_folder: str | None = None) -> ConfigError | None:
    """A ConfigError naming the [model] key the size grows with when the whole model's training
    state (16 B per parameter: plan/shape.py) exceeds `have` bytes, the memory of every rank of
    the job together (`words`): no layout could hold it, whatever it shards. 0: unknown, no check.
    `hf_folder`: init.from's, whose config.json set the key."""
    shape = ModelShape.of_model_config(model)
    need = shape.state_bytes()
    if not have or need <= have:
        return None
    key = shape.size_key()
    origin = hf_import.config_json_key(key, model.arch, hf_folder) if hf_folder else ""
    return ConfigError(f"config key 'model.{key}': {getattr(shape, key)}{origin} makes a model of "
                       f"{shape.total_params():.3g} parameters, {fmt_bytes(need)} of fp32 weights, "
                       f"gradients and AdamW state ({STATE_BYTES_PER_PARAM} B per parameter), more "
                       f"than this job's {words} together; lower it (`hpctrain plan` shows what "
                       f"fits where)")
