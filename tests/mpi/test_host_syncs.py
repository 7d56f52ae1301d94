"""Host syncs per optimizer step on every layout, counted in the real trainer loop under a real
mpiexec (HPCTRAIN_COUNT_HOST_SYNCS=1: hpctrain/metrics/host_syncs.py, per rank and step in
<run.dir>/host_syncs.rank<r>.json). On a GPU each of them stalls the host until the stream drains.

Target: no sync between log intervals; at a log step one batched read of the interval's values
(loss, grad norm, ...). K below is the most allowed per step on any rank, with its reason."""
import json

import pytest

from tests.conftest import losses
from tests.helpers import PARITY_GPT, train, write_config

pytestmark = pytest.mark.mpi

STEPS, LOG_EVERY = 8, 4
STEADY = range(3, STEPS + 1)  # steps 1-2: lazy set-up (pipeline shapes, optimizer state)
LLAMA = ["--model.arch=llama", "--model.n_kv_head=2", "--model.multiple_of=32"]
MOE = LLAMA + ["--model.moe_experts=4", "--model.moe_top_k=2"]
PP = ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=4"]
TP = ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1"]

# The one read at a log step: train/step_log.py stacks every pending record's device numbers
# (loss, grad norm; fp16: loss scale, overflow flag and count; the bad-step flag) into one tolist().
LOG_READ = 1
# torch's vocabulary-parallel embedding (RowwiseParallel on tok_emb: DTensor's _MaskPartial) zeroes
# the ids and rows outside this rank's slice with two boolean-mask assignments per forward (index_put_
# with a bool index: a nonzero each). TODO(#49): an own vocab-parallel embedding (where / masked_fill).
TP_EMBEDDING = 2

# MoE: 4 layers here (4 blocks). The MoE monitor keeps its numbers on the device and reads every
# layer's at a log step in one .cpu() (+1 at a log step). Expert parallelism's all-to-all needs its
# split sizes on the host: one counts.tolist() per MoE layer and forward (inherent; 4 here). One
# rank's grouped-matmul host copy runs on CUDA only (moe.py), so it is not counted on this CPU.
MOE_MONITOR_READ = 1
EP_SPLIT_SIZES = 4

# parallel.offload (hpctrain/parallel/offload.py) adds no counted op: "optimizer" copies into
# pinned buffers without blocking and waits once per step with a stream synchronize (on CUDA: 1
# sync per step, not a dispatched op); "all" moves the bad-step flag to the host for the CPU AdamW
# (on CUDA: 1 counted Tensor.to per step; on this CPU run the flag is already there: 0).
OFFLOAD = ["--parallel.data_parallel=fsdp", "--train.grad_accum=1"]

# name: (ranks, overrides, K between log steps, K at a log step)
LAYOUTS = {
    "one": (1, [], 0, LOG_READ),
    "ddp": (2, ["--train.grad_accum=1"], 0, LOG_READ),
    "fsdp2": (2, ["--parallel.data_parallel=fsdp", "--train.grad_accum=1"], 0, LOG_READ),
    "tp2": (2, TP, TP_EMBEDDING, TP_EMBEDDING + LOG_READ),
    "pp2": (2, PP + ["--parallel.pp_schedule=1f1b"], 0, LOG_READ),
    # + DiLoCo's round line (rank 0 reads its pseudo-gradient norm when the line prints: a log step)
    "diloco": (2, ["--train.grad_accum=1", "--sync.mode=diloco", "--sync.inner_steps=2"], 0, LOG_READ + 1),
    "chunked_loss": (1, ["--train.loss_chunk=16"], 0, LOG_READ),
    "chunked_loss_tp2": (2, TP + ["--train.loss_chunk=16"], TP_EMBEDDING, TP_EMBEDDING + LOG_READ),
    "fp16": (2, ["--train.grad_accum=1", "--train.precision=fp16"], 0, LOG_READ),
    "fsdp2_offload_all": (2, OFFLOAD + ["--parallel.offload=all"], 0, LOG_READ),
    "fsdp2_offload_optimizer": (2, OFFLOAD + ["--parallel.offload=optimizer"], 0, LOG_READ),
    "moe_one": (1, MOE, 0, LOG_READ + MOE_MONITOR_READ),
    "moe_ep2": (2, MOE + ["--parallel.ep=2", "--train.grad_accum=1"], EP_SPLIT_SIZES,
                EP_SPLIT_SIZES + LOG_READ + MOE_MONITOR_READ),
}


def sync_counts(run, ranks: int) -> dict[int, dict[str, int]]:
    """{step: {"op @ file:line": most on any rank}} of the steady steps."""
    out = {}
    for r in range(ranks):
        steps = json.loads((run / f"host_syncs.rank{r}.json").read_text())["steps"]
        for step in STEADY:
            for key, n in steps[str(step)].items():
                out.setdefault(step, {})[key] = max(n, out.get(step, {}).get(key, 0))
    return {step: out.get(step, {}) for step in STEADY}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_host_syncs_per_step(tmp_path, dataset, name):
    ranks, overrides, between, at_log = LAYOUTS[name]
    cfg, run = write_config(tmp_path, dataset, template=PARITY_GPT)
    train(ranks, cfg, f"--train.steps={STEPS}", f"--train.log_interval={LOG_EVERY}",
          "--train.eval_interval=0", "--checkpoint.interval=100", *overrides,
          env={"HPCTRAIN_COUNT_HOST_SYNCS": "1", "HPCTRAIN_METRICS_FLUSH_S": "3600"})  # log steps only
    counts = sync_counts(run, ranks)
    for step, ops in counts.items():
        limit = at_log if step % LOG_EVERY == 0 else between
        assert sum(ops.values()) <= limit, (name, step, limit, ops)
    # the counter ran inside the loop (it sees the log step's batched read) and the deferred
    # records all reached metrics.jsonl, every step with its loss
    read = [n for key, n in counts[2 * LOG_EVERY].items()
            if key.startswith("Tensor.tolist @ hpctrain/train/step_log.py:")]
    assert read == [LOG_READ], counts
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
