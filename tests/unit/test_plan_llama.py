"""`hpctrain plan` for model.arch = "llama": counts against the real Llama (meta device), the
presets against Meta's models, activations against autograd, TP / PP holdings, the configs."""
from __future__ import annotations

import contextlib
import dataclasses
import re
import sys

import pytest
import torch

from tests.conftest import ROOT, run_cmd
from hpctrain import config
from hpctrain.model import Llama, LlamaConfig, build_model_from_section
from hpctrain.parallel.runner import lm_loss
from hpctrain.plan import comm, memory, recommend
from hpctrain.plan.cli import build_parser, shape_and_job
from hpctrain.plan.layout import Job
from hpctrain.plan.shape import PRESETS, ModelShape
from hpctrain.parallel.loss import chunked_lm_loss, use_chunked_head

LLAMA_KEYS = ("n_kv_head", "ffn_hidden", "multiple_of", "ffn_dim_multiplier", "qkv_bias",
              "tie_embeddings")
SMALL = [  # GQA untied; MHA + q/k/v bias tied (Qwen2-like); Llama-3 rule with a multiplier
    ModelShape(2, 64, 4, 97, 32, arch="llama", n_kv_head=2, multiple_of=32),
    ModelShape(3, 48, 6, 257, 16, arch="llama", qkv_bias=True, tie_embeddings=True),
    ModelShape(1, 128, 8, 50, 8, arch="llama", n_kv_head=1, multiple_of=64, ffn_dim_multiplier=1.3),
]


def _llama(s: ModelShape, device="cpu") -> Llama:
    with torch.device(device):
        return Llama(LlamaConfig(n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd,
                                 block_size=s.block_size, vocab_size=s.vocab_size,
                                 **{k: getattr(s, k) for k in LLAMA_KEYS}))


def _counts_match(shape: ModelShape, model: Llama) -> None:
    assert shape.total_params() == model.num_params(non_embedding=False)
    assert shape.num_params() == model.num_params()
    assert shape.flops_per_token() == model.flops_per_token()
    assert shape.block_params == sum(p.numel() for p in model.blocks["0"].parameters())
    assert shape.ffn == model.cfg.ffn_hidden_size


@pytest.mark.parametrize("shape", SMALL)
def test_counts_are_the_real_llamas_built_on_the_meta_device(shape):
    _counts_match(shape, _llama(shape, "meta"))


@pytest.mark.parametrize("name,billions,ffn", [("llama3-8b", 8.03, 14336), ("llama3-70b", 70.55, 28672)])
def test_presets_are_metas_llama3(name, billions, ffn):
    shape = PRESETS[name]
    assert (shape.n_kv_head, shape.vocab_size, shape.tied, shape.ffn) == (8, 128256, False, ffn)
    assert abs(shape.total_params() / (billions * 1e9) - 1) < 0.005, shape.total_params()
    _counts_match(shape, _llama(shape, "meta"))


def test_tensor_parallel_share_of_a_block_and_the_vocabulary():
    """Every Linear (q, k, v by heads; gate, up, proj by columns / rows) / tp, RMSNorms whole;
    an untied head and the embedding each vocab-sharded; gpt2-only pieces absent."""
    shape = SMALL[0]
    block = _llama(shape, "meta").blocks["0"]
    linear = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    norms = block.norm1.weight.numel() + block.norm2.weight.numel()
    assert shape.block_params_tp(2) == linear // 2 + norms
    assert shape.block_matmul_params_tp(2) == linear // 2
    assert shape.position_params == shape.position_params_tp(2) == 0
    n_one = memory.local_params(shape, Job(nodes=1, gpus_per_node=1), memory.Stage(0, (0, 1), True, True, 1))
    assert n_one[0] == shape.total_params()  # untied: embedding and head both held, once each


def test_pipeline_stages_hold_embedding_and_untied_head_once_and_no_tied_allreduce():
    shape = PRESETS["llama3-8b"]
    job = Job(nodes=1, gpus_per_node=4, pp=4, grad_accum=4).check(shape)
    stages = memory.pipeline_stages(shape, job)
    held = [memory.local_params(shape, job, s)[0] for s in stages]
    assert sum(held) == shape.total_params()  # gpt2 holds its tied table twice (test_plan.py)
    assert comm.pp_bytes(shape, job, True, False) == comm.pp_bytes(shape, job, False, False) // 2
    tied = dataclasses.replace(shape, tie_embeddings=True)
    extra = comm.pp_bytes(tied, job, True, False) - comm.pp_bytes(tied, job, False, False) // 2
    assert extra == 4 * shape.embedding_params  # the tied gradient's all-reduce, only when tied


