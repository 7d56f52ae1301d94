"""A module-scoped fixture that launches processes into a fresh temp dir is built once per session
(tests/shared_dirs.py), or says here why not.

`make test` runs two pytest-xdist workers, and xdist splits a module's tests between them, so such
a fixture ran once on each worker: training runs, HF folders and probes built twice (in one CI run
test_deepseek_v3_parallel.py's six launches took 48 s on each worker, test_qwen3.py's 30 s). The
check reads the test modules' source: a `@pytest.fixture(scope="module")` function that calls
`tmp_path_factory.mktemp` and one of LAUNCHERS without `shared_dir` is reported, unless PER_WORKER
names it with its reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

# what starts a process (a training, a probe, a shard or a folder written in a subprocess)
LAUNCHERS = {"mpirun", "run_cmd", "train", "_train", "Popen", "train_layout", "one_node"}

PER_WORKER = {  # "path::fixture": why it stays per worker
    "tests/mpi/test_checkpoint_mpi.py::saved_by_2":
        "its load tests write their reports (.report-*) into the checkpoint root",
    "tests/mpi/test_checkpoint_node_layout.py::saved_by_2_nodes":
        "its load tests write their reports (.report-*) into the checkpoint root",
    "tests/mpi/test_peer_snapshot.py::killed":
        "its tests copy the run and the nodes' snapshot folders beside it, into its dir",
    "tests/slurm/test_multinode.py::one_rank_curve":
        "trains lazily, only the grad_accum curves the worker's tests ask for",
    "tests/slurm/test_slurm_jobs.py::reference":
        "trained on the dataset this worker's own Slurm cluster made (its `dataset`)",
    "tests/slurm/test_first_week.py::data": "a few seconds of sharding two plays",
    "tests/unit/test_data_cache_faults.py::dataset": "a few seconds of sharding one play",
    "tests/unit/test_dataset_once.py::blend": "a few seconds of blending two shared datasets",
    "tests/unit/test_document_mask.py::packed": "a few seconds of sharding ten short documents",
}


def _is_module_fixture(node: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Call) and any(k.arg == "scope" and getattr(k.value, "value", None) == "module"
                                               for k in d.keywords)
               for d in node.decorator_list)


def _called(node: ast.AST) -> set[str]:
    """The names of every function called inside `node` (x(...) and obj.x(...) both give x)."""
    return {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
            for c in ast.walk(node) if isinstance(c, ast.Call)}


def unshared_fixtures(path: Path, root: Path = ROOT) -> list[str]:
    """'path::name' of each module fixture in `path` that launches into a mktemp dir unshared."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and _is_module_fixture(node):
            called = _called(node)
            if "mktemp" in called and called & LAUNCHERS and "shared_dir" not in called:
                out.append(f"{path.relative_to(root).as_posix()}::{node.name}")
    return out


def test_module_fixtures_that_launch_are_built_once_per_session():
    modules = sorted((ROOT / "tests").rglob("test_*.py"))
    assert len(modules) > 100  # the test modules were found
    found = [name for path in modules for name in unshared_fixtures(path)]
    assert sorted(set(found) - set(PER_WORKER)) == []
    assert sorted(set(PER_WORKER) - set(found)) == []  # a stale entry (now shared, or gone) goes


def test_an_unshared_launching_fixture_is_found(tmp_path):
    """A module fixture running mpirun in a mktemp dir is reported; the same through shared_dir,
    a session-scoped one and one that launches nothing are not."""
    probe = tmp_path / "test_probe.py"
    probe.write_text('''import pytest

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("x")
    mpirun(2, ["-m", "hpctrain", "train", "--config", tmp / "c.toml"])
    return tmp

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return shared_dir(tmp_path_factory, "x", lambda out: mpirun(2, [out]))

@pytest.fixture(scope="session")
def session_wide(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("x")
    run_cmd(["true"])
    return tmp

@pytest.fixture(scope="module")
def no_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("x")
    (tmp / "a").write_text("a")
    return tmp
''')
    assert unshared_fixtures(probe, tmp_path) == ["test_probe.py::runs"]
