"""init.from reads a Hugging Face folder only when it is exactly the model its config.json
describes (#47): every tensor's name, shape and a float dtype checked before anything is read,
weight files only inside the folder, a damaged config.json, index or safetensors file named in
one line. What transformers itself writes still loads (tied heads, buffers, GPT2Model's names,
fp16, a hub cache snapshot's links). The end-to-end `train --init.from` rows are in
test_bad_input_table.py."""
from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

from hpctrain.errors import ConfigError, UserError
from hpctrain.interop import hf_import
from hpctrain.model import build_model_from_section
from tests.hf_models import edit_weights, make_hf_model, split_in_two, write_index

KINDS = ("llama_gqa_untied", "qwen2_tied", "gpt2", "mixtral")
INDEX = "model.safetensors.index.json"
TOKENS = torch.randint(0, 131, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{kind: (folder, transformers model)} of a few families, saved once (never changed)."""
    base = tmp_path_factory.mktemp("hf")
    return {kind: (base / kind, make_hf_model(kind, base / kind)) for kind in KINDS}


def copy(built, kind, tmp_path):
    folder = tmp_path / kind
    shutil.copytree(built[kind][0], folder)
    return folder


def _set(name, shape, dtype=torch.float32):
    return lambda f: edit_weights(f, lambda t: t.__setitem__(name, torch.ones(shape, dtype=dtype)))


def _drop(name):
    return lambda f: edit_weights(f, lambda t: t.pop(name))


def _index_entry(value, name="lm_head.weight"):
    """Shards + an index whose entry for `name` is `value`."""
    def damage(folder):
        weight_map = split_in_two(folder)
        write_index(folder, {**weight_map, name: value})
    return damage


def _index_text(text):
    def damage(folder):
        split_in_two(folder)
        (folder / INDEX).write_text(text)
    return damage


def _outside_shard(folder):
    """The second shard moved out of the folder, named '../outside/...' by the index."""
    weight_map = split_in_two(folder)
    (folder.parent / "outside").mkdir()
    shutil.move(folder / "model-00002-of-00002.safetensors", folder.parent / "outside" / "x.safetensors")
    write_index(folder, {k: "../outside/x.safetensors" if v.endswith("2.safetensors") else v
                         for k, v in weight_map.items()})


def _linked_shard(folder):
    """The second shard moved out of the folder, a symlink to it left in its place."""
    split_in_two(folder)
    shard = folder / "model-00002-of-00002.safetensors"
    shutil.move(shard, folder.parent / "elsewhere.safetensors")
    os.symlink(folder.parent / "elsewhere.safetensors", shard)


def _file_bytes(edit):
    def damage(folder):
        path = folder / "model.safetensors"
        path.write_bytes(edit(path.read_bytes()))
    return damage


# name: (family, damage(folder), what the one error line names); the probe's cases first
DAMAGED = {
    "wider_down_proj": ("llama_gqa_untied", _set("model.layers.0.mlp.down_proj.weight", (32, 81)),
                        ["'model.layers.0.mlp.down_proj.weight'", "model.safetensors", "(32, 81)"]),
    "longer_lm_head": ("llama_gqa_untied", _set("lm_head.weight", (300, 32)),
                       ["'lm_head.weight'", "(300, 32)", "(131, 32)"]),
    "layer_5_of_2": ("llama_gqa_untied", _set("model.layers.5.mlp.up_proj.weight", (80, 32)),
                     ["'model.layers.5.mlp.up_proj.weight'", "model.safetensors"]),
    "extra_tensor": ("llama_gqa_untied", _set("evil.extra", (3,)), ["'evil.extra'"]),
    "int8_embedding": ("llama_gqa_untied", _set("model.embed_tokens.weight", (131, 32), torch.int8),
                       ["'model.embed_tokens.weight'", "I8"]),
    "fp64_norm": ("llama_gqa_untied", _set("model.norm.weight", (32,), torch.float64),
                  ["'model.norm.weight'", "F64"]),
    "missing_norm": ("llama_gqa_untied", _drop("model.norm.weight"), ["'model.norm.weight'"]),
    "tied_head_of_another_shape": ("qwen2_tied", _set("lm_head.weight", (132, 32)), ["'lm_head.weight'"]),
    "narrow_expert": ("mixtral", _set("model.layers.1.block_sparse_moe.experts.3.w1.weight", (79, 32)),
                      ["'model.layers.1.block_sparse_moe.experts.3.w1.weight'"]),
    "fifth_expert": ("mixtral", _set("model.layers.0.block_sparse_moe.experts.4.w1.weight", (80, 32)),
                     ["'model.layers.0.block_sparse_moe.experts.4.w1.weight'"]),
    "gpt2_c_attn_narrow": ("gpt2", _set("transformer.h.0.attn.c_attn.weight", (32, 95)),
                           ["'transformer.h.0.attn.c_attn.weight'", "(32, 96)"]),
    "index_parent_dir": ("llama_gqa_untied", _outside_shard, [INDEX, "../outside/x.safetensors"]),
    "index_absolute": ("llama_gqa_untied", _index_entry("/etc/passwd"), [INDEX, "'lm_head.weight'", "/etc/passwd"]),
    "index_link_outside": ("llama_gqa_untied", _linked_shard, [INDEX, "elsewhere.safetensors"]),
    "index_missing_shard": ("llama_gqa_untied", _index_entry("model-00003-of-00002.safetensors"),
                            [INDEX, "'lm_head.weight'", "model-00003-of-00002.safetensors"]),
    "index_other_shard": ("llama_gqa_untied", _index_entry("model-00002-of-00002.safetensors",
                                                           "model.embed_tokens.weight"),
                          [INDEX, "'model.embed_tokens.weight'"]),
    "index_not_json": ("llama_gqa_untied", _index_text("{not json"), [INDEX, "JSON"]),
    "index_weight_map_5": ("llama_gqa_untied", _index_text('{"weight_map": 5}'), [INDEX, "weight_map"]),
    "index_entry_5": ("llama_gqa_untied", _index_entry(5), [INDEX, "'lm_head.weight'"]),
    "truncated": ("llama_gqa_untied", _file_bytes(lambda b: b[:len(b) // 2]), ["model.safetensors"]),
    "random_bytes": ("llama_gqa_untied", _file_bytes(lambda b: os.urandom(5000)), ["model.safetensors"]),
    "header_of_2_62_bytes": ("llama_gqa_untied", _file_bytes(lambda b: struct.pack("<Q", 2**62) + b[8:]),
                             ["model.safetensors"]),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_folder_is_one_line_naming_the_tensor_or_file(built, tmp_path, case):
    kind, damage, named = DAMAGED[case]
    folder = copy(built, kind, tmp_path)
    damage(folder)
    section = hf_import.model_section(folder)
    model = build_model_from_section({**section, "dropout": 0.0})
    with pytest.raises(UserError) as refused:
        hf_import.load_weights(model, folder, section)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(str(folder)), message
    assert all(word in message for word in named), message


def _loads_as_transformers(folder, hf) -> None:
    section = hf_import.model_section(folder)
    model = build_model_from_section({**section, "dropout": 0.0}).eval()
    hf_import.load_weights(model, folder, section)
    with torch.no_grad():
        assert (model(TOKENS) - hf(TOKENS).logits).abs().max().item() < 1e-4


def test_what_transformers_writes_beside_the_weights_loads(built, tmp_path):
    """A tied head's copy, rotary inv_freq, GPT2Model's names with its mask buffers: accepted."""
    qwen = copy(built, "qwen2_tied", tmp_path)
    edit_weights(qwen, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    llama = copy(built, "llama_gqa_untied", tmp_path)
    edit_weights(llama, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq",
                                                torch.ones(4)))
    gpt2 = copy(built, "gpt2", tmp_path)

    def as_gpt2_model(t):  # transformer.h.0... -> h.0..., the causal mask buffers as old saves had
        for name in list(t):
            t[name.removeprefix("transformer.")] = t.pop(name)
        t["h.0.attn.bias"] = torch.ones(1, 1, 32, 32, dtype=torch.uint8)
        t["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    edit_weights(gpt2, as_gpt2_model)
    for kind, folder in (("qwen2_tied", qwen), ("llama_gqa_untied", llama), ("gpt2", gpt2)):
        _loads_as_transformers(folder, built[kind][1])


def test_fp16_and_a_hub_cache_snapshot_load(built, tmp_path):
    """fp16 weights; a snapshot folder whose files link into the repository's blobs/ folder (how
    the Hugging Face cache lays a download out)."""
    repo = tmp_path / "models--x--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    source = copy(built, "llama_gqa_untied", tmp_path)
    edit_weights(source, lambda t: t.update({k: v.half() for k, v in t.items()}))
    split_in_two(source)
    for n, path in enumerate(sorted(source.iterdir())):
        shutil.move(path, repo / "blobs" / f"blob{n}")
        os.symlink(f"../../blobs/blob{n}", snapshot / path.name)
    hf = built["llama_gqa_untied"][1]
    section = hf_import.model_section(snapshot)
    model = build_model_from_section({**section, "dropout": 0.0}).eval()
    hf_import.load_weights(model, snapshot, section)
    with torch.no_grad():  # fp16 weights: transformers' fp32 logits within fp16's rounding
        assert (model(TOKENS) - hf(TOKENS).logits).abs().max().item() < 5e-2


# config.json fields of the wrong type or range: (field, value, what the error names)
BAD_CONFIG = [("num_attention_heads", 0, "'num_attention_heads'"),
              ("num_attention_heads", "4", "'num_attention_heads'"),
              ("num_hidden_layers", 1e9, "'num_hidden_layers'"),
              ("num_hidden_layers", -2, "'num_hidden_layers'"),
              ("hidden_size", None, "'hidden_size'"),
              ("vocab_size", True, "'vocab_size'"),
              ("rms_norm_eps", 0, "'rms_norm_eps'"),
              ("tie_word_embeddings", "yes", "'tie_word_embeddings'"),
              ("num_key_value_heads", 0, "'num_key_value_heads'"),
              ("rope_parameters", {"rope_theta": "x", "rope_type": "default"}, "'rope_parameters.rope_theta'"),
              ("rope_parameters", [1], "'rope_parameters'")]


@pytest.mark.parametrize("field, value, named", BAD_CONFIG, ids=[f"{f}={v!r}" for f, v, _ in BAD_CONFIG])
def test_a_config_json_field_of_the_wrong_type_or_range_is_named(built, tmp_path, field, value, named):
    folder = tmp_path / "hf"
    folder.mkdir()
    cfg = json.loads((built["llama_gqa_untied"][0] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ConfigError) as refused:
        hf_import.model_section(folder)
    assert str(refused.value).startswith(f"config key 'init.from': {folder / 'config.json'}: {named}")


def test_a_config_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json: not a JSON object"):
        hf_import.model_section(tmp_path)
