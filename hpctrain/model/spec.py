"""The model-family registry: one `ModelSpec` per `model.arch`, registered by its family folder.

Owns: what a family must say about itself (the `ModelSpec` and `HFSpec` fields below), the
registry (`register`, `get`, `names`) and the flat [model] keys every family shares plus the ones
each family adds (`model_fields`: config_schema builds its ModelConfig from them, so saved
checkpoints and TOML files keep their flat keys and the [model.moe] table).

A family is a folder hpctrain/model/<name>/ and one entry of FAMILIES below. Its `spec.py` is
torch-free (config, plan and `--help` import it) and calls `register(ModelSpec(...))`; the parts
that need torch are named by module (`ModelSpec.module`, `HFSpec.module`) and imported by the
layers that use them (model build, interop, export), never here. It must never import torch,
distributed or checkpoint code, nor read files.

The module contract (what `build` returns; pipeline.py, tensor_parallel.py, meta_init.py and the
loss rely on it): attributes tok_emb, pos_emb (None without a position table), drop, blocks (an
nn.ModuleDict keyed "0".."L-1", a pipeline stage keeps the keys it holds) of blocks with norm1 /
attn / norm2 / mlp, norm_f and lm_head; any of them None in a pipeline stage; `forward(idx)` ->
logits, `embed(idx)`, `num_params()`, `flops_per_token()`, `reset_parameters()`, `generate`.
"""
from __future__ import annotations

import dataclasses
import importlib
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from hpctrain.errors import ConfigError

# The family packages under hpctrain/model/, in registration order (their keys' order in [model]
# and `train --help`): one line per family. "gpt2" first: the default arch, and the arch of every
# [model] section saved before `arch` existed.
FAMILIES = ("gpt2", "llama", "qwen3", "deepseek_v3")
DEFAULT_ARCH = "gpt2"

# check(ok, key, why): raises ConfigError "config key 'KEY': WHY" when not ok (config_rules._check)
Check = Callable[[bool, str, str], None]


@dataclass
class CommonArgs:
    """The [model] keys of every family (their meaning is the same in each)."""
    n_layer: int = field(metadata={"help": "transformer blocks"})
    n_head: int = field(metadata={"help": "attention heads per block (n_embd must divide by it)"})
    n_embd: int = field(metadata={"help": "embedding width"})
    block_size: int = field(metadata={"help": "context length in tokens (training window)"})
    vocab_size: int = field(metadata={"help": "must be >= the dataset's vocab size (padding is allowed)"})
    dropout: float = field(default=0.0, metadata={"help": "dropout probability (0 keeps runs bit-reproducible cheaply)"})
    max_positions: int = field(default=0, metadata={
        "help": "positions the model holds (gpt2: rows of its position table; all: what export "
                "writes as n_positions / max_position_embeddings); 0 = block_size. init.from sets "
                "it to the folder's, so a shorter block_size trains at that length and the export "
                "keeps the folder's table and limit"})


@dataclass(frozen=True)
class HFSpec:
    """A family's Hugging Face adapter. `module` (torch may be imported there) defines:
    - section_from_config(cfg: dict) -> dict: config.json -> the [model] keys (with "arch");
      UserError("config.json: ...") for a config the family cannot represent;
    - export(state: dict, section: dict) -> (tensors, config): our fp32 state dict -> HF tensor
      names and values, and config.json (with "model_type" and "architectures");
    - source_of(fqn: str, section: dict) -> (HF name, transposed, row offset) | None: the HF
      tensor init.from reads our parameter from ('{e}' in the name: one tensor per expert,
      stacked; None: a parameter HF has no tensor for, initialized to 0);
    - alias(name: str, section: dict) -> (exported name, same) | None: for a folder tensor that
      is not one of the exported ones, the exported tensor it stands for: the same tensor under
      another name (same: True, e.g. GPT-2 saved without "transformer.") or a tied copy (False:
      checked for its shape only); None: not a weight of the model.
    """
    model_types: tuple[str, ...]    # config.json "model_type" values init.from reads as this family
    module: str                     # dotted module of the functions above
    # [model] key -> the config.json field it comes from, for messages naming the folder's field
    config_json_keys: dict[str, str] = field(default_factory=dict)
    # names of the HF classes export may write: "LlamaForCausalLM", ...
    architectures: tuple[str, ...] = ()
    # what `export --help` says the family exports as, e.g. "GPT-2 (model.arch = 'gpt2')"
    export_words: str = ""


def _no_experts(m) -> int:
    return 0


