"""train.loss_chunk: the chunked linear + cross-entropy gives the plain path's loss and gradients
(fp32, <= 1e-6 relative) without ever holding more than one chunk's logits."""
import pytest
import torch
import torch.nn.functional as F

from hpctrain.model import GPT, GPTConfig
from hpctrain.parallel.loss import ChunkedLossHead, chunked_lm_loss, use_chunked_head


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _plain(h, w, t):
    return F.cross_entropy((h @ w.t()).float().flatten(0, 1), t.flatten())


def _case(seed=0, b=3, t=37, c=16, v=101):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, c, generator=g, dtype=torch.float64).float() * 2
    w = torch.randn(v, c, generator=g).float() * 0.5
    tgt = torch.randint(0, v, (b, t), generator=g)
    return h, w, tgt


def _grads(fn, h, w, t):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h, w, t)
    (loss * 3.0).backward()  # a loss scale / 1/n factor reaches both gradients
    return loss.detach(), h.grad, w.grad


def test_chunked_matches_plain_loss_and_grads_fp32():
    h, w, t = _case()
    t[0, :5] = -100  # ignored positions (F.cross_entropy's default ignore_index)
    ref = _grads(_plain, h, w, t)
    for chunk in (1, 7, 64, 111, 4096):  # chunks that do not divide 111 tokens, and one chunk
        got = _grads(lambda a, b, c: chunked_lm_loss(a, b, c, chunk), h, w, t)
        assert abs(got[0].item() - ref[0].item()) <= 1e-6 * ref[0].item(), chunk
        assert _rel(got[1], ref[1]) <= 1e-6, chunk
        assert _rel(got[2], ref[2]) <= 1e-6, chunk
        assert got[1][0, :5].abs().max().item() == 0.0  # no gradient from ignored positions


def test_chunked_eval_without_grad_and_under_bf16_autocast():
    h, w, t = _case(seed=1)
    with torch.no_grad():
        assert abs(chunked_lm_loss(h, w, t, 10).item() - _plain(h, w, t).item()) <= 1e-6 * 5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(_plain, h, w, t)
        got = _grads(lambda a, b, c: chunked_lm_loss(a, b, c, 16), h, w, t)
    assert abs(got[0].item() - ref[0].item()) <= 2e-2 * ref[0].item()
    assert _rel(got[1], ref[1]) <= 2e-2 and _rel(got[2], ref[2]) <= 2e-2
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32


