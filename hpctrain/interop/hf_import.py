"""`init.from = "DIR"`: start a fresh run from a local Hugging Face model folder (config.json +
model.safetensors, or shards + model.safetensors.index.json; fp32, bf16 or fp16) of LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM or GPT2LMHeadModel.
`hpctrain.load` (hpctrain/api.py) reads a folder the same way.

Owns: the [model] section an HF config.json gives (`fill_model_section`, at config load: a key the
user set to another value is a one-line error naming it), and loading the weights into a laid-out
model (`load_weights`): each rank reads only the part of each tensor it holds (safetensors
`get_slice`; a TP / FSDP shard's rows and columns, nothing for a parameter another pipeline stage
owns), after meta-device init. Never a whole copy of the model per rank, never transformers, never
a download. A run that has checkpoints resumes from them alone: [model] from the newest one's
trainer_state.json and no weights read, so the folder may be moved away or deleted after the start.
"""
from __future__ import annotations

import json
from pathlib import Path

from hpctrain.errors import ConfigError, UserError
from hpctrain.interop.hf_config import read_hf_config
from hpctrain.model import spec as model_spec
from hpctrain.interop.hf_weights import WeightFiles, open_checked


def model_section(folder: str | Path) -> dict:
    """The [model] keys that the folder's config.json sets (the family whose HFSpec lists its
    model_type; none: the last family with an adapter says what it cannot read)."""
    cfg = read_hf_config(folder)
    try:
        return hf_spec_of(cfg).hf_module().section_from_config(cfg)
    except KeyError as e:
        raise ConfigError(f"config key 'init.from': {Path(folder) / 'config.json'} lacks {e}") from None
    except UserError as e:
        raise ConfigError(f"config key 'init.from': {Path(folder)}/{e}") from None


def hf_spec_of(cfg: dict) -> model_spec.ModelSpec:
    """The family that reads a config.json of this model_type (HFSpec.model_types); an unknown
    type goes to the last registered family with an adapter, whose reader names the types it has."""
    specs = [model_spec.get(name) for name in model_spec.names() if model_spec.get(name).hf]
    for spec in specs:
        if cfg.get("model_type") in spec.hf.model_types:
            return spec
    return specs[-1]


def checkpoint_root(raw: dict) -> Path:
    """The run's checkpoint root as Config.checkpoint_dir names it, from raw (TOML + overrides)."""
    run = raw.get("run") if isinstance(raw.get("run"), dict) else {}
    ckpt = raw.get("checkpoint") if isinstance(raw.get("checkpoint"), dict) else {}
    return Path(ckpt["dir"]) if ckpt.get("dir") else Path(run.get("dir", "")) / "checkpoints"


def run_has_checkpoints(root: str | Path) -> bool:
    """True when the run will resume (or refuse to start over): a checkpoint lies under root. Its
    weights then replace init.from's, so the folder is neither read nor needed."""
    from hpctrain.checkpoint.directory import scan

    return any(kind in ("checkpoint", "aside") for _, kind, _ in scan(Path(root)))


