"""Parameter counts as Hugging Face transformers counts the exported model, for the lines a person
reads (`train`'s start-up line, `hpctrain.load`): `num_parameters()` and
`num_parameters(exclude_embeddings=True)`.

A tied weight counts once; "without embeddings" leaves out every nn.Embedding table (the token
embedding, gpt2's position embedding) and so, when tied, the head that is the same tensor, as
transformers does. The MoE balancing bias (router.bias: DeepSeek-V3's routing offset, which no
Hugging Face class has and `export` does not write) is not counted. The MFU's N is not this:
that is each model's num_params() / active_params() (gpt2/model.py, llama/model.py), unchanged.
"""
from __future__ import annotations

import torch.nn as nn

NOT_EXPORTED = ("router.bias",)  # our parameters that the Hugging Face model has no tensor for


def hf_param_counts(model: nn.Module) -> tuple[int, int]:
    """(every parameter, every parameter but the embedding tables) of the whole `model` (before
    any pipeline split), as transformers' num_parameters() counts its export."""
    embeddings = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    total = without = 0
    for name, p in model.named_parameters():  # a tied weight once, under its first name
        if name.endswith(NOT_EXPORTED):
            continue
        total += p.numel()
        without += 0 if name in embeddings else p.numel()
    return total, without


def params_words(total: int, without_embeddings: int) -> str:
    """'1.23M params (1.10M without embeddings)': the start-up line's words for the counts."""
    return f"{total / 1e6:.2f}M params ({without_embeddings / 1e6:.2f}M without embeddings)"
