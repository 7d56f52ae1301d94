"""Training reader throughput next to numpy.memmap, and the data-wait fraction of a training run.

Run:  python bench/loader.py [--tokens 64000000] [--batch 16] [--block 1024] [--train-steps 60]

Part 1 writes a dataset of random GPT-2-range token ids (4 HDF5 shards, the real writer) and a raw
`.bin` of the same tokens, warms both in the page cache, then reads the SAME random windows of
block+1 tokens into an int64 [B, block+1] batch with:
  ours      hpctrain.data.TokenShards.batch (one os.preadv per window at the dataset offset)
  memmap    np.memmap over the raw .bin, one slice copy per row into a preallocated int64 array
  nanoGPT   np.memmap + torch.stack of per-row astype(int64) (nanoGPT's get_batch)
Part 2 trains configs/demo.toml on 2 ranks (mpiexec) through the node cache in /dev/shm and prints
the share of step time spent producing batches (data_time_s) and blocked on the cache
(data_wait_s), from metrics.jsonl (step 1 excluded: it includes the first staging).
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
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data_tools.format import FORMAT_VERSION, write_manifest, write_shard  # noqa: E402
from hpctrain.data import TokenShards  # noqa: E402


def make_dataset(root: str, n_tokens: int, n_shards: int = 4) -> np.ndarray:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 50256, n_tokens, dtype=np.uint16)
    per = n_tokens // n_shards
    shards = []
    for k in range(n_shards):
        part = toks[k * per:(k + 1) * per]
        shards.append(write_shard(os.path.join(root, f"train_{k:05d}.h5"), part,
                                  np.array([0] if k == 0 else [], np.int64), split="train",
                                  tokenizer="gpt2", vocab_size=50257, eot_id=50256))
    write_manifest(root, {
        "format_version": FORMAT_VERSION, "tokenizer": {"name": "gpt2", "vocab_size": 50257,
                                                        "eot_id": 50256},
        "dtype": "uint16", "seed": 0, "val_fraction": 0.0, "shard_tokens": per,
        "n_documents": {"train": 1, "val": 0}, "n_tokens": {"train": per * n_shards, "val": 0},
        "shards": shards})
    toks[:per * n_shards].tofile(os.path.join(root, "raw.bin"))
    return toks[:per * n_shards]


def reader_bench(args) -> None:
    tmp = tempfile.mkdtemp(prefix="hpctrain-loader-")
    try:
        make_dataset(tmp, args.tokens)
        ours = TokenShards(tmp, "train", args.block, range_checked=True)  # verified dataset
        raw = np.memmap(os.path.join(tmp, "raw.bin"), dtype=np.uint16, mode="r")
        for name in os.listdir(tmp):  # warm the page cache: we measure the reader, not the disk
            with open(os.path.join(tmp, name), "rb") as f:
                while f.read(64 << 20):
                    pass
        W, B = args.block + 1, args.batch
        per_shard = ours.samples_per_shard[0]
        shard_tokens = int(ours.shard_tokens[0])

        def raw_offsets(idx):  # the same windows in the raw file
            return ((idx // per_shard) * shard_tokens + (idx % per_shard) * args.block).tolist()

        def run_ours(idx, _offs):
            return ours.batch(idx)

        def run_memmap(_idx, offs):
            out = np.empty((B, W), dtype=np.int64)
            for r, a in enumerate(offs):
                out[r] = raw[a:a + W]
            return torch.from_numpy(out)

        def run_nanogpt(_idx, offs):
            return torch.stack([torch.from_numpy(raw[a:a + W].astype(np.int64)) for a in offs])

        rng = np.random.default_rng(1)
        batches = [rng.integers(0, len(ours), B) for _ in range(args.batches)]
        offs = [raw_offsets(b) for b in batches]
        assert torch.equal(run_ours(batches[0], offs[0]), run_memmap(batches[0], offs[0]))
        fns = {"ours (TokenShards.batch)": run_ours, "numpy.memmap raw .bin": run_memmap,
               "nanoGPT get_batch": run_nanogpt}
        rates = {k: [] for k in fns}
        for _ in range(args.trials):  # interleaved trials: machine noise hits all alike
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for b, o in zip(batches, offs):
                    fn(b, o)
                rates[name].append(args.batches * B * W / (time.perf_counter() - t0) / 1e6)
        ref = statistics.median(rates["numpy.memmap raw .bin"])
        print(f"random windows: {args.batches} batches of {B} x {W} tokens from "
              f"{args.tokens / 1e6:.0f}M uint16 tokens (warm), median of {args.trials} trials")
        for name, r in rates.items():
            m = statistics.median(r)
            print(f"  {name:26s} {m:8.1f} Mtok/s   {m / ref:5.2f}x memmap")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def wait_bench(args) -> None:
    data = os.path.join(ROOT, "data", "shakespeare_bytes")
    py = sys.executable
    env = dict(os.environ, PATH=f"{os.path.dirname(py)}:{os.environ.get('PATH', '')}")
    if not os.path.exists(os.path.join(data, "manifest.json")):
        plays = subprocess.run([py, "-m", "data_tools.corpora", "shakespeare"], check=True,
                               capture_output=True, text=True, cwd=ROOT).stdout.split()
        subprocess.run([py, "-m", "data_tools", "shard", "--input", *plays, "--output", data,
                        "--tokenizer", "bytes", "--no-progress"], check=True, cwd=ROOT, timeout=600)
    run = tempfile.mkdtemp(prefix="hpctrain-loader-run-")
    cache = tempfile.mkdtemp(prefix="hpctrain-cache-", dir="/dev/shm")
    try:
        cmd = [os.path.join(os.path.dirname(py), "mpiexec"), "-n", "2", py, "-m", "hpctrain",
               "train", "--config", "configs/demo.toml", f"--run.dir={run}",
               f"--data.path={data}", f"--data.cache_dir={cache}", f"--train.steps={args.train_steps}",
               "--train.warmup_steps=0", "--train.eval_interval=0", "--checkpoint.interval=100000"]
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=1200, capture_output=True)
        recs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        recs = [r for r in recs if "loss" in r and r["step"] > 1]
        step = sum(r["step_time_s"] for r in recs)
        data_t = sum(r["data_time_s"] for r in recs)
        wait = sum(r["data_wait_s"] for r in recs)
        hits = sum(r["cache_hits"] for r in recs)
        misses = sum(r["cache_misses"] for r in recs)
        print(f"training (configs/demo.toml, 2 ranks, node cache in /dev/shm, steps 2-"
              f"{args.train_steps}): step time {step / len(recs) * 1e3:.1f} ms/step")
        print(f"  producing batches: {data_t / step:.3%} of step time "
              f"({data_t / len(recs) * 1e3:.3f} ms/step, max over ranks)")
        print(f"  blocked on the cache: {wait / step:.3%} of step time; "
              f"shard look-ups {hits} hits / {misses} waits")
    finally:
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64_000_000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--skip-train", action="store_true")
    args = p.parse_args()
    reader_bench(args)
    if not args.skip_train:
        wait_bench(args)


if __name__ == "__main__":
    main()
