"""parallel.cp's pure parts (#51): the loader's part of a micro-batch (hpctrain/parallel/
apply_context_parallel.py's local_batch: zig-zag chunks of inputs, targets, document ids and the
tokens' global positions), the mesh's rank order with a cp axis, the config's refusals (each names
its key), and the attention kernel swap of every model family. Under mpiexec, against one rank:
tests/mpi/test_context_parallel_training.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hpctrain import config
from hpctrain.data.documents import DocumentBatch
from hpctrain.distributed.mesh import ParallelDims
from hpctrain.errors import ConfigError
from hpctrain.model import spec
from hpctrain.model.attention import causal_attention
from hpctrain.parallel.apply_context_parallel import apply_context_parallel, local_batch
from hpctrain.parallel.zigzag import from_zigzag

BASE = {"run": {"dir": "r"}, "data": {"path": "d"},
        "model": {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 32, "vocab_size": 257},
        "train": {"steps": 10, "micro_batch_size": 2}}


def test_local_batch_keeps_chunks_r_and_2cp_minus_1_minus_r_with_global_positions():
    tokens = torch.arange(100, 109).repeat(2, 1)  # [2, T + 1], T = 8: chunks of 2 at cp = 2
    parts = [local_batch(tokens, 2, rank) for rank in range(2)]
    assert parts[0].positions.tolist() == [[0, 1, 6, 7]] * 2  # chunks 0 and 3
    assert parts[1].positions.tolist() == [[2, 3, 4, 5]] * 2  # chunks 1 and 2
    assert parts[0].tokens.tolist() == [[100, 101, 106, 107]] * 2
    assert parts[0].targets.tolist() == [[101, 102, 107, 108]] * 2  # the next token of each
    assert parts[0].doc_ids is None
    whole = from_zigzag(torch.cat([p.tokens for p in parts], 1), 2)
    assert torch.equal(whole, tokens[:, :-1])


def test_local_batch_of_documents_splits_ids_and_per_document_positions_alike():
    tokens = torch.arange(17)[None]                     # T = 16, cp = 4: chunks of 2
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 5])
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
    part = local_batch(DocumentBatch(tokens, docs, positions), 4, 1)  # chunks 1 and 6
    assert part.tokens.tolist() == [[2, 3, 12, 13]]
    assert part.doc_ids.tolist() == [[0, 0, 2, 2]]
    assert part.positions.tolist() == [[2, 3, 0, 1]]  # in their documents, not 2, 3, 12, 13
    no_positions = local_batch(DocumentBatch(tokens, docs, None), 4, 1)
    assert no_positions.positions.tolist() == [[2, 3, 12, 13]]  # global ones


def test_mesh_rank_order_puts_cp_between_dp_and_tp():
    d = ParallelDims.from_world(8, tp=2, cp=2)  # dp = 2
    assert (d.dp, d.cp, d.tp) == (2, 2, 2) and d.axis_names == ("pp", "dp", "cp", "tp")
    assert [d.coords_of(r)["cp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [d.coords_of(r)["dp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(d.rank_of(**d.coords_of(r)) == r for r in range(8))
    assert ParallelDims.from_world(4, cp=1).axis_names == ("pp", "dp", "tp")  # cp = 1: unchanged
    with pytest.raises(ConfigError, match=r"tp=1 x pp=1 x cp=3 = 3 does not divide the world size 4"):
        ParallelDims.from_world(4, cp=3)


@pytest.mark.parametrize("parallel, model, key", [
    ({"cp": 3}, {}, "model.block_size"),                    # 32 tokens: not 6 equal chunks
    # ep is borrowed from dp x cp (#51): 4 does not divide 1 x 2; a tree of 3 x 2 ranks has no pairs
    ({"cp": 2, "dp": 1, "ep": 4}, {"arch": "llama", "moe_experts": 4}, "parallel.ep"),
    ({"cp": 2, "dp": 3, "deterministic_experts": True}, {"arch": "llama", "moe_experts": 4},
     "parallel.deterministic_experts"),
    ({"cp": 2}, {"dropout": 0.1}, "model.dropout"),
    ({"cp": 4, "tp": 2, "cp_attention": "ulysses"}, {}, "parallel.cp_attention"),  # 2 heads / tp rank
    ({"cp": 2, "cp_attention": "ulysses"}, {"arch": "llama", "n_kv_head": 1}, "parallel.cp_attention"),
    ({"cp": 2}, {"arch": "llama", "moe_experts": 4, "moe_aux_loss_coef": 0.01}, "model.moe_aux_loss_coef"),
    ({"cp": 0}, {}, "parallel.cp"),
])
def test_what_cp_does_not_take_is_refused_naming_the_key(parallel, model, key):
    raw = {**BASE, "model": {**BASE["model"], **model}, "parallel": parallel}
    with pytest.raises(ConfigError, match=rf"^config key '{key}'"):
        config.from_dict(raw)


def test_cp_defaults_and_a_valid_layout():
    assert (config.from_dict(BASE).parallel.cp, config.from_dict(BASE).parallel.cp_attention) == (1, "ring")
    ok = config.from_dict({**BASE, "parallel": {"cp": 4, "cp_attention": "ulysses"}})
    assert (ok.parallel.cp, ok.parallel.cp_attention) == (4, "ulysses")
    for schedule in ("gpipe", "1f1b", "interleaved"):  # cp composes with pipeline parallelism
        piped = config.from_dict({**BASE, "model": {**BASE["model"], "n_layer": 4},
                                  "parallel": {"cp": 2, "pp": 2, "pp_schedule": schedule}})
        assert (piped.parallel.cp, piped.parallel.pp, piped.parallel.pp_schedule) == (2, 2, schedule)
    moe = {**BASE["model"], "arch": "llama", "moe_experts": 4}
    for parallel in ({"cp": 2, "dp": 1, "ep": 2}, {"cp": 2, "dp": 2, "ep": 4, "deterministic_experts": True}):
        cp_ep = config.from_dict({**BASE, "model": moe, "parallel": parallel})  # ep over dp x cp (#51)
        assert (cp_ep.parallel.cp, cp_ep.parallel.ep) == (2, parallel["ep"])


@pytest.mark.parametrize("arch", spec.names())
def test_every_familys_attention_goes_through_the_swapped_kernel(arch):
    section = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "vocab_size": 16, "arch": arch}
    torch.manual_seed(0)
    model = spec.get(arch).model_module().build(section).eval()
    idx = torch.randint(0, 16, (1, 8))
    with torch.no_grad():
        plain = model(idx)
    mesh = SimpleNamespace(group=lambda axis: None, cp_size=2, cp_rank=0)
    cp = apply_context_parallel(model, mesh, "ring")
    calls = []

    def kernel(q, k, v, plan, scale=None):  # stands in for the ring: records, then attends whole
        calls.append(plan)
        return causal_attention(q, k, v, scale=scale)
    cp.kernel = kernel
    with pytest.raises(RuntimeError, match="outside ContextParallel.batch"):
        model(idx)
    cp.plan = "plan"  # what batch() installs
    with torch.no_grad():
        routed = model(idx)
    assert calls == ["plan", "plan"]  # one per layer
    assert torch.allclose(routed, plain, atol=1e-6)
