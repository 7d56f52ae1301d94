"""bench/long_context.py --smoke (#51) under real mpiexec: 4-rank `hpctrain train` runs at cp = 1 and
cp = 4 print per-rank tokens/s, peak RSS, in-use bytes and the planner's peak, all positive; cp = 4
needs less memory per rank than cp = 1 at the same length; and under a per-rank cap midway
between their peaks the guard stops cp = 1 (refused) while cp = 4 trains."""
import re
import sys

import pytest

from tests.conftest import ROOT, run_cmd

pytestmark = pytest.mark.mpi

NUMBER = r"([\d,]+(?:\.\d+)?)"
ROW = re.compile(rf"^seq +(\d+) cp (\d)( capped)?: +(?:{NUMBER} tok/s/rank \(cpu {NUMBER}\)|(refused) "
                 rf"\(over the cap\)) +"
                 rf"peak RSS +{NUMBER} MiB +growth +(-?{NUMBER}) MiB +in use +{NUMBER} MiB +"
                 rf"plan +{NUMBER} MiB +in use/plan {NUMBER}", re.M)


def num(text: str) -> float:
    return float(text.replace(",", ""))


def test_smoke_bench_reports_positive_numbers_and_the_cap(tmp_path):
    r = run_cmd([sys.executable, ROOT / "bench" / "long_context.py", "--smoke"], timeout=300, check=True)
    rows = {}
    for m in ROW.finditer(r.stdout):
        seq, cp, capped, tok, cpu_tok, refused, peak, growth, _, in_use, plan, ratio = m.groups()
        rows[(int(seq), int(cp), bool(capped))] = {
            "tok": None if refused else num(tok), "cpu_tok": None if refused else num(cpu_tok),
            "peak": num(peak), "growth": num(growth),
            "in_use": num(in_use), "plan": num(plan), "ratio": num(ratio)}
    assert sorted(rows) == [(4096, 1, False), (4096, 1, True), (4096, 4, False), (4096, 4, True)], r.stdout
    for key, row in rows.items():
        assert all(row[k] > 0 for k in ("peak", "growth", "in_use", "plan", "ratio")), (key, row)
    for key in [(4096, 1, False), (4096, 4, False), (4096, 4, True)]:
        assert rows[key]["tok"] > 0 and rows[key]["cpu_tok"] > 0, (key, r.stdout)
    assert rows[(4096, 1, True)]["tok"] is None and rows[(4096, 1, True)]["cpu_tok"] is None, r.stdout
    uncapped_1, uncapped_4 = rows[(4096, 1, False)], rows[(4096, 4, False)]
    assert uncapped_4["peak"] < uncapped_1["peak"] and uncapped_4["plan"] < uncapped_1["plan"]
    cap = num(re.search(rf"^cap {NUMBER} MiB per rank", r.stdout, re.M).group(1))
    assert uncapped_4["peak"] < cap < uncapped_1["peak"], (cap, r.stdout)
    assert rows[(4096, 4, True)]["peak"] <= cap < rows[(4096, 1, True)]["peak"], r.stdout
