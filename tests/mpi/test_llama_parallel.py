"""model.arch = "llama" under a real mpiexec: every layout reproduces the 1-rank loss curve
(<= 1e-5 relative), resume is bit-exact and reshards (tp=2 -> 1 rank).

The tiny GPT run of test_parallel_parity.py (same data, config and helpers) turned into a
Llama-family model by overrides: grouped-query attention (4 heads, 2 key/value heads), untied
embeddings, Llama-3 rope_theta and a qkv bias (Qwen2), 4 steps. DiLoCo, bf16, fp16 and tp=2 with
torch.compile run it through the same layout code (checked by hand: 46 s under compile, not here).
"""
import sys

import pytest
import torch

from tests.conftest import losses, run_cmd
from tests.helpers import assert_same_curve, copy_run_at
from tests.helpers import train_layout as train
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

LLAMA = ["--model.arch=llama", "--model.n_kv_head=2", "--model.multiple_of=32",
         "--model.rope_theta=500000", "--model.qkv_bias=true", "--train.steps=4",
         "--train.warmup_steps=1", "--checkpoint.interval=2"]
STEPS = range(1, 5)
PP = ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=4"]
LAYOUTS = {  # every layout: 8 sequences per step, as the reference's 4 x 2
    "dp2_meta_init_off": (2, ["--train.grad_accum=1", "--parallel.meta_init=false"]),
    "fsdp2": (2, ["--parallel.data_parallel=fsdp", "--train.grad_accum=1"]),
    "tp2": (2, ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1"]),
    "pp2_1f1b": (2, PP + ["--parallel.pp_schedule=1f1b"]),
    "dp2_ac_full": (2, ["--train.grad_accum=1", "--parallel.activation_checkpoint=full"]),
    "pp2_interleaved": (2, PP + ["--parallel.pp_schedule=interleaved", "--parallel.pp_virtual_stages=2"]),
    "tp2_loss_chunk": (2, ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1",
                           "--train.loss_chunk=64"]),
}
SLOW = {"pp2_1f1b", "dp2_ac_full", "pp2_interleaved"}


@pytest.fixture(scope="module")
def llama_reference_run(tmp_path_factory, dataset):  # noqa: F811
    """The 1-rank run (checkpoints at steps 2 and 4), trained once per session
    (tests/shared_dirs.py), read-only: a test resumes a copy."""
    def build(out):
        r, _ = train(1, out, dataset, "one", *LLAMA)
        assert "training:" in r.stderr
    return shared_dir(tmp_path_factory, "llama_ref", build) / "one"


@pytest.fixture(scope="module")
def llama_reference(llama_reference_run):
    return losses(llama_reference_run)


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k
                                    for k in LAYOUTS])
def test_llama_loss_parity(tmp_path, dataset, llama_reference, layout, request):  # noqa: F811
    n, overrides = LAYOUTS[layout]
    run = (request.getfixturevalue("tp2_run") / "rs" if layout == "tp2" else
           train(n, tmp_path, dataset, layout, *LLAMA, *overrides)[1])
    assert_same_curve(llama_reference, losses(run), STEPS)
    assert llama_reference[4] < llama_reference[1]  # and it learns


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, dataset):  # noqa: F811
    """The tp2 layout's run (checkpoints at steps 2 and 4) in tmp/rs: a parity case, the
    resharded resume's source (at step 2) and the export's checkpoint (step 4); trained once per
    session (tests/shared_dirs.py), read-only."""
    n, overrides = LAYOUTS["tp2"]
    return shared_dir(tmp_path_factory, "llama_tp2",
                      lambda out: train(n, out, dataset, "rs", *LLAMA, *overrides))


def test_llama_resume_resharded_is_exact(tmp_path, dataset, llama_reference, tp2_run):  # noqa: F811
    """The tp=2 run's step-2 checkpoint resumed to 4 on 1 rank: the uninterrupted curve, exactly
    as gpt2's resharded resume (weights, AdamW state, data position)."""
    copy_run_at(tp2_run / "rs", tmp_path / "rs", 2)
    r, run = train(1, tmp_path, dataset, "rs", *LLAMA)
    assert "resumed from" in r.stderr and "step_00000002" in r.stderr
    assert_same_curve(llama_reference, losses(run), STEPS)


def test_llama_resume_same_layout_bit_exact(tmp_path, dataset, llama_reference_run,  # noqa: F811
                                            llama_reference):
    """The 1-rank run's step-2 checkpoint resumed to 4: its steps 3 and 4 bit for bit."""
    copy_run_at(llama_reference_run, tmp_path / "r1", 2)
    r, run = train(1, tmp_path, dataset, "r1", *LLAMA)
    assert "step_00000002" in r.stderr
    got = losses(run)
    assert [got[s] for s in STEPS] == [llama_reference[s] for s in STEPS]


def test_llama_tp2_export_loads_in_transformers(tmp_path, tp2_run):
    """`hpctrain export --format hf` of the tp=2 checkpoint: transformers' Qwen2ForCausalLM (the
    run has a q/k/v bias) gives our logits (max |d| <= 1e-4, fp32)."""
    transformers = pytest.importorskip("transformers")
    from hpctrain.export import find_checkpoint, load_model_state
    from hpctrain.model import build_model_from_section

    out = tmp_path / "hf"
    r = run_cmd([sys.executable, "-m", "hpctrain", "export", "--checkpoint", tp2_run / "rs",
                 "--format", "hf", "--output", out], timeout=120, check=True)
    assert "Qwen2ForCausalLM" in r.stdout
    sd, section = load_model_state(find_checkpoint(tp2_run / "rs"))
    ours = build_model_from_section(section).eval()
    ours.load_state_dict(sd)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4
