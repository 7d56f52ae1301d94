"""GPT architecture: causality, tied embeddings, parameter names, FLOP count, generation; no
module under hpctrain/model/ (family folders included) imports distributed code."""
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


MODEL_DIR = Path(__file__).resolve().parents[2] / "hpctrain" / "model"
# Code a model module must never import: the model knows nothing of ranks, layouts or checkpoints.
FORBIDDEN = ("torch.distributed", "hpctrain.distributed", "hpctrain.parallel", "hpctrain.checkpoint",
             "mpi4py")
# (file under hpctrain/model/, module): imports not yet removed, each with its reason; a new one fails.
KNOWN = {
    # the optimizer is training code kept in model/: it asks whether a parameter is an expert-parallel
    # DTensor (a module that imports nothing distributed); to go, optim.py must move out of model/
    ("optim.py", "hpctrain.distributed.dtensor"),
}


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module `path` imports, anywhere in it, absolute (relative imports resolved against
    `package`, the file's own package) and with `from a import b` also as `a.b`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def distributed_imports(model_dir: Path, package: str = "hpctrain.model") -> set[tuple[str, str]]:
    """(file relative to `model_dir`, module) of every FORBIDDEN import of every module under it,
    family folders included (`from a import b`: a, or a.b when only that is forbidden)."""
    found = set()
    for path in sorted(model_dir.rglob("*.py")):
        rel = path.relative_to(model_dir)
        own = ".".join([package, *rel.parent.parts])
        hits = {m for m in imported_modules(path, own)
                if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)}
        found.update((rel.as_posix(), m) for m in hits if not any(m.startswith(h + ".") for h in hits))
    return found


def test_no_model_module_imports_distributed_code():
    assert len(list(MODEL_DIR.rglob("*.py"))) >= 5  # the folder was found
    found = distributed_imports(MODEL_DIR)
    assert found - KNOWN == set()
    assert KNOWN - found == set()  # a removed import leaves KNOWN with it


def test_a_distributed_import_in_a_family_folder_is_found(tmp_path):
    """Every form of import, at any depth (a family folder added later): found; plain torch is not."""
    family = tmp_path / "fam"
    family.mkdir(parents=True)
    (tmp_path / "gpt.py").write_text("import torch\nimport torch.nn as nn\n")
    (family / "__init__.py").write_text("from torch import distributed as dist\n")
    (family / "blocks.py").write_text("def f():\n    from ...parallel import tensor_parallel\n"
                                      "    import mpi4py.MPI\n")
    (family / "plan.py").write_text("from hpctrain.distributed.mesh import ParallelDims\n")
    assert distributed_imports(tmp_path) == {
        ("fam/__init__.py", "torch.distributed"),
        ("fam/blocks.py", "hpctrain.parallel"), ("fam/blocks.py", "mpi4py.MPI"),
        ("fam/plan.py", "hpctrain.distributed.mesh"),
    }
