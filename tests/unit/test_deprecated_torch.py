"""No code of ours calls a torch.distributed function that this torch deprecates: each such call
prints a FutureWarning on every rank (#47: `all_gather_into_tensor` at parallel.ep = 2, once per
rank per run). The deprecated names are read from torch itself (its `@deprecated` functions), so a
name torch deprecates later is caught by the same test."""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
# the one place allowed to name one: the fallback for a torch without the new name (2.11)
ALLOWED = {("hpctrain/distributed/collectives.py", "all_gather_into_tensor")}


def deprecated_names() -> set[str]:
    with warnings.catch_warnings():  # looking at `dist.reduce_op` warns too
        warnings.simplefilter("ignore")
        return {name for name in dir(dist) if not name.startswith("__")
                and getattr(getattr(dist, name, None), "__deprecated__", None)}


def uses(path: Path, names: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found += [(node.lineno, a.name) for a in node.names if a.name in names]
    return found


def test_no_deprecated_torch_distributed_call():
    names = deprecated_names()
    if hasattr(dist, "all_gather_single"):  # torch >= 2.12: the old name is deprecated
        assert "all_gather_into_tensor" in names, names
    bad = []
    for package in ("hpctrain", "data_tools", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            bad += [f"{rel}:{line}: dist.{name}" for line, name in uses(path, names)
                    if (rel, name) not in ALLOWED]
    assert not bad, "deprecated torch.distributed calls (each warns on every rank):\n" + "\n".join(bad)