def test_chunked_head_keeps_names_tie_and_model_gradients():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=24, vocab_size=97)
    plain = GPT(cfg)
    chunked = GPT(cfg)
    chunked.load_state_dict(plain.state_dict())
    use_chunked_head(chunked)
    assert isinstance(chunked.lm_head, ChunkedLossHead)
    assert chunked.lm_head.weight is chunked.tok_emb.weight  # still tied
    assert list(dict(chunked.named_parameters())) == list(dict(plain.named_parameters()))
    tokens = torch.randint(0, 97, (2, 25), generator=torch.Generator().manual_seed(3))
    F.cross_entropy(plain(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    hidden = chunked(tokens[:, :-1])
    assert hidden.shape == (2, 24, 16)  # never [B, T, V]
    chunked_lm_loss(hidden, chunked.lm_head.weight, tokens[:, 1:], 5).backward()
    for (name, a), b in zip(plain.named_parameters(), chunked.parameters()):
        assert (b.grad - a.grad).norm() <= 1e-6 * a.grad.norm() + 1e-10, name


def test_only_one_chunk_of_logits_is_alive():
    """The largest tensor autograd or the loop holds is a chunk's logits, not [tokens x vocab]."""
    n, c, v, chunk = 2048, 32, 4096, 128
    h = torch.randn(n, c, requires_grad=True)
    w = torch.randn(v, c, requires_grad=True)
    t = torch.randint(0, v, (n,))
    biggest = []

    def pack(x):
        biggest.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        chunked_lm_loss(h, w, t, chunk).backward()
    assert max(biggest) <= v * c  # the saved gradients: [n, c] and [v, c]; no [n, v]
    biggest.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        _plain(h.unsqueeze(0), w, t.unsqueeze(0)).backward()
    assert max(biggest) >= n * v  # the plain path keeps the full logits


def test_planner_models_the_chunked_head():
    """plan's head bytes with train.loss_chunk: what autograd keeps (dh, dW) exactly, and at the
    GPT-2 vocabulary >= 8x less than the full logits' (micro-batch 8 x 128, chunks of 128)."""
    from hpctrain.plan import memory
    from hpctrain.plan.shape import ModelShape

    shape = ModelShape(1, 16, 2, 97, 24)  # n_layer, n_embd, n_head, vocab, block_size
    h = torch.randn(3, 24, 16, requires_grad=True)
    w = torch.randn(97, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        chunked_lm_loss(h, w, torch.randint(0, 97, (3, 24)), 10)
    stored, _ = memory.head_bytes(shape, 3, 1, False, chunk=10)
    norm_input = 4 * 3 * 24 * 16
    assert sum(x.numel() * x.element_size() for x in saved) == stored - norm_input
    gpt2 = ModelShape(4, 128, 4, 50304, 128)
    plain = sum(memory.head_bytes(gpt2, 8, 1, False))
    assert sum(memory.head_bytes(gpt2, 8, 1, False, chunk=128)) * 8 <= plain


@pytest.mark.compiles
def test_compiled_chunks_match_the_plain_loss_and_grads():
    """train.compile: each chunk's math through torch.compile (_fused_chunk) gives the plain
    path's loss and gradients (fp32, <= 1e-6 relative; bf16: bench/hf_baseline.py --compile's curve)."""
    h, w, t = _case(seed=2, t=32)  # 96 tokens: 6 chunks of one shape, one compile
    t[1, 3:9] = -100
    ref = _grads(_plain, h, w, t)
    got = _grads(lambda a, b, c: chunked_lm_loss(a, b, c, 16, compiled=True), h, w, t)
    assert abs(got[0].item() - ref[0].item()) <= 1e-6 * ref[0].item()
    assert _rel(got[1], ref[1]) <= 1e-6 and _rel(got[2], ref[2]) <= 1e-6
    assert got[1][1, 3:9].abs().max().item() == 0.0


@pytest.mark.compiles
def test_compiled_dw_upcast_add_keeps_the_bits():
    """train.compile adds each chunk's 16-bit [V, C] dW product into the fp32 dW in one compiled
    pass (_fused_add_upcast): the bits of the eager two-pass upcast-add it replaces."""
    from hpctrain.parallel.loss import _add_upcast, _compiled, _fused_add_upcast

    g = torch.Generator().manual_seed(5)
    acc, part = torch.randn(257, 16, generator=g), torch.randn(257, 16, generator=g).bfloat16()
    eager, fused = acc.clone(), acc.clone()
    _add_upcast(eager, part, torch.empty(8, 16, dtype=torch.bfloat16))
    _compiled(_fused_add_upcast)(fused, part)
    assert torch.equal(fused, eager) and not torch.equal(fused, acc)


@pytest.mark.compiles
def test_compile_regions_compiles_each_block_in_place():
    """Regional compile: parameter names unchanged, every block's forward compiled, the chunked
    head told to compile its chunks, and the model's output that of eager (<= 1e-5)."""
    from hpctrain.parallel.activation import compile_regions

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=24, vocab_size=97)
    eager, compiled = GPT(cfg), GPT(cfg)
    compiled.load_state_dict(eager.state_dict())
    use_chunked_head(eager), use_chunked_head(compiled)
    names = list(dict(compiled.named_parameters()))
    assert compile_regions(compiled) == 2
    assert list(dict(compiled.named_parameters())) == names
    assert all(type(b.forward).__name__ != "method" for b in compiled.blocks.values())
    assert compiled.lm_head.compiled and not eager.lm_head.compiled
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    assert (compiled(tokens) - eager(tokens)).abs().max().item() <= 1e-5


def _casts_each_chunk(h, w, t, chunk):
    """The 16-bit chunked loss written with a fresh tensor per op (its math before the work
    buffers): 16-bit logits upcast, fp32 softmax gradient cast back, each dW product upcast."""
    hc, wc, n = h.detach().bfloat16(), w.detach().bfloat16(), (t != -100).sum().float()
    loss, dh, dw = torch.zeros(()), torch.empty_like(h), torch.zeros(w.shape)
    for s in range(0, len(t), chunk):
        tc, logits = t[s:s + chunk], (hc[s:s + chunk] @ wc.t()).float()
        logits -= logits.amax(dim=1, keepdim=True)
        valid, idx = tc != -100, tc.clamp(min=0).unsqueeze(1)
        target, sum_exp = logits.gather(1, idx).squeeze(1), logits.exp_().sum(dim=1)
        loss += torch.where(valid, sum_exp.log() - target, 0.0).sum()
        probs = logits.mul_((valid.float() / n / sum_exp).unsqueeze(1))
        rows = torch.arange(len(tc))[valid]
        probs[rows, idx.squeeze(1)[valid]] -= (valid.float() / n)[rows]
        g = probs.bfloat16()
        dh[s:s + chunk] = g @ wc
        dw += (g.t() @ hc[s:s + chunk]).float()
    return loss / n, dh, dw


@pytest.mark.parametrize("width", [16, 64])  # 64: the dW product is made in vocabulary blocks
def test_bf16_chunks_reuse_buffers_with_the_same_bits(width):
    """Under bf16 autocast the chunks reuse their [chunk, V] / [V, C] buffers (allocated once per
    call, not per chunk) and give the bits of the per-op casts: runs train bit-identically. Where
    the [V, C] dW product does not fit the chunk's fp32 logits (2 x chunk < width) it is made a
    block of vocabulary rows at a time in their bytes: no [V, C] 16-bit buffer either."""
    from torch.profiler import ProfilerActivity, profile

    h, w, t = _case(seed=4, b=4, t=64, c=width, v=4099)  # 256 tokens: 16 chunks of 16
    t[0, :3] = -100
    h, w, t = h.flatten(0, 1), w, t.flatten()
    ref = _casts_each_chunk(h, w, t, 16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _grads(lambda a, b, c: chunked_lm_loss(a, b, c, 16), h, w, t)
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1], ref[1] * 3.0) and torch.equal(got[2], ref[2] * 3.0)
    from tests.unit.test_plan import _bench_plan_memory

    records, _ = _bench_plan_memory().allocation_records(prof)
    big = [path for _, _, size, path in records  # the loss's, a 16-bit chunk or more, not GEMM's
           if size >= 16 * 4099 * 2 and "_ChunkedLinear" in path and not path.endswith("aten::mm")]
    assert len(big) == 4, big  # fp32 dW, 16-bit W, 2 chunk buffers; was 3 more per chunk (52),
    # and at width 64 one [V, C] 16-bit product buffer more (5)
