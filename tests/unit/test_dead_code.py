"""No dead code in the shipped packages (hpctrain/, data_tools/): every function, method and class
defined there is used somewhere (hpctrain/, data_tools/, tests/, bench/, scripts/), and every
attribute a method sets on `self` is read somewhere. A name counts as used when it is read as a
name or an attribute, imported, or written as a whole string (getattr's name, __all__); the code
strings of tests/ (scripts run in a subprocess) count word by word. Methods that a library calls by
name are in CALLED_BY_NAME, each with its caller."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import ROOT

SHIPPED = ("hpctrain", "data_tools")
READERS = (*SHIPPED, "tests", "bench", "scripts")
# (file, name): called by a library through its protocol, never by our code
CALLED_BY_NAME = {
    ("hpctrain/train/fake_device.py", "get_amp_supported_dtype"): "torch's autocast, of a device module",
    ("hpctrain/train/fake_device.py", "_is_in_bad_fork"): "torch's lazy init, of a device module",
    ("hpctrain/train/fake_device.py", "manual_seed_all"): "torch.manual_seed, of every device module",
    ("hpctrain/train/fake_device.py", "record_event"): "FSDP2's HSDP all-reduce, of a device stream",
    ("hpctrain/checkpoint/safe_load.py", "persistent_load"): "pickle.Unpickler",
    ("hpctrain/checkpoint/metadata_scan.py", "persistent_load"): "pickle.Unpickler",
    ("hpctrain/checkpoint/safe_load.py", "load_bytes"): "torch.distributed.checkpoint's LoadPlanner",
    ("hpctrain/tune/journal.py", "append_logs"): "optuna's JournalStorage, of its backend",
    ("hpctrain/lm_eval_model.py", "HpctrainLM"): "lm_eval's model registry (--model hpctrain)",
    ("hpctrain/lm_eval_model.py", "loglikelihood_rolling"): "lm_eval's evaluator, of an LM",
    ("hpctrain/lm_eval_model.py", "generate_until"): "lm_eval's evaluator, of an LM",
}
WORD = re.compile(r"[A-Za-z_]\w*")


def names_read(tree: ast.AST, every_word_of_strings: bool) -> set[str]:
    """Names and attributes `tree` reads or imports, and the names its strings spell."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            found.add(node.attr)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.alias):
            found.add(node.name.rsplit(".", 1)[-1])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if every_word_of_strings:
                found.update(WORD.findall(node.value))
            elif re.fullmatch(r"[\w.]+", node.value):
                found.add(node.value.rsplit(".", 1)[-1])
    return found


def definitions(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every function, method and class, and every `self.X = ...` attribute."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not (node.name.startswith("__") and node.name.endswith("__")):
                found.append((node.lineno, node.name))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append((node.lineno, node.attr))
    return found


def unused(root: Path, shipped=SHIPPED, readers=READERS) -> list[str]:
    """'file:line name' of every definition under `shipped` that nothing under `readers` reads."""
    trees = {p: ast.parse(p.read_text(encoding="utf-8"), filename=str(p))
             for d in readers for p in sorted((root / d).rglob("*.py"))}
    read = set()
    for path, tree in trees.items():
        read |= names_read(tree, every_word_of_strings=path.relative_to(root).parts[0] == "tests")
    return [f"{rel}:{line} {name}" for path, tree in trees.items()
            if (rel := path.relative_to(root).as_posix()).split("/")[0] in shipped
            for line, name in sorted(definitions(tree))
            if name not in read and (rel, name) not in CALLED_BY_NAME]


def test_every_definition_in_the_packages_is_used():
    assert unused(ROOT) == []
    defined = {(rel, name) for rel, _ in CALLED_BY_NAME
               for _, name in definitions(ast.parse((ROOT / rel).read_text(encoding="utf-8")))}
    assert set(CALLED_BY_NAME) - defined == set()  # an entry whose method is gone goes with it


def test_an_unused_function_method_and_attribute_are_found(tmp_path):
    """A function nobody calls, a method only a docstring names, an attribute only ever set: found;
    their uses (a call, getattr's string, a read in a test's script string) clear them."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        '"""dead_method is named here only."""\n'
        "def dead_function():\n    pass\n\n"
        "class Used:\n    def __init__(self):\n        self.dead_attr = 1\n        self.live_attr = 2\n"
        "    def dead_method(self):\n        return self.live_attr\n")
    (tmp_path / "tests" / "t.py").write_text("from pkg.m import Used\n")
    found = unused(tmp_path, shipped=("pkg",), readers=("pkg", "tests"))
    assert found == ["pkg/m.py:2 dead_function", "pkg/m.py:7 dead_attr", "pkg/m.py:9 dead_method"]
    (tmp_path / "tests" / "t.py").write_text(
        "from pkg.m import Used, dead_function\nx = getattr(Used(), 'dead_method')\n"
        "SCRIPT = 'print(Used().dead_attr)'\n")
    assert unused(tmp_path, shipped=("pkg",), readers=("pkg", "tests")) == []
