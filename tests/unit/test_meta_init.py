"""Meta-device initialization on one process (hpctrain/parallel/meta_init.py): the replayed init
is `torch.manual_seed(seed); factory()` bit for bit, one tensor at a time; what it cannot replay
is refused. Layouts (TP, FSDP2, pipeline) under mpiexec: tests/mpi/test_meta_init.py."""
import pytest
import torch
import torch.nn as nn

from hpctrain.model import GPT, GPTConfig
from hpctrain.parallel.meta_init import build_on_meta, materialize, on_meta

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=97)
CPU = torch.device("cpu")


def reference(seed, factory=lambda: GPT(CFG)):
    torch.manual_seed(seed)
    model = factory()
    return model, torch.get_rng_state()


def test_gpt_bit_identical_tied_and_rng_in_step():
    ref, ref_rng = reference(5)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    recipe, model = build_on_meta(lambda: GPT(CFG))
    assert on_meta(model) and torch.equal(before, torch.get_rng_state())  # no RNG drawn on meta
    materialize(model, recipe, 5, CPU)
    assert not on_meta(model) and model.lm_head.weight is model.tok_emb.weight
    got = dict(model.named_parameters())
    assert got.keys() == dict(ref.named_parameters()).keys()
    for k, v in ref.named_parameters():
        assert torch.equal(got[k], v), k
    assert torch.equal(torch.get_rng_state(), ref_rng)  # the stream goes on where it would have
    # and the replay has to follow the whole stream: construction-time inits included
    assert [op.func.__name__ for op in recipe.ops[:3]] == ["normal_", "normal_", "ones_"]
    materialize(model, recipe, 6, CPU)
    assert not torch.equal(model.tok_emb.weight, ref.tok_emb.weight)


def test_a_dropped_parameter_is_still_drawn():
    """A pipeline stage without block 0: block 1 gets the values it has in the whole model."""
    ref, _ = reference(3)
    recipe, model = build_on_meta(lambda: GPT(CFG))
    del model.blocks["0"]
    materialize(model, recipe, 3, CPU)
    assert torch.equal(model.blocks["1"].attn.wq.weight, ref.blocks["1"].attn.wq.weight)


class TruncNet(nn.Module):
    """Update ops (trunc_normal_ then mul_) interleaved across tensors: values must be kept."""
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.empty(40, 3))
        self.b = nn.Parameter(torch.empty(17))
        nn.init.trunc_normal_(self.a, std=0.5)
        nn.init.uniform_(self.b)
        with torch.no_grad():
            self.a.mul_(3.0)
            self.b.add_(1.0)
            self.b.uniform_()  # overwrites: the add_ above is dead, the draw is not


def test_update_ops_replayed_in_order():
    ref, ref_rng = reference(11, TruncNet)
    recipe, model = build_on_meta(TruncNet)
    materialize(model, recipe, 11, CPU)
    assert torch.equal(model.a, ref.a) and torch.equal(model.b, ref.b)
    assert torch.equal(torch.get_rng_state(), ref_rng)


class RandnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))


class BufferNet(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
        self.register_buffer("scale", torch.ones(4))


class UnrecordedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4))
        with torch.no_grad():
            self.w.add_(1.0)  # an update of a value no recorded op wrote


@pytest.mark.parametrize("factory, what", [(RandnNet, "torch.randn"), (BufferNet, "buffers"),
                                           (UnrecordedNet, "no recorded write")])
def test_what_cannot_be_replayed_is_refused(factory, what):
    with pytest.raises(NotImplementedError, match=what):
        build_on_meta(factory)