def test_grouped_query_attention_shrinks_memory():
    gqa = PRESETS["llama3-8b"]
    mha = dataclasses.replace(gqa, n_kv_head=0)
    for half in (False, True):
        assert memory.layer_activation_bytes(gqa, 1, 1, half) < memory.layer_activation_bytes(mha, 1, 1, half)
    assert mha.total_params() - gqa.total_params() == 32 * 2 * 4096 * (4096 - 1024)


def _saved_bytes(run, exclude) -> int:
    """Bytes of the distinct storages autograd saves while `run()` builds the graph, leaving out
    parameters and their 16-bit copies (weights, as memory.py counts them)."""
    params = {p.untyped_storage().data_ptr() for p in exclude}
    shapes = {tuple(p.shape) for p in exclude if p.dim() == 2}
    shapes |= {s[::-1] for s in shapes}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and tuple(t.shape) not in shapes:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _autocast(half: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if half else contextlib.nullcontext()


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("shape", SMALL[:2])
def test_llama_block_activation_formula_is_exactly_what_autograd_saves(shape, half):
    block = _llama(shape).blocks["0"]
    x = torch.randn(5, shape.block_size, shape.n_embd, requires_grad=True)  # 5 x T: no weight's dim

    def run():
        with _autocast(half):
            block(x)

    assert _saved_bytes(run, list(block.parameters())) == memory.layer_activation_bytes(shape, 5, 1, half)


@pytest.mark.parametrize("shape", SMALL[:2])
def test_llama_block_on_16bit_parameters_saves_what_the_formula_says(shape):
    """FSDP2's MixedPrecisionPolicy all-gathers bf16 parameters: the block's input (the residual
    stream) and RMSNorm's output are bf16, so no fp32 residual and one bf16 q/k/v input, not
    three casts. Before, the planner counted the fp32-parameter bytes here (+6 h per token)."""
    block = _llama(shape).blocks["0"].to(torch.bfloat16)
    x = torch.randn(5, shape.block_size, shape.n_embd, dtype=torch.bfloat16, requires_grad=True)

    def run():
        with _autocast(True):
            block(x)

    got = _saved_bytes(run, list(block.parameters()))
    assert got == memory.layer_activation_bytes(shape, 5, 1, True, params16=True)
    assert got < memory.layer_activation_bytes(shape, 5, 1, True)
    assert memory.checkpointed_layer_bytes(shape, 5, 1, params16=True) == x.numel() * 2


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("chunk", [0, 40])
def test_llama_model_activations_and_head_within_three_percent(half, chunk):
    """The whole model (blocks + RMSNorm + untied head + loss), plain and chunked."""
    shape = dataclasses.replace(SMALL[0], n_layer=3)
    model = _llama(shape)
    if chunk:
        use_chunked_head(model)
    idx = torch.randint(0, shape.vocab_size, (5, shape.block_size + 1))

    def run():
        with _autocast(half):
            out = model(idx[:, :-1])
        if chunk:
            chunked_lm_loss(out, model.lm_head.weight, idx[:, 1:], chunk)
        else:
            lm_loss(out, idx[:, 1:])

    got = _saved_bytes(run, list(model.parameters()))
    stored, _ = memory.head_bytes(shape, 5, 1, half, chunk)
    predicted = 3 * memory.layer_activation_bytes(shape, 5, 1, half) + stored
    assert abs(predicted - got) / got < 0.03, (predicted, got)


def test_tp_not_dividing_kv_heads_is_one_line_naming_the_key():
    r = run_cmd([sys.executable, "-m", "hpctrain", "plan", "--preset", "llama3-8b", "--nodes", "1",
                 "--gpus-per-node", "16", "--tp", "16"], timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "--tp 16" in r.stderr and "n_kv_head 8" in r.stderr
    gpt = run_cmd([sys.executable, "-m", "hpctrain", "plan", "--preset", "7b", "--nodes", "1",
                   "--gpus-per-node", "16", "--tp", "16", "--summary"], timeout=120)
    assert gpt.returncode == 0, gpt.stderr  # gpt2: 32 heads, no kv heads of their own


def _comment_layouts(path) -> dict[int, str]:
    """The `N nodes: LAYOUT, ...` lines of a config's comments."""
    found = re.findall(r"^#\s+(\d+) nodes?\s*: (\w+ dp\d+ tp\d+ pp\d+ mb\d+x\d+ ac=\w+)",
                       path.read_text(), re.M)
    return {int(n): layout for n, layout in found}


@pytest.mark.parametrize("name,preset", [("llama3_8b", "llama3-8b"), ("llama3_70b", "llama3-70b")])
def test_config_loads_builds_and_its_layouts_are_the_planners(name, preset):
    path = ROOT / "configs" / f"{name}.toml"
    cfg = config.load(str(path))
    model = build_model_from_section_on_meta(dataclasses.asdict(cfg.model))
    shape, job = shape_and_job(build_parser().parse_args(["--config", str(path)]))
    assert dataclasses.replace(shape, multiple_of=PRESETS[preset].multiple_of) == PRESETS[preset]
    _counts_match(shape, model)
    assert job.loss_chunk > 0 and job.precision == "bf16"
    layouts = _comment_layouts(path)
    assert {4, 16, 64} <= set(layouts), layouts  # 70b: 1 node fits nothing (16 B/param > 8 x 80 GB)
    advice = recommend.advise(shape, dataclasses.replace(job, nodes=16))  # one count: cheap
    assert advice.best is not None and advice.best.job.layout_name == layouts[16]
    user = recommend.advise(shape, dataclasses.replace(job, nodes=16 if "70b" in name else 4)).user
    assert user.fits, user.why  # the [parallel] section itself fits where the header says


def build_model_from_section_on_meta(section: dict):
    with torch.device("meta"):
        return build_model_from_section(section)


@pytest.mark.parametrize("shape", [SMALL[0], ModelShape(2, 64, 4, 5000, 32)])  # the loss: the peak
def test_chunked_heads_dw_is_its_gradient_counted_once(shape):
    """With train.loss_chunk the head's dW, computed in forward, becomes lm_head's gradient: the
    1-rank peak at the loss holds it once (counted twice, the plan was 0.87-0.91 of the measured
    bench/plan_memory.py peak; docs/benchmarks.md)."""
    job = Job(nodes=1, gpus_per_node=1, micro_batch=8, precision="fp32", loss_chunk=16).check(shape)
    stage = memory.pipeline_stages(shape, job)[0]
    blocks = shape.n_layer * memory.layer_activation_bytes(shape, 8, 1, False)
    at_loss = blocks + sum(memory.head_bytes(shape, 8, 1, False, 16))
    assert memory.backward_sweep(shape, job, stage) == at_loss
    plain = dataclasses.replace(job, loss_chunk=0)
    assert memory.backward_sweep(shape, plain, stage) == (
        blocks + sum(memory.head_bytes(shape, 8, 1, False)) + 4 * shape.embedding_params)


# bench/plan_memory.py's live-tensor peak on 2 ranks, tp 2 (configs/llama_tiny.toml, 4 x 128,
# vocab 50,304, block 128, micro-batch 4; docs/benchmarks.md): the plan was 0.89 of it before it
# knew the whole-table embedding gradient and the vocabulary-parallel loss's extra logits shard
@pytest.mark.parametrize("precision,chunk,measured_mib", [("fp32", 0, 336), ("fp32", 128, 129),
                                                          ("bf16", 128, 130)])
def test_tp_plan_at_a_large_vocabulary_within_five_percent_of_the_measured(precision, chunk, measured_mib):
    cfg = config.load(str(ROOT / "configs/llama_tiny.toml"), [
        "--model.n_embd=128", "--model.block_size=128", "--model.multiple_of=64",
        "--model.vocab_size=50304", "--parallel.tp=2", "--train.micro_batch_size=4",
        f"--train.precision={precision}", f"--train.loss_chunk={chunk}"])
    shape = ModelShape.of_model_config(cfg.model)
    job = Job(nodes=1, gpus_per_node=2, tp=2, micro_batch=4, precision=precision,
              loss_chunk=chunk).check(shape)
    planned = memory.largest_rank(shape, job).peak
    assert 0.95 <= measured_mib * 2**20 / planned <= 1.05, planned / 2**20
