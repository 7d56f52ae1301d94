"""The planner's CPU offload (parallel.offload, issue 52; hpctrain/plan/offload.py): what leaves
each GPU, the host memory per node it takes (checked against --node-memory), its PCIe and CPU
AdamW seconds in the step time, and the search offering it only where the same layout without it
does not fit: llama3-70b on 2 nodes of 8 GPUs (nothing fits without offload), on 8 (offload buys
ac=none), not on 16. Pure arithmetic, no MPI."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hpctrain import config
from hpctrain.plan import memory, offload, search
from hpctrain.plan.cli import main as plan_main
from hpctrain.plan.layout import GB, Job
from hpctrain.plan.shape import PRESETS
from hpctrain.plan.step_time import step_time

SHAPE = PRESETS["llama3-70b"]
STATE = ("parameters (fp32)", "gradients (fp32)", "AdamW m, v (fp32)")


def _rank(**job):
    j = Job(**{"nodes": 2, "gpus_per_node": 8, "data_parallel": "fsdp", "pp": 2,
               "activation_checkpoint": "full", "grad_accum": 2, **job}).check(SHAPE)
    return j, memory.largest_rank(SHAPE, j)


def test_what_each_mode_takes_off_the_gpu_and_puts_on_the_host():
    """optimizer: AdamW's 8 B per parameter leave the GPU; all: parameters, gradients and moments
    (16 B). Both: 16 B per local parameter in host memory; the peak falls by what left."""
    _, none = _rank()
    _, opt = _rank(offload="optimizer")
    _, off_all = _rank(offload="all")
    local = none.parts["parameters (fp32)"] // 4
    assert opt.parts["AdamW m, v (fp32)"] == 0 and opt.parts["parameters (fp32)"] == none.parts["parameters (fp32)"]
    assert all(off_all.parts[k] == 0 for k in STATE)
    assert opt.host == off_all.host == 16 * local and none.host == 0
    assert none.peak - opt.peak == none.parts["AdamW m, v (fp32)"]
    assert none.peak - off_all.peak >= sum(none.parts[k] for k in STATE) - none.parts["gradients (fp32)"]


def test_host_memory_per_node_is_checked():
    """2 x 8 GPUs of llama3-70b offloaded: 16 B x 70.6e9 / 2 nodes = 565 GB per node: fits 1 TB
    nodes (80% usable), not 512 GB ones."""
    job, mem = _rank(offload="all")
    assert mem.host * 8 == pytest.approx(16 * SHAPE.total_params() / 2, rel=0.01)
    need, room = offload.host_need_and_room(mem.host, job)
    assert need == mem.host * 8 <= room == int(0.8 * 1024 * GB)
    small = replace(job, node_memory=512 * GB)
    assert search.evaluate(SHAPE, job).fits
    rejected = search.evaluate(SHAPE, small)
    assert not rejected.fits and "host memory per node" in rejected.why


def test_offload_seconds_in_the_step_time():
    """optimizer: 8 B per local parameter over PCIe, all exposed; AdamW on the host 28 B per
    parameter at the node's memory bandwidth / its ranks. all: 12 B x micro-batches, hidden under
    compute up to the compute time."""
    job, mem = _rank(offload="optimizer")
    local = mem.host // 16
    t = step_time(SHAPE, job, mem)
    assert t.offload_pcie == pytest.approx(8 * local / job.pcie_bw)
    assert t.offload_adam == pytest.approx(28 * local / (job.host_memory_bw / 8))
    base = step_time(SHAPE, replace(job, offload="none"), memory.largest_rank(SHAPE, replace(job, offload="none")))
    assert t.total == pytest.approx(base.total + t.offload_pcie + t.offload_adam)
    job_all, mem_all = _rank(offload="all", grad_accum=4)
    assert offload.pcie_bytes(mem_all.host, job_all) == 12 * local * 4
    slow = replace(job_all, pcie_bw=1 * GB)
    t_all = step_time(SHAPE, slow, mem_all)
    assert t_all.offload_pcie == pytest.approx(12 * local * 4 / GB - t_all.compute)


def test_offload_needs_fsdp_for_all_and_sync():
    with pytest.raises(ValueError, match="--offload"):
        Job(nodes=2, offload="all").check(SHAPE)
    with pytest.raises(ValueError, match="--offload"):
        Job(nodes=2, offload="optimizer", sync_mode="diloco").check(SHAPE)


def _json(capsys, args) -> dict:
    assert plan_main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_70b_on_2_nodes_fits_only_with_offload(capsys):
    """Without offload no layout of 16 GPUs holds llama3-70b's 16 B per parameter (the planner
    sent it to 3 nodes); with it one fits, recommended with why and flags train accepts."""
    out = _json(capsys, ["--preset", "llama3-70b", "--nodes", "2"])
    fitting = [c for c in out["candidates"] if c["fits"]]
    assert fitting and all(c.get("offload") in ("optimizer", "all") for c in fitting)
    rec = out["recommended"]
    assert rec["offload"] in ("optimizer", "all") and "no layout fits without offload" in rec["offload_why"]
    assert rec["host_bytes_per_rank"] * 8 <= 0.8 * Job().node_memory
    flags = rec["train_command"].split(" --config ")[1].split()[1:]
    cfg = config.load("configs/llama3_70b.toml", flags)
    assert cfg.parallel.offload == rec["offload"] and cfg.parallel.data_parallel == "fsdp"


@pytest.mark.parametrize("nodes,offloads", [(8, True), (16, False)])
def test_offload_is_recommended_where_it_pays(capsys, nodes, offloads):
    """8 nodes: offload frees the memory for ac=none, faster than the best layout without it
    (which must recompute); 16 nodes: ac=none fits without offload, which then only costs time.
    An offloading candidate is listed only where its twin without offload does not fit."""
    out = _json(capsys, ["--preset", "llama3-70b", "--nodes", str(nodes)])
    rec = out["recommended"]
    assert (rec.get("offload", "none") != "none") == offloads
    if offloads:
        rival = next(c for c in out["candidates"] if c["fits"] and "offload" not in c)
        assert rec["tokens_per_s"] > rival["tokens_per_s"] and rival["activation_checkpoint"] != "none"
        assert rec["activation_checkpoint"] == "none" and "offload" in rec["offload_why"]
    names = {c["layout"]: c for c in out["candidates"]}
    for c in out["candidates"]:
        if c.get("offload"):
            twin = names.get(c["layout"].replace(f" offload={c['offload']}", ""))
            assert twin is None or not twin["fits"]
