#!/usr/bin/env bash
# Shard the Shakespeare plays into DIR with TOKENIZER (bytes | gpt2 | ...) unless DIR already holds a
# dataset that verifies; used by scripts/demo.sh and scripts/llama_demo.sh. Expects the venv on PATH.
set -euo pipefail
DATA=$1 TOKENIZER=$2
if ! python -m data_tools verify "$DATA" >/dev/null 2>&1; then
  rm -rf "$DATA"
  python -m data_tools shard --input $(python -m data_tools.corpora shakespeare) \
      --output "$DATA" --tokenizer "$TOKENIZER" --val-fraction 0.05 --seed 1
fi
