"""Model families (hpctrain/model/<family>/, registered in spec.py; no distributed code here) and
`build_model_from_section`, which turns a [model] config section (a dict, as saved with every
checkpoint) into the module of its `model.arch` (no arch: gpt2, sections saved before it existed).

Importing this package is light (config and plan import the registry, spec.py): the families'
torch modules are imported on first use; `from hpctrain.model import GPT, Llama, ...` still works.
"""
from hpctrain.model import spec as _spec

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "build_model_from_section",
           "model_config_from_section"]

_LAZY = {"GPT": "hpctrain.model.gpt2.model", "GPTConfig": "hpctrain.model.gpt2.model",
         "Llama": "hpctrain.model.llama.model", "LlamaConfig": "hpctrain.model.llama.model",
         "MoEConfig": "hpctrain.model.moe"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpctrain.model' has no attribute {name!r}")


def model_config_from_section(section: dict):
    """The family's config object (GPTConfig, LlamaConfig, ...) from a [model] section: the keys
    it does not have (other families', at their defaults) dropped."""
    return _spec.of_section(section).model_module().model_config(section)


def build_model_from_section(section: dict):
    """The (freshly initialized, from torch's global RNG) model of a [model] section."""
    return _spec.of_section(section).model_module().build(section)
