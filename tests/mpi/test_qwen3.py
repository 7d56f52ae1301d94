"""The Qwen3 family (#50) under a real mpiexec.

- Tensor parallelism (tests/mpi/scripts/qwen3_tp_probe.py): over tp = 2, with and without sequence
  parallelism, dense and with Qwen3-MoE layers, one forward / backward gives the unsplit model's
  loss and every gradient within 1e-5. The per-head q/k norms are what Llama's plan lacks: without
  their "partial" style (model/qwen3/spec.py's block_tp_plan) each tp rank's norm gradient is
  its own heads' part only (k_norm's off by 1.3e-3 dense, 2.4e-3 MoE, without it).
- Training from a Qwen3-MoE folder transformers wrote (tests/mpi/scripts/qwen3_hf_folder.py: a
  dense first layer, a sparse second one, head width 16 on a 32-wide model), init.from, 3 steps of
  8 sequences: 1 rank, then every layout in two launches, FSDP (dp2) x tp2, and pp2 x dp2 (DDP)
  x ep2: the losses within 1e-5 of 1 rank's (each rank read only its slices of the folder). The
  second is also a pipeline stage without a sparse layer next to one with: before the MoE
  monitor asked the spec whether the model has experts, the first stage skipped the records'
  gather and the run hung (step 1, both stages waiting in different collectives).
- The fsdp x tp run exported by `hpctrain export`: Qwen3MoeForCausalLM, whose logits are ours
  (<= 1e-4) and whose greedy tokens are ours.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, losses, mpirun, run_cmd
from tests.helpers import assert_same_curve
from tests.hf_models import OFFLINE, hf_logits
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

CONFIG = """[run]
dir = "{run}"
[data]
path = "{data}"
verify = "size"
cache_dir = "off"
[init]
from = "{hf}"
[model]
block_size = 32
[train]
steps = 3
warmup_steps = 0
micro_batch_size = 4
global_batch = 8
eval_interval = 0
log_interval = 1
lr = 0.003
[checkpoint]
interval = 3
"""
LAYOUTS = {  # name: (ranks, overrides): two launches cover dp, fsdp, tp2, pp2 and ep2
    "fsdp2_tp2": (4, ["--parallel.data_parallel=fsdp", "--parallel.tp=2"]),
    "pp2_dp2_ep2": (4, ["--parallel.pp=2", "--parallel.ep=2", "--train.micro_batch_size=2"]),
}


def test_tp_plan_gives_the_unsplit_gradients():
    r = mpirun(2, [ROOT / "tests/mpi/scripts/qwen3_tp_probe.py"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [l.split() for l in r.stdout.splitlines() if l.startswith(("SAME", "DIFF"))]
    assert [l[:2] for l in lines] == [["SAME", c] for c in ("dense_sp", "dense_nosp", "moe_sp", "moe_nosp")], lines
    assert [int(l[2]) for l in lines] == [25, 25, 26, 26]  # every parameter has its gradient


@pytest.fixture(scope="module")
def runs(tmp_path_factory, two_plays):
    """{layout: run dir} of 1 rank and every LAYOUTS entry, from one Qwen3-MoE folder, trained once
    per session (tests/shared_dirs.py: xdist splits the tests that read them between its workers)."""
    def train_all(tmp):
        run_cmd([sys.executable, ROOT / "tests/mpi/scripts/qwen3_hf_folder.py", tmp / "hf"], timeout=240,
                check=True, env=OFFLINE)
        for name, (n, overrides) in {"one": (1, []), **LAYOUTS}.items():
            cfg = tmp / f"{name}.toml"
            cfg.write_text(CONFIG.format(run=tmp / name, data=two_plays, hf=tmp / "hf"))
            args = ["-m", "hpctrain", "train", "--config", cfg, *overrides]
            r = run_cmd([sys.executable, *args], timeout=300) if n == 1 else mpirun(n, args, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
    tmp = shared_dir(tmp_path_factory, "qwen3_layouts", train_all)
    return {name: tmp / name for name in ("one", *LAYOUTS)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_as_one_rank(runs, layout):
    one = losses(runs["one"])
    assert_same_curve(one, losses(runs[layout]), range(1, 4))
    assert one[3] < one[1] - 0.1  # it trains


def test_export_is_a_qwen3_moe_with_our_logits_and_greedy_tokens(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from hpctrain.export import find_checkpoint, load_model_state
    from hpctrain.model import build_model_from_section

    out = tmp_path / "hf_out"
    r = run_cmd([sys.executable, "-m", "hpctrain", "export", "--checkpoint", runs["fsdp2_tp2"],
                 "--output", out], timeout=180, env=OFFLINE)
    assert r.returncode == 0, r.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["mlp_only_layers"] == [0]
    sd, section = load_model_state(find_checkpoint(runs["fsdp2_tp2"]))
    ours = build_model_from_section({**section, "dropout": 0.0}).eval()
    ours.load_state_dict(sd)
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf_logits(out, tokens) - ours(tokens)).abs().max().item() < 1e-4
        hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        theirs = hf.generate(tokens[:, :8], max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert ours.generate(tokens[:, :8], 16, temperature=0.0).tolist() == theirs.tolist()
