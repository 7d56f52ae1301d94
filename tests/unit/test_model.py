"""GPT architecture: causality, tied embeddings, parameter names, FLOP count, generation."""
import ast
from pathlib import Path

import torch
import torch.nn.functional as F

from hpctrain.model import GPT, GPTConfig

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=97)


def make(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG).eval()


def test_causal_future_tokens_do_not_change_past_logits():
    model = make()
    x = torch.randint(0, 97, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 97
    a, b = model(x), model(y)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tied_embeddings_and_layout_free_names():
    model = make()
    assert model.lm_head.weight is model.tok_emb.weight
    names = set(dict(model.named_parameters()))
    assert "blocks.1.attn.wq.weight" in names and "blocks.0.mlp.proj.bias" in names
    assert "lm_head.weight" not in names  # tied: stored once, under tok_emb
    assert model.num_params(non_embedding=False) == sum(p.numel() for p in model.parameters())


def test_attention_matches_explicit_softmax():
    model = make()
    attn = model.blocks["0"].attn
    x = torch.randn(1, 8, 32)
    b, t, c = x.shape
    q, k, v = (w(x).view(b, t, 4, 8).transpose(1, 2) for w in (attn.wq, attn.wk, attn.wv))
    att = (q @ k.transpose(-2, -1)) / 8 ** 0.5
    att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    ref = attn.wo((F.softmax(att, -1) @ v).transpose(1, 2).reshape(b, t, c))
    torch.testing.assert_close(attn(x), ref, rtol=1e-5, atol=1e-6)


def test_initial_loss_near_uniform():
    model = make()
    x, y = torch.randint(0, 97, (4, 16)), torch.randint(0, 97, (4, 16))
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.3


def test_flops_per_token_formula():
    model = make()
    n = model.num_params()
    assert model.flops_per_token() == 6 * n + 12 * 2 * 32 * 16
    assert n == model.num_params(non_embedding=False) - 16 * 32


def test_generate_greedy_is_deterministic_and_respects_block_size():
    model = make()
    prompt = torch.tensor([[1, 2, 3]])
    a = model.generate(prompt, 30, temperature=0)
    b = model.generate(prompt, 30, temperature=0)
    assert a.shape == (1, 33) and torch.equal(a, b) and torch.equal(a[:, :3], prompt)


def test_model_file_imports_nothing_distributed():
    src = Path(__file__).resolve().parents[2] / "hpctrain" / "model" / "gpt.py"
    tree = ast.parse(src.read_text())
    mods = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in mods if "distributed" in m or m.startswith(("hpctrain.distributed", "mpi4py",
                                                                         "hpctrain.checkpoint"))]
