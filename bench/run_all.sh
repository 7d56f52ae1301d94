#!/usr/bin/env bash
# `make bench`: every benchmark in one go, each printing ours next to its reference; the combined
# output is written to bench/report.txt (copy the numbers into docs/benchmarks.md with the date).
# Needs the demo's byte-level dataset (built here if missing). ~12 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=data/shakespeare_bytes
if ! python -m data_tools verify "$DATA" >/dev/null 2>&1; then
  rm -rf "$DATA"
  python -m data_tools shard --input $(python -m data_tools.corpora shakespeare) --output "$DATA" \
      --tokenizer bytes --val-fraction 0.05 --seed 1 >/dev/null
fi
{
  echo "# hpctrain benchmarks, $(date -u +%F' '%H:%M) UTC, $(nproc) cores, $(python -c 'import torch; print("torch", torch.__version__)')"
  echo; echo "## bench/train.py (tokens/s vs torchrun + DDP)"; python bench/train.py --steps 20 --rounds 4
  echo; python bench/train.py --model wide --steps 10 --rounds 3
  echo; echo "## bench/recipe.py (time to nanoGPT's CPU-recipe loss vs torchrun + DDP)"; python bench/recipe.py --pairs 1
  echo; echo "## bench/mfu.py (model FLOP/s vs measured matmul peak)"; python bench/mfu.py --steps 10
  echo; echo "## bench/allreduce.py (gradient sync busbw vs raw all-reduce)"; mpiexec -n 2 python bench/allreduce.py --mib 32 --reps 10
  echo; echo "## bench/loader.py (reader vs np.memmap, data wait)"; python bench/loader.py
  echo; echo "## bench/preprocess.py (shard tokens/s vs raw tokenizer)"; python bench/preprocess.py
  echo; echo "## bench/checkpoint.py (async/sync save vs raw write)"; python bench/checkpoint.py
} 2>&1 | tee bench/report.txt
