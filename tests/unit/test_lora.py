"""LoRA's wrapping (hpctrain/parallel/lora.py) in one process: which layers get adapters, that step
0 computes the base model, that only adapters train (the base bit-unchanged after AdamW steps with
weight decay), A's init independent of the global random stream and of meta-init, merging, PEFT's
names, and the [lora] section's refusals."""
import pytest
import torch

from hpctrain.config import from_dict
from hpctrain.config_schema import LoraConfig
from hpctrain.errors import ConfigError
from hpctrain.model import build_model_from_section
from hpctrain.model.optim import build_optimizer
from hpctrain.parallel.lora import apply_lora, init_adapters, merge_adapters, peft_names
from hpctrain.parallel.meta_init import build_on_meta, materialize

SECTION = dict(arch="llama", n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=67, dropout=0.0)
LORA = LoraConfig(rank=4, alpha=8.0, targets="wq,wv,gate")


def lora_model(seed=0, lora=LORA, section=SECTION):
    torch.manual_seed(seed)
    model = build_model_from_section(section)
    apply_lora(model, lora)
    init_adapters(model, lora, seed)
    return model


def test_targets_get_adapters_and_everything_else_freezes():
    model = lora_model()
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"blocks.{b}.{m}.lora_{x}.weight" for b in "01"
                               for m in ("attn.wq", "attn.wv", "mlp.gate") for x in "AB")
    assert model.blocks["0"].attn.wq.lora_A.weight.shape == (4, 32)
    assert model.blocks["0"].mlp.gate.lora_B.weight.shape == (model.blocks["0"].mlp.gate.out_features, 4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_step0_is_the_base_and_only_adapters_train(arch):
    section = {**SECTION, "arch": arch}
    torch.manual_seed(0)
    base = build_model_from_section(section)
    model = lora_model(section=section, lora=LoraConfig(rank=4, alpha=8.0, targets="wq,wv,proj"))
    tokens = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(base(tokens), model(tokens))  # B = 0
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = build_optimizer(model, type("T", (), dict(weight_decay=0.1, optimizer="adamw", lr=1e-2,
                                                    beta1=0.9, beta2=0.95))())
    assert sum(len(g["params"]) for g in opt.param_groups) == 12  # (wq, wv, proj) x 2 blocks x (A, B)
    for _ in range(3):
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert not torch.equal(base(tokens), model(tokens))


def test_a_is_seeded_apart_from_the_global_stream():
    a = lora_model(seed=5).blocks["1"].attn.wv.lora_A.weight
    torch.manual_seed(123)  # whatever the global stream did before
    b = lora_model(seed=5).blocks["1"].attn.wv.lora_A.weight
    assert torch.equal(a, b) and a.abs().max() > 0
    assert not torch.equal(a, lora_model(seed=5).blocks["0"].attn.wv.lora_A.weight)  # per layer
    assert not torch.equal(a, lora_model(seed=6).blocks["1"].attn.wv.lora_A.weight)  # per seed


def test_meta_init_gives_the_same_model():
    def factory():
        m = build_model_from_section(SECTION)
        apply_lora(m, LORA)
        return m
    recipe, meta = build_on_meta(factory)
    materialize(meta, recipe, 0, torch.device("cpu"))
    init_adapters(meta, LORA, 0)
    whole = lora_model(seed=0)
    assert all(torch.equal(p, whole.state_dict()[n]) for n, p in meta.state_dict().items())


def test_merge_equals_the_adapted_forward():
    model = lora_model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    merged = merge_adapters(model.state_dict(), LORA.alpha / LORA.rank)
    assert not any("lora" in k for k in merged)
    plain = build_model_from_section(SECTION)
    plain.load_state_dict(merged)
    tokens = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (plain(tokens) - model(tokens)).abs().max().item() < 1e-5


def test_peft_names():
    adapters = {"blocks.0.attn.wq.lora_A.weight": torch.zeros(4, 32),
                "blocks.0.attn.wq.lora_B.weight": torch.zeros(32, 4)}
    names, modules = peft_names(adapters, lambda fqn: fqn.replace("blocks", "model.layers")
                                .replace("attn.wq", "self_attn.q_proj"))
    assert sorted(names) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert modules == ["q_proj"]


def test_unknown_target_names_the_layers():
    with pytest.raises(ValueError, match=r"'lora.targets': 'q_proj'.*gate, lm_head, proj, up, wk, wo, wq, wv"):
        lora_model(lora=LoraConfig(rank=2, targets="q_proj"))


@pytest.mark.parametrize("override,key", [({"lora": {"rank": 2}, "parallel": {"tp": 2}}, "parallel.tp"),
                                          ({"lora": {"rank": -1}}, "lora.rank"),
                                          ({"lora": {"rank": 2, "dropout": 1.0}}, "lora.dropout"),
                                          ({"lora": {"rank": 2, "targets": " , "}}, "lora.targets"),
                                          ({"lora": {"rank": 2}, "train": {"precision": "fp8"}}, "lora.rank")])
def test_config_refusals_name_the_key(override, key):
    override = dict(override)
    raw = {"run": {"dir": "r"}, "data": {"path": "d"}, "model": dict(SECTION),
           "train": {"steps": 2, "micro_batch_size": 1, **override.pop("train", {})}, **override}
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        from_dict(raw)


def test_the_recipe_loads_and_its_targets_are_llama_layers(tmp_path):
    """configs/lora.toml on a Llama folder (config.json only): its [lora] is read and each of its
    targets names a layer of every Llama block."""
    from hpctrain.config import load
    from hpctrain.parallel.lora import target_layers, targets_of
    from tests.conftest import ROOT
    from tests.hf_configs import write_config_folder

    cfg = load(ROOT / "configs" / "lora.toml", [f"--init.from={write_config_folder(tmp_path / 'base')}"])
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout) == (8, 16.0, 0.05)
    layers = target_layers(build_model_from_section(SECTION), targets_of(cfg.lora.targets))
    assert len(layers) == 4 * SECTION["n_layer"]
