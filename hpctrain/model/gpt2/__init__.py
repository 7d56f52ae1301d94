"""model.arch = "gpt2": spec.py (registration, torch-free), model.py (the modules), hf.py (Hugging
Face GPT2LMHeadModel). Names of model.py are importable from here (imported on first use)."""


def __getattr__(name: str):
    import importlib
    import importlib.util

    if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        raise AttributeError(name)  # a submodule (spec, args, ...): the import system loads it
    try:
        return getattr(importlib.import_module("hpctrain.model.gpt2.model"), name)
    except AttributeError:
        raise AttributeError(f"module 'hpctrain.model.gpt2' has no attribute {name!r}") from None
