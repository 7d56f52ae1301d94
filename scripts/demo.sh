#!/usr/bin/env bash
# End-to-end demo (run by `make demo`): shard the Shakespeare corpus -> train on 2 ranks under mpiexec
# -> stop at a checkpoint -> resume to the end -> print generated text. Expects the venv on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=data/shakespeare_bytes
RUN=runs/demo
NP=${NP:-2}

echo "== 1/4 shard the Shakespeare plays (byte tokenizer) into $DATA"
bash scripts/shard_shakespeare.sh "$DATA" bytes
python -m data_tools inspect "$DATA"

echo "== 2/4 train on $NP ranks, stopping at step 900 (a checkpoint is committed there)"
rm -rf "$RUN"
mpiexec -n "$NP" python -m hpctrain train --config configs/demo.toml --train.stop_at_step=900

echo "== 3/4 resume: the same command without the stop resumes from the newest checkpoint"
mpiexec -n "$NP" python -m hpctrain train --config configs/demo.toml

echo "== 4/4 sample from the final checkpoint"
python -m hpctrain sample --checkpoint "$RUN" --prompt "ROMEO:" --tokens 400 --seed 1 \
    --real-words "$DATA" | tee "$RUN/sample.txt"
python -m hpctrain plot "$RUN" >/dev/null && echo "loss curve: $RUN/metrics.png"
python - <<'PY'
import json
recs = [json.loads(l) for l in open("runs/demo/metrics.jsonl")]
vals = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
print("validation loss by step:", ", ".join(f"{s}: {v:.3f}" for s, v in vals))
print(f"final validation loss: {vals[-1][1]:.3f} nats per character on held-out plays")
PY
grep "^# real words" "$RUN/sample.txt"
