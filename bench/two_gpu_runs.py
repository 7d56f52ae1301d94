"""The 2-GPU runs of a lent multi-GPU machine (issue 49; bench/gpu_session.sh's part `multi`): one
GPT and one mixture-of-experts Llama trained for 12 steps on 2 ranks over NCCL in each layout the
CPU tests can only check on Gloo, and a resume.

    python bench/two_gpu_runs.py OUTDIR [CASE ...]     (default: every case, in the order below)
    python bench/two_gpu_runs.py --cpu OUTDIR          a rehearsal on Gloo, tiny models (the script)
    python bench/two_gpu_runs.py --collect OUTDIR      OUTDIR/results.json (gpu_session.sh's last step)

Layouts: ddp2 (DDP's own NCCL all-reduce, no comm hook), fsdp2 (its async checkpoints at steps 6
and 12 are the resume's), tp2, pp2 (1F1B over 4 micro-batches), ep2 and ep2_det (MoE experts over
2 GPUs, without and with parallel.deterministic_experts, and moe1, the same MoE on one GPU), then
resume (fsdp2 from its step-6 checkpoint: steps 7-12 must equal fsdp2's bit for bit). Every GPT run
trains the same 16 sequences per step from the same seed, so its step-1 loss is comparable with
ddp2's (`step1_vs_ddp2`, relative); the MoE runs' with moe1's.

Writes OUTDIR/two_gpu_runs.json: {case: {status "pass"/"fail", rc, wall_s, tokens_per_s (median of
steps 4-12), step1_loss, peak_mem_gib (rank 0's max allocated), error (the last line of stderr on
a failure)}, "machine": ...}, and each run's log as OUTDIR/two_gpu_<case>.log. With fewer than 2
CUDA GPUs it prints one line saying so, writes {"skipped": that line} and exits 0.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = Path("/tmp/shakespeare_bytes")
RUNS = Path("/tmp/runs_two_gpu")
STEPS = 12
COMMON = ["--train.precision=bf16", f"--train.steps={STEPS}", "--train.warmup_steps=2",
          "--train.eval_interval=0", "--train.log_interval=4", "--train.global_batch=16",
          "--checkpoint.interval=1000000", f"--data.path={DATA}"]
GPT = ["--model.n_layer=8", "--model.n_head=8", "--model.n_embd=512", "--model.block_size=512"]
MOE = ["--model.arch=llama", "--model.n_layer=4", "--model.n_head=8", "--model.n_kv_head=4",
       "--model.n_embd=512", "--model.block_size=512", "--model.moe_experts=4", "--model.moe_top_k=2",
       "--model.moe_expert_hidden=1024"]
# --cpu: a rehearsal of this script on Gloo with tiny models (its logic, not the GPUs)
CPU = {"--train.precision=bf16": "--train.precision=fp32", "--model.n_layer=8": "--model.n_layer=2",
       "--model.n_layer=4": "--model.n_layer=2", "--model.n_head=8": "--model.n_head=2",
       "--model.n_kv_head=4": "--model.n_kv_head=1", "--model.n_embd=512": "--model.n_embd=64",
       "--model.block_size=512": "--model.block_size=64", "--model.moe_expert_hidden=1024":
       "--model.moe_expert_hidden=128"}
FSDP_CKPT = ["--checkpoint.interval=6", "--checkpoint.keep=2", "--checkpoint.async=true"]
# case: (ranks, overrides, the case its step-1 loss is compared with)
CASES = {
    "ddp2": (2, GPT + ["--train.micro_batch_size=8"], None),
    "fsdp2": (2, GPT + ["--parallel.data_parallel=fsdp", "--train.micro_batch_size=8"] + FSDP_CKPT, "ddp2"),
    "tp2": (2, GPT + ["--parallel.tp=2", "--train.micro_batch_size=16"], "ddp2"),
    "pp2": (2, GPT + ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--train.micro_batch_size=4"],
            "ddp2"),
    "moe1": (1, MOE + ["--train.micro_batch_size=16"], None),
    "ep2": (2, MOE + ["--parallel.ep=2", "--train.micro_batch_size=8"], "moe1"),
    "ep2_det": (2, MOE + ["--parallel.ep=2", "--parallel.deterministic_experts=true",
                          "--train.micro_batch_size=8"], "moe1"),
}


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def shard_data(outdir: Path) -> None:
    if (DATA / "manifest.json").exists():
        return
    from data_tools.corpora import shakespeare_files
    with open(outdir / "shard.log", "a") as log:
        subprocess.run([sys.executable, "-m", "data_tools", "shard", "--input", *sorted(shakespeare_files()),
                        "--output", str(DATA), "--tokenizer", "bytes", "--val-fraction", "0.01",
                        "--no-progress"], stdout=log, stderr=subprocess.STDOUT, timeout=180, check=True)


def train(outdir: Path, name: str, ranks: int, overrides: list[str], fresh: bool = True,
          cpu: bool = False) -> dict:
    """One run of `hpctrain train` on `ranks` GPUs (`cpu`: Gloo ranks); its result entry."""
    run = RUNS / name
    if fresh:
        shutil.rmtree(run, ignore_errors=True)
    flags = [CPU.get(a, a) if cpu else a for a in COMMON + overrides]
    args = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "hpctrain", "train", "--config",
            str(ROOT / "configs" / "demo.toml"), f"--dist.backend={'gloo' if cpu else 'nccl'}",
            *flags, f"--run.dir={run}"]
    t0 = time.monotonic()
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, str(e.stdout or ""), str(e.stderr or "") + "\ntimed out after 300 s"
    (outdir / f"two_gpu_{name}.log").write_text(" ".join(args) + "\n" + out + err)
    result = {"status": "pass" if rc == 0 else "fail", "rc": rc,
              "wall_s": round(time.monotonic() - t0, 1), **metrics(run)}
    if rc != 0:
        result["error"] = next((ln for ln in reversed(err.splitlines()) if ln.strip()), "")
    return result


def metrics(run: Path) -> dict:
    path = run / "metrics.jsonl"
    recs = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
    steps = {r["step"]: r for r in recs if "loss" in r}
    late = [r["tokens_per_s"] for s, r in steps.items() if s >= 4 and "tokens_per_s" in r]
    return {"tokens_per_s": round(statistics.median(late)) if late else None,
            "step1_loss": steps[1]["loss"] if 1 in steps else None,
            "peak_mem_gib": max((r["gpu_mem_gib"] for r in recs if "gpu_mem_gib" in r), default=None),
            "losses": {s: r["loss"] for s, r in sorted(steps.items())}}


def resume(outdir: Path, cpu: bool = False) -> dict:
    """fsdp2's run dir as it was at its step-6 checkpoint, trained on to step 12."""
    src, dst = RUNS / "fsdp2", RUNS / "resume"
    if not (src / "checkpoints" / "step_00000006").is_dir():
        return {"status": "fail", "error": "fsdp2 left no step-6 checkpoint to resume from"}
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step_00000012", ignore_errors=True)
    kept = [ln for ln in (dst / "metrics.jsonl").read_text().splitlines() if json.loads(ln).get("step", 0) <= 6]
    (dst / "metrics.jsonl").write_text("".join(ln + "\n" for ln in kept))
    result = train(outdir, "resume", 2, CASES["fsdp2"][1], fresh=False, cpu=cpu)
    straight, resumed = metrics(src)["losses"], result["losses"]
    differ = [s for s in range(7, STEPS + 1) if straight.get(s) is None or straight.get(s) != resumed.get(s)]
    result["steps_differing_from_fsdp2"] = differ
    if differ and result["status"] == "pass":
        result.update(status="fail", error=f"steps {differ} differ from the straight fsdp2 run")
    return result


