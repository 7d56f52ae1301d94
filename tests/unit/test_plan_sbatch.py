"""`hpctrain plan` writes what to submit (issue #48 item 4): `--sbatch FILE` (slurm/train.sbatch
with the job's #SBATCH lines and the recommended layout baked in), `--preset` and `--config` of one
model recommending the same line, `--parallel.dp=0` explained where it is printed, the
recommendation before the figures of a layout that does not fit, the configs' comments. The
script's Slurm run: tests/slurm/test_plan_sbatch.py."""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import shlex
import stat
import subprocess

import pytest

from hpctrain.config_schema import ParallelConfig
from hpctrain.plan.cli import build_parser, shape_and_job
from hpctrain.plan.cli import main as plan_main
from hpctrain.plan.sbatch import SBATCH, TEMPLATE, directives
from hpctrain.plan.shape import PRESET_CONFIGS
from tests.conftest import ROOT

CFG_8B = str(ROOT / "configs" / "llama3_8b.toml")


def _plan(capsys, args) -> tuple[int, str, str]:
    rc = plan_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _recommended(out: str) -> str:
    return next(x for x in out.splitlines() if x.startswith("recommended: "))


@pytest.mark.parametrize("preset,nodes", [("llama3-8b", 4), ("llama3-70b", 16), ("llama3-70b", 4)])
def test_preset_and_config_recommend_the_same_line(capsys, preset, nodes):
    """Before: --preset llama3-8b on 4 nodes planned global batch 32 (mb1x2), --config 512 (mb1x32);
    the 70B config on 4 nodes (its [parallel] is 128 ranks) was an error."""
    config = PRESET_CONFIGS[preset][0]
    rc_p, by_preset, _ = _plan(capsys, ["--preset", preset, "--nodes", nodes])
    rc_c, by_config, err = _plan(capsys, ["--config", ROOT / config, "--nodes", nodes])
    assert (rc_p, rc_c) == (0, 0), err
    line = _recommended(by_preset)
    assert line == _recommended(by_config).replace(shlex.quote(str(ROOT / config)), config)
    assert "--train.global_batch=512" in line and "--train.micro_batch_size=1" in line
    if preset == "llama3-8b":
        assert line.startswith("recommended: fsdp dp4 tp1 pp8 mb1x128 ac=none: ")
    if nodes == 4 and preset == "llama3-70b":  # the config's layout is reported, not an error
        assert ("your layout: ddp dp0 tp4 pp32 mb1x1 ac=selective does not fit: --dp/--tp/--pp: "
                "dp=0 x tp=4 x pp=32 does not match the world size 32") in by_config


@pytest.mark.parametrize("preset", sorted(PRESET_CONFIGS))
def test_a_presets_batch_keys_are_its_shipped_configs(preset):
    path, recipe = PRESET_CONFIGS[preset]
    _, job = shape_and_job(build_parser().parse_args(["--config", str(ROOT / path)]))
    assert {k: getattr(job, k) for k in recipe} == recipe
    _, from_preset = shape_and_job(build_parser().parse_args(["--preset", preset]))
    assert (from_preset.global_batch, from_preset.loss_chunk) == (512, 1024)


def test_an_explicit_grad_accum_replaces_the_presets_global_batch(capsys):
    rc, out, err = _plan(capsys, ["--preset", "llama3-8b", "--nodes", "4", "--grad-accum", "2", "--json"])
    assert rc == 0, err
    assert json.loads(out)["assumptions"]["global_batch"] == 1 * 2 * 32


def test_dp_zero_is_explained_where_it_is_printed(capsys):
    rc, out, _ = _plan(capsys, ["--config", CFG_8B, "--nodes", "4"])
    lines = out.splitlines()
    i = lines.index(_recommended(out))
    assert "--parallel.dp=0" in lines[i]
    assert lines[i + 1].strip().startswith("(--parallel.dp=0: dp = world / (tp x pp)")
    assert "32 / (1 x 8) = 4 here" in lines[i + 1]
    dp_help = next(f for f in dataclasses.fields(ParallelConfig) if f.name == "dp").metadata["help"]
    assert "0 = world / (tp * pp" in dp_help  # what `hpctrain train --help` says of it (i51-wire: * cp)


