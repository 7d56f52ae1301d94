"""The model (GPT or Llama) in this job's layout, initialized from the seed: `build_model(cfg, mesh, device)`.

Owns: which way the model is built. parallel.meta_init (default): on the meta device, laid out,
then only this rank's shards materialized and initialized (hpctrain/parallel/meta_init.py);
otherwise whole in fp32 on every rank, moved to the device, then laid out. Both give bit-identical
initial weights for a seed (tests/mpi/test_meta_init.py). It must never apply a layout itself
(parallelize does) or know how a layout shards a tensor (meta_init does). With init.from, a Hugging
Face model's weights replace the initial ones after that (hpctrain/interop/hf_import.py), unless
the run has checkpoints (it resumes from them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hpctrain.config import Config
from hpctrain.distributed.mesh import Mesh
from hpctrain.interop.hf_import import run_has_checkpoints
from hpctrain.model import build_model_from_section
from hpctrain.parallel import Layout, parallelize
from hpctrain.parallel.meta_init import allocate, build_on_meta, materialize
from hpctrain.parallel.loss import use_chunked_head


@dataclass(frozen=True)
class BuiltModel:
    layout: Layout
    n_params: int            # of the whole model, without position embeddings (GPT.num_params)
    flops_per_token: float   # of the whole model


def build_model(cfg: Config, mesh: Mesh, device: torch.device, precision: str) -> BuiltModel:
    """The GPT of cfg.model in cfg.parallel's layout; weights as `torch.manual_seed(seed);
    GPT(...)` makes them, on every rank (the same values before sharding). `precision`: the
    resolved train.precision (FSDP's mixed precision)."""
    section = dataclasses.asdict(cfg.model)  # model.arch picks GPT or Llama (hpctrain/model)
    seed = cfg.train.seed
    if cfg.parallel.meta_init:
        recipe, model = build_on_meta(lambda: build_model_from_section(section))
        init = lambda m: materialize(m, recipe, seed, device)  # noqa: E731
    else:
        torch.manual_seed(seed)  # identical initial weights on every rank
        model, init = build_model_from_section(section).to(device), None
    n_params, flops = model.num_params(), model.flops_per_token()  # before a pipeline split
    if cfg.train.loss_chunk:
        use_chunked_head(model)  # lm_head hands hidden states to the chunked loss (parallel/loss.py)
    if cfg.init.from_dir and not run_has_checkpoints(cfg.checkpoint_dir):
        # each rank reads its part of a Hugging Face model's weights instead (on resume the
        # checkpoint's replace the seed's: the folder is not read, it may be gone)
        init = load_hf_weights(cfg.init.from_dir, section, device if cfg.parallel.meta_init else None)
    return BuiltModel(parallelize(model, mesh, cfg, precision, materialize=init), n_params, flops)


def load_hf_weights(folder: str, section: dict, meta_device: torch.device | None):
    """The materialize step for init.from: a meta-built model's shards are allocated on
    `meta_device` without replaying the seed's init (every parameter is overwritten), then the
    folder's weights are copied into the parts this rank holds (hpctrain/interop/hf_import.py)."""
    from hpctrain.interop.hf_import import load_weights

    def allocate_and_load(model: torch.nn.Module) -> None:
        if meta_device is not None:
            allocate(model, meta_device)
        load_weights(model, folder, section)
    return allocate_and_load
