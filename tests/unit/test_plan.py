"""`hpctrain plan`: its formulas against our real model, the ZeRO paper, and each other."""
from __future__ import annotations

import contextlib
import dataclasses
import re
import tracemalloc

import numpy as np
import pytest
import torch

from hpctrain.data.sampler import GlobalSampler
from hpctrain.model import GPT, GPTConfig
from hpctrain.parallel.runner import lm_loss
from hpctrain.plan import comm, memory, storage
from hpctrain.plan.cli import main as plan_main, size
from hpctrain.plan.layout import Job
from hpctrain.plan.report import make_plan
from hpctrain.plan.shape import PRESETS, ModelShape
from hpctrain.plan.wire import bytes_sent, wire_layout
from hpctrain.sync.compress import Codec

SHAPES = [ModelShape(2, 64, 4, 97, 32), ModelShape(3, 48, 6, 257, 16), ModelShape(1, 32, 2, 50, 8)]


def _gpt(s: ModelShape) -> GPT:
    return GPT(GPTConfig(n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd,
                         block_size=s.block_size, vocab_size=s.vocab_size))


@pytest.mark.parametrize("shape", SHAPES)
def test_parameter_count_is_the_real_models(shape):
    model = _gpt(shape)
    assert shape.num_params() == model.num_params()
    assert shape.total_params() == model.num_params(non_embedding=False)
    assert shape.flops_per_token() == model.flops_per_token()
    block = sum(p.numel() for p in model.blocks["0"].parameters())
    assert shape.block_params == block


def test_presets_sizes():
    assert 1.2e9 < PRESETS["1b"].num_params() < 1.4e9
    assert 6.5e9 < PRESETS["7b"].num_params() < 6.8e9  # 32 x 4096: no SwiGLU / GQA in our model
    assert 64e9 < PRESETS["70b"].num_params() < 66e9


def _mem(shape, **job):
    j = Job(**{"nodes": 1, "gpus_per_node": 8, **job}).check(shape)
    return memory.largest_rank(shape, j)


def test_zero_paper_sixteen_bytes_per_parameter():
    shape = PRESETS["7b"]
    m = _mem(shape, precision="bf16")
    n = shape.total_params()
    assert sum(memory.ZERO_PAPER.values()) == 16
    assert m.zero_paper == 16 * n
    model_state = m.parts["parameters (fp32)"] + m.parts["gradients (fp32)"] + m.parts["AdamW m, v (fp32)"]
    assert model_state == 16 * n  # ours: 4 + 4 + 8, the same total split otherwise
    assert m.parts["16-bit weight copies (autocast)"] == 2 * (12 * shape.n_embd ** 2 * shape.n_layer
                                                              + shape.embedding_params)


def test_fsdp_divides_model_state_by_dp():
    shape = PRESETS["1b"]
    ddp, fsdp = _mem(shape, data_parallel="ddp"), _mem(shape, data_parallel="fsdp")
    for key in ("parameters (fp32)", "gradients (fp32)", "AdamW m, v (fp32)"):
        assert fsdp.parts[key] == ddp.parts[key] // 8
    assert fsdp.zero_paper == ddp.zero_paper // 8
    assert "FSDP accumulated grads (grad_accum > 1)" in _mem(shape, data_parallel="fsdp", grad_accum=2).parts


