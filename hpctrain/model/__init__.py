"""Model architectures (no distributed code here) and `build_model_from_section`, which turns a
[model] config section (a dict, as saved with every checkpoint) into the module of its
`arch`: "gpt2" (gpt.py, the default: also for sections saved before `arch` existed) or "llama"
(llama.py: Llama / Mistral / Qwen2)."""
import dataclasses

from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.model.llama import Llama, LlamaConfig
from hpctrain.model.moe import MoEConfig

ARCHS = {"gpt2": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}

__all__ = ["ARCHS", "GPT", "GPTConfig", "Llama", "LlamaConfig", "build_model_from_section",
           "model_config_from_section"]


def model_config_from_section(section: dict):
    """The architecture's config dataclass from a [model] section: keys it does not have (the
    other architecture's, left at their defaults by config_rules) are dropped; the moe_* keys
    become llama's MoEConfig (moe_experts 0 or absent: dense)."""
    _, config_cls = ARCHS[section.get("arch", "gpt2")]
    names = {f.name for f in dataclasses.fields(config_cls)}
    kwargs = {k: v for k, v in section.items() if k in names}
    if config_cls is LlamaConfig and section.get("moe_experts", 0) > 0:
        moe_names = {f.name for f in dataclasses.fields(MoEConfig)}
        kwargs["moe"] = MoEConfig(n_experts=section["moe_experts"], **{
            k.removeprefix("moe_"): v for k, v in section.items()
            if k.startswith("moe_") and k.removeprefix("moe_") in moe_names - {"n_experts"}},
            n_shared_experts=section.get("moe_shared_experts", 0))
    return config_cls(**kwargs)


def build_model_from_section(section: dict):
    """The (freshly initialized, from torch's global RNG) model of a [model] section."""
    model_cls, _ = ARCHS[section.get("arch", "gpt2")]
    return model_cls(model_config_from_section(section))
