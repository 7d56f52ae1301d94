"""hpctrain: train GPT-style language models on Slurm clusters with MPI (`python -m hpctrain`).

In Python, `hpctrain.load(path)` gives a trained model (a run directory, a checkpoint or a Hugging
Face model folder) with its tokenizer, `.logits(ids)` and `.generate(...)`: hpctrain/api.py.
Importing hpctrain imports nothing else (no torch): every command's start-up pays for this file.
"""


def load(path, device=None, step=None):
    """The model at `path` in eval mode on `device` (CUDA when available, else the CPU), with its
    tokenizer: an `hpctrain.api.LoadedModel` (`.model`, `.tokenizer`, `.logits`, `.generate`).
    `path`: a run directory (its newest intact checkpoint, or the one of `step`), a checkpoint's
    step_N folder, or a Hugging Face model folder (GPT-2, Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE)."""
    from hpctrain.api import load as load_model

    return load_model(path, device=device, step=step)


def __getattr__(name: str):
    if name == "LoadedModel":
        from hpctrain.api import LoadedModel

        return LoadedModel
    raise AttributeError(f"module 'hpctrain' has no attribute {name!r}")
