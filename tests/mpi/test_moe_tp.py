"""Tensor parallelism on the dense parts of a mixture-of-experts Llama (#34): attention tp-split,
the MoE layers' router and experts replicated over tp; with sequence parallelism each tp rank
routes its own sequence shard (gradients and loads summed over tp), without (parallel.sp = false)
every tp rank routes all tokens (nothing summed: not counted twice); experts sharded over
parallel.ep.

The model is tests/mpi/test_moe_parallel.py's skewed Mixtral (2 layers x 32, routing deliberately
unbalanced) with 4 experts, its config and helpers imported. Trained 10 steps with real mpiexec
against one rank (same global batch): tp2 with and without SP (dp1) and tp2 x ep2 x FSDP2 (dp2,
4 ranks, SP; ep without FSDP under tp was checked by hand, 2.0e-7) within 1e-5 relative loss, grad
norms within 1e-4, every routed token counted once in the loads; the tp2 x ep2 run's step-5
checkpoint resumes on one rank with the straight run's losses. `hpctrain plan` takes tp with
experts: the sparse layers whole on every tp rank, their gradient all-reduce over tp, the
all-to-all of each rank's sequence shard (tests/unit/test_plan_moe.py's shape, counted by hand).
"""
from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

from hpctrain import config as config_mod
from hpctrain.model import build_model_from_section
from hpctrain.model.moe import MoEFeedForward
from hpctrain.plan.report import make_plan
from tests.conftest import losses, records
from tests.mpi.test_moe_parallel import CONFIG, MODEL, STEPS, _no_init, _rel, _train, skewed_mixtral
from tests.shared_dirs import shared_dir
from tests.unit.test_plan_moe import JOB, SHAPE

EXPERTS = 4
LAYOUTS = {  # name: (ranks, overrides)
    "tp2": (2, ["--parallel.tp=2"]),
    "tp2_no_sp": (2, ["--parallel.tp=2", "--parallel.sp=false"]),
    "tp2_ep2": (4, ["--parallel.tp=2", "--parallel.ep=2", "--parallel.data_parallel=fsdp"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, two_plays):
    """{layout: run dir} of the one-rank reference and every LAYOUTS entry (each beside its
    NAME.toml), trained once per session: xdist splits the tests that read them between its
    workers, and tests/shared_dirs.py lets the second read the first's."""
    def train_all(tmp):
        skewed_mixtral(tmp / "hf", EXPERTS)
        for name, (n, overrides) in {"one": (1, []), **LAYOUTS}.items():
            cfg = tmp / f"{name}.toml"
            cfg.write_text(CONFIG.format(run=tmp / name, data=two_plays, hf=tmp / "hf"))
            _train(n, cfg, overrides)
    tmp = shared_dir(tmp_path_factory, "moe_tp_runs", train_all)
    return {name: tmp / name for name in ("one", *LAYOUTS)}


@pytest.mark.mpi
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp_moe_training_equals_one_rank(runs, layout):
    dirs = runs
    ref, got = losses(dirs["one"]), losses(dirs[layout])
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    worst = max(_rel(got[s], ref[s]) for s in ref)
    assert worst <= 1e-5, (layout, worst, got, ref)
    ref_norm, got_norm = losses(dirs["one"], "grad_norm"), losses(dirs[layout], "grad_norm")
    assert max(_rel(got_norm[s], ref_norm[s]) for s in ref) <= 1e-4, (got_norm, ref_norm)
    assert ref[STEPS] < ref[1] - 0.3  # it trains
    first, one = records(dirs[layout])[0], records(dirs["one"])[0]
    loads = sorted(k for k in first if k.startswith("moe.") and k.endswith(".load"))
    assert len(loads) == 2
    for key in loads:  # every routed row counted once over tp (and dp): 8 x 32 tokens x top-2
        assert first[key] == one[key] and sum(first[key]) == 8 * 32 * 2
        assert sum(sorted(first[key])[-2:]) > 0.9 * sum(first[key])  # 2 experts: deliberately unbalanced


@pytest.mark.mpi
def test_a_tp2_ep2_checkpoint_resumes_on_one_rank(runs, tmp_path):
    dirs = runs
    run = tmp_path / "resume_one"
    shutil.copytree(dirs["tp2_ep2"], run)
    shutil.rmtree(run / "checkpoints" / "step_00000010")
    (run / "metrics.jsonl").unlink()
    cfg = tmp_path / "resume_one.toml"
    source = dirs["tp2_ep2"]
    cfg.write_text((source.parent / "tp2_ep2.toml").read_text().replace(str(source), str(run)))
    _train(1, cfg)
    straight, got, one = losses(dirs["tp2_ep2"]), losses(run), losses(dirs["one"])
    assert sorted(got) == list(range(6, STEPS + 1))
    worst = max(max(_rel(got[s], straight[s]), _rel(got[s], one[s])) for s in got)
    assert worst <= 1e-5, (got, straight, one)


def _held_on_a_tp_rank(tp: int, ep: int) -> int:
    """Parameters one tp rank holds of SHAPE's real model: the MoE layers whole (but the routed
    experts / ep), norms replicated, the rest split (vocab rows rounded up)."""
    with torch.device("meta"):
        model = build_model_from_section({**dataclasses.asdict(SHAPE), "dropout": 0.0})
    moe = {id(p) for m in model.modules() if isinstance(m, MoEFeedForward) for p in m.parameters()}
    n = 0
    for name, p in model.named_parameters():
        if id(p) in moe:
            n += p.numel() // ep if ".mlp.experts." in name else p.numel()
        elif "norm" in name:
            n += p.numel()
        elif name in ("tok_emb.weight", "lm_head.weight"):
            n += math.ceil(p.shape[0] / tp) * p.shape[1]
        else:
            n += p.numel() // tp
    return n


def test_the_planner_keeps_moe_layers_whole_over_tp():
    assert SHAPE.tp_problem(2) is None  # planned and searched with tp now
    plans = {tp: make_plan(SHAPE, dataclasses.replace(JOB, tp=tp, ep=2)) for tp in (1, 2)}
    assert plans[2].mem.local_params == _held_on_a_tp_rank(2, 2)
    assert plans[1].mem.local_params == _held_on_a_tp_rank(1, 2)
    sent = {tp: {axis: b for axis, _, b, _ in plans[tp].comm} for tp in plans}
    assert sent[2]["ep"] * 2 == sent[1]["ep"] > 0  # each tp rank dispatches its sequence shard
    moe_layer = 64 * 8 + 8 + 3 * 8 * 64 * 96 // 2 + 3 * 64 * 40 + 64  # router, experts / ep, shared
    tp_only_dense = make_plan(dataclasses.replace(SHAPE, moe_experts=0), dataclasses.replace(JOB, tp=2))
    dense_tp = {a: b for a, _, b, _ in tp_only_dense.comm}["tp"]
    assert sent[2]["tp"] - dense_tp == 3 * moe_layer * 4  # fp32 all-reduce over 2 ranks: 2 x 1/2


@pytest.mark.parametrize("sp", ["true", "false"])
def test_the_config_takes_tp_with_experts(tmp_path, sp):
    cfg = tmp_path / "c.toml"
    cfg.write_text(_no_init(tmp_path) + MODEL)
    p = config_mod.load(cfg, ["--parallel.tp=2", "--parallel.ep=2", f"--parallel.sp={sp}"]).parallel
    assert (p.tp, p.ep, p.sp) == (2, 2, sp == "true")
