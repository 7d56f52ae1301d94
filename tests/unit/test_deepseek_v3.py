"""The DeepSeek-V3 family (hpctrain/model/deepseek_v3/, #50) against transformers'
DeepseekV3ForCausalLM built here from small configs with random weights (never downloaded):
multi-head latent attention (with and without the query bottleneck, interleaved and plain rope,
YaRN), the sigmoid router with its correction bias and group-limited choice, shared + routed
experts, the first layers dense. Import: logits within 1e-4 of HF's (read with the group limit off,
interleave flipped, no routed scale, no YaRN or its mscale, or with the correction bias zeroed,
they move by > 1e-3: the comparison sees each). Export:
the folder transformers loads gives our logits within 1e-4 and our greedy text, and its
AutoTokenizer the shard's ids. The planner's arithmetic equals the torch model's counts.
"""
from __future__ import annotations

import json

import pytest
import torch

from hpctrain.export import export_hf
from hpctrain.model import build_model_from_section
from hpctrain.plan.shape import ModelShape
from tests.hf_models import pipeline_generates
from tests.unit.test_hf_import_export import save_run
from tests.unit.test_hf_export_tokenizer import TEXT, auto_ids, byte_level  # noqa: F401 (fixture)

SMALL = {"vocab_size": 131, "hidden_size": 32, "intermediate_size": 80, "moe_intermediate_size": 24,
         "num_hidden_layers": 3, "num_attention_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 12,
         "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
         "n_shared_experts": 2, "routed_scaling_factor": 2.5, "max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 8, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}
CASES = {
    "groups_interleaved": {},
    "no_q_lora_plain_rope_tied": {"q_lora_rank": None, "rope_interleave": False, "n_group": 1,
                                  "topk_group": 1, "norm_topk_prob": False, "tie_word_embeddings": True},
    "yarn": {"qk_rope_head_dim": 16, "rope_parameters": YARN, "first_k_dense_replace": 0},
}
# [model] keys changed in a case: how far the logits then move (the comparison sees each feature)
BROKEN = {"groups_interleaved": [{"moe_topk_groups": 4}, {"rope_interleave": False},
                                 {"moe_routed_scale": 1.0}],
          "no_q_lora_plain_rope_tied": [{"rope_interleave": True}],
          "yarn": [{"rope_scaling_factor": 0.0}, {"rope_mscale_all_dim": 0.0}, {"rope_beta_fast": 32.0}]}


def shape_of(section: dict):
    return ModelShape(arch="deepseek_v3", **section).check()


def make_hf(folder, **extra):
    """A DeepseekV3ForCausalLM of SMALL + extra, every parameter and the routers' correction
    bias N(0, 0.2) (not init-time values), saved to `folder`."""
    import transformers

    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**{**SMALL, **extra})).eval()
    with torch.no_grad():
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if not name.endswith("inv_freq"):
                t.normal_(0.0, 0.2)
    hf.save_pretrained(folder)
    return hf


def imported(folder, **changed):
    """Our model of an HF folder as init.from reads it (config.json -> [model], then each tensor
    from its file: hpctrain/interop/hf_import.py asking the family's source_of)."""
    from hpctrain.interop import hf_import

    section = {**hf_import.model_section(folder), **changed}
    model = build_model_from_section(section).eval()
    assert hf_import.load_weights(model, folder, section) == len(list(model.parameters()))
    return model, section


TOKENS = torch.randint(0, 131, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_import_gives_transformers_logits(case, tmp_path):
    hf = make_hf(tmp_path, **CASES[case])
    model, section = imported(tmp_path)
    with torch.no_grad():
        want = hf(TOKENS).logits
        assert (model(TOKENS) - want).abs().max().item() < 1e-4
        for changed in BROKEN[case]:
            assert (imported(tmp_path, **changed)[0](TOKENS) - want).abs().max().item() > 1e-3, changed
        for name, p in model.named_parameters():  # the correction bias read from the folder
            if name.endswith("router.bias"):
                assert p.abs().min() > 0
                p.zero_()
        assert (model(TOKENS) - want).abs().max().item() > 1e-3
    assert (section["moe_experts"], section["moe_first_dense"]) == (8, CASES[case].get("first_k_dense_replace", 1))


def test_export_loads_in_transformers_with_our_logits_text_and_ids(byte_level, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    record, want_ids = byte_level
    section = {"arch": "deepseek_v3", "n_layer": 3, "n_head": 4, "n_embd": 32, "block_size": 32,
               "vocab_size": 3072, "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8,
               "qk_rope_head_dim": 4, "v_head_dim": 6, "ffn_hidden": 80, "moe_experts": 8, "moe_top_k": 2,
               "moe_expert_hidden": 24, "moe_shared_experts": 1, "moe_first_dense": 1, "moe_groups": 4,
               "moe_topk_groups": 2, "moe_routed_scale": 2.5}
    model = save_run(tmp_path / "run", section, tokenizer=record)  # random weights, a checkpoint
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.randint(0, 3000, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens)).abs().max().item() < 1e-4
    back, _ = imported(out)  # and back: the same tensors, bit for bit
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())
    got_ids, tok = auto_ids(out)
    assert got_ids == want_ids
    prompt = tok("KING HENRY")["input_ids"]
    ours = model.generate(torch.tensor([prompt]), 6, temperature=0.0)[0].tolist()
    assert pipeline_generates(out) == tok.decode(ours)


def test_planner_shape_counts_the_model():
    section = {"n_layer": 3, "n_head": 4, "n_embd": 32, "block_size": 32, "vocab_size": 131,
               "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
               "v_head_dim": 6, "ffn_hidden": 80, "moe_experts": 8, "moe_top_k": 2, "moe_expert_hidden": 24,
               "moe_shared_experts": 2, "moe_first_dense": 1}
    for extra in ({}, {"q_lora_rank": 0, "tie_embeddings": True}, {"moe_experts": 0}):
        model, shape = build_model_from_section({**section, **extra, "arch": "deepseek_v3"}), shape_of({**section, **extra})
        assert shape.total_params() == model.num_params(non_embedding=False)
        assert (shape.num_params(), shape.active_params()) == (model.num_params(), model.active_params())
        assert shape.family.flops_per_token(shape) == model.flops_per_token()
        dense = model.blocks["0"]
        assert shape.block_params == sum(p.numel() for p in dense.parameters())
        replicated = sum(p.numel() for n, p in dense.named_parameters()
                         if n.split(".")[1] in ("q_a", "q_norm", "kv_a", "k_rope", "kv_norm") or "norm" in n)
        assert shape.block_params_tp(2) == replicated + (shape.block_params - replicated) // 2


def test_deepseek_v3_671b_shape():
    """DeepSeek-V3's published shape: 671B parameters, 37B activated per token (the main model,
    without its multi-token-prediction module)."""
    shape = shape_of({"n_layer": 61, "n_embd": 7168, "n_head": 128, "vocab_size": 129280, "block_size": 4096,
                      "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                      "v_head_dim": 128, "ffn_hidden": 18432, "moe_experts": 256, "moe_top_k": 8,
                      "moe_expert_hidden": 2048, "moe_shared_experts": 1, "moe_first_dense": 3})
    assert shape.total_params() == 671_026_419_200
    assert shape.active_params() + shape.embedding_params == 37_552_297_472
    assert shape.tp_problem(8) is None and shape.tp_problem(3) == "must divide n_head 128"
