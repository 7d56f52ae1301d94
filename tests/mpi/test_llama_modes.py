"""model.arch = "llama" in every training mode under a real mpiexec: DiLoCo (the synchronous-SGD
anchor, int8 bytes per round, bit-exact resume mid-round), async_diloco (a 1-replica H = 1 run is
plain SGD, across a resume; the servers' global model loads into a Llama), torch.compile, bf16 and
fp16 (loss scaling, overflow steps skipped), and meta-device init (bit for bit).

One reference curve serves every comparison: the tiny Llama of test_llama_parallel.py (grouped-query
attention 4:2, untied embeddings, a q/k/v bias as Qwen2, 2 layers) trained 6 steps with plain SGD
on 1 rank, 8 sequences per step (4 x 2 micro-batches) — what 2 DiLoCo replicas of 4 do at H = 1.
"""
import math

import pytest

from tests.conftest import losses, records
from tests.helpers import copy_run_at, held_out_losses, probe
from tests.helpers import train_layout as train
from tests.shared_dirs import shared_dir

pytestmark = pytest.mark.mpi

STEPS = 6
LLAMA = ["--model.arch=llama", "--model.n_layer=2", "--model.n_kv_head=2", "--model.multiple_of=32",
         "--model.rope_theta=500000", "--model.qkv_bias=true", f"--train.steps={STEPS}",
         "--train.warmup_steps=1", "--train.optimizer=sgd", "--train.lr=0.2", "--train.min_lr=0.05",
         "--train.grad_clip=0", "--checkpoint.interval=100"]
ONE_REPLICA_H1 = ["--sync.inner_steps=1", "--sync.outer_lr=1", "--sync.outer_momentum=0"]
DP2 = ["--train.grad_accum=1"]  # 2 ranks x 4: the reference's 8 sequences per step


def llama_params(run) -> int:
    """Parameters of the run's model (tied weights once), from its checkpoint's [model]."""
    from hpctrain.export import find_checkpoint, load_model_state
    from hpctrain.model import build_model_from_section

    _, section = load_model_state(find_checkpoint(run))
    assert section["arch"] == "llama"
    return sum(p.numel() for p in build_model_from_section(section).parameters())


def assert_close(ref, got, tol, steps=range(1, STEPS + 1)):
    assert sorted(got) == list(steps), sorted(got)
    gaps = {s: abs(got[s] - ref[s]) for s in steps}
    assert max(gaps.values()) <= tol, (gaps, ref, got)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):  # noqa: F811
    """The fp32 eager curve on 1 rank, meta init on (the default); {step: loss}. Trained once per
    session (tests/shared_dirs.py)."""
    def build(out):
        r, _ = train(1, out, dataset, "ref", *LLAMA)
        assert "training:" in r.stderr
    ref = losses(shared_dir(tmp_path_factory, "llama_modes_ref", build) / "ref")
    assert ref[STEPS] < ref[1] - 0.3, ref  # it learns
    return ref


def test_diloco_h1_is_synchronous_sgd_and_sends_4_bytes_per_parameter(tmp_path, dataset, reference):  # noqa: F811
    """2 replicas, H = 1, outer lr 1, no momentum: DiLoCo is synchronous SGD, the reference's curve
    within 1e-5; each round all-reduces the fp32 model: 2 (p-1)/p x 4 bytes = 4 bytes per parameter."""
    _, run = train(2, tmp_path, dataset, "diloco", *LLAMA, *DP2, "--sync.mode=diloco", *ONE_REPLICA_H1)
    assert_close(reference, losses(run), 1e-5)
    n = llama_params(run)
    assert losses(run, "comm_bytes") == {s: 4 * n * s for s in range(1, STEPS + 1)}


def test_diloco_int8_resume_mid_round_is_bit_exact(tmp_path, dataset, reference):  # noqa: F811
    """int8 pseudo-gradients, H = 2, overlapped: stop at step 3 (mid-round), resume: the straight
    run's losses bit for bit; int8 moves (chunk + a 4-byte scale per 256) x 2 bytes a round."""
    common = [*LLAMA, *DP2, "--sync.mode=diloco", "--sync.inner_steps=2", "--sync.overlap=true",
              "--sync.compression=int8", "--checkpoint.interval=3"]
    _, straight = train(2, tmp_path, dataset, "straight", *common)
    copy_run_at(straight, tmp_path / "parts", 3)  # the straight run at its step-3 checkpoint
    r, parts = train(2, tmp_path, dataset, "parts", *common)
    assert "resumed from" in r.stderr and "step_00000003" in r.stderr
    assert losses(parts) == losses(straight) and sorted(losses(parts)) == list(range(1, STEPS + 1))
    assert losses(parts, "comm_bytes") == losses(straight, "comm_bytes")
    assert losses(straight)[STEPS] < reference[1] - 0.3  # it learns
    chunk = math.ceil(math.ceil(llama_params(straight) / 2) / 256) * 256
    assert losses(straight, "comm_bytes")[STEPS] == STEPS // 2 * 2 * (chunk + chunk // 256 * 4)


