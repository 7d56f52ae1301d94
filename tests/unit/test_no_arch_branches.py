"""Outside hpctrain/model/ nothing branches on the model family: every family question goes to its
ModelSpec (hpctrain/model/spec.py). AST-based: a comparison of `arch` (a name, an attribute or a
`.get("arch")`) with a string, or a string constant that is a family's name (`== "llama"`, `{"gpt2": ...}`
dispatch tables, `.get("arch", "gpt2")` defaults), anywhere in hpctrain/ outside model/, fails,
except the mentions ALLOWED lists with their reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

from hpctrain.model import spec

ROOT = Path(__file__).resolve().parents[2]
FAMILY_WORDS = set(spec.names()) | {name for s in map(spec.get, spec.names()) if s.hf
                                    for name in s.hf.model_types}

# (file, the constant or "arch ==" found) -> why it is no branch on the family
ALLOWED: dict[tuple[str, str], str] = {
    # the presets of `hpctrain plan --preset` are data: each names the family it is a shape of
    ("hpctrain/plan/shape.py", "'llama'"): "llama3-8b / llama3-70b / mixtral-8x7b presets' arch",
}


def _mentions_arch(node: ast.AST) -> bool:
    """`arch`, `x.arch`, `x.get("arch", ...)` / `x["arch"]`."""
    if isinstance(node, ast.Name):
        return node.id == "arch"
    if isinstance(node, ast.Attribute):
        return node.attr == "arch"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "arch"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "arch"
    return False


def _has_string(node: ast.AST) -> bool:
    """A string constant in it: `"x"`, `("x", "y")` (a check of arch against the registry,
    `arch in spec.names()`, is none)."""
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in ast.walk(node))


def family_branches(path: Path) -> list[tuple[int, str]]:
    """(line, what) of every comparison with arch and every family-name constant in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        sides = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
        if any(map(_mentions_arch, sides)) and any(map(_has_string, sides)):
            found.append((node.lineno, "arch compared"))
        elif isinstance(node, ast.Constant) and node.value in FAMILY_WORDS:
            found.append((node.lineno, repr(node.value)))
    return sorted(found)


def test_no_family_branch_outside_model():
    bad = []
    for path in sorted((ROOT / "hpctrain").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("hpctrain/model/"):
            continue
        bad += [f"{rel}:{line} {what}" for line, what in family_branches(path)
                if (rel, what) not in ALLOWED]
    assert not bad, "family branches outside hpctrain/model/ (ask the ModelSpec):\n" + "\n".join(bad)


def test_the_check_sees_each_kind_of_branch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('if cfg.model.arch == "x":\n    pass\n'
                     'kind = section.get("arch", "gpt2")\n'
                     'TABLE = {"llama": 1}\n'
                     'ok = section["arch"] in ("a", "b")\n'
                     'registered = cfg.arch in spec.names()\n'
                     'fine = "gpt2-style words in a sentence"\n')
    assert family_branches(probe) == [(1, "arch compared"), (3, "'gpt2'"), (4, "'llama'"),
                                      (5, "arch compared")]
