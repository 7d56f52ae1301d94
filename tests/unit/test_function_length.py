"""No function over 60 lines (def line to last line, docstring and comments included) in the
shipped code (hpctrain/, data_tools/), the benchmarks (bench/) and scripts/; tests/ are not held
to it. A long function is split into named steps, each with one job."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

MAX_LINES = 60
CHECKED = ("hpctrain", "data_tools", "bench", "scripts")


def long_functions(path: Path, limit: int = MAX_LINES) -> list[str]:
    """'file:line name N lines' for every function or method in ``path`` longer than ``limit``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{name}:{node.lineno} {node.name} {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_over_60_lines():
    files = sorted(p for d in CHECKED for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 100  # the packages were found
    too_long = [entry for path in files for entry in long_functions(path)]
    assert too_long == []


def test_a_61_line_function_is_found(tmp_path):
    """60 lines pass, 61 (a method, nested in a class) are reported with file, line and name."""
    body = "".join(f"x{i} = {i}\n" for i in range(59))
    indent = lambda text, n: "".join(" " * n + line for line in text.splitlines(True))  # noqa: E731
    probe = tmp_path / "probe.py"
    probe.write_text(f"def ok():\n{indent(body, 4)}\n\nclass C:\n    def long(self):\n"
                     f"{indent(body, 8)}        return 1\n")
    assert long_functions(probe) == ["probe.py:64 long 61 lines"]
    assert long_functions(probe, limit=61) == []
