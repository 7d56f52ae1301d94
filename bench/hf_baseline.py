"""A Llama-shaped model trained by hpctrain and by transformers' LlamaForCausalLM in a torchrun DDP
loop: tokens/s of each, their ratio, and both loss curves (issue #32, "How it is checked").

Run:  python bench/hf_baseline.py [--rounds 2] [--steps 30] [--hpctrain-chunk 128]
                                  [--precision bf16|fp32] [--compile] [--smoke]

The model (the same on both sides): Llama, 4 layers, 256 wide, 8 query heads and 2 key/value heads
(grouped-query attention), SwiGLU 704 wide (Llama's rule, multiple_of 64), untied 32,000-token
vocabulary, 128-token context. transformers builds it locally from a LlamaConfig (random init,
seeded, never downloaded) and saves it once; both sides start from that folder: the HF loop with
from_pretrained, hpctrain with `init.from` (its config.json fills [model]). The data: Shakespeare
with a 32k byte-level BPE trained here (`data_tools train-tokenizer --vocab-size 32000`; 30,214 ids
are used), sharded once into data/shakespeare_bpe32k; both sides read the same windows in the same
order (the HF loop asks hpctrain's sampler for the indices of each step, rank r takes its share),
so the loss curves are comparable step by step.

- hpctrain: `mpiexec -n 2 python -m hpctrain train` (DDP over gloo, fused AdamW), precision bf16
  (autocast) and `train.loss_chunk = 128` (its documented settings for a large vocabulary: README
  "Models"; docs/benchmarks.md), eager.
- transformers: `torchrun --nproc_per_node 2 bench/hf_baseline.py --worker ...`: DDP(model),
  attn_implementation="sdpa", torch.autocast("cpu", bfloat16) (faster than fp32 on this AMX CPU),
  the model's own loss (labels -> ForCausalLMLoss, logits upcast to fp32), clip_grad_norm_(1.0),
  torch.optim.AdamW(fused=True) (PyTorch's fastest documented implementation, as the Trainer's
  optim="adamw_torch_fused"), decay 0.1 on matrices, betas (0.9, 0.95), the same warmup + cosine
  schedule through LambdaLR, eager.
- `--compile`: both sides compile, regionally (each decoder layer, as PyTorch's regional
  compilation recipe and torchtitan do; the whole model took minutes to compile on 2 cores):
  hpctrain `train.compile = true` (its blocks and the chunked loss's chunks: parallel/activation.py),
  transformers `layer.compile()` for every LlamaDecoderLayer.

Both sides: 2 ranks, micro-batch 8 x 128 tokens per rank, the same steps. A round runs hpctrain then
transformers (A B A B ...); tokens/s = median over each run's steps after the first 5; the ratio is
the median over rounds of the round's ratio. Loss check: the mean loss of the last 5 steps of
hpctrain's and of transformers' last run agree within --loss-tol (0.05 nats; bf16 on both sides).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

MODEL = dict(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
             rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
BLOCK, MICRO_BATCH, SEED = 128, 8, 1337
TRAIN = dict(lr=2e-3, min_lr=2e-4, warmup_steps=5, weight_decay=0.1, beta1=0.9, beta2=0.95,
             grad_clip=1.0)
SKIP = 5  # steps left out of the tokens/s median (allocator and thread-pool warm-up)


RESULT_GRACE_S = 60.0  # a launcher that printed its result and then does not exit is ended


def run(cmd: list, log: Path, result: str | None = None) -> str:
    """Run `cmd` in its own process group (its output also into `log`); its stdout. With `result`
    (the start of the line that carries it): once that line is out, the launcher gets
    RESULT_GRACE_S to exit, then its whole group is killed (seen here: torchrun's eager second
    round, rank 1 gone with status 0 while rank 0 waited in a futex after the loop, torchrun
    waiting on it forever)."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    out_path, err_path = log.with_suffix(".out"), log.with_suffix(".err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=err, text=True, env=env,
                                cwd=ROOT, start_new_session=True)
        deadline, seen, killed = time.monotonic() + 1800, None, False
        while proc.poll() is None:
            now = time.monotonic()
            if seen is None and result and any(line.startswith(result) for line in
                                               out_path.read_text().splitlines()):
                seen = now
            if now > deadline or (seen is not None and now - seen > RESULT_GRACE_S):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                killed = True
                break
            time.sleep(0.5)
    stdout, stderr = out_path.read_text(), err_path.read_text()
    log.write_text(stdout + stderr)
    if killed and seen is not None:
        print(f"note: {Path(str(cmd[0])).name} printed its result but had not exited "
              f"{RESULT_GRACE_S:g} s later: its process group was killed ({log})", file=sys.stderr)
    elif killed or proc.returncode:
        why = "ran past 1800 s" if killed else f"exited {proc.returncode}"
        sys.exit(f"error: {cmd[0]} {why}; its output: {log}\n{stderr[-2000:]}")
    return stdout


