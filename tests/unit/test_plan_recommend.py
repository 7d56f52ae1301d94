"""`hpctrain plan` recommends a layout (issue #31 item 7): the search, its step-time model and its
advice, through the command line (text and --json); pure arithmetic, no MPI."""
from __future__ import annotations

import dataclasses
import json
import shlex
import sys

import pytest

from hpctrain import config, config_schema
from hpctrain.plan import search
from hpctrain.plan.cli import main as plan_main
from hpctrain.plan.layout import Job
from hpctrain.plan.memory import largest_rank
from hpctrain.plan.shape import PRESETS
from hpctrain.plan.step_time import step_time
from tests.conftest import run_cmd

ISSUE = ["--preset", "7b", "--nodes", "8", "--gpus-per-node", "8", "--gpu-memory", "80GB"]


def _json(capsys, args) -> dict:
    assert plan_main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def issue_text():
    """The issue's command, as a user runs it: the full report with its advice."""
    r = run_cmd([sys.executable, "-m", "hpctrain", "plan", *ISSUE], timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _recommended_flags(text: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith("recommended: "))
    return [a for a in shlex.split(line.split(" train ", 1)[1]) if a.startswith("--") and "." in a]


def test_7b_on_8x8_recommends_a_layout_that_fits(capsys):
    out = _json(capsys, ISSUE)
    rec, usable = out["recommended"], out["assumptions"]["usable_memory"]
    assert rec["fits"] and rec["peak_bytes"] <= usable <= 80e9
    assert rec["step_s"] > 0 and rec["tokens_per_s"] == pytest.approx(64 * 2048 / rec["step_s"])
    assert rec["days_to_tokens"] == pytest.approx(1e12 / rec["tokens_per_s"] / 86400)
    fits = [c for c in out["candidates"] if c["fits"]]
    assert rec["step_s"] == min(c["step_s"] for c in fits)  # ranked by the modelled step time
    assert all(c["peak_bytes"] <= usable for c in fits)
    rejected = [c for c in out["candidates"] if not c["fits"]]
    assert rejected and all(c["why"] for c in rejected)
    by_reason = {r: [c for c in rejected if r in c["why"]] for r in ("usable", "--pp", "grad_accum >= pp")}
    assert all(by_reason.values()), {r: len(v) for r, v in by_reason.items()}
    assert all(c["peak_bytes"] > usable for c in by_reason["usable"])
    assert all(c["pp"] > 32 for c in by_reason["--pp"])  # more stages than the 32 blocks
    assert all(c["grad_accum"] < c["pp"] for c in by_reason["grad_accum >= pp"])


def test_the_issues_layout_is_told_what_would_fit(capsys, issue_text):
    """`plan --preset 7b --nodes 8 --gpus-per-node 8` (DDP, dp 64) printed only the GPU memory
    warning; now it names the fitting changes, FSDP among them, each with its peak."""
    out = _json(capsys, ISSUE)
    assert not out["user"]["fits"] and out["user"]["peak_bytes"] > out["assumptions"]["usable_memory"]
    fixes = {" + ".join(f["changes"]): f for f in out["fixes"]}
    assert "add FSDP" in fixes and fixes["add FSDP"]["data_parallel"] == "fsdp"
    assert all(f["fits"] and len(f["changes"]) == 1 for f in out["fixes"][:3])
    assert "your layout: ddp dp64 tp1 pp1 mb1x1 ac=none does not fit" in issue_text
    assert "fits with: add FSDP" in issue_text
    assert "time to 1T tokens" in issue_text and "--mfu 0.4" in issue_text


def test_recommended_flags_fed_back_fit_and_load_as_a_training_config(capsys, issue_text):
    flags = _recommended_flags(issue_text)
    keys = {f.split("=")[0][2:] for f in flags}
    schema = {f"{s}.{f.name}" for s, cls in (("parallel", config_schema.ParallelConfig),
                                              ("train", config_schema.TrainConfig))
              for f in dataclasses.fields(cls)}
    assert keys <= schema and {"parallel.tp", "parallel.data_parallel", "train.micro_batch_size"} <= keys
    again = _json(capsys, [*ISSUE, *flags])
    assert again["user"]["fits"] and again["user"]["layout"] == again["recommended"]["layout"]
    assert again["user"]["peak_bytes"] == again["recommended"]["peak_bytes"]
    shape = [f"--model.{k}={v}" for k, v in dataclasses.asdict(PRESETS["7b"]).items()]
    cfg = config.load("configs/demo.toml", shape + flags)  # train's own loader takes them
    assert cfg.parallel.tp == again["user"]["tp"] and cfg.train.global_batch == 64


def test_lower_inter_node_bandwidth_never_makes_a_layout_faster(capsys):
    fast, slow = (_json(capsys, [*ISSUE, "--inter-node-bw", bw]) for bw in ("100GB", "10GB"))
    step = {c["layout"]: c["step_s"] for c in fast["candidates"] if "step_s" in c}
    slower = 0
    for c in slow["candidates"]:
        if "step_s" in c and c["layout"] in step:  # (HSDP layouts: listed where they pay)
            assert c["step_s"] >= step[c["layout"]], c["layout"]
            slower += c["step_s"] > step[c["layout"]] and c["dp"] * c["tp"] > 8
    assert slower > 0  # dp across nodes pays for it
    assert slow["recommended"]["step_s"] >= fast["recommended"]["step_s"]


def test_step_time_parts():
    """One GPU: compute only, at the stated MFU; full checkpointing adds a forward (x 4/3); a
    pipeline idles (pp - 1) / micro-batches of its time; DDP's all-reduce hides under the last
    backward, what is left is exposed."""
    shape = PRESETS["1b"]
    one = Job(nodes=1, gpus_per_node=1, micro_batch=2, grad_accum=4).check(shape)
    t = step_time(shape, one, largest_rank(shape, one))
    flops = shape.flops_per_token() * 8 * 2048
    assert t.total == pytest.approx(flops / (989e12 * 0.4)) and t.tp == t.pp == t.dp_exposed == 0
    ac = dataclasses.replace(one, activation_checkpoint="full")
    assert step_time(shape, ac, largest_rank(shape, ac)).compute == pytest.approx(t.compute * 4 / 3)
    pipe = Job(nodes=1, gpus_per_node=4, pp=4, grad_accum=8).check(shape)
    p = step_time(shape, pipe, largest_rank(shape, pipe))
    assert p.bubble == pytest.approx((p.compute + p.tp + p.pp) * 3 / 8)
    ddp = Job(nodes=2, gpus_per_node=1, inter_node_bw=10 ** 9).check(shape)
    d = step_time(shape, ddp, largest_rank(shape, ddp))
    assert d.dp_exposed == pytest.approx(d.dp_total - d.compute * 2 / 3) and d.dp_exposed > 0


def test_nothing_fits_names_the_smallest_node_count(capsys):
    out = _json(capsys, ["--preset", "70b", "--nodes", "1", "--gpus-per-node", "8"])
    assert out["recommended"] is None
    more = out["more_nodes"]
    assert more["fits"] and more["nodes"] == 2 and more["peak_bytes"] <= out["assumptions"]["usable_memory"]
    assert _json(capsys, ["--preset", "70b", "--nodes", "2", "--gpus-per-node", "8"])["recommended"]
    assert plan_main(["--preset", "70b", "--nodes", "1", "--gpus-per-node", "8"]) == 0
    assert "more nodes: 2 (" in capsys.readouterr().out


def test_a_pipeline_with_too_few_micro_batches_is_rejected_with_why(capsys):
    out = _json(capsys, [*ISSUE, "--pp", "4", "--data-parallel", "fsdp"])
    assert not out["user"]["fits"] and "grad_accum >= pp" in out["user"]["why"]
    assert out["fixes"] and all(f["fits"] for f in out["fixes"])


def test_global_batch_sets_grad_accum_and_bad_values_are_one_line(capsys):
    out = _json(capsys, [*ISSUE, "--data-parallel", "fsdp", "--global-batch", "512"])
    assert out["user"]["grad_accum"] == 8 and out["assumptions"]["global_batch"] == 512
    assert all(c["micro_batch"] * c["grad_accum"] * c["dp"] == 512
               for c in out["candidates"] if c["fits"])
    for bad, named in ((["--global-batch", "100"], "--global-batch 100"),
                       (["--global-batch", "128", "--grad-accum", "2"], "--global-batch 128"),
                       (["--mfu", "1.5"], "--mfu"), (["--inter-node-bw", "0"], "--inter-node-bw")):
        assert plan_main([*ISSUE, *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {named}") and err.count("\n") == 1, err


def test_search_layouts_cover_every_knob():
    job = Job(nodes=2, gpus_per_node=4).check(PRESETS["1b"])
    seen = {(j.tp, j.pp, j.data_parallel, j.micro_batch, j.activation_checkpoint)
            for j in search.layouts(job, 64)}
    assert {t for t, *_ in seen} == {1, 2, 4} and {p for _, p, *_ in seen} == {1, 2, 4, 8}
    assert {("fsdp", "full"), ("ddp", "none"), ("ddp", "selective")} <= {(d, a) for *_, d, _, a in seen}
    assert all(j.dp_size * j.tp * j.pp == 8 for j in search.layouts(job, 64))
