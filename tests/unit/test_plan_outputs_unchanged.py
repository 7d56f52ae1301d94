"""The planner's reports of the shipped Llama-3 configs (8k context) stay byte for byte what they
were before context parallelism entered the planner (#51): short sequences never search, show or
recommend cp. The files under plan_outputs/ were written by main at fd379f4 (`hpctrain plan
--config configs/llama3_*.toml --nodes N`; --json as its sha256); a deliberate change to the
planner's figures rewrites them with the same commands (#52's CPU offload did: offloading layouts
are searched where the same layout without offload does not fit, so the counts of searched and
fitting layouts grew and llama3-70b on 8 nodes now recommends offload = all with ac = none)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from hpctrain.plan import cli

OUTPUTS = Path(__file__).parent / "plan_outputs"
ROOT = Path(__file__).resolve().parents[2]
CASES = [("8b", 1), ("8b", 8), ("8b", 32), ("70b", 1), ("70b", 8)]  # 70b on 1 node: nothing fits


def _plan(capsys, monkeypatch, model: str, nodes: int, *extra: str) -> str:
    """The report of `hpctrain plan --config configs/llama3_MODEL.toml` run in the checkout, as
    the files were written (a relative path: the printed command quotes an absolute one that
    holds a space, as a clone in "/tmp/ci run/hpctrain" does)."""
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    assert cli.main(["--config", f"configs/llama3_{model}.toml", "--nodes", str(nodes), *extra]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("model,nodes", CASES)
def test_report_is_byte_identical(capsys, monkeypatch, model, nodes):
    expected = (OUTPUTS / f"llama3_{model}_nodes{nodes}.md").read_text()
    assert _plan(capsys, monkeypatch, model, nodes).replace(str(ROOT) + "/", "") == expected


@pytest.mark.parametrize("model,nodes", [("8b", 8), ("70b", 8)])
def test_json_is_byte_identical(capsys, monkeypatch, model, nodes):
    expected = (OUTPUTS / f"llama3_{model}_nodes{nodes}.json.sha256").read_text().strip()
    out = _plan(capsys, monkeypatch, model, nodes, "--json").replace(str(ROOT) + "/", "")
    assert hashlib.sha256(out.encode()).hexdigest() == expected