def resumed_model_section(root: Path) -> dict | None:
    """[model] as the newest checkpoint under root records it (trainer_state.json), or None."""
    from hpctrain.checkpoint.directory import scan

    for _, kind, path in scan(root):
        try:
            if kind in ("checkpoint", "aside"):
                state = json.loads((path / "trainer_state.json").read_text())
                return dict(state["trainer"]["config"]["model"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: an older one, else init.from's config.json
    return None


def fill_model_section(raw: dict, coerce) -> dict:
    """raw (TOML + overrides) with [model] filled from init.from's config.json, or, when the run
    resumes, from its newest checkpoint (the folder may have moved away since the start);
    `coerce(key, value, like)` turns a user's value into the type of HF's for the comparison."""
    init = raw.get("init") if isinstance(raw.get("init"), dict) else {}
    folder = init.get("from") or init.get("from_dir")  # the key's two spellings (config.ALIASES)
    if not folder:
        return raw
    given = dict(raw.get("model") or {})
    resumed = resumed_model_section(checkpoint_root(raw))
    if resumed:  # a key given that differs: the resume's model check names it and the checkpoint
        return {**raw, "model": {**resumed, **given}}
    section = model_section(folder)
    length = given.get("block_size")  # the training length: any up to the folder's positions
    for key, value in section.items():
        if key in given and key != "block_size" and coerce(f"model.{key}", given[key], value) != value:
            raise ConfigError(f"config key 'model.{key}': {given[key]!r} conflicts with init.from "
                              f"{Path(folder) / 'config.json'} ({value!r}); remove the key")
        given[key] = value
    if length is not None:
        given["block_size"] = training_length(coerce("model.block_size", length, 1), section, folder)
    return {**raw, "model": given}


def training_length(length: int, section: dict, folder: str | Path) -> int:
    """model.block_size given with init.from: the sequence length to train at, at most the
    positions the folder's model holds (max_position_embeddings / n_positions: rope tables are
    computed for the training length, gpt2's position table keeps all its rows)."""
    limit = section["max_positions"]
    if length > limit:
        field = model_spec.of_section(section).hf.config_json_keys["max_positions"]
        raise ConfigError(f"config key 'model.block_size': {length} exceeds init.from "
                          f"{Path(folder) / 'config.json'}'s {field} ({limit}); train at most "
                          f"{limit} tokens per sequence (longer, by rope scaling, is not supported)")
    return length


def source_of(fqn: str, section: dict) -> tuple[str, bool, int] | None:
    """(HF tensor name, transposed, row offset) our parameter is read from; '{e}' in the name: one
    tensor per expert, stacked; None: a parameter HF does not have (the MoE balancing bias)."""
    return model_spec.of_section(section).hf_module().source_of(fqn, section)


def local_region(param) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, shape) of the part of `param` this rank holds (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(param, DTensor) and all(type(p) in (Shard, Replicate) for p in param.placements):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                              param.placements)
        return tuple(offset), tuple(shape)
    return (0,) * param.dim(), tuple(param.shape)  # whole (a strided 2-D shard: sliced after)


def read_region(files: WeightFiles, source: tuple[str, bool, int], offset, shape):
    """Our tensor's [offset : offset + shape] region, read from the file alone (a stacked-experts
    tensor: the experts it holds, each one's region; a shared expert: HF's 2-D tensor)."""
    import torch

    name, transposed, shift = source
    if len(shape) == 3:
        if "{e}" not in name:
            return read_region(files, source, offset[1:], shape[1:])[None]
        return torch.stack([read_region(files, (name.format(e=e), transposed, shift), offset[1:], shape[1:])
                            for e in range(offset[0], offset[0] + shape[0])])
    sl = files.slice(name)
    rows = slice(shift + offset[0], shift + offset[0] + shape[0])
    if len(shape) == 1:
        return sl[rows]
    cols = slice(offset[1], offset[1] + shape[1])
    return sl[cols, rows].t() if transposed else sl[rows, cols]


def load_weights(model, folder: str | Path | WeightFiles, section: dict, skip=None) -> int:
    """Copy the folder's weights into the parts of `model` (laid out, materialized) this rank
    holds; returns the number of parameters written. `folder`: a path (its files opened and
    checked against `section` first: hf_weights.open_checked) or the files opened so. `skip(fqn)`:
    parameters the folder does not hold and the caller writes (LoRA's adapters)."""
    import torch
    from torch.distributed.tensor import DTensor

    from hpctrain.parallel.meta_init import _copy_part, _held_params

    files = folder if isinstance(folder, WeightFiles) else open_checked(folder, section)
    done = set()
    with torch.no_grad():
        for fqn, param in _held_params(model).items():
            if id(param) in done or (skip is not None and skip(fqn)):
                continue
            offset, shape = local_region(param)
            source = source_of(fqn, section)
            if source is None:  # no HF tensor (only the MoE balancing bias): its initial value, 0,
                # written here: a meta-built model's allocation is uninitialized memory (#34)
                (param.to_local() if isinstance(param, DTensor) else param).zero_()
                continue
            part = read_region(files, source, offset, shape)
            local = param.to_local() if isinstance(param, DTensor) else param
            if tuple(part.shape) == tuple(local.shape) and tuple(shape) != tuple(param.shape):
                local.copy_(part)
            elif tuple(part.shape) == tuple(param.shape):
                _copy_part(param, part)  # whole tensor read: a plain parameter, or a 2-D shard
            else:
                raise UserError(f"{files.where(source[0])} has shape {tuple(part.shape)}, the model "
                                f"expects {tuple(param.shape)} (init.from)")
            done.add(id(param))
    return len(done)


def source_words(files: WeightFiles, fqn: str, param, section: dict) -> str:
    """"FILE: tensor 'NAME'" of the HF tensor our parameter `fqn` is read from; a stacked-experts
    parameter: the first expert whose values in this rank's part (`param`, None: held by
    another rank) are not finite."""
    import torch

    name = source_of(fqn, section)[0]
    if "{e}" in name and param is None:
        name = name.format(e="*")
    elif "{e}" in name:
        offset, _ = local_region(param)
        local = param.to_local() if hasattr(param, "to_local") else param
        bad = (~torch.isfinite(local.detach())).flatten(1).any(1).nonzero().flatten().tolist()
        name = name.format(e=offset[0] + bad[0] if bad else "*")
    return files.where(name)


def config_json_key(key: str, arch: str, folder: str | Path) -> str:
    """" (FIELD of FOLDER/config.json)": where init.from's [model] `key` was set, for messages."""
    field = model_spec.get(arch).hf.config_json_keys.get(key, key)
    return f" ({field} of {Path(folder) / 'config.json'})"
