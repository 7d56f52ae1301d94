"""`init.from = "DIR"`: start a fresh run from a local Hugging Face model folder (config.json +
model.safetensors, or shards + model.safetensors.index.json; fp32 or bf16) of LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM or GPT2LMHeadModel.

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

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config key 'init.from': {path} not found (a Hugging Face model folder "
                          f"holds config.json and model.safetensors)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key 'init.from': {path}: cannot read it as JSON ({e})") from None


def gpt2_section(cfg: dict) -> dict:
    """The [model] section of a GPT2LMHeadModel config.json (what hpctrain's gpt2 can represent)."""
    width = cfg["n_embd"]
    if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"config.json: activation_function {cfg['activation_function']!r}: "
                        f"hpctrain's gpt2 uses gelu_new")
    if cfg.get("n_inner") not in (None, 4 * width) or not cfg.get("tie_word_embeddings", True):
        raise UserError("config.json: n_inner != 4 n_embd or untied embeddings: not hpctrain's gpt2")
    if abs(cfg.get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        raise UserError(f"config.json: layer_norm_epsilon {cfg['layer_norm_epsilon']}: gpt2 uses 1e-5")
    return {"arch": "gpt2", "n_layer": cfg["n_layer"], "n_head": cfg["n_head"], "n_embd": width,
            "block_size": cfg["n_positions"], "vocab_size": cfg["vocab_size"]}


def model_section(folder: str | Path) -> dict:
    """The [model] keys that the folder's config.json sets."""
    from hpctrain.interop import hf_llama

    cfg = read_hf_config(folder)
    try:
        if cfg.get("model_type") == "gpt2":
            return gpt2_section(cfg)
        return hf_llama.model_section_from_hf(cfg)
    except KeyError as e:
        raise ConfigError(f"config key 'init.from': {Path(folder) / 'config.json'} lacks {e}") from None
    except UserError as e:
        raise ConfigError(f"config key 'init.from': {Path(folder)}/{e}") from None


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
    for key, value in model_section(folder).items():
        if key in given and coerce(f"model.{key}", given[key], value) != value:
            raise ConfigError(f"config key 'model.{key}': {given[key]!r} conflicts with init.from "
                              f"{Path(folder) / 'config.json'} ({value!r}); remove the key")
        given[key] = value
    return {**raw, "model": given}


class WeightFiles:
    """The folder's tensors by HF name, opened lazily (one safe_open per file)."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.folder / SINGLE).is_file():
            with safe_open(str(self.folder / SINGLE), "pt") as f:
                weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise UserError(f"{self.folder}: no {SINGLE} or {INDEX} (init.from)")
        self.weight_map, self.open_files = weight_map, {}

    def slice(self, name: str):
        if name not in self.weight_map and name.startswith("transformer.") \
                and name[len("transformer."):] in self.weight_map:
            name = name[len("transformer."):]  # saved from GPT2Model
        if name not in self.weight_map:
            raise UserError(f"{self.folder}: tensor {name!r} not found (init.from)")
        file = self.weight_map[name]
        if file not in self.open_files:
            from safetensors import safe_open

            self.open_files[file] = safe_open(str(self.folder / file), "pt")
        return self.open_files[file].get_slice(name)


_GPT2_BLOCK = {"norm1": ("ln_1", False), "norm2": ("ln_2", False), "attn.wo": ("attn.c_proj", True),
               "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True)}


def gpt2_source(fqn: str, width: int) -> tuple[str, bool, int]:
    """(HF tensor, stored transposed (Conv1D), offset on its output dim) of our gpt2 parameter."""
    top = {"tok_emb.weight": "transformer.wte.weight", "lm_head.weight": "transformer.wte.weight",
           "pos_emb.weight": "transformer.wpe.weight", "norm_f.weight": "transformer.ln_f.weight",
           "norm_f.bias": "transformer.ln_f.bias"}
    if fqn in top:
        return top[fqn], False, 0
    _, layer, rest = fqn.split(".", 2)
    module, kind = rest.rsplit(".", 1)
    hf = f"transformer.h.{layer}."
    if module in ("attn.wq", "attn.wk", "attn.wv"):  # one c_attn, q | k | v on the output dim
        return hf + "attn.c_attn." + kind, True, "qkv".index(module[-1]) * width
    if module not in _GPT2_BLOCK:
        raise UserError(f"parameter {fqn!r}: not a parameter of hpctrain's gpt2")
    name, transposed = _GPT2_BLOCK[module]
    return hf + f"{name}.{kind}", transposed, 0


def source_of(fqn: str, section: dict) -> tuple[str, bool, int] | None:
    """(HF tensor name, transposed, row offset) our parameter is read from; '{e}' in the name: one
    tensor per expert, stacked; None: a parameter HF does not have (the MoE balancing bias)."""
    from hpctrain.interop import hf_llama, hf_moe

    if section.get("arch", "gpt2") == "gpt2":
        return gpt2_source(fqn, section["n_embd"])
    if fqn == "lm_head.weight" and section.get("tie_embeddings"):
        return "model.embed_tokens.weight", False, 0
    kind = hf_moe.moe_type(section) if section.get("moe_experts") else None
    name = hf_llama.to_hf_name(fqn, kind)
    return None if name is None else (name, False, 0)


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


def load_weights(model, folder: str | Path, section: dict) -> int:
    """Copy the folder's weights into the parts of `model` (laid out, materialized) this rank
    holds; returns the number of parameters written."""
    import torch
    from torch.distributed.tensor import DTensor

    from hpctrain.parallel.meta_init import _copy_part, _held_params

    files, done = WeightFiles(folder), set()
    with torch.no_grad():
        for fqn, param in _held_params(model).items():
            if id(param) in done:
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
                raise UserError(f"{Path(folder)}: tensor {source_of(fqn, section)[0]!r} has shape "
                                f"{tuple(part.shape)}, the model expects {tuple(param.shape)} (init.from)")
            done.add(id(param))
    return len(done)
