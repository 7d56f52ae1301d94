"""Llama-family architecture: logits parity with transformers' LlamaForCausalLM, Qwen2ForCausalLM
and MistralForCausalLM built here from small configs with random weights (never downloaded), both
directions through hpctrain/model/llama/hf.py; GQA, llama3 rope scaling, tied / untied; the
hidden-size rule, FLOPs, and one-line config errors."""
import sys

import pytest
import torch

from hpctrain.model.llama import hf as hf_llama
from hpctrain.model import Llama, build_model_from_section
from tests.conftest import run_cmd

transformers = pytest.importorskip("transformers")

BASE = dict(arch="llama", n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=131)
CASES = {
    "llama_gqa_untied": ("llama", dict(n_kv_head=2, rope_theta=500000.0)),
    "llama31_rope_scaling_tied": ("llama", dict(n_kv_head=1, rope_theta=500000.0, tie_embeddings=True,
                                                rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                                                rope_high_freq_factor=4.0,
                                                rope_original_max_positions=16)),
    "qwen2_qkv_bias_tied": ("qwen2", dict(n_kv_head=2, qkv_bias=True, tie_embeddings=True,
                                          rms_norm_eps=1e-6, rope_theta=1e6, ffn_hidden=96)),
    "mistral_gqa": ("mistral", dict(n_kv_head=2, multiple_of=32)),
}


