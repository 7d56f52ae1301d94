"""The Qwen3 family (hpctrain/model/qwen3/, #50) against transformers' own Qwen3ForCausalLM and
Qwen3MoeForCausalLM, built here from small configs with random weights (never downloaded):

- import, as init.from reads a folder: its config.json -> our [model] section (arch "qwen3"),
  its tensors checked and read into our model, which gives HF's logits (<= 1e-4, fp32) and HF's
  greedy tokens; the head width is decoupled from n_embd / n_head (4 heads of 16 on a 32-wide
  stream), the q/k norms are per head, GQA, tied and untied heads, MoE with normalized and
  unnormalized top-k, a dense first layer (mlp_only_layers [0]) and every other layer sparse
  (decoder_sparse_step 2); a config.json it cannot reproduce is one line naming the field;
- export (`hpctrain export`'s function on a checkpoint): transformers loads the folder as the
  right class with our logits, and AutoTokenizer gives the shard's ids (transformers 5 reads
  tokenizer_config.json's class for qwen3 / qwen3_moe, unlike qwen2's: no loader file needed);
- the [model] checks name the key; the planner's counts, FLOPs and activation bytes are the
  model's own (Qwen3-30B-A3B: 30.53B parameters).
"""
from __future__ import annotations

import json

import pytest
import torch

from hpctrain.model.qwen3.hf import export, section_from_config
from hpctrain.model.qwen3.model import build

SMALL = dict(vocab_size=131, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
             num_attention_heads=4, head_dim=16, max_position_embeddings=32)
HF_CASES = {  # name: (config class, its keys)
    "dense_gqa": ("Qwen3Config", dict(num_key_value_heads=2, rope_theta=1000000.0)),
    "dense_tied": ("Qwen3Config", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[0])),
    "moe_unnormalized": ("Qwen3MoeConfig", dict(num_key_value_heads=1, num_experts=4,
                                                num_experts_per_tok=3, moe_intermediate_size=24,
                                                norm_topk_prob=False, decoder_sparse_step=2)),
}
TOKENS = torch.randint(0, 131, (2, 32), generator=torch.Generator().manual_seed(1))


def make_hf(kind: str, folder):
    """transformers' model of HF_CASES[kind], every weight N(0, 0.2) (norms matter), saved."""
    import transformers

    cls_name, extra = HF_CASES[kind]
    cfg = getattr(transformers, cls_name)(**{**SMALL, **extra})
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    hf.save_pretrained(folder)
    return hf


def imported(folder):
    """Our model of an HF folder as init.from reads it (hpctrain/interop/hf_import.py: config.json
    -> [model], every tensor checked, then read into our names through the family's source_of)."""
    from hpctrain.interop import hf_import

    section = hf_import.model_section(folder)
    model = build({**section, "dropout": 0.0}).eval()
    read = hf_import.load_weights(model, folder, section)  # all but the balancing bias (0)
    assert read == sum(1 for n, _ in model.named_parameters() if not n.endswith("router.bias"))
    return model, section