def prepare_data(data: Path, tmp: Path) -> None:
    """Shakespeare sharded with a 32k BPE trained on it (once; about 10 s)."""
    if (data / "manifest.json").exists():
        return
    texts = run([sys.executable, "-m", "data_tools.corpora", "shakespeare"], tmp / "corpora.log").split()
    tok = tmp / "tokenizer.json"
    run([sys.executable, "-m", "data_tools", "train-tokenizer", "--input", *texts, "--output", tok,
         "--vocab-size", "32000"], tmp / "train_tokenizer.log")
    run([sys.executable, "-m", "data_tools", "shard", "--input", *texts, "--output", data,
         "--tokenizer", tok, "--val-fraction", "0.05", "--seed", "1"], tmp / "shard.log")


def save_init(out: Path) -> None:
    """The random-init LlamaForCausalLM both sides start from (built here, never downloaded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    model.save_pretrained(out)


def lr_at(step: int, steps: int) -> float:
    """hpctrain's warmup + cosine (hpctrain/model/optim.py), the one schedule both sides follow."""
    from types import SimpleNamespace

    from hpctrain.model.optim import lr_at as schedule
    return schedule(step, SimpleNamespace(steps=steps, **TRAIN))


def run_hpctrain(args, tmp: Path, init: Path, tag: str) -> dict:
    rundir = tmp / f"run_{tag}"
    shutil.rmtree(rundir, ignore_errors=True)
    t = TRAIN
    cfg = tmp / "hpctrain.toml"
    cfg.write_text(f'[run]\ndir = "{rundir}"\n[data]\npath = "{args.data}"\nverify = "size"\n'
                   f'[init]\nfrom = "{init}"\n[train]\nsteps = {args.steps}\n'
                   f'micro_batch_size = {MICRO_BATCH}\nprecision = "{args.precision}"\n'
                   f'loss_chunk = {args.hpctrain_chunk}\nseed = {SEED}\neval_interval = 0\n'
                   f'compile = {str(args.compile).lower()}\n'
                   f'log_interval = 10\n' + "".join(f"{k} = {v}\n" for k, v in t.items())
                   + f'[checkpoint]\ninterval = {10 ** 6}\n')
    run([BIN / "mpiexec", "-n", "2", sys.executable, "-m", "hpctrain", "train", "--config", cfg,
        ], tmp / f"hpctrain_{tag}.log")
    recs = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r and "tokens_per_s" in r]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps[SKIP:]),
            "losses": [r["loss"] for r in steps]}


def run_transformers(args, tmp: Path, init: Path, tag: str) -> dict:
    out = run([BIN / "torchrun", "--standalone", "--nproc_per_node=2", Path(__file__), "--worker",
               "--init", init, "--data", args.data, "--steps", args.steps,
               "--precision", args.precision] + ["--compile"] * args.compile,
              tmp / f"transformers_{tag}.log", result='{"tokens_per_s"')
    return json.loads(out.strip().splitlines()[-1])