def test_fsdp_backward_sweep_is_the_measured_peak_point():
    """FSDP2, one micro-batch: the peak is in block n-2's backward (docs/scale.md, measured 178 MiB
    vs 177 on 2 ranks): gathered root + 2 blocks, the root's gradients, activations of blocks
    0..n-2, its unsharded gradients, block n-1's kept fp32 reduce-scatter input and its shard."""
    shape = ModelShape(4, 512, 8, 257, 128)
    job = Job(nodes=1, gpus_per_node=2, data_parallel="fsdp", micro_batch=4, precision="fp32",
              backend="gloo").check(shape)
    stage = memory.pipeline_stages(shape, job)[0]
    L, B = memory.layer_activation_bytes(shape, 4, 1, False), shape.block_params
    root = shape.embedding_params + shape.position_params + shape.norm_f_params
    want = 4 * (root + 2 * B) + 4 * root + 3 * L + (4 + 4 + 4 // 2) * B
    assert memory.fsdp_backward_sweep(shape, job, stage) == want
    m = memory.rank_memory(shape, job, stage)
    state = m.parts["parameters (fp32)"] + m.parts["AdamW m, v (fp32)"]
    assert m.peak == state + want
    assert 176 << 20 < m.peak < 178 << 20
    old_sum = sum(m.parts.values())  # every part at once, the formula before: 215 MiB
    assert old_sum - m.peak > 37 << 20


def test_fsdp_gloo_reduce_scatter_clones_its_input():
    """Gloo reduce-scatters by all-reducing a clone of the fp32 input: + 4 B x block at the
    reduce-scatter, the peak when activations are small and the later blocks' shards add up."""
    shape = ModelShape(4, 512, 8, 257, 8)
    stage = memory.pipeline_stages(shape, Job(nodes=1, gpus_per_node=2))[0]
    kw = dict(nodes=1, gpus_per_node=2, data_parallel="fsdp", micro_batch=1, precision="bf16")
    nccl, gloo = (memory.fsdp_backward_sweep(shape, Job(**kw, backend=b).check(shape), stage)
                  for b in ("nccl", "gloo"))
    L, B = memory.layer_activation_bytes(shape, 1, 1, True), shape.block_params
    root = shape.embedding_params + shape.position_params + shape.norm_f_params
    fixed = 2 * (root + 2 * B) + 2 * root
    # block 0's backward: its activations, bf16 gradients, block 1's kept input, 3 fp32 shards
    assert nccl == fixed + L + (2 + 4 + 3 * 2) * B
    # block 0's reduce-scatter: fp32 input + Gloo's clone, 4 shards (its own included)
    assert gloo == fixed + (4 + 4 + 4 * 2) * B
    with pytest.raises(ValueError, match="--backend"):
        Job(backend="mpi").check(shape)

def _fsdp_accum(shape, micro_batch=4, backend="gloo", precision="fp32", gpus=2, **kw):
    """(fsdp_accum_sweep, rank_memory, root parameters) of 1 node x `gpus` ranks under FSDP."""
    job = Job(nodes=1, gpus_per_node=gpus, data_parallel="fsdp", micro_batch=micro_batch,
              backend=backend, precision=precision, **kw).check(shape)
    stage = memory.pipeline_stages(shape, job)[0]
    root = shape.embedding_params + shape.position_params + shape.norm_f_params
    return memory.fsdp_accum_sweep(shape, job, stage), memory.rank_memory(shape, job, stage), root


@pytest.mark.parametrize("half", [False, True])
def test_fsdp_grad_accum_peak_is_the_last_micro_batchs_last_block(half):
    """FSDP2, grad_accum 2 (docs/scale.md, measured 225 MiB fp32 / 177 bf16 on 2 ranks). Always:
    gathered root + 2 blocks, the root's accumulated fp32 + new gradients. The second micro-batch's
    backward of block 3: all 4 blocks' activations, its new gradients (16-bit under bf16) and all 4
    blocks' accumulated fp32 gradients (the measured peak point); its reduce-scatter: blocks 0..2's
    activations and accumulated gradients, its fp32 input + Gloo's clone + its shard. fp32: the
    backward is higher (L = 16 MiB > 4 B = 12 MiB); bf16: the reduce-scatter (L = 10 MiB)."""
    shape, p = ModelShape(4, 512, 8, 257, 128), (2 if half else 4)
    sweep, m, root = _fsdp_accum(shape, precision="bf16" if half else "fp32", grad_accum=2)
    L, B = memory.layer_activation_bytes(shape, 4, 1, half), shape.block_params
    backward, reduce = 4 * L + p * B + 4 * 4 * B, 3 * L + (3 * 4 + 4 + 4 + 2) * B
    assert (reduce > backward) == half
    want = p * (root + 2 * B) + (4 + p) * root + max(backward, reduce)
    assert sweep == want
    assert m.peak == m.parts["parameters (fp32)"] + m.parts["AdamW m, v (fp32)"] + want
    lo, hi = (182, 184) if half else (223, 225)
    assert lo << 20 < m.peak < hi << 20
    assert sum(m.parts.values()) - m.peak > (37 << 20)  # every part at once, the formula before
    three = _fsdp_accum(shape, precision="bf16" if half else "fp32", grad_accum=3)[0]
    assert three == sweep  # a middle micro-batch holds what the last one's block n-1 holds


def test_fsdp_grad_accum_sweeps_the_last_micro_batchs_reduce_scatters():
    """Small activations (8 tokens, 1 sequence, L << B): fp32 NCCL, block 2's backward: its new
    gradients, blocks 0..2's accumulated ones, block 3's kept fp32 input and its shard (4 + 12 + 4
    + 2 B), above block 3's backward (4 L + 20 B) and reduce-scatter (accumulated + input, 20 B).
    bf16 on Gloo: block 3's reduce-scatter, 12 B accumulated + fp32 input + Gloo's clone + shard,
    2 B above NCCL's. bf16 NCCL on 8 ranks (shards of B / 2): block 3's reduce-scatter while its
    accumulated gradients are copied into its fp32 input (12 + 4 + 4 B), above block 2's backward
    (2 + 12 + 4 + 0.5 B). Checkpointed: block 2's backward with one block recomputed."""
    shape = ModelShape(4, 512, 8, 257, 8)
    B = shape.block_params
    L, L16 = (memory.layer_activation_bytes(shape, 1, 1, half) for half in (False, True))
    nccl, _, root = _fsdp_accum(shape, micro_batch=1, backend="nccl", grad_accum=2)
    assert nccl == 4 * (root + 2 * B) + 8 * root + 3 * L + (4 + 3 * 4 + 4 + 2) * B
    kw = dict(micro_batch=1, precision="bf16", grad_accum=2)
    gloo16, nccl16 = _fsdp_accum(shape, **kw)[0], _fsdp_accum(shape, backend="nccl", **kw)[0]
    assert gloo16 == 2 * (root + 2 * B) + 6 * root + 3 * L16 + (3 * 4 + 4 + 4 + 2) * B
    assert gloo16 - nccl16 == 2 * B
    dp8 = _fsdp_accum(shape, backend="nccl", gpus=8, **kw)[0]
    assert dp8 == 2 * (root + 2 * B) + 6 * root + 3 * L16 + (3 * 4 + 4 + 4) * B
    shape = ModelShape(4, 512, 8, 257, 128)
    C, L = (memory.checkpointed_layer_bytes(shape, 4, 1),
            memory.layer_activation_bytes(shape, 4, 1, False))
    ckpt, m, root = _fsdp_accum(shape, grad_accum=2, activation_checkpoint="full")
    assert ckpt == 4 * (root + 2 * B) + 8 * root + 3 * C + L + (4 + 3 * 4 + 4 + 2) * B
    assert 184 << 20 < m.peak < 186 << 20  # measured 181 MiB


def test_tp_divides_parameters_and_sharded_activations():
    shape = PRESETS["7b"]
    one, two = _mem(shape, tp=1), _mem(shape, tp=2)
    ratio = two.local_params / one.local_params
    assert 0.5 < ratio < 0.5 + 1e-3  # LayerNorms and row-parallel biases are replicated
    a1 = memory.layer_activation_bytes(shape, 1, 1, True)
    a2 = memory.layer_activation_bytes(shape, 1, 2, True)
    sbh = shape.block_size * shape.n_embd
    assert a1 - a2 == 16 * sbh + (4 * shape.n_head + 16) * shape.block_size // 2


def test_pp_divides_blocks_over_stages():
    shape = PRESETS["7b"]
    job = Job(nodes=1, gpus_per_node=8, pp=4, grad_accum=8).check(shape)
    stages = memory.pipeline_stages(shape, job)
    assert sorted(b for s in stages for b in s.block_ids) == list(range(shape.n_layer))
    assert [s.in_flight for s in stages] == [4, 3, 2, 1]  # 1F1B
    held = [memory.local_params(shape, job, s)[0] for s in stages]
    # every parameter once, plus the tied head's second copy on the last stage
    assert sum(held) == shape.total_params() + shape.embedding_params
    assert max(held) < 0.3 * shape.total_params()


def test_activation_checkpointing_follows_the_formula():
    shape = PRESETS["1b"]
    job = Job(nodes=1, gpus_per_node=8, micro_batch=2, ac_every=3).check(shape)
    (stage,) = memory.pipeline_stages(shape, job)
    full = memory.layer_activation_bytes(shape, 2, 1, True)
    kept = memory.checkpointed_layer_bytes(shape, 2, 1)
    by = {m: memory.stage_activations(shape, job, stage, m) for m in ("none", "selective", "full")}
    n_wrapped = len(range(0, shape.n_layer, 3))
    assert by["none"] - by["full"] == shape.n_layer * (full - kept) - full
    assert by["none"] - by["selective"] == n_wrapped * (full - kept) - full
    assert by["full"] < by["selective"] < by["none"]


def _saved_activation_bytes(model: GPT, idx: torch.Tensor, half: bool) -> int:
    """Bytes of the distinct storages autograd saves for backward, parameters and their 16-bit
    copies left out (memory.py counts those as model state)."""
    param_shapes = {tuple(p.shape) for p in model.parameters()}
    seen = {}

    def pack(t):
        if not (t.dim() <= 2 and tuple(t.shape) in param_shapes):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if half else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast:
            logits = model(idx[:, :-1])
        lm_loss(logits, idx[:, 1:])
    return sum(seen.values())


@pytest.mark.parametrize("half", [False, True])
def test_block_activation_formula_is_exactly_what_autograd_saves(half):
    shape = ModelShape(2, 64, 4, 97, 32)
    block = _gpt(shape).blocks["0"]
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    weight_shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}
    seen = {}

    def pack(t):  # activations only: not parameters, not their 16-bit copies
        if t.untyped_storage().data_ptr() not in params and tuple(t.shape) not in weight_shapes:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if half else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        block(torch.randn(3, 32, 64, requires_grad=True))
    assert sum(seen.values()) == memory.layer_activation_bytes(shape, 3, 1, half)