@pytest.mark.parametrize("kind", list(HF_CASES))
def test_import_gives_transformers_logits_and_greedy_tokens(kind, tmp_path):
    hf = make_hf(kind, tmp_path / "hf")
    model, section = imported(tmp_path / "hf")
    assert model.cfg.q_dim == 64 != model.cfg.n_embd  # the head width is its own
    with torch.no_grad():
        assert (model(TOKENS) - hf(TOKENS).logits).abs().max().item() < 1e-4
        ours = model.generate(TOKENS[:, :8], 12, temperature=0.0)
        theirs = hf.generate(TOKENS[:, :8], max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert ours.tolist() == theirs.tolist()
    sparse = [i for i in range(3) if model.cfg.is_sparse(i)]
    assert sparse == {"moe": [1, 2], "moe_unnormalized": [1]}.get(kind, [])


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """(a dataset's tokenizer record, the shard's ids of TEXT): a byte-level BPE with Llama 3's
    regex (digits in threes: Qwen2Tokenizer's own pre-tokenizer splits them one by one) trained on
    three plays, with special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from data_tools.format import read_manifest
    from data_tools.tokenizers import tokenizer_file_of
    from tests.tokenizer_files import LLAMA3_PAT, LLAMA3_SPECIALS, plays, shard, tokens

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(plays(3), trainer=trainers.BpeTrainer(
        vocab_size=3000, special_tokens=LLAMA3_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path_factory.mktemp("qwen3_tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    (d / "doc.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    assert shard([d / "doc.jsonl"], d / "data", d / "tokenizer.json").returncode == 0
    m, ids = tokens(d / "data")
    return dict(m["tokenizer"], **tokenizer_file_of(str(d / "data"), read_manifest(str(d / "data")))), ids.tolist()


TEXT = "KING HENRY. Count 1234567 89 and 2024!\na    b\t\tc  naïve café <|end_of_text|> end  "


@pytest.mark.parametrize("kind", ["dense_tied", "moe"])
def test_export_loads_in_transformers_with_our_logits(kind, byte_level, tmp_path):
    """A checkpoint of our model (random weights, the byte-level dataset's tokenizer recorded)
    through `hpctrain export`'s function."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpctrain.checkpoint import CheckpointManager
    from hpctrain.export import export_hf

    _, section = imported(make_hf(kind, tmp_path / "src") and tmp_path / "src")
    torch.manual_seed(5)
    model = build(section).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    CheckpointManager(tmp_path / "run" / "checkpoints", keep=1, rank=0, world_size=1).save(
        7, {"model": get_state_dict(model, [])[0]},
        {"step": 7, "config": {"model": section, "data": {"path": ""}}, "tokenizer": byte_level[0]})
    export_hf(tmp_path / "run", tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    assert tok(TEXT)["input_ids"] + [tok.eos_token_id] == byte_level[1]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert type(hf).__name__ == {"dense_tied": "Qwen3ForCausalLM", "moe": "Qwen3MoeForCausalLM"}[kind]
    with torch.no_grad():
        assert (hf(TOKENS).logits - model(TOKENS)).abs().max().item() < 1e-4
    back = imported(tmp_path / "out")[0].state_dict()  # and back: the same tensors, but the
    # balancing bias (no Qwen3-MoE tensor, unused by its softmax routing): 0 again
    assert all(torch.equal(v, back[k]) for k, v in model.state_dict().items() if "router.bias" not in k)
    assert all(back[k].eq(0).all() for k in back if "router.bias" in k)


@pytest.mark.parametrize("field,value", [("mlp_only_layers", [1]), ("attention_bias", True),
                                         ("use_sliding_window", True), ("hidden_act", "gelu"),
                                         ("rope_parameters", {"rope_type": "yarn", "factor": 4.0})])
def test_a_config_json_it_cannot_reproduce_is_one_line_naming_the_field(field, value):
    from hpctrain.errors import UserError

    cfg = {**SMALL, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 24, field: value}
    with pytest.raises(UserError, match=field) as e:
        section_from_config(cfg)
    assert str(e.value).startswith("config.json: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("key,value", [("n_kv_head", 3), ("head_dim", 15), ("moe_top_k", 5),
                                       ("moe_shared_experts", 1), ("moe_gate", "sigmoid")])
def test_a_bad_section_names_its_key(key, value):
    from hpctrain.model import spec

    section = {"arch": "qwen3", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 32,
               "vocab_size": 131, "moe_experts": 4, "moe_top_k": 2, key: value}
    failed = []
    spec.get("qwen3").check_config(spec.as_args(section), lambda ok, k, why: ok or failed.append(k))
    assert failed == [f"model.{key}"]


@pytest.mark.parametrize("kv,ffn,names", [(4, 90, "SwiGLU width 90"), (2, 80, "model.n_kv_head=2"),
                                          (4, 80, None)])
def test_tp_names_the_width(kv, ffn, names):
    from hpctrain.model import spec

    m = spec.as_args({"arch": "qwen3", "n_layer": 2, "n_head": 4, "n_kv_head": kv, "n_embd": 32,
                      "block_size": 32, "vocab_size": 131, "ffn_hidden": ffn})
    failed = []
    spec.get("qwen3").check_tp(m, 4, lambda ok, k, why: ok or failed.append(why))
    assert (len(failed), names is None or names in failed[0]) == (int(names is not None), True)


SHAPES = {  # the planner's arithmetic against the built model's own counts (meta device)
    "dense_untied": dict(n_layer=3, n_head=4, n_kv_head=2, head_dim=16, n_embd=32, ffn_hidden=80),
    "dense_tied_default_width": dict(n_layer=2, n_head=4, n_embd=32, tie_embeddings=True),
    "moe_mlp_only": dict(n_layer=4, n_head=4, n_kv_head=1, head_dim=24, n_embd=32, ffn_hidden=40,
                         moe_experts=6, moe_top_k=2, moe_expert_hidden=12, moe_first_dense=1),
    "moe_every_2": dict(n_layer=5, n_head=2, n_embd=32, moe_experts=4, moe_top_k=3, moe_every=2),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_planner_shape_counts_what_the_model_holds(name):
    from hpctrain.plan import moe
    from hpctrain.plan.shape import ModelShape

    section = dict(arch="qwen3", block_size=32, vocab_size=131, **SHAPES[name])
    with torch.device("meta"):
        model = build(section)
    shape = ModelShape(**section).check()
    assert shape.total_params() == model.num_params(non_embedding=False)
    assert shape.num_params() == model.num_params()
    assert shape.active_params() == model.active_params()
    assert shape.flops_per_token() == model.flops_per_token()
    assert moe.sparse_layers(shape) == [int(i) for i, b in model.blocks.items() if hasattr(b.mlp, "router")]
    dense = next(b for b in model.blocks.values() if not hasattr(b.mlp, "router"))
    assert shape.block_params == sum(p.numel() for p in dense.parameters())
    assert shape.block_params_tp(2) == shape.block_params - shape.block_matmul_params // 2


def test_qwen3_30b_a3b_shape():
    """Qwen3-30B-A3B's config.json (48 layers, 2048 wide, 32 heads of 128, 4 kv heads, 128 experts
    of 768, top 8, vocabulary 151,936, untied): 30.53B parameters, 3.35B active with the input
    embedding (Qwen's model card: 30.5B, 3.3B activated)."""
    from hpctrain.plan.shape import ModelShape

    shape = ModelShape(arch="qwen3", n_layer=48, n_head=32, n_kv_head=4, head_dim=128, n_embd=2048,
                       block_size=4096, vocab_size=151936, ffn_hidden=6144, moe_experts=128,
                       moe_top_k=8, moe_expert_hidden=768)
    assert shape.total_params() == 30_532_128_768
    assert shape.active_params() + shape.embedding_params == 3_353_038_848


def saved_bytes(block, x) -> int:
    """Bytes autograd keeps for one block's backward (x, the residual input, counted once;
    parameters not)."""
    kept = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()}
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def pack(t):
        kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(n for ptr, n in kept.items() if ptr not in params)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_activation_bytes_are_what_autograd_keeps(moe):
    """fp32, tp = 1: the planner's per-layer bytes within 3% of the tensors one block saves
    (dense: 470,016 vs 473,088; MoE: 478,208 vs 485,904 measured; without the routing term the
    MoE block's count was 404,480, 17% short)."""
    from hpctrain.plan.memory import layer_activation_bytes
    from hpctrain.plan.shape import ModelShape

    section = dict(arch="qwen3", n_layer=1, n_head=4, n_kv_head=2, head_dim=16, n_embd=32,
                   block_size=64, vocab_size=131, ffn_hidden=80,
                   **(dict(moe_experts=4, moe_top_k=2, moe_expert_hidden=24) if moe else {}))
    torch.manual_seed(0)
    got = saved_bytes(build(section).blocks["0"], torch.randn(2, 64, 32, requires_grad=True))
    want = layer_activation_bytes(ModelShape(**section), 2, 1, half=False)
    assert abs(want - got) <= 0.03 * got, (want, got)


def test_plan_of_a_qwen3_config(tmp_path):
    """`hpctrain plan --config` of docs/scale.md's Qwen3-30B-A3B: the family's one line, its
    recommended layout on 8 nodes, and tp refused beyond the 4 kv heads."""
    import sys

    from tests.conftest import run_cmd

    cfg = tmp_path / "qwen3.toml"
    cfg.write_text("""[run]\ndir = "r"\n[data]\npath = "d"\n[model]\narch = "qwen3"\nn_layer = 48
n_head = 32\nn_kv_head = 4\nhead_dim = 128\nn_embd = 2048\nffn_hidden = 6144\nvocab_size = 151936
block_size = 4096\nmax_positions = 40960\n[model.moe]\nexperts = 128\ntop_k = 8\nexpert_hidden = 768
[train]\nsteps = 1000\nmicro_batch_size = 1\nglobal_batch = 512\nprecision = "bf16"\nloss_chunk = 1024\n""")
    r = run_cmd([sys.executable, "-m", "hpctrain", "plan", "--config", cfg, "--nodes", "8"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# Plan: qwen3 48 x 2048 (32 heads of 128, 4 kv heads, ffn 6144, 128 "
                               "experts of 768 top 8 in 48 layers") and "30.5B parameters" in r.stdout
    assert "| fsdp dp4 tp1 pp16 mb1x128 ac=none | 58.6 GiB | 2.61 s | 803,554 |" in r.stdout
    r = run_cmd([sys.executable, "-m", "hpctrain", "plan", "--config", cfg, "--nodes", "8", "--tp", "8"])
    assert r.returncode == 2 and "--tp 8 must divide n_kv_head 4" in r.stderr
