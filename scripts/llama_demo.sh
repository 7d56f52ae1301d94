#!/usr/bin/env bash
# The Llama recipe (run by `make llama-demo`): shard Shakespeare with the GPT-2 BPE if missing ->
# train configs/llama_shakespeare.toml on 2 ranks (a 17.3M-parameter Llama, <= 10 minutes on 2 CPU
# cores) -> print generated text with its share of real words. Expects the venv on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=data/shakespeare
RUN=runs/llama_shakespeare
NP=${NP:-2}

echo "== 1/3 shard the Shakespeare plays (GPT-2 tokenizer) into $DATA"
bash scripts/shard_shakespeare.sh "$DATA" gpt2

echo "== 2/3 train on $NP ranks (a rerun resumes from $RUN's newest checkpoint)"
mpiexec -n "$NP" python -m hpctrain train --config configs/llama_shakespeare.toml

echo "== 3/3 sample from the final checkpoint"
python -m hpctrain sample --checkpoint "$RUN" --prompt "ROMEO:" --tokens 200 --seed 1 \
    --real-words "$DATA" | tee "$RUN/sample.txt"
python - <<'PY'
import json
recs = [json.loads(l) for l in open("runs/llama_shakespeare/metrics.jsonl")]
vals = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
print("validation loss by step:", ", ".join(f"{s}: {v:.3f}" for s, v in vals))
PY