def test_async_diloco_one_replica_is_plain_sgd_across_a_resume(tmp_path, dataset, reference):  # noqa: F811
    """1 replica + 1 server, H = 1, outer SGD lr 1: the global model is the replica's after every
    step, so the run is the reference's (within 1e-5), also after a stop at step 3 and a resume;
    each arrival moves 24 bytes per parameter; the checkpoint's global model loads into a Llama
    and gives the run's last validation loss."""
    common = [*LLAMA, "--sync.mode=async_diloco", "--sync.ps_servers=1", "--sync.outer_optimizer=sgd",
              *ONE_REPLICA_H1]
    train(2, tmp_path, dataset, "async", *common, "--train.stop_at_step=3", "--checkpoint.interval=3")
    r, run = train(2, tmp_path, dataset, "async", *common)
    assert "resumed from" in r.stderr and "at step 3" in r.stderr
    assert_close(reference, losses(run), 1e-5)
    n = llama_params(run)
    assert [rec["arrival_bytes"] for rec in records(run) if "arrival" in rec] == [24 * n] * STEPS
    held_out = held_out_losses(run, dataset)  # the global model, built as a Llama, strict load
    assert sorted(held_out) == [3, STEPS] and held_out[STEPS] < reference[1] - 0.3, held_out


@pytest.mark.compiles
def test_compile_matches_eager(tmp_path, dataset, reference):  # noqa: F811
    """train.compile = true over the whole model (train.compile_scope = model; per block is the
    CPU's auto, covered by the dp2/fsdp2/tp2 compile parity cases and the compiled exact resume):
    fused kernels round differently, the curve stays within 1e-5."""
    r, run = train(1, tmp_path, dataset, "compiled", *LLAMA, "--train.compile=true",
                   "--train.compile_scope=model")
    assert "torch.compile (model), steps 0 -> 6" in r.stderr  # the start-up line says so
    assert_close(reference, losses(run), 1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_follows_fp32(tmp_path, dataset, reference, precision):  # noqa: F811
    """bf16 / fp16 autocast (fp16 with dynamic loss scaling, no overflow at 2^16): finite, within
    0.005 of the fp32 curve at every step (measured 2.6e-4 bf16, 4.9e-5 fp16), and learning."""
    _, run = train(1, tmp_path, dataset, precision, *LLAMA, f"--train.precision={precision}")
    got = losses(run)
    print(precision, "max gap to fp32:", max(abs(got[s] - reference[s]) for s in reference))
    assert all(math.isfinite(v) for v in got.values()) and got[STEPS] < got[1] - 0.3, got
    assert_close(reference, got, 0.005)
    if precision == "fp16":
        recs = [rec for rec in records(run) if "loss" in rec]
        assert {rec["loss_scale"] for rec in recs} == {65536.0} and recs[-1]["overflow_steps"] == 0


def test_fp16_overflow_steps_are_skipped(tmp_path, dataset):  # noqa: F811
    """A 2^20 loss scale overflows the Llama's fp16 gradients at step 1: an overflow step is
    skipped on both ranks (the weights stay: the loss stays ~ln(257) until a step goes through) and
    halves the scale, a clean step keeps it, every one is counted, and the run learns."""
    _, run = train(2, tmp_path, dataset, "overflow", *LLAMA, *DP2, "--train.precision=fp16",
                   f"--train.loss_scale_init={2.0 ** 20}", "--train.steps=10")
    recs = [rec for rec in records(run) if "loss" in rec]
    over = [rec["step"] for rec in recs if rec["overflow"]]
    assert 1 <= len(over) <= 6 and over[0] == 1, over
    scale = 2.0 ** 20
    for rec in recs:  # each record: the scale after that step's update
        scale /= 2 if rec["overflow"] else 1
        assert rec["loss_scale"] == scale, (rec, recs)
    first_update = next(i for i, rec in enumerate(recs) if not rec["overflow"])
    assert all(abs(rec["loss"] - math.log(257)) < 0.3 for rec in recs[:first_update + 1]), recs
    assert recs[-1]["overflow_steps"] == len(over) and not any(rec.get("skipped") for rec in recs)
    assert recs[-1]["loss"] < recs[first_update]["loss"] - 0.3, recs


def test_meta_init_gives_the_plain_build_bit_for_bit():
    """The meta-init probe of test_meta_init.py on the tiny Llama (GQA, untied, q/k/v bias): each
    rank's parameters in dp2, tp2, pp2 and fsdp2 equal the whole-model build and a plain Llama."""
    llama = "model.arch=llama,model.n_kv_head=2,model.multiple_of=32,model.qkv_bias=true"
    probe(2, {name: f"{llama},{layout}" if layout else llama for name, layout in {
        "llama_dp2": "", "llama_tp2": "parallel.tp=2", "llama_pp2": "parallel.pp=2",
        "llama_fsdp2": "parallel.data_parallel=fsdp"}.items()})