@dataclass(frozen=True)
class ModelSpec:
    """What hpctrain needs of a model family. Functions taking `m` get any object with the flat
    [model] keys as attributes: config_schema.ModelConfig, plan's ModelShape, or a saved section
    through `as_args`."""
    name: str                       # the model.arch value that picks this family
    summary: str                    # one line for model.arch's help: what the architecture is
    args: type                      # dataclass of the family's own [model] keys beyond CommonArgs,
    #                                 each with a default and metadata={"help": ...}; a key declared
    #                                 by two families must have the same type and default
    module: str                     # dotted torch module defining build(section: dict) -> nn.Module
    #                                 (fresh init from torch's global RNG; the module contract above)
    #                                 and model_config(section: dict) -> its config object
    check_config: Callable[[Any, Check], None]  # the rules on its keys (ranges, divisibility)
    check_tp: Callable[[Any, int, Check], None]  # the rules tensor parallelism of `tp` ranks puts
    #                                 on its keys (beyond tp | n_head and tp | block_size under SP)
    block_tp_plan: Callable[[Any, int], dict[str, str]]  # (m, layer index) -> {submodule of the
    #                                 block: style}; styles (parallel/tensor_parallel.py): "gather"
    #                                 (its input all-gathered to whole, e.g. attn, mlp), "colwise",
    #                                 "rowwise" (output back to the residual stream's layout),
    #                                 "norm" (sequence-parallel norm), "experts" (a MoE layer:
    #                                 local tokens in, weights replicated over tp), "partial" (its
    #                                 input a local part, e.g. a per-head q/k norm after a colwise
    #                                 projection: weights replicated, gradients summed over tp),
    #                                 "gather_local" ("gather" handing over a local tensor),
    #                                 "replicate" (whole input, weights replicated, run locally:
    #                                 e.g. MLA's low-rank projections and their norms),
    #                                 "replicate_sum_grad" (the same, its output's gradient summed
    #                                 over tp in backward: MLA's one rope key, used by every head)
    shape: Any                      # the planner's arithmetic (plan/shape.py asks it): an object
    #                                 with `llama_style` (bool: plan/memory.py's RMSNorm / SwiGLU /
    #                                 rotary activation formula, else LayerNorm / GELU) and methods
    #                                 taking the plan's ModelShape `s` (every [model] key an
    #                                 attribute): kv_heads, kv_dim, ffn, tied, block_matmul_params,
    #                                 block_params, position_params, norm_f_params, num_params,
    #                                 named_params (what the model is called by), block_params_tp(s,
    #                                 tp), position_params_tp(s, tp), tp_problem(s, tp) -> str | None,
    #                                 describe(s, fmt_params, sparse_layers) -> the plan's one line;
    #                                 optional: flops_per_token(s) (default 6N + 12 L w T, w =
    #                                 attention_width(s), default n_embd) and
    #                                 layer_activation_bytes(s, micro_batch, tp, half) (default
    #                                 plan/memory.py's formula of llama_style)
    hf: HFSpec | None = None        # its Hugging Face adapter; None: no import or export
    n_experts: Callable[[Any], int] = _no_experts  # expert-parallel hook: routed experts per
    #                                 sparse layer (0 = dense: parallel.ep must stay 1); a family
    #                                 with experts uses model/moe.py's MoEFeedForward, which
    #                                 apply_expert.py shards over ep
    undecayed: Callable[[Any], tuple[str, ...]] = lambda m: ()  # parameter names kept out of
    #                                 weight decay (gpt2: a position table longer than block_size)

    def model_module(self):
        """The family's torch module (imported on first use)."""
        return importlib.import_module(self.module)

    def hf_module(self):
        """The family's Hugging Face adapter module; UserError-free: callers check `hf` first."""
        return importlib.import_module(self.hf.module)


_REGISTRY: dict[str, ModelSpec] = {}
_LOADED = False


def register(spec: ModelSpec) -> ModelSpec:
    """Add a family (called by hpctrain/model/<name>/spec.py at import)."""
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"model.arch {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def _load() -> dict[str, ModelSpec]:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for family in FAMILIES:
            importlib.import_module(f"hpctrain.model.{family}.spec")
    return _REGISTRY


def names() -> tuple[str, ...]:
    """The registered model.arch values (FAMILIES' order): `--arch` choices, model.arch's Literal."""
    return tuple(_load())


def get(arch: str | None) -> ModelSpec:
    """The spec of `arch` (None: DEFAULT_ARCH); an unknown one is one line listing the registered."""
    specs = _load()
    arch = DEFAULT_ARCH if arch is None else arch
    if arch not in specs:
        raise ConfigError(f"config key 'model.arch': {arch!r}: expected one of {', '.join(specs)}")
    return specs[arch]


def of_section(section: dict) -> ModelSpec:
    """The spec of a [model] section (a dict, as saved; no "arch": gpt2, saved before it existed)."""
    return get(section.get("arch", DEFAULT_ARCH))


def as_args(section: dict):
    """A saved [model] section as `m` for the spec's functions: every key of every family, those
    the section lacks (saved before they existed) at their defaults."""
    defaults = {name: f.default for name, _, f in model_fields() if f.default is not dataclasses.MISSING}
    return _Args(**{**defaults, **section})


class _Args:
    def __init__(self, **keys):
        self.__dict__.update(keys)


def _own_fields(cls: type) -> list[tuple[str, Any, dataclasses.Field]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name], f) for f in dataclasses.fields(cls)]


def owned_keys(spec: ModelSpec) -> frozenset[str]:
    """The [model] keys `spec` reads: CommonArgs', "arch" and its args'. Any other key set away from
    its default is refused for that arch (it would be silently ignored)."""
    return frozenset(f.name for f in dataclasses.fields(CommonArgs)) | {"arch"} | {
        f.name for f in dataclasses.fields(spec.args)}


def model_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """(name, type, field) of every [model] key: CommonArgs', "arch" (a Literal of the registered
    names), then each family's args in FAMILIES order, a key two families declare once."""
    arch = field(default=DEFAULT_ARCH, metadata={"help": "the model family: " + "; ".join(
        f"'{s.name}' ({s.summary})" for s in _load().values()) + ". Another family's key set is refused"})
    out = [*_own_fields(CommonArgs), ("arch", Literal[names()], arch)]
    seen = {name: (typ, f) for name, typ, f in out}
    for spec in _load().values():
        for name, typ, f in _own_fields(spec.args):
            if name in seen:
                if (seen[name][0], seen[name][1].default) != (typ, f.default):
                    raise ValueError(f"model key {name!r} of arch {spec.name!r} differs in type or "
                                     f"default from an earlier family's; use the same or rename it")
                continue
            seen[name] = (typ, f)
            out.append((name, typ, f))
    return out
