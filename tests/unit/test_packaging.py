"""A non-editable install works: the wheel holds every module of the source tree, and a fresh
virtualenv with only that wheel (its dependencies borrowed from the test venv, no network) shards
and trains from a folder outside the checkout. `make install` uses an editable install, which
hides a package that `find:` leaves out of the wheel (hpctrain/train had no __init__.py: #17).
"""
from __future__ import annotations

import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import ROOT, TINY_TRAIN


def _source_modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for pkg in ("hpctrain", "data_tools")
            for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts}


def _run(args, cwd, timeout=300, env=None):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                       env=None if env is None else dict(os.environ, **env))
    assert r.returncode == 0, f"{args}: {r.stderr[-3000:]}"
    return r


def test_wheel_holds_every_module_and_trains_outside_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
          wheels, ROOT], cwd=tmp_path)
    (wheel,) = wheels.glob("hpctrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_modules() - names)
    assert not missing, f"left out of the wheel: {missing}"

    env = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", env], cwd=tmp_path)
    py = env / "bin" / "python"
    env_site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         cwd=tmp_path).stdout.strip())
    # dependencies (torch, h5py, mpi4py, ...) from the test venv; hpctrain itself only from the wheel
    (env_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], cwd=tmp_path)

    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run([py, "-c", "import hpctrain.train.loop as m, data_tools; print(m.__file__)"], cwd=work)
    assert where.stdout.strip().startswith(str(env_site)), where.stdout
    from data_tools.corpora import shakespeare_files

    _run([py, "-m", "data_tools", "shard", "--input", sorted(shakespeare_files())[0], "--output",
          work / "ds", "--tokenizer", "bytes", "--val-fraction", "0.1", "--no-progress"], cwd=work)
    (work / "tiny.toml").write_text(TINY_TRAIN.format(run=work / "run", data=work / "ds", steps=3))
    # the mpich wheel's libmpi lies beside the test venv's prefix, not the new one's: the
    # documented switch names it (a real install has mpich in the same venv)
    libmpi = next(Path(sys.prefix, "lib").glob("libmpi.so.[0-9]*"), None)
    r = _run([py, "-m", "hpctrain", "train", "--config", "tiny.toml"], cwd=work,
             env={"MPI4PY_LIBMPI": str(libmpi)} if libmpi else None)
    assert "step 3/3 loss" in r.stderr, r.stderr[-2000:]
    assert (work / "run" / "checkpoints" / "step_00000003" / "COMMIT.json").is_file()
