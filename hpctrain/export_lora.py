"""The export of a LoRA run's checkpoint (it holds the adapters only, lora.rank > 0):

    merged (`export --format hf`): the base rebuilt as the run built it (init.from's folder, or the
        seed's initial weights), W + (alpha / rank) B A written into each adapted layer, then the
        family's ordinary Hugging Face export (hpctrain/export.py)
    peft (`export --format peft`): adapter_config.json + adapter_model.safetensors with PEFT's key
        names (base_model.model.<HF layer>.lora_A.weight), which `PeftModel.from_pretrained(base,
        OUT)` loads on the base folder (init.from's, or a `--format hf` export of the base)

Owns: rebuilding the base for an export and the PEFT folder's two files. It must never import
transformers or peft (test-only), or write anything but OUT.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from hpctrain.errors import UserError
from hpctrain.model import build_model_from_section
from hpctrain.model import spec as model_spec
from hpctrain.parallel.lora import is_adapter, merge_adapters, peft_names


def lora_section(trainer: dict) -> dict:
    """The run's [lora] section ({} without one or with rank 0)."""
    lora = (trainer.get("config") or {}).get("lora") or {}
    return lora if lora.get("rank") else {}


def base_state(trainer: dict, model_cfg: dict) -> dict[str, torch.Tensor]:
    """The frozen base a LoRA run trained on: init.from's folder read into our model, or the seed's
    initial weights (as `torch.manual_seed(seed); model = family(section)` made them)."""
    config = trainer.get("config") or {}
    folder = (config.get("init") or {}).get("from_dir") or ""
    torch.manual_seed(int((config.get("train") or {}).get("seed", 1337)))
    model = build_model_from_section({**model_cfg, "dropout": 0.0})
    if folder:
        from hpctrain.interop import hf_import

        if not (Path(folder) / "config.json").exists():
            raise UserError(f"{folder}: the LoRA run's base (init.from) is gone; the checkpoint "
                            f"holds only the adapters: restore the folder to export")
        hf_import.load_weights(model, folder, model_cfg)
    return {k: v.detach() for k, v in model.state_dict().items()}


def merged_state(adapters: dict, trainer: dict, model_cfg: dict) -> dict[str, torch.Tensor]:
    """The base with the checkpoint's adapters merged in: our names, fp32, no adapters left."""
    lora = lora_section(trainer)
    full = {**base_state(trainer, model_cfg), **{k: v for k, v in adapters.items() if is_adapter(k)}}
    return merge_adapters(full, float(lora["alpha"]) / int(lora["rank"]))


def write_peft(adapters: dict, trainer: dict, model_cfg: dict, out: Path) -> list[str]:
    """adapter_config.json + adapter_model.safetensors in `out` (made here); returns the names."""
    from safetensors.torch import save_file

    lora = lora_section(trainer)
    spec = model_spec.of_section(model_cfg)
    hf = spec.hf_module() if spec.hf is not None else None

    def hf_name(fqn: str) -> str:
        source = hf.source_of(fqn, model_cfg) if hf is not None else None
        if source is None or source[1] or source[2]:  # gpt2: q, k, v fused (c_attn), transposed
            raise UserError(f"model.arch {spec.name!r}: layer {fqn} has no separate Hugging Face "
                            f"module for PEFT; export --format hf (merged) instead")
        return source[0]
    tensors, modules = peft_names({k: v.float() for k, v in adapters.items() if is_adapter(k)}, hf_name)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    folder = (trainer.get("config") or {}).get("init", {}).get("from_dir") or None
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora["rank"]),
              "lora_alpha": float(lora["alpha"]), "lora_dropout": float(lora.get("dropout", 0.0)),
              "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": folder, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["adapter_config.json", "adapter_model.safetensors"]
