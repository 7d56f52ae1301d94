"""parallel.activation_checkpoint = selective_op under a real mpiexec: the Llama run of
test_llama_parallel.py (grouped-query attention, a qkv bias) on dp 2 (DDP) and tp 2 (+ sequence
parallelism: DTensor matmuls, all-gathers recomputed) gives the losses of the same layout without
checkpointing bit for bit (the kept outputs are the forward's own tensors, the recomputed ops run
in the same order), and a resume from its step-2 checkpoint continues it bit for bit. Slow: the
same under FSDP2, a 1F1B pipeline, a mixture of experts over ep 2 (the grouped expert matmul
kept) and context parallelism's ring (recomputed inside backward)."""
import pytest

from tests.conftest import losses
from tests.helpers import copy_run_at
from tests.helpers import train_layout as train
from tests.mpi.test_llama_parallel import LLAMA, STEPS

pytestmark = pytest.mark.mpi

MOE = ["--model.moe_experts=4", "--model.moe_top_k=2"]
LAYOUTS = {  # every layout: 8 sequences per step
    "dp2": (2, ["--train.grad_accum=1"]),
    "tp2": (2, ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1"]),
    "fsdp2": (2, ["--parallel.data_parallel=fsdp", "--train.grad_accum=1"]),
    "pp2_1f1b": (2, ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=4"]),
    "moe_ep2": (2, MOE + ["--parallel.ep=2", "--train.grad_accum=1"]),
    "moe_cp2": (2, MOE + ["--parallel.cp=2"]),
}
SLOW = {"fsdp2", "pp2_1f1b", "moe_ep2", "moe_cp2"}
SELECTIVE_OP = "--parallel.activation_checkpoint=selective_op"


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k
                                    for k in LAYOUTS])
def test_selective_op_losses_equal_no_checkpointing(tmp_path, dataset, layout):  # noqa: F811
    n, overrides = LAYOUTS[layout]
    _, plain = train(n, tmp_path, dataset, "none", *LLAMA, *overrides)
    r, op = train(n, tmp_path, dataset, "op", *LLAMA, *overrides, SELECTIVE_OP)
    want, got = losses(plain), losses(op)
    assert sorted(got) == list(STEPS)
    assert [got[s] for s in STEPS] == [want[s] for s in STEPS], (want, got)
    if layout == "dp2":  # the resume: the step-2 checkpoint of the selective_op run, to step 4
        copy_run_at(op, tmp_path / "resumed", 2)
        r, resumed = train(n, tmp_path, dataset, "resumed", *LLAMA, *overrides, SELECTIVE_OP)
        assert "step_00000002" in r.stderr
        again = losses(resumed)
        assert [again[s] for s in STEPS] == [got[s] for s in STEPS]
