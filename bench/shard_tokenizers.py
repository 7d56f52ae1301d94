"""Sharding speed per core: `data_tools shard` with gpt2 vs a tokenizer.json (#32).

Run:  python bench/shard_tokenizers.py [--copies 2] [--trials 3] [--vocab 50257]

Trains a byte-level BPE with --vocab ids on the 42 plays (`data_tools train-tokenizer`, offline),
tiles the plays --copies times, then alternates `shard --tokenizer gpt2` and `shard --tokenizer
tokenizer.json` on ONE rank pinned to core 0, --trials times each, and prints the sharder's own
tokenize + write rate (its summary line) for each, the medians and their ratio.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RATE = re.compile(r"tokenize \+ write [\d.]+ s = ([\d,]+) tokens/s")


def _shard(inputs: str, out: str, tokenizer: str) -> float:
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "data_tools", "shard", "--input", inputs,
           "--output", out, "--tokenizer", tokenizer, "--no-progress"]
    env = dict(os.environ, RAYON_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return float(RATE.search(r.stdout).group(1).replace(",", ""))


def main() -> None:
    from data_tools.corpora import shakespeare_dir, shakespeare_files

    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=50257)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-tok-")
    try:
        tok = os.path.join(tmp, "tok", "tokenizer.json")
        subprocess.run([sys.executable, "-m", "data_tools", "train-tokenizer", "--input",
                        shakespeare_dir(), "--output", tok, "--vocab-size", str(args.vocab)],
                       check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=ROOT))
        corpus = os.path.join(tmp, "corpus")
        os.makedirs(corpus)
        for c in range(args.copies):
            for f in shakespeare_files():
                shutil.copy(f, os.path.join(corpus, f"{c}_{os.path.basename(f)}"))
        rates = {"gpt2": [], "tokenizer.json": []}
        for t in range(args.trials):
            for name, spec in (("gpt2", "gpt2"), ("tokenizer.json", tok)):
                rates[name].append(_shard(corpus, os.path.join(tmp, f"out-{name}"), spec))
                print(f"trial {t}: {name:15s} {rates[name][-1]:>12,.0f} tokens/s", flush=True)
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"median: gpt2 {med['gpt2']:,.0f}, tokenizer.json (vocab {args.vocab}) "
              f"{med['tokenizer.json']:,.0f} tokens/s on 1 rank; ratio "
              f"{med['tokenizer.json'] / med['gpt2']:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