def test_the_recommendation_comes_before_the_figures_of_a_layout_that_does_not_fit(capsys):
    _, unfit, _ = _plan(capsys, ["--preset", "llama3-8b", "--nodes", "4"])  # DDP over 32: 196 GiB
    assert unfit.startswith("# Plan: llama 32 x 4096")
    order = [unfit.index(x) for x in ("## Recommended layouts", "recommended: ",
                                      "your layout: ddp dp32 tp1 pp1 mb1x16 ac=none does not fit",
                                      "## Your layout, which does not fit: its figures",
                                      "## Memory per rank", "## Warnings")]
    assert order == sorted(order)
    _, fits, _ = _plan(capsys, ["--config", CFG_8B, "--nodes", "4"])  # its own layout fits
    assert fits.index("## Memory per rank") < fits.index("recommended: ") < fits.index("your layout:")
    assert "does not fit: its figures" not in fits


def _write(capsys, tmp_path, *extra, name="job.sbatch"):
    target = tmp_path / name
    rc, out, err = _plan(capsys, ["--config", CFG_8B, "--nodes", "4", "--sbatch", target, *extra])
    return rc, out, err, target


def test_the_written_script_carries_the_plan(capsys, tmp_path):
    rc, out, err, target = _write(capsys, tmp_path, "--time", "2-00:00:00", "--cpus-per-task", "12",
                                  "--partition", "gpu")
    assert rc == 0, err
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert os.listdir(tmp_path) == ["job.sbatch"]  # the temporary file was renamed
    assert subprocess.run(["bash", "-n", str(target)], capture_output=True).returncode == 0
    text = target.read_text()
    got = directives(text)
    for want in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=12",
                 "--time=2-00:00:00", "--signal=B:USR1@300", "--partition=gpu", "--requeue",
                 "--no-kill", "--job-name=hpctrain-llama3_8b"):
        assert want in got, got
    assert len(got) == len({d.split("=")[0] for d in got})  # each key once
    assert not [d for d in got if d.startswith(("--gpus-per-task", "--gres", "--ntasks="))]
    flags = _recommended(out).split(f"--config {shlex.quote(CFG_8B)} ", 1)[1]  # a path may hold spaces
    assert f"CONFIG={shlex.quote(CFG_8B)}\nset -- {flags} \"$@\"\n" in text
    assert f"wrote {target}: " in out and out.rstrip().endswith(f"submit it: sbatch {target}")


def test_the_script_is_the_template_but_its_header_and_command(capsys, tmp_path):
    rc, _, err, target = _write(capsys, tmp_path)
    assert rc == 0, err
    tpl, got = TEMPLATE.read_text().splitlines(), target.read_text().splitlines()
    changed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=tpl, b=got, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        changed += 1
        assert all(SBATCH.match(x) or x.startswith(("CONFIG=${1:?", "shift")) for x in tpl[i1:i2]), tpl[i1:i2]
        assert all(x.startswith(("#", "CONFIG=", "set -- ")) for x in got[j1:j2]), got[j1:j2]
    assert changed >= 3  # the note on top, the #SBATCH lines, the command
    assert got[got.index(next(x for x in got if x.startswith("set -- "))) + 1:] == \
        tpl[tpl.index("shift") + 1:]  # the whole body after it, byte for byte


def test_sbatch_refusals_are_one_line_and_write_nothing(capsys, tmp_path):
    rc, _, _, target = _write(capsys, tmp_path)
    assert rc == 0
    target.write_text("mine\n")
    rc, out, err, _ = _write(capsys, tmp_path)
    assert rc == 2 and err.strip() == (f"error: --sbatch {target}: the file exists; give --force to "
                                       f"replace it, or another name") and out == ""
    assert target.read_text() == "mine\n"
    rc, _, err, _ = _write(capsys, tmp_path, "--force")
    assert rc == 0 and target.read_text().startswith("#!/bin/bash\n# Written from slurm/train.sbatch")
    cases = [(["--preset", "7b"], "--sbatch needs --config FILE"),
             (["--config", CFG_8B, "--time", "00:05:00"], "--time 00:05:00: the job gets USR1 300 s"),
             (["--config", CFG_8B, "--time", "soon"], "--time 'soon': expected Slurm's"),
             (["--config", str(ROOT / "configs/llama3_70b.toml"), "--nodes", "1"], "no layout fits 1 node"),
             (["--config", CFG_8B, "--sbatch-template", tmp_path / "none"], "--sbatch-template")]
    for args, words in cases:
        rc, _, err = _plan(capsys, [*args, "--sbatch", tmp_path / "new.sbatch"])
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and words in err, err
        assert not (tmp_path / "new.sbatch").exists()
    assert sorted(os.listdir(tmp_path)) == ["job.sbatch"]


