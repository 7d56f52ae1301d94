"""LoRA: low-rank adapters on a model's nn.Linear layers, applied from outside the model.

    model = factory()                 # the family's model, unchanged (architecture only)
    apply_lora(model, cfg.lora)       # before any layout: adapters are ordinary parameters then
    ... parallelize (DDP | FSDP2), materialize / init.from ...
    init_adapters(model, cfg.lora, seed)   # A from its own seeded generator, B = 0

A target layer (its name ends with one of lora.targets) computes y = W x + b + (alpha / rank) *
B(A dropout(x)): two child modules `lora_A` (rank x in) and `lora_B` (out x rank) added to the
nn.Linear itself and a forward hook, so the base weight keeps its name (init.from, checkpoints of
the base, the export's name mapping and the layouts' plans still see `blocks.0.attn.wq.weight`).
B starts at 0, so step 0 computes exactly the base model. Every other parameter is frozen
(requires_grad False): the optimizer (model/optim.py builds it over trainable parameters only),
DDP's and FSDP2's reductions and the checkpoint's model entry (train/states.py) hold the adapters
alone. A is drawn from torch.Generator(seed) per layer in name order, not from the global stream:
the base's initial weights and the dropout stream are those of the run without LoRA.

Owns: which layers get adapters, their forward, their init, freezing the base, merging B A into W
(the export's merged form) and the adapters' names in PEFT's format. It must never edit a model
family's file, run a step, or read or write files.
"""
from __future__ import annotations

import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

ADAPTER_NAMES = ("lora_A", "lora_B")


def targets_of(targets: str) -> tuple[str, ...]:
    """lora.targets ("wq,wk,wv,wo") as a tuple of module-name suffixes."""
    return tuple(t.strip() for t in targets.split(",") if t.strip())


def is_adapter(fqn: str) -> bool:
    """Whether a parameter name is an adapter's (`...wq.lora_A.weight`)."""
    parts = fqn.split(".")
    return any(part in ADAPTER_NAMES for part in parts)


def target_layers(model: nn.Module, targets: tuple[str, ...]) -> dict[str, nn.Linear]:
    """{name: layer} of the nn.Linear layers whose name's last part is one of `targets`."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.split(".")[-1] in targets}


class LowRank(nn.Module):
    """One adapter matrix, `weight` (out x in), applied as x W^T; built without drawing from the
    global random stream (nn.Linear's constructor would)."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _lora_forward_hook(layer: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    x = F.dropout(inputs[0], layer.lora_dropout, layer.training) if layer.lora_dropout else inputs[0]
    return output + layer.lora_B(layer.lora_A(x)) * layer.lora_scale


def apply_lora(model: nn.Module, lora) -> list[str]:
    """Adapters on every target nn.Linear of `model` (in place), the rest frozen; returns the names
    of the layers adapted. `lora`: the [lora] section (rank, alpha, targets, dropout). Both
    matrices are created as zeros (no random draw: meta-built models record a zeros_ init);
    `init_adapters` gives A its values once the model is materialized."""
    targets = targets_of(lora.targets)
    layers = target_layers(model, targets)
    if not layers:
        names = sorted({n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"config key 'lora.targets': {lora.targets!r} matches no nn.Linear of "
                         f"this model; its linear layers are named {', '.join(names)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in layers.values():
        device, dtype = layer.weight.device, layer.weight.dtype
        layer.lora_A = LowRank(layer.in_features, lora.rank, device, dtype)
        layer.lora_B = LowRank(lora.rank, layer.out_features, device, dtype)
        nn.init.zeros_(layer.lora_A.weight)  # A: init_adapters; B stays 0 (step 0 = the base)
        nn.init.zeros_(layer.lora_B.weight)
        layer.lora_scale = lora.alpha / lora.rank
        layer.lora_dropout = lora.dropout
        layer.register_forward_hook(_lora_forward_hook)
    return sorted(layers)


def adapter_a_values(name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A's initial values for layer `name`: kaiming-uniform (a = sqrt(5), as nn.Linear and PEFT)
    from a generator seeded by (seed, the layer's name), the same on every rank and layout."""
    # CPU generators keep 32 bits of a seed: (seed, name) mixed into 32 bits
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    bound = 1.0 / shape[1] ** 0.5  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) x sqrt(3 / fan_in)
    return torch.rand(shape, generator=gen, dtype=torch.float32) * (2 * bound) - bound


@torch.no_grad()
def init_adapters(model: nn.Module, lora, seed: int) -> None:
    """A of every adapter from `adapter_a_values`, B = 0, into the part this rank holds (a
    DTensor shard, or the whole tensor)."""
    from hpctrain.parallel.meta_init import _copy_part, _held_params

    for fqn, p in _held_params(model).items():
        if fqn.endswith("lora_A.weight"):
            layer = fqn[:-len(".lora_A.weight")]
            _copy_part(p, adapter_a_values(layer, tuple(p.shape), seed).to(p.dtype))
        elif fqn.endswith("lora_B.weight"):
            (p.to_local() if hasattr(p, "to_local") else p).zero_()


def merge_adapters(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full state dict (base + adapters, whole tensors) with W + scale * B A in each adapted
    layer's weight and the adapters removed: the base model's names, for the export."""
    merged = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if key.endswith(".lora_A.weight"):
            layer = key[:-len(".lora_A.weight")]
            a, b = state[key].double(), state[f"{layer}.lora_B.weight"].double()
            w = merged[f"{layer}.weight"]
            merged[f"{layer}.weight"] = (w.double() + scale * (b @ a)).to(w.dtype)
    return merged


def peft_names(adapters: dict[str, torch.Tensor], hf_name) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The adapters under PEFT's key names (`base_model.model.<HF layer>.lora_A.weight`) and the
    HF module names they target (adapter_config.json's target_modules). `hf_name(fqn)`: the
    family's HF name of one of our base weights, e.g. blocks.0.attn.wq.weight ->
    model.layers.0.self_attn.q_proj.weight."""
    out, modules = {}, set()
    for key, value in adapters.items():
        layer, which = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        hf_layer = hf_name(f"{layer}.weight")[:-len(".weight")]
        out[f"base_model.model.{hf_layer}.{which}.weight"] = value.contiguous()
        modules.add(hf_layer.split(".")[-1])
    return out, sorted(modules)
