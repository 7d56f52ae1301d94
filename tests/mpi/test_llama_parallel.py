"""model.arch = "llama" under a real mpiexec: every layout reproduces the 1-rank loss curve
(<= 1e-5 relative), resume is bit-exact and reshards (tp=2 -> 1 rank).

The tiny GPT run of test_parallel_parity.py (same data, config and helpers) turned into a
Llama-family model by overrides: grouped-query attention (4 heads, 2 key/value heads), untied
embeddings, Llama-3 rope_theta and a qkv bias (Qwen2), 4 steps. DiLoCo, bf16, fp16 and tp=2 with
torch.compile run it through the same layout code (checked by hand: 46 s under compile, not here).
"""
import pytest

from tests.mpi.test_parallel_parity import assert_same_curve, dataset, losses, train  # noqa: F401

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
def llama_reference(tmp_path_factory, dataset):  # noqa: F811
    tmp = tmp_path_factory.mktemp("llama_ref")
    r, run = train(1, tmp, dataset, "one", *LLAMA)
    assert "training:" in r.stderr
    return losses(run)


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k
                                    for k in LAYOUTS])
def test_llama_loss_parity(tmp_path, dataset, llama_reference, layout):  # noqa: F811
    n, overrides = LAYOUTS[layout]
    _, run = train(n, tmp_path, dataset, layout, *LLAMA, *overrides)
    assert_same_curve(llama_reference, losses(run), STEPS)
    assert llama_reference[4] < llama_reference[1]  # and it learns


def test_llama_resume_resharded_is_exact(tmp_path, dataset, llama_reference):  # noqa: F811
    """Stop at step 2 on tp=2, resume to 4 on 1 rank: the uninterrupted curve, exactly as gpt2's
    resharded resume (weights, AdamW state, data position)."""
    train(2, tmp_path, dataset, "rs", *LLAMA, "--parallel.tp=2", "--train.micro_batch_size=8",
          "--train.grad_accum=1", "--train.stop_at_step=2")
    r, run = train(1, tmp_path, dataset, "rs", *LLAMA)
    assert "resumed from" in r.stderr and "step_00000002" in r.stderr
    assert_same_curve(llama_reference, losses(run), STEPS)


def test_llama_resume_same_layout_bit_exact(tmp_path, dataset, llama_reference):  # noqa: F811
    train(1, tmp_path, dataset, "r1", *LLAMA, "--train.stop_at_step=2")
    r, run = train(1, tmp_path, dataset, "r1", *LLAMA)
    assert "step_00000002" in r.stderr
    got = losses(run)
    assert [got[s] for s in STEPS] == [llama_reference[s] for s in STEPS]