@pytest.mark.parametrize("half", [False, True])
def test_model_activations_within_three_percent_of_autograd(half):
    shape = ModelShape(3, 64, 4, 97, 32)
    model = _gpt(shape)
    got = _saved_activation_bytes(model, torch.randint(0, 97, (5, 33)), half)
    stored, _ = memory.head_bytes(shape, 5, 1, half)
    predicted = 3 * memory.layer_activation_bytes(shape, 5, 1, half) + stored
    assert abs(predicted - got) / got < 0.03, (predicted, got)


def test_sampler_bytes_match_the_real_sampler():
    shape, n = ModelShape(1, 32, 2, 50, 8), 2_000_000
    assert storage.n_windows(shape, Job(tokens=8 * n + 1, shard_tokens=8 * n + 1)) == n
    figures = storage.sampler_bytes(shape, Job(tokens=8 * n + 1, shard_tokens=8 * n + 1))
    sampler = GlobalSampler(n, 10, seed=0)
    GlobalSampler(100, 10, seed=0).next_indices()  # numpy's lazy imports are not the sampler's
    tracemalloc.start()
    sampler.next_indices()
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    sampler.seek(sampler.steps_per_epoch)  # the next call builds epoch 1 while epoch 0 is held
    sampler.next_indices()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert abs(kept - figures["per rank (kept)"]) / kept < 0.01
    assert abs(peak - figures["per rank (peak)"]) / peak < 0.01


