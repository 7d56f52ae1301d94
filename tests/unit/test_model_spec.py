"""The model-family registry (hpctrain/model/spec.py): model.arch picks a registered ModelSpec, the
[model] keys are the union of the families' args, a family's key conflict is refused."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from hpctrain.errors import ConfigError
from hpctrain.model import spec


def test_registered_families_and_unknown_arch_lists_them():
    assert spec.names() == ("gpt2", "llama", "qwen3", "deepseek_v3")
    assert spec.get(None) is spec.get("gpt2") and spec.of_section({}) is spec.get("gpt2")
    with pytest.raises(ConfigError) as e:
        spec.get("qwen9")
    assert "'model.arch'" in str(e.value) and all(n in str(e.value) for n in spec.names())


def test_every_spec_builds_its_model_and_says_its_keys():
    section = {"n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 4, "vocab_size": 16}
    for name in spec.names():
        s = spec.get(name)
        model = s.model_module().build({**section, "arch": name})
        assert sum(p.numel() for p in model.parameters()) > 0
        assert {"tok_emb", "blocks", "norm_f", "lm_head"} <= set(dir(model))
        plan = s.block_tp_plan(spec.as_args({**section, "arch": name}), 0)
        block = model.blocks["0"]
        assert all(block.get_submodule(path) is not None for path in plan), (name, plan)
        assert set(plan.values()) <= {"gather", "colwise", "rowwise", "norm", "experts", "partial",
                                      "gather_local", "replicate", "replicate_sum_grad"}


def test_model_fields_union_and_conflicts(monkeypatch):
    @dataclass
    class Extra:
        probe_width: int = field(default=0, metadata={"help": "probe"})
        n_kv_head: int = field(default=0, metadata={"help": "shared with llama: same type/default"})

    probe = spec.ModelSpec(name="probe", summary="a test family", args=Extra, module="none",
                           check_config=lambda m, c: None, check_tp=lambda m, t, c: None,
                           block_tp_plan=lambda m, i: {}, shape=None)
    monkeypatch.setattr(spec, "_REGISTRY", {**spec._load(), "probe": probe})
    names = [n for n, _, _ in spec.model_fields()]
    assert names.count("n_kv_head") == 1 and names[-1] == "probe_width"
    assert spec.owned_keys(probe) >= {"probe_width", "n_kv_head", "n_layer", "arch"}

    @dataclass
    class Clash:
        n_kv_head: float = field(default=1.0, metadata={"help": "another type"})

    monkeypatch.setattr(spec, "_REGISTRY", {**spec._load(), "probe": dataclasses.replace(probe, args=Clash)})
    with pytest.raises(ValueError, match="n_kv_head"):
        spec.model_fields()


def test_tp_styles_become_dtensor_plans_and_an_unknown_style_is_refused():
    """parallel/tensor_parallel.py reads the family's styles: a MoE layer is "experts" (its
    module replicated, not split), SwiGLU's gate/up column-parallel; a style it does not know
    is one error naming it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput

    from hpctrain.parallel.tensor_parallel import _block_plan

    section = {"arch": "llama", "n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": 4,
               "vocab_size": 16, "moe_experts": 4, "moe_every": 2}
    model = spec.get("llama").model_module().build(section)
    styles = [spec.get("llama").block_tp_plan(spec.as_args(section), i) for i in (0, 1)]
    dense, _, no_experts = _block_plan(model.blocks["0"], styles[0], Shard(1), True)
    sparse, _, experts = _block_plan(model.blocks["1"], styles[1], Shard(1), True)
    assert isinstance(dense["mlp.gate"], ColwiseParallel) and not no_experts
    assert isinstance(sparse["mlp"], PrepareModuleInputOutput) and experts == [model.blocks["1"].mlp]
    _, local_norms, _ = _block_plan(model.blocks["0"], styles[0], Replicate(), False)
    assert local_norms == [model.blocks["0"].norm1, model.blocks["0"].norm2]
    with pytest.raises(ValueError, match="sideways"):
        _block_plan(model.blocks["0"], {"attn.wq": "sideways"}, Shard(1), True)


def test_mla_styles_gather_locally_and_replicate_under_sequence_parallelism():
    """The styles multi-head latent attention needs (deepseek_v3): "gather_local" hands the
    all-gathered input over as a local tensor; "replicate" / "replicate_sum_grad" run whole on
    replicated weights even under SP (not SequenceParallel). The k_rope gradient sum itself:
    tests/mpi/test_deepseek_v3_tp.py. Before: each was a ValueError naming the style."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    from hpctrain.parallel.tensor_parallel import _block_plan

    section = {"arch": "llama", "n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 4, "vocab_size": 16}
    block = spec.get("llama").model_module().build(section).blocks["0"]
    styles = {"attn": "gather_local", "norm1": "replicate", "norm2": "replicate_sum_grad"}
    plan, local, experts = _block_plan(block, styles, Shard(1), True)
    assert isinstance(plan["attn"], PrepareModuleInput) and plan["attn"].use_local_output
    assert set(plan) == {"attn"} and local == [block.norm1, block.norm2] and not experts


PARTIAL_PROBE = """
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from hpctrain.model import spec
from hpctrain.parallel.tensor_parallel import apply_tensor_parallel, tp_token_split_moe
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
section = {"arch": "llama", "n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": 4, "vocab_size": 16}
model = spec.get("llama").model_module().build(section)
llama_plan = spec.get("llama").block_tp_plan
styles = lambda i: {**llama_plan(spec.as_args(section), i), "norm2": "partial"}
apply_tensor_parallel(model, init_device_mesh("cpu", (1,)), styles, sequence_parallel=False)
layers, group = tp_token_split_moe(model)
print(len(layers), group is not None, type(model.blocks["0"].norm2.weight).__name__)
model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
print(model.blocks["1"].norm2.weight.grad is not None)
"""


def test_a_partial_style_module_is_replicated_and_its_grads_summed_over_tp():
    """Style "partial" (e.g. Qwen3's per-head q/k norms): the module's weights become Replicate
    DTensors, it runs on local tensors, and the runner finds it to sum its gradients over tp."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", PARTIAL_PROBE], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PROBE_PORT": str(port)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["2", "True", "DTensor", "True"]