def test_cpu_nodes_write_no_gpu_line(capsys, tmp_path):
    target = tmp_path / "cpu.sbatch"
    rc, _, err = _plan(capsys, ["--config", ROOT / "configs/demo.toml", "--nodes", "2", "--gpus-per-node",
                                "0", "--ranks-per-node", "4", "--sbatch", target])
    assert rc == 0, err
    got = directives(target.read_text())
    assert "--nodes=2" in got and "--ntasks-per-node=4" in got
    assert not [d for d in got if "gpu" in d]
    assert "##SBATCH --gpus-per-node=4" in target.read_text()  # the template's, still commented
    _, job = shape_and_job(build_parser().parse_args(["--preset", "1b", "--gpus-per-node", "0",
                                                      "--ranks-per-node", "4", "--node-memory", "256GB"]))
    assert (job.gpus_per_node, job.gpu_memory, job.backend, job.precision) == (
        4, 64 * 10 ** 9, "gloo", "fp32")  # a quarter of the node's 256 GB
    rc, _, err = _plan(capsys, ["--preset", "1b", "--ranks-per-node", "4"])
    assert rc == 2 and err.startswith("error: --ranks-per-node is for CPU nodes")


@pytest.mark.parametrize("name", ["llama3_8b", "llama3_70b"])
def test_a_configs_sbatch_comment_is_what_the_planner_writes(capsys, tmp_path, name):
    """The header's `plan ... --sbatch F` writes the #SBATCH values the comment names, and its
    by-hand sbatch line gives the template those same values."""
    comments = " ".join(x.lstrip("#").strip() for x in (ROOT / "configs" / f"{name}.toml").read_text()
                        .splitlines() if x.startswith("#"))
    plan = re.search(r"python -m hpctrain plan --config (\S+) --nodes (\d+) --sbatch (\S+) sbatch (\S+)",
                     comments)
    assert plan and plan.group(1) == f"configs/{name}.toml" and plan.group(3) == plan.group(4)
    said = re.search(r"#SBATCH ((?:--[\w-]+=\S+ )+)and", comments).group(1).split()
    by_hand = re.search(r"sbatch ((?:--[\w-]+=\S+ )+)slurm/train\.sbatch (\S+?)\)", comments)
    assert by_hand.group(1).split() == said and by_hand.group(2) == plan.group(1)
    rc, _, err = _plan(capsys, ["--config", ROOT / plan.group(1), "--nodes", plan.group(2), "--sbatch",
                                tmp_path / plan.group(3)])
    assert rc == 0, err
    assert set(said) <= set(directives((tmp_path / plan.group(3)).read_text()))


# A command that asks for one GPU per task: srun/sbatch/salloc with --gpus-per-task, or a directive.
GPUS_PER_TASK = re.compile(r"(\b(srun|sbatch|salloc)\b[^`]*|#SBATCH\s+)--gpus-per-task")


def test_gpu_launch_advice_is_gpus_per_node_never_gpus_per_task():
    """Issue 49 defect 6: --gpus-per-task=1 confines each rank to its own GPU under cgroups, which
    blocks CUDA IPC (NCCL between a node's GPUs through host memory, not NVLink). The GPU
    templates ask for --gpus-per-node (commented, as their other site lines), none has a GPU-per-task
    directive, and no template, doc, README or message of ours gives a command with --gpus-per-task
    (the planner's written script: test_the_written_script_carries_the_plan)."""
    for name in ("train", "sweep", "tune"):
        text = (ROOT / "slurm" / f"{name}.sbatch").read_text()
        assert re.search(r"^##SBATCH --gpus-per-node=\d+$", text, re.M), name
        assert not re.search(r"^#{1,2}SBATCH\s+--(gpus-per-task|gres|gpus)(=|\s|$)", text, re.M), name
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("slurm/*"), *ROOT.glob("bench/*.sh"),
             *ROOT.glob("hpctrain/**/*.py")]
    found = [f"{path.relative_to(ROOT)}:{n}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if GPUS_PER_TASK.search(line)]
    assert found == []