def collect(outdir: Path) -> None:
    """OUTDIR/results.json: the tests' outcomes (OUTDIR/tests.xml, pytest's JUnit XML) with a count
    per outcome, and two_gpu_runs.json's results; a part that did not run is absent."""
    import xml.etree.ElementTree as ET

    results: dict = {}
    if (outdir / "tests.xml").exists():
        tests = {}
        for case in ET.parse(outdir / "tests.xml").getroot().iter("testcase"):
            outcome = next((kind for kind in ("failure", "error", "skipped") if case.find(kind) is not None),
                           "passed")
            tests[f"{case.get('classname')}::{case.get('name')}"] = {"failure": "failed"}.get(outcome, outcome)
        results["tests"] = tests
        results["tests_summary"] = {k: list(tests.values()).count(k) for k in sorted(set(tests.values()))}
    if (outdir / "two_gpu_runs.json").exists():
        results["two_gpu_runs"] = json.loads((outdir / "two_gpu_runs.json").read_text())
    (outdir / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--collect"]:
        collect(Path(argv[1]))
        return 0
    cpu = "--cpu" in argv
    argv = [a for a in argv if a != "--cpu"]
    outdir = Path(argv[0] if argv else os.environ.get("OUT", "/tmp/gpu_session"))
    outdir.mkdir(parents=True, exist_ok=True)
    report = outdir / "two_gpu_runs.json"
    gpus = gpu_count()
    if gpus < 2 and not cpu:
        line = f"two_gpu_runs: skipped: needs 2 CUDA GPUs, this machine has {gpus}"
        print(line)
        report.write_text(json.dumps({"skipped": line}, indent=1) + "\n")
        return 0
    shard_data(outdir)
    import torch
    results: dict = {"machine": "CPU rehearsal (gloo)" if cpu else
                     f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"}
    for name in argv[1:] or [*CASES, "resume"]:
        results[name] = (resume(outdir, cpu) if name == "resume" else
                         train(outdir, name, *CASES[name][:2], cpu=cpu))
        ref = CASES.get(name, (0, 0, None))[2]
        mine, theirs = results[name].get("step1_loss"), results.get(ref, {}).get("step1_loss")
        if mine is not None and theirs:
            results[name]["step1_vs_" + ref] = round(abs(mine - theirs) / abs(theirs), 6)
        print(f"{name}: {results[name]['status']} " + " ".join(
            f"{k}={results[name][k]}" for k in ("tokens_per_s", "step1_loss", "peak_mem_gib", "error")
            if results[name].get(k) is not None), flush=True)
        report.write_text(json.dumps(results, indent=1) + "\n")  # after each: a killed session keeps them
    return 0 if all(v.get("status") == "pass" for k, v in results.items() if k != "machine") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
