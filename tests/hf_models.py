"""What the tests against Hugging Face transformers share (a test-only dependency, never
downloading: HF_HUB_OFFLINE=1): tiny HF models of each imported family, an HF folder's logits, and
what `pipeline("text-generation")` makes of an exported folder."""
from __future__ import annotations

import os
import sys

import torch

from tests.conftest import run_cmd

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def hf_logits(folder, tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        return hf(tokens).logits


def pipeline_generates(folder) -> str:
    """The text `pipeline("text-generation")` makes in a fresh, offline process."""
    code = ("import sys, transformers; p = transformers.pipeline('text-generation', sys.argv[1]); "
            "print(repr(p('KING HENRY', max_new_tokens=6, do_sample=False)[0]['generated_text']))")
    r = run_cmd([sys.executable, "-c", code, str(folder)], timeout=180, env=OFFLINE)
    assert r.returncode == 0, r.stderr[-2000:]
    return eval(r.stdout.strip().splitlines()[-1])


# Import: tiny HF models built here from small configs (random weights, save_pretrained)
HF_CASES = {
    "llama_gqa_untied": ("LlamaConfig", dict(num_key_value_heads=2, rope_theta=500000.0)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, sliding_window=None)),
    "qwen2_tied": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", dict(n_layer=2, n_head=4, n_embd=32, n_positions=32, vocab_size=131)),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                         decoder_sparse_step=2, norm_topk_prob=False)),
}


def make_hf_model(kind: str, folder, dtype=torch.float32, max_shard_size="5GB", **sizes):
    """A transformers model of HF_CASES[kind] (sizes: config keys to change, LlamaConfig-style or
    GPT2Config's), saved."""
    import transformers

    cls_name, extra = HF_CASES[kind]
    if cls_name == "GPT2Config":
        cfg = transformers.GPT2Config(**{**extra, **sizes})
    else:
        cfg = getattr(transformers, cls_name)(**{
            "vocab_size": 131, "hidden_size": 32, "intermediate_size": 80, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 32, **extra, **sizes})
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():  # not init-time values: every norm and bias matters
            p.normal_(0.0, 0.2)
    hf.to(dtype).save_pretrained(folder, max_shard_size=max_shard_size)
    return hf.float()


# Damaging a model folder (init.from's refusals, #47): its weights edited, or split into shards
def edit_weights(folder, edit) -> None:
    """model.safetensors rewritten with `edit(tensors)` applied to its {name: tensor}."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def split_in_two(folder) -> dict:
    """model.safetensors as two shards + model.safetensors.index.json (the tensors in name order,
    half in each); returns the index's weight_map."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {name: files[i >= len(names) // 2] for i, name in enumerate(names)}
    for file in files:
        save_file({n: tensors[n] for n in names if weight_map[n] == file}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def write_index(folder, weight_map: dict) -> None:
    import json

    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
