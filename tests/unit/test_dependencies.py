"""Layering: data_tools (shard format, preprocessing) is the lower layer; hpctrain uses it, never the
reverse, so the preprocessing side installs and runs without the training stack."""
import subprocess
import sys

from tests.conftest import ROOT

PROBE = """
import importlib, pkgutil, sys
import data_tools
names = sorted(m.name for m in pkgutil.walk_packages(data_tools.__path__, "data_tools."))
for name in names:
    importlib.import_module(name)
print(len(names), sorted(m for m in sys.modules if m == "hpctrain" or m.startswith("hpctrain.")))
"""


def test_no_data_tools_module_imports_hpctrain():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    count, loaded = r.stdout.strip().split(" ", 1)
    assert int(count) >= 10 and loaded == "[]", r.stdout


def test_the_error_base_is_shared():
    from data_tools.errors import UserError
    from data_tools.format import DataError
    from hpctrain import errors

    assert errors.UserError is UserError and issubclass(DataError, UserError)
    assert issubclass(errors.UnsafeCheckpointError, errors.CheckpointError)
