"""train.precision = "fp8": torchao's float8 training swapped into the model's nn.Linear layers,
from outside the model, before any layout is applied (as torchtitan converts before
parallelize: FSDP2 then shards the converted layers' weights, and with fp8.fsdp_all_gather
all-gathers them in float8).

Owns: which Linear layers convert (`float8_layers`: not those fp8.skip names, nor those with a
dimension that is not a multiple of 16, which float8 tensor cores need), the device's refusal
(`fp8_refusal`: compute capability >= 8.9, or fp8.emulate), torchao's import (an optional extra)
and the swap itself (`apply_float8`), and the one line saying what was converted. The rest of
the step runs as bf16 (autocast, FSDP2's bf16 parameters: precision.half_dtype). It must never
edit the model's code or parameter names (a Float8Linear keeps `weight` and `bias`), nor apply a
layout.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.nn as nn

from hpctrain.errors import ConfigError, UserError

MIN_CAPABILITY = (8, 9)   # Ada / Hopper: float8 tensor cores (torch._scaled_mm)
DIM_MULTIPLE = 16         # float8 matmuls need both dimensions of the weight multiples of 16


@dataclass(frozen=True)
class Float8Swap:
    """What `apply_float8` did: the converted layers' names and the skipped ones with why."""
    recipe: str
    fsdp_all_gather: bool
    emulate: bool
    converted: tuple[str, ...]
    skipped: dict[str, str]   # name -> "fp8.skip" | "dims MxN"

    def line(self) -> str:
        how = f"{self.recipe}{', float8 FSDP all-gather' if self.fsdp_all_gather else ''}" \
              f"{', emulated' if self.emulate else ''}"
        skipped = ", ".join(f"{name} ({why})" for name, why in self.skipped.items()) or "none"
        return (f"fp8 ({how}): {len(self.converted)} of {len(self.converted) + len(self.skipped)} "
                f"Linear layers converted; kept in bf16: {skipped}")


def skip_names(skip: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in skip.split(",") if s.strip())


def float8_layers(model: nn.Module, skip: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """(names of the nn.Linear layers to convert, {name: why} of those kept)."""
    converted, skipped = [], {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if any(s in name for s in skip):
            skipped[name] = "fp8.skip"
        elif module.in_features % DIM_MULTIPLE or module.out_features % DIM_MULTIPLE:
            skipped[name] = f"dims {module.out_features}x{module.in_features}"
        else:
            converted.append(name)
    return converted, skipped


def fp8_refusal(capability: tuple[int, int] | None, emulate: bool) -> str | None:
    """The one line refusing fp8 on this device (capability None: not a CUDA GPU), or None."""
    if emulate or (capability is not None and capability >= MIN_CAPABILITY):
        return None
    where = "this CPU" if capability is None else f"this GPU (compute capability {capability[0]}.{capability[1]})"
    return (f"config key 'train.precision': 'fp8' needs float8 tensor cores (NVIDIA compute "
            f"capability >= 8.9: H100, H200, L40), which {where} lacks; use train.precision = "
            f"'bf16' (or fp8.emulate = true for fp8's numbers without its speed)")


def float8_config(recipe: str, fsdp_all_gather: bool, emulate: bool):
    """torchao's Float8LinearConfig for fp8.recipe (UserError naming the extra without torchao)."""
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError:
        raise UserError("train.precision = 'fp8' needs torchao: pip install 'hpctrain[fp8]'") from None
    # (rowwise with the float8 all-gather: refused by config_rules_fp8)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe),
                               enable_fsdp_float8_all_gather=fsdp_all_gather, emulate=emulate)


def apply_float8(model: nn.Module, fp8, capability: tuple[int, int] | None) -> Float8Swap:
    """Swap the chosen nn.Linear layers of `model` for torchao's Float8Linear in place (their
    parameters kept: same names, same values). `fp8`: the [fp8] section; `capability`: the
    device's CUDA compute capability (None: no CUDA GPU). ConfigError where the device has no FP8."""
    refusal = fp8_refusal(capability, fp8.emulate)
    if refusal is not None:
        raise ConfigError(refusal)
    config = float8_config(fp8.recipe, fp8.fsdp_all_gather, fp8.emulate)
    from torchao.float8 import convert_to_float8_training

    converted, skipped = float8_layers(model, skip_names(fp8.skip))
    chosen = set(converted)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, name: name in chosen)
    return Float8Swap(fp8.recipe, fp8.fsdp_all_gather, fp8.emulate, tuple(converted), skipped)
