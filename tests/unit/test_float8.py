"""train.precision = "fp8" (hpctrain/parallel/float8.py, config_rules_fp8.py): which Linear layers
convert, the device's refusal, torchao's absence, the [fp8] rules, and the swap itself (torchao's
Float8Linear with the parameters' names and values kept). Training with it: tests/mpi/test_fp8.py
(emulated, CPUs) and tests/gpu/test_gpu_fp8.py (H100/H200)."""
from __future__ import annotations

import sys

import pytest
import torch

from hpctrain import config
from hpctrain.config_schema import Fp8Config
from hpctrain.errors import ConfigError, UserError
from hpctrain.model import build_model_from_section
from hpctrain.parallel.float8 import apply_float8, float8_layers, fp8_refusal, skip_names
from tests.conftest import TINY_TRAIN

LLAMA = {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "block_size": 32,
         "vocab_size": 256, "ffn_hidden": 192, "tie_embeddings": False}
BLOCK_LINEARS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.gate", "mlp.up", "mlp.proj")


def llama(**keys) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model_from_section({**LLAMA, **keys})


def test_every_block_linear_converts_and_the_head_is_skipped_by_name():
    converted, skipped = float8_layers(llama(), skip_names("lm_head"))
    assert converted == [f"blocks.{b}.{name}" for b in range(2) for name in BLOCK_LINEARS]
    assert skipped == {"lm_head": "fp8.skip"}
    converted, skipped = float8_layers(llama(), skip_names(" attn.wo , lm_head,"))
    assert len(converted) == 12 and set(skipped) == {"blocks.0.attn.wo", "blocks.1.attn.wo", "lm_head"}


def test_a_layer_with_a_dimension_not_a_multiple_of_16_is_skipped():
    """ffn_hidden 200: the MLP's three layers are 200 wide (not a multiple of 16), kept in bf16."""
    converted, skipped = float8_layers(llama(ffn_hidden=200), ())
    assert converted == [f"blocks.{b}.attn.{n}" for b in range(2) for n in ("wq", "wk", "wv", "wo")] + ["lm_head"]
    assert skipped == {**{f"blocks.{b}.mlp.{n}": "dims 200x64" for b in range(2) for n in ("gate", "up")},
                       **{f"blocks.{b}.mlp.proj": "dims 64x200" for b in range(2)}}


@pytest.mark.parametrize("capability,emulate,refused", [
    (None, False, True), ((8, 0), False, True), ((8, 6), False, True), ((8, 9), False, False),
    ((9, 0), False, False), ((10, 0), False, False), (None, True, False), ((7, 0), True, False)])
def test_the_device_refusal_needs_capability_8_9_unless_emulated(capability, emulate, refused):
    line = fp8_refusal(capability, emulate)
    assert (line is not None) == refused
    if refused:
        assert "\n" not in line and "'train.precision'" in line and "'bf16'" in line


def test_apply_float8_on_a_cpu_raises_the_refusal_and_leaves_the_model_alone():
    model = llama()
    with pytest.raises(ConfigError, match="'train.precision'"):
        apply_float8(model, Fp8Config(), None)
    assert sum(type(m) is torch.nn.Linear for m in model.modules()) == 15


def test_without_torchao_the_line_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import torchao.float8 -> ImportError
    with pytest.raises(UserError) as err:
        apply_float8(llama(), Fp8Config(emulate=True), None)
    assert "pip install 'hpctrain[fp8]'" in str(err.value)


@pytest.mark.parametrize("recipe,all_gather", [("tensorwise", False), ("tensorwise", True), ("rowwise", False)])
def test_the_swap_keeps_names_and_values_and_sets_the_recipe(recipe, all_gather):
    float8 = pytest.importorskip("torchao.float8.float8_linear")
    model = llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    swap = apply_float8(model, Fp8Config(recipe=recipe, fsdp_all_gather=all_gather, emulate=True), None)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    swapped = {n for n, m in model.named_modules() if isinstance(m, float8.Float8Linear)}
    assert swapped == set(swap.converted) and len(swapped) == 14 and "lm_head" not in swapped
    layer = model.get_submodule("blocks.0.attn.wq")
    assert layer.config.enable_fsdp_float8_all_gather is all_gather and layer.config.emulate
    granularity = layer.config.cast_config_weight.scaling_granularity.value
    assert granularity == {"tensorwise": "tensorwise", "rowwise": "axiswise"}[recipe]
    x = torch.randint(0, 256, (2, 32))
    assert model(x).shape == (2, 32, 256)  # emulated float8 matmuls run on the CPU


@pytest.mark.parametrize("overrides,key", [
    (["--fp8.recipe=rowwise", "--fp8.fsdp_all_gather=true"], "fp8.fsdp_all_gather"),
    (["--train.precision=fp8", "--parallel.tp=2"], "parallel.tp"),
    (["--train.precision=fp8", "--fp8.emulate=true", "--train.compile=true"], "fp8.emulate")])
def test_what_fp8_does_not_support_is_one_line_naming_its_key(tmp_path, overrides, key):
    path = tmp_path / "c.toml"
    path.write_text(TINY_TRAIN.format(run=tmp_path / "run", data="unused", steps=2))
    with pytest.raises(ConfigError) as err:
        config.load(path, overrides)
    assert str(err.value).startswith(f"config key '{key}'") and "\n" not in str(err.value)
    config.load(path, overrides[:1])  # each alone is fine
