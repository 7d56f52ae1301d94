"""LoRA (`[lora]`, hpctrain/parallel/lora.py) under a real mpiexec, on a Llama folder built here
(init.from, random N(0, 0.2) weights, the byte vocabulary): step 0's loss is the base model's, the
loss falls, dp=2 and FSDP2 (dp=2) give the 1-rank curve, a stop + resume gives the straight run's
losses bit for bit (the base read again from init.from: had training moved it, the resumed run
would differ), checkpoints hold only the adapters (small), and the exports load in transformers:
merged (`--format hf`) and PEFT (`--format peft`, PeftModel.from_pretrained) logits equal ours.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import losses, mpirun, run_cmd
from tests.helpers import assert_same_curve
from tests.hf_models import OFFLINE, hf_logits, make_hf_model
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

CONFIG = """
[run]
dir = "{run}"
[data]
path = "{data}"
verify = "size"
cache_dir = "off"
[init]
from = "{hf}"
[train]
steps = 4
warmup_steps = 0
lr = {lr}
micro_batch_size = 4
eval_interval = 0
log_interval = 1
[checkpoint]
interval = 2
keep = 3
{lora}
"""
LORA = "[lora]\nrank = 4\nalpha = 16\ntargets = \"wq,wv,gate\"\n"
SIZES = dict(vocab_size=257, hidden_size=64, intermediate_size=128, max_position_embeddings=64)


def train(n, tmp, data, hf, name, *overrides, lora=LORA):
    """Train CONFIG as tmp/NAME on n ranks; LoRA's adapters take a 10x larger learning rate."""
    cfg = Path(tmp) / f"{name}.toml"
    cfg.write_text(CONFIG.format(run=Path(tmp) / name, data=data, hf=hf, lora=lora,
                                 lr=1e-1 if lora else 1e-2))
    args = ["-m", "hpctrain", "train", "--config", cfg, *overrides]
    r = run_cmd([sys.executable, *args], timeout=300) if n == 1 else mpirun(n, args, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(tmp) / name


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return shared_dir(tmp_path_factory, "lora_hf",
                      lambda out: make_hf_model("llama_gqa_untied", out / "llama", **SIZES)) / "llama"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset, hf_dir):
    """{name: run dir}: full fine-tuning and LoRA on 1 rank, trained once per session."""
    def build(out):
        train(1, out, dataset, hf_dir, "full", lora="")
        train(1, out, dataset, hf_dir, "lora")
    out = shared_dir(tmp_path_factory, "lora_runs", build)
    return {"full": out / "full", "lora": out / "lora"}


def test_step0_is_the_base_and_the_loss_falls(runs):
    full, lora = losses(runs["full"]), losses(runs["lora"])
    assert lora[1] == full[1]  # B = 0: step 0's forward is the base model's, bit for bit
    assert lora[4] < lora[1] - 0.05, lora
    assert lora[2] != full[2]  # but it trains other weights than full fine-tuning


@pytest.mark.parametrize("layout", [[], ["--parallel.data_parallel=fsdp"]], ids=["ddp", "fsdp"])
def test_dp2_equals_one_rank(tmp_path, dataset, hf_dir, runs, layout):
    run = train(2, tmp_path, dataset, hf_dir, "dp2", "--train.micro_batch_size=2", *layout)
    assert_same_curve(losses(runs["lora"]), losses(run), range(1, 5))


def test_resume_is_bit_exact(tmp_path, dataset, hf_dir, runs):
    run = train(2, tmp_path, dataset, hf_dir, "stopped", "--train.micro_batch_size=2",
                "--train.stop_at_step=2")
    assert sorted(losses(run)) == [1, 2]
    train(2, tmp_path, dataset, hf_dir, "stopped", "--train.micro_batch_size=2")
    straight = train(2, tmp_path, dataset, hf_dir, "straight", "--train.micro_batch_size=2")
    assert losses(run) == losses(straight)  # every step, equal floats


def _checkpoint_bytes(run: Path) -> int:
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    return sum(f.stat().st_size for f in step.rglob("*") if f.is_file())


def test_checkpoint_holds_only_the_adapters(runs):
    from hpctrain.checkpoint.safe_load import read_metadata

    step = sorted((runs["lora"] / "checkpoints").glob("step_*"))[-1]
    keys = [k for k in read_metadata(step / ".metadata").state_dict_metadata]
    model = sorted(k for k in keys if k.startswith("model."))
    optim = [k for k in keys if k.startswith("optim.")]
    # wq, wv, gate in 2 blocks, A and B each: 12 tensors, and AdamW's exp_avg, exp_avg_sq, step for each
    assert len(model) == 12 and all(".lora_A." in k or ".lora_B." in k for k in model), model
    assert len(optim) == 36 and all(".lora_" in k for k in optim), optim
    ratio = _checkpoint_bytes(runs["lora"]) / _checkpoint_bytes(runs["full"])
    assert ratio < 0.1, ratio  # 0.2M frozen parameters x 3 (weights, exp_avg, exp_avg_sq) not saved


def _our_logits(run: Path, hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The LoRA run's final model as training built it: the base from init.from, adapters on."""
    from hpctrain.config import load as load_config
    from hpctrain.export import find_checkpoint, load_model_state
    from hpctrain.interop import hf_import
    from hpctrain.model import build_model_from_section
    from hpctrain.parallel.lora import apply_lora

    sd, section = load_model_state(find_checkpoint(run))
    model = build_model_from_section({**section, "dropout": 0.0})
    apply_lora(model, load_config(run / "config.toml").lora)
    hf_import.load_weights(model, hf_dir, section, skip=lambda fqn: fqn in sd)
    model.load_state_dict(sd, strict=False)
    with torch.no_grad():
        return model.eval()(tokens)


def test_merged_and_peft_exports_give_our_logits(tmp_path, runs, hf_dir):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = _our_logits(runs["lora"], hf_dir, tokens)
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    for fmt, out in (("hf", merged), ("peft", adapter)):
        r = run_cmd([sys.executable, "-m", "hpctrain", "export", "--checkpoint", runs["lora"],
                     "--format", fmt, "--output", out], timeout=180, env=OFFLINE)
        assert r.returncode == 0, r.stderr[-2000:]
    assert (hf_logits(merged, tokens) - ours).abs().max().item() < 1e-5  # measured 7e-7
    import hpctrain  # the Python API (and `sample`) on the run: the base + adapters, merged
    assert (hpctrain.load(runs["lora"]).logits(tokens) - ours).abs().max().item() < 1e-5
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 16.0)
    assert sorted(config["target_modules"]) == ["gate_proj", "q_proj", "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True)
    with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        theirs = with_adapter(tokens).logits
    assert (theirs - ours).abs().max().item() < 1e-5  # measured 0.0
    assert (theirs - hf_logits(hf_dir, tokens)).abs().max().item() > 1e-3  # the adapters matter
