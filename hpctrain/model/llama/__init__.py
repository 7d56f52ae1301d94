"""model.arch = "llama" (Llama 2/3/3.1, Mistral, Qwen2, Mixtral, Qwen2-MoE): spec.py (registration,
torch-free), args.py (its [model] keys and rules), model.py (the modules), hf.py / hf_moe.py
(Hugging Face). Names of model.py are importable from here (`from hpctrain.model.llama import
Llama`, the path from before families had folders; imported on first use)."""


def __getattr__(name: str):
    import importlib
    import importlib.util

    if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        raise AttributeError(name)  # a submodule (spec, args, ...): the import system loads it
    try:
        return getattr(importlib.import_module("hpctrain.model.llama.model"), name)
    except AttributeError:
        raise AttributeError(f"module 'hpctrain.model.llama' has no attribute {name!r}") from None