def test_block_sampler_bytes_match_the_real_sampler():
    """data.shuffle = "block": 16 B x shards + two blocks' windows kept; at peak 24 B x shards (a
    new epoch's shard order) or 16 B x shards + three blocks' windows."""
    shape, shards, per_shard = ModelShape(1, 32, 2, 50, 8), 20_000, 300
    job = Job(tokens=shards * (8 * per_shard + 1), shard_tokens=8 * per_shard + 1,
              shuffle_block_shards=16)
    figures = storage.sampler_bytes(shape, job)
    windows = np.full(shards, per_shard, dtype=np.int64)
    n = int(windows.sum())
    assert figures["windows"] == n and storage.block_windows(shape, job) == 16 * per_shard
    GlobalSampler(100, 10, 0, [50, 50], "block", 1).next_indices()  # lazy imports
    tracemalloc.start()
    sampler = GlobalSampler(n, 100, 0, windows, "block", 16)
    for _ in range(3 * 16 * per_shard // 100 - 1):  # into the third block: two are kept
        sampler.next_indices()
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    sampler.seek(sampler.steps_per_epoch)  # a new epoch's shard order while the old blocks are held
    for _ in range(2 * 16 * per_shard // 100 + 1):  # and a third block
        sampler.next_indices()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"block sampler: kept {kept:,} B (predicted {figures['per rank (kept)']:,}), peak "
          f"{peak:,} B (predicted {figures['per rank (peak)']:,})")
    assert abs(kept - figures["per rank (kept)"]) / kept < 0.05
    assert abs(peak - figures["per rank (peak)"]) / peak < 0.05
    assert figures["per rank (kept)"] < storage.sampler_bytes(
        shape, Job(tokens=job.tokens, shard_tokens=job.shard_tokens, shuffle="global"))["per rank (kept)"] / 10


def test_diloco_bytes_are_the_encoded_bytes_the_average_moves():
    """bytes_sent (plan's DiLoCo row, diloco's counter) against what compress.average really sends:
    phase 1 all-to-all and phase 2 all-gather each move (p - 1) encoded chunks per rank."""
    for n, p, kind, block in [(10_001, 3, "bf16", 256), (123_457, 8, "int8", 256), (1_000, 4, "int8", 0)]:
        chunk, blk = wire_layout(n, p, kind, block)
        encoded = sum(t.numel() for t in Codec(kind, chunk, blk).encode(torch.zeros(chunk)))
        assert bytes_sent(n, p, kind, block) == 2 * (p - 1) * encoded
    job = Job(dp=4, sync_mode="diloco", inner_steps=10, compression="int8")
    assert comm.dp_bytes(None, job, 123_457)[0] == bytes_sent(123_457, 4, "int8") // 10


def test_checkpoint_files_one_per_rank_plus_four():
    shape = PRESETS["1b"]
    fig = storage.checkpoint_figures(shape, Job(nodes=64, gpus_per_node=8).check(shape))
    assert fig["files"] == 512 + 4
    assert fig["bytes"] == 12 * shape.total_params()


@pytest.mark.parametrize("nodes, expect", [(16, "rank"), (32, "node")])
def test_checkpoint_files_for_both_layouts_and_the_recommendation(capsys, nodes, expect):
    """A file per rank or per node (+ 4 small ones); node layout recommended from 256 ranks."""
    shape = PRESETS["1b"]
    fig = storage.checkpoint_figures(shape, Job(nodes=nodes, gpus_per_node=8).check(shape))
    assert (fig["files, layout rank"], fig["files, layout node"]) == (nodes * 8 + 4, nodes + 4)
    assert fig["recommended layout"] == expect
    node = storage.checkpoint_figures(shape, Job(nodes=nodes, gpus_per_node=8,
                                                 checkpoint_layout="node").check(shape))
    assert node["files"] == nodes + 4 and node["recommended layout"] == expect
    assert plan_main(["--preset", "1b", "--nodes", str(nodes), "--gpus-per-node", "8"]) == 0
    said = re.findall(r"^Recommended: --checkpoint.layout=(\w+) \((\d+) .* (\d+);",
                      capsys.readouterr().out, re.M)
    assert said == ([("node", str(nodes + 4), str(nodes * 8 + 4))] if expect == "node" else [])
    big = make_plan(shape, Job(nodes=512, gpus_per_node=8).check(shape))
    warned = [w for w in big.warnings if w.startswith("checkpoint: 4100 files")]
    assert len(warned) == 1 and warned[0].endswith("checkpoint.layout = 'node' writes 516")


def test_warnings_name_the_budget():
    plan = make_plan(PRESETS["70b"], Job(nodes=8, gpus_per_node=8, tokens=15e12, shuffle="global",
                                         meta_init=False))
    text = "\n".join(plan.warnings)
    assert "--gpu-memory" in text and "setup" in text and "sampler" in text
    block = make_plan(PRESETS["70b"], Job(nodes=8, gpus_per_node=8, tokens=15e12))  # the defaults
    assert not [w for w in block.warnings if w.startswith("sampler")], block.warnings
    sharded = dict(tp=8, data_parallel="fsdp", activation_checkpoint="full")  # docs/scale.md's 70B
    meta = make_plan(PRESETS["70b"], Job(nodes=8, gpus_per_node=8, tokens=15e12, **sharded))
    whole = make_plan(PRESETS["70b"], Job(nodes=8, gpus_per_node=8, tokens=15e12, meta_init=False, **sharded))
    assert not [w for w in meta.warnings if w.startswith("setup")], meta.warnings
    assert [w for w in whole.warnings if w.startswith("setup")], whole.warnings


def test_meta_init_setup_is_the_shard_plus_one_whole_parameter():
    shape = PRESETS["7b"]  # the embedding, 50304 x 4096, is its largest parameter
    job = Job(nodes=1, gpus_per_node=4, data_parallel="fsdp").check(shape)
    plan = make_plan(shape, job)
    shard = plan.mem.parts["parameters (fp32)"]
    assert shard == 4 * shape.total_params() // 4
    assert plan.setup["per rank (host, then GPU)"] == shard + 4 * 50304 * 4096
    assert plan.setup["per node (host)"] == 4 * 4 * 50304 * 4096
    whole = make_plan(shape, Job(nodes=1, gpus_per_node=4, data_parallel="fsdp", meta_init=False))
    assert whole.setup["per rank (host, then GPU)"] == 4 * shape.total_params()


def test_cli_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        plan_main(["--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(Job):
        assert f"--{f.name.replace('_', '-')}" in out
    assert "--preset" in out and "--config" in out


def test_cli_config_and_errors(capsys):
    assert plan_main(["--config", "configs/demo.toml", "--nodes", "1", "--gpus-per-node", "2"]) == 0
    assert "1.8" in capsys.readouterr().out  # the demo's 1.8M parameters
    assert plan_main(["--preset", "7b", "--nodes", "1", "--gpus-per-node", "6", "--tp", "3"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --tp 3")
    assert plan_main(["--n-layer", "2"]) == 2
    assert "--n-embd is required" in capsys.readouterr().err
    assert size("80GiB") == 80 << 30 and size("1e12") == 10 ** 12 and size("3.84TB") == 3_840 * 10 ** 9


def _bench_plan_memory():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "plan_memory.py"
    spec = importlib.util.spec_from_file_location("bench_plan_memory", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass needs it
    spec.loader.exec_module(mod)
    return mod


def test_bench_live_peaks_pairs_frees_by_address():
    """bench/plan_memory.py's measure (docs/scale.md): allocations and frees paired by address in
    time order; a free never recorded (Gloo's thread) bounds the peak from both sides."""
    pm = _bench_plan_memory()
    recs = [(1, 0xA, 100, "setup"), (5, 0xB, 50, "steps > x"), (6, 0xC, 30, "steps > c10d::y"),
            (7, 0xA, -100, "steps"), (8, 0xB, 20, "steps > z"),  # 0xB reused: its free was missed
            (9, 0xC, -30, "steps"), (10, 0xD, 40, "steps > c10d::y"),  # 0xD: a c10d block, no free
            (11, 0xE, 10, "steps > w")]
    live = pm.live_peaks(recs, mark_ns=5)
    assert live.setup == 100
    assert live.high == 100 + 50 + 30  # t=6; then 80, 50 (0xB's 50 dropped at t=8), 20, 60, 70
    assert live.low == 100 + 30  # t=6, the missed blocks (0xB, 0xD) never counted
    assert (live.missed, live.missed_bytes) == (2, 50 + 40)
    assert sorted(b for b, _ in live.at_high.values()) == [30, 50, 100]
    assert sorted(b for b, _ in live.at_low.values()) == [30, 100]  # --top-at low: recorded only
    assert pm.top_alive(live, 1, "low", depth=1) == [(100, "setup")]


def test_bench_live_peaks_of_a_real_profile():
    """The profiler's records of known tensors give their bytes exactly (the old measure summed
    FunctionEvent.self_cpu_memory_usage, which counts a record once per open op on any thread)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    pm = _bench_plan_memory()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        keep = torch.empty(1 << 20, dtype=torch.uint8)
        with record_function("steps"):
            tmp = torch.empty(4 << 20, dtype=torch.uint8)
            del tmp
            more = torch.empty(2 << 20, dtype=torch.uint8)
    live = pm.live_peaks(*pm.allocation_records(prof))
    assert live.setup == 1 << 20
    assert live.high == live.low == 5 << 20 and live.missed == 0
    del keep, more