def _hf_model(model_type, section):
    cfg = transformers.AutoConfig.for_model(**hf_llama.hf_config(section, model_type))
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # HF's init: norms 1, biases 0; randomize them so the mapping is tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _ids():
    return torch.randint(0, BASE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_ours_logits(case):
    model_type, extra = CASES[case]
    section = {**BASE, **extra}
    hf = _hf_model(model_type, section)
    ours_section = {**BASE, **hf_llama.model_section_from_hf(hf.config.to_dict())}
    ours = build_model_from_section(ours_section).eval()
    state = hf_llama.from_hf_state_dict(hf.state_dict(), ours.cfg.tie_embeddings)
    assert set(state) == set(ours.state_dict())
    ours.load_state_dict(state)
    ids = _ids()
    with torch.no_grad():
        d = (ours(ids) - hf(ids).logits).abs().max().item()
    assert d <= 1e-4, d
    assert (ours.lm_head.weight is ours.tok_emb.weight) == section.get("tie_embeddings", False)


@pytest.mark.parametrize("case", list(CASES))
def test_ours_to_hf_logits(case):
    model_type, extra = CASES[case]
    section = {**BASE, **extra}
    torch.manual_seed(2)
    ours = build_model_from_section(section).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**hf_llama.hf_config(section, model_type)),
        attn_implementation="sdpa").eval()
    missing, unexpected = hf.load_state_dict(
        hf_llama.to_hf_state_dict(ours.state_dict(), ours.cfg.tie_embeddings), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ids = _ids()
    with torch.no_grad():
        d = (ours(ids) - hf(ids).logits).abs().max().item()
    assert d <= 1e-4, d


def test_rope_scaling_changes_logits():
    """The llama3 scaling is not a no-op at these sizes (so the parity above tests it)."""
    torch.manual_seed(3)
    a = build_model_from_section({**BASE, **CASES["llama31_rope_scaling_tied"][1]}).eval()
    b = build_model_from_section({**BASE, **CASES["llama31_rope_scaling_tied"][1],
                                  "rope_scaling_factor": 0.0}).eval()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        assert (a(_ids()) - b(_ids())).abs().max().item() > 1e-3


@pytest.mark.parametrize("n_embd,multiplier,expected", [(4096, 1.0, 11008), (4096, 1.3, 14336),
                                                        (8192, 1.3, 28672), (64, 1.0, 256)])
def test_ffn_hidden_rule(n_embd, multiplier, expected):
    """Llama 2 7B (11008), Llama 3 8B (14336) and 70B (28672) from Meta's rule, multiple_of 1024
    for Llama 3, 256 for Llama 2."""
    from hpctrain.model import LlamaConfig
    multiple_of = 256 if multiplier == 1.0 else 1024
    c = LlamaConfig(1, 32, n_embd, 8, 8, ffn_dim_multiplier=multiplier, multiple_of=multiple_of)
    assert c.ffn_hidden_size == expected


def test_flops_and_params():
    m = build_model_from_section({**BASE, "n_kv_head": 2})
    c = m.cfg
    per_block = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * c.ffn_hidden_size + 2 * 64
    head = 131 * 64
    assert m.num_params() == 2 * per_block + 64 + head  # the input embedding is not counted
    assert m.num_params(non_embedding=False) == m.num_params() + 131 * 64
    assert m.flops_per_token() == 6 * m.num_params() + 12 * 2 * 64 * 64
    assert isinstance(m, Llama)


TRAIN = ["--run.dir={run}", "--data.path={run}/nodata", "--model.n_layer=2", "--model.n_embd=64",
         "--model.block_size=32", "--model.vocab_size=257", "--train.steps=2", "--train.micro_batch_size=2",
         "--train.warmup_steps=0"]


@pytest.mark.parametrize("overrides,key", [
    (["--model.arch=llama", "--model.n_head=4", "--model.n_kv_head=3"], "model.n_kv_head"),
    (["--model.arch=llama", "--model.n_head=6"], "model.n_head"),
    (["--model.arch=llama", "--model.n_head=4", "--model.n_kv_head=2", "--parallel.tp=4"], "parallel.tp"),
    (["--model.n_head=4", "--model.n_kv_head=2"], "model.n_kv_head"),
    (["--model.n_head=4", "--model.tie_embeddings=false", "--model.rope_theta=5e5"], "model.rope_theta"),
    (["--model.arch=llama", "--model.n_head=4", "--model.rope_scaling_factor=8",
      "--model.rope_low_freq_factor=4", "--model.rope_high_freq_factor=1"], "model.rope_high_freq_factor"),
    (["--model.arch=mamba", "--model.n_head=4"], "model.arch"),
    (["--model.arch=llama", "--model.n_head=4", "--model.ffn_hidden=171", "--parallel.tp=2"],
     "parallel.tp"),
])
def test_config_errors_one_line(tmp_path, overrides, key):
    args = [a.format(run=tmp_path) for a in TRAIN] + overrides
    r = run_cmd([sys.executable, "-m", "hpctrain", "train", *args], timeout=120, check=False)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and key in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("tied", [False, True])
def test_meta_init_bit_identical(tied):
    """parallel.meta_init (the default) replays llama's init: the same weights as a plain build,
    bit for bit, the tie kept (RMSNorm weights and rotary tables hold no unreplayable state)."""
    from hpctrain.parallel.meta_init import build_on_meta, materialize

    section = {**BASE, "n_kv_head": 2, "qkv_bias": True, "tie_embeddings": tied}
    torch.manual_seed(7)
    ref = build_model_from_section(section)
    recipe, model = build_on_meta(lambda: build_model_from_section(section))
    materialize(model, recipe, 7, torch.device("cpu"))
    assert (model.lm_head.weight is model.tok_emb.weight) == tied
    got = dict(model.named_parameters())
    assert got.keys() == dict(ref.named_parameters()).keys()
    for k, v in ref.named_parameters():
        assert torch.equal(got[k], v), k


def test_hf_configs_we_cannot_represent_are_refused():
    """Never a silently different model: each refusal names the config.json key."""
    from hpctrain.errors import UserError

    llama = hf_llama.hf_config(BASE, "llama")
    for change, key in [({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope"),
                        ({"attention_bias": True}, "attention_bias"),
                        ({"model_type": "mistral", "sliding_window": 16}, "sliding_window"),
                        ({"hidden_act": "gelu"}, "hidden_act"),
                        ({"model_type": "gpt_neox"}, "model_type")]:
        with pytest.raises(UserError, match=key):
            hf_llama.model_section_from_hf({**llama, **change})
    with pytest.raises(UserError, match="qwen2"):
        hf_llama.hf_config({**BASE, "qkv_bias": True}, "llama")
    with pytest.raises(UserError, match="model.layers.0.self_attn.o_proj.bias"):
        hf_llama.from_hf_state_dict({"model.layers.0.self_attn.o_proj.bias": torch.zeros(1)}, False)
    assert hf_llama.from_hf_name("model.layers.3.self_attn.rotary_emb.inv_freq") is None