def worker(args) -> None:
    """The user's loop: torchrun + DDP + LlamaForCausalLM (rank 0 prints one JSON line)."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import LlamaForCausalLM
    from transformers.utils import logging

    from hpctrain.data import make_sampler, open_split, split_for_rank

    logging.disable_progress_bar()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reader = open_split(str(args.data), "train", BLOCK)  # the windows hpctrain reads
    sampler = make_sampler(reader, MICRO_BATCH * world, SEED)
    model = LlamaForCausalLM.from_pretrained(args.init, attn_implementation="sdpa",
                                             dtype=torch.float32)
    model.train()
    if args.compile:  # regional compilation: each decoder layer
        for layer in model.model.layers:
            layer.compile()
    ddp = DDP(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": TRAIN["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=TRAIN["lr"], betas=(TRAIN["beta1"], TRAIN["beta2"]),
                            eps=1e-8, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, args.steps) / TRAIN["lr"])
    amp = (torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16"
           else contextlib.nullcontext())
    losses, rates = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        idx = split_for_rank(sampler.next_indices(), rank, world, MICRO_BATCH, 1)[0]
        xy = reader.batch(idx).long()
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # y: already shifted
        with amp:
            loss = ddp(input_ids=x, labels=y, shift_labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), TRAIN["grad_clip"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # the mean loss over ranks, as a user logs it
        losses.append(logged.item() / world)
        rates.append(MICRO_BATCH * BLOCK * world / (time.perf_counter() - t0))
    if rank == 0:
        print(json.dumps({"tokens_per_s": statistics.median(rates[SKIP:]), "losses": losses}),
              flush=True)  # read as soon as it is out (run(): the launcher may not exit)
    dist.destroy_process_group()


def report(args, results: dict) -> int:
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in results.items()}
    ratios = [a["tokens_per_s"] / b["tokens_per_s"]
              for a, b in zip(results["hpctrain"], results["transformers"])]
    print(f"Llama {MODEL['num_hidden_layers']}x{MODEL['hidden_size']}, GQA "
          f"{MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']}, vocab "
          f"{MODEL['vocab_size']:,}, 2 ranks x {MICRO_BATCH} x {BLOCK} tokens, {args.precision}, "
          f"{args.steps} steps x {args.rounds} rounds{', compiled' if args.compile else ''}; "
          f"load average {os.getloadavg()[0]:.1f}")
    for k, v in results.items():
        print(f"{k:<13}{med[k]:>9,.0f} tokens/s   runs: "
              + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in v))
    ratio = statistics.median(ratios)
    print(f"ratio hpctrain / transformers: {ratio:.2f}x (rounds: "
          f"{', '.join(f'{x:.2f}' for x in ratios)}; target >= 1.5x)")
    a, b = results["hpctrain"][-1]["losses"], results["transformers"][-1]["losses"]
    every = max(1, len(a) // 10)
    print("step  hpctrain  transformers")
    for i in sorted(set(range(0, len(a), every)) | {len(a) - 1}):
        print(f"{i + 1:>4}  {a[i]:8.4f}  {b[i]:12.4f}")
    tail = min(5, len(a))
    fa, fb = statistics.fmean(a[-tail:]), statistics.fmean(b[-tail:])
    ok = abs(fa - fb) <= args.loss_tol
    print(f"final loss (mean of last {tail} steps): hpctrain {fa:.4f}, transformers {fb:.4f}, "
          f"|diff| {abs(fa - fb):.4f} {'<=' if ok else '>'} {args.loss_tol}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=ROOT / "data/shakespeare_bpe32k")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--hpctrain-chunk", type=int, default=128, help="train.loss_chunk (0 = plain)")
    ap.add_argument("--loss-tol", type=float, default=0.05)
    ap.add_argument("--compile", action="store_true", help="both sides compile each layer")
    ap.add_argument("--smoke", action="store_true", help="1 round of 7 steps (a test)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--init", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.rounds, args.steps = 1, SKIP + 2
    with tempfile.TemporaryDirectory(prefix="hf_baseline.") as name:
        tmp = Path(name)
        prepare_data(args.data, tmp)
        save_init(tmp / "init")
        results = {"hpctrain": [], "transformers": []}
        for r in range(args.rounds):
            results["hpctrain"].append(run_hpctrain(args, tmp, tmp / "init", str(r)))
            results["transformers"].append(run_transformers(args, tmp, tmp / "init", str(r)))
        return report(args, results)


if __name__ == "__main__":
    sys.exit(main())
