"""Mixture of experts (issue #34): expert parallelism against replicated experts, the all-to-all
share of the step, and MoE against dense at equal active parameters and equal wall time.

Run:  python bench/moe.py [--part layer,ep,recipe] [--reps 20] [--ep-steps 60] [--rounds 1]
                          [--config configs/moe_recipe.toml] [--data data/shakespeare_bytes]
      python bench/moe.py --smoke      (seconds: toy sizes; tests/mpi/test_moe_recipe.py: --part layer,recipe)

layer (a, b): one MoE layer (hpctrain/model/moe.py) on 2 ranks under a real `mpiexec -n 2`, each rank
with its own tokens, forward + backward + the gradient all-reduce data parallelism needs:
  replicated   every rank holds all E experts, computes its tokens locally, then all-reduces every
               gradient (experts included), as DDP does;
  ep = 2       hpctrain/parallel/expert.py: each rank holds E/2 experts, rows go to their expert's
               rank and back with all-to-all (forward and backward); only the router's gradient
               is all-reduced (each expert's gradient already sums every rank's tokens);
  all-to-all   the same exchanges alone (the count exchange + 2 row exchanges forward + 2
               backward, of the sizes the routing gives): its share of the ep step.
The three alternate in every repetition (the order reversed each time); a time is the slowest
rank's; figures are medians. Before timing, ep's output is checked against replicated's and every
routed row is counted (dropless).

ep (a, whole runs): configs/moe_recipe.toml trained on 2 ranks by the real CLI under mpiexec with
parallel.ep = 2 against parallel.ep = 1 (dp2, experts replicated), alternating; tokens/s = the
median of metrics.jsonl's tokens_per_s after the first quarter of the steps. The all-to-all share
is the layer part's (the trainer does not time its collectives apart).

recipe (c): configs/moe_recipe.toml (a small byte-level Llama MoE) against the dense Llama of the
same active parameters (the same file with --model.moe_experts=0: its ffn_hidden is top_k x
expert_hidden), both trained on 1 rank by the real CLI (`python -m hpctrain train`) for the same
wall time. There is no train.max_time, so the bench measures both models' step times first
(in-process, fwd + bwd + AdamW on the recipe's micro-batch, alternating, median ratio) and gives
the dense run the steps that fill the MoE run's time (each with its full lr schedule). Reported per
run: steps, training seconds (the sum of metrics.jsonl's step_time_s), launch wall, final
validation loss (the trainer's, on the same validation windows for both); and, from the eval
curves, the dense run's validation loss at the MoE run's training time.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

SHAPES = "128x128x768,512x1024x2048"  # model width x expert width x tokens per rank
SMOKE_SHAPES = "32x32x64"


def env() -> dict:
    """One thread per process: on a shared machine, torch's 2-thread steps wait for a descheduled
    thread (measured here under load: 12.6 s per recipe step with 2 threads, ~0.1 s with 1)."""
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS="1", HPCTRAIN_THREADS="1")


# ---------------------------------------------------------------- (a, b): one layer on 2 ranks

def layer_setup(dim: int, hidden: int, tokens: int, args, rank: int):
    from hpctrain.model.moe import MoEConfig, MoEFeedForward, init_moe_
    from hpctrain.parallel.expert import shard_experts
    import torch.distributed as dist

    torch.manual_seed(0)  # the same layer on every rank
    base = MoEFeedForward(dim, hidden, MoEConfig(n_experts=args.experts, top_k=args.top_k))
    init_moe_(base, 0.02, 0.02)
    replicated, ep = copy.deepcopy(base), copy.deepcopy(base)
    ep.experts = shard_experts(ep.experts, args.experts, dist.group.WORLD)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own tokens
    x, w = torch.randn(tokens, dim, generator=gen), torch.randn(tokens, dim, generator=gen)
    return replicated, ep, x, w


def step_fn(layer, x, w, grads_of):
    """Forward + backward + one all-reduce of the gradients data parallelism must sum."""
    import torch.distributed as dist

    def run():
        (layer(x) * w).sum().backward()
        dist.all_reduce(torch.cat([p.grad.reshape(-1) for p in grads_of()]))
        layer.zero_grad(set_to_none=True)
    return run


def a2a_fn(ep, x, n_ranks: int):
    """The ep layer's exchanges alone, at the sizes this rank's routing gives."""
    import torch.distributed as dist

    with torch.no_grad():
        _, ids, _ = ep.router(x)
    counts = torch.bincount(ids.reshape(-1), minlength=ep.cfg.n_experts).reshape(n_ranks, -1)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send, recv = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    rows_out, rows_in = torch.randn(sum(send), x.shape[1]), torch.empty(sum(recv), x.shape[1])

    def run():
        dist.all_to_all_single(torch.empty_like(counts), counts)
        for _ in range(2):  # forward: there and back; backward: the same two, reversed
            dist.all_to_all_single(rows_in, rows_out, recv, send)
            dist.all_to_all_single(rows_out, rows_in, send, recv)
    return run


def check_layer(replicated, ep, x, tokens: int, top_k: int) -> tuple[float, int, int]:
    """(max |ep - replicated| of the outputs, rows ep's experts computed, rows routed), over ranks."""
    import torch.distributed as dist

    ep.experts.local_rows_computed = 0
    replicated.take_load()
    with torch.no_grad():
        diff = (ep(x) - replicated(x)).abs().max().reshape(1)
    counts = torch.tensor([ep.experts.local_rows_computed, int(replicated.take_load().sum())])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    dist.all_reduce(counts)
    ep.take_load()
    return float(diff), int(counts[0]), int(counts[1])


def timed_medians(fns: dict, reps: int) -> dict:
    """Median over repetitions of each fn's time on the slowest rank (order alternating)."""
    import torch.distributed as dist

    names, times = list(fns), {k: [] for k in fns}
    for rep in range(reps + 1):  # repetition 0 warms up
        for name in (names if rep % 2 else names[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            fns[name]()
            dist.barrier()
            if rep:
                times[name].append(time.perf_counter() - t0)
    t = torch.tensor([times[k] for k in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # barriers bound it; the max removes timer skew
    return {k: statistics.median(t[i].tolist()) for i, k in enumerate(names)}


def layer_worker(args) -> None:
    from hpctrain.distributed import init_distributed, teardown

    ctx = init_distributed("gloo", 300)
    rows = []
    for shape in args.shapes.split(","):
        dim, hidden, tokens = (int(v) for v in shape.split("x"))
        replicated, ep, x, w = layer_setup(dim, hidden, tokens, args, ctx.rank)
        diff, computed, routed = check_layer(replicated, ep, x, tokens, args.top_k)
        not_experts = [p for n, p in ep.named_parameters() if not n.startswith("experts.")
                       and p.requires_grad]
        med = timed_medians({
            "replicated": step_fn(replicated, x, w, lambda: [p for p in replicated.parameters()
                                                              if p.requires_grad]),
            "ep": step_fn(ep, x, w, lambda: not_experts),
            "a2a": a2a_fn(ep, x, ctx.world_size)}, args.reps)
        tok = tokens * ctx.world_size
        rows.append({"dim": dim, "expert_hidden": hidden, "tokens_per_rank": tokens,
                     "experts": args.experts, "top_k": args.top_k, "ranks": ctx.world_size,
                     "out_diff": diff, "rows_computed": computed, "rows_routed": routed,
                     "replicated_ms": med["replicated"] * 1e3, "ep_ms": med["ep"] * 1e3,
                     "a2a_ms": med["a2a"] * 1e3, "replicated_tok_s": tok / med["replicated"],
                     "ep_tok_s": tok / med["ep"], "a2a_share": med["a2a"] / med["ep"]})
    if ctx.is_main:
        sys.stdout.write("LAYER " + json.dumps(rows) + "\n")
    teardown()


def part_layer(args) -> list[dict]:
    cmd = [str(BIN / "mpiexec"), "-n", "2", sys.executable, __file__, "--layer-worker",
           "--shapes", args.shapes, "--reps", str(args.reps), "--experts", str(args.experts),
           "--top-k", str(args.top_k)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=1800)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("LAYER ")), None)
    if r.returncode or line is None:
        sys.exit(f"error: bench/moe.py layer part failed ({r.returncode}): {' '.join(cmd)}\n"
                 f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
    rows = json.loads(line[len("LAYER "):])
    print(f"layer, 2 ranks, {args.experts} experts top-{args.top_k}, {args.reps} repetitions "
          "(fwd + bwd + gradient all-reduce; medians of the slowest rank)")
    print(f"{'width x expert x tokens/rank':<30}{'replicated tok/s':>18}{'ep=2 tok/s':>12}"
          f"{'ep/repl':>9}{'a2a ms':>9}{'a2a share':>11}{'|d out|':>10}{'rows':>12}")
    for x in rows:
        shape = f"{x['dim']} x {x['expert_hidden']} x {x['tokens_per_rank']}"
        print(f"{shape:<30}{x['replicated_tok_s']:>18,.0f}{x['ep_tok_s']:>12,.0f}"
              f"{x['ep_tok_s'] / x['replicated_tok_s']:>8.2f}x{x['a2a_ms']:>9.2f}"
              f"{x['a2a_share']:>10.0%}{x['out_diff']:>10.2g}{x['rows_computed']:>6}/{x['rows_routed']}")
    return rows


# ---------------------------------------------------------------- (a): whole runs, parallel.ep

def ep_run(args, ep: int, tmp: Path, tag: str) -> float:
    """Median tokens/s (all ranks) of a 2-rank recipe run with parallel.ep = ep, after warm-up."""
    rundir = tmp / f"ep{ep}_{tag}"
    cmd = [str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "hpctrain", "train", "--config",
           args.config, f"--run.dir={rundir}", f"--data.path={args.data}", f"--parallel.ep={ep}",
           f"--train.steps={args.ep_steps}", f"--train.warmup_steps={args.ep_steps // 4}",
           "--train.eval_interval=0",
           f"--checkpoint.interval={args.ep_steps}", *(SMOKE_MODEL if args.smoke else []),
           *args.ep_overrides.split()]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=1800)
    if r.returncode:
        sys.exit(f"error: bench/moe.py: the ep={ep} run failed ({r.returncode}): {' '.join(cmd)}\n"
                 f"{r.stderr[-3000:]}")
    recs = [json.loads(ln) for ln in (rundir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    speeds = [rec["tokens_per_s"] for rec in recs if "tokens_per_s" in rec]
    return statistics.median(speeds[len(speeds) // 4:])  # the first quarter warms up


def part_ep(args) -> dict:
    """Whole training runs on 2 ranks: parallel.ep = 2 against ep = 1 (experts replicated, DDP),
    alternating; the ratio per round and its median."""
    speeds: dict = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.ep_rounds):
            for ep in ((2, 1) if rnd % 2 == 0 else (1, 2)):
                speeds[ep].append(ep_run(args, ep, Path(tmp), str(rnd)))
            print(f"round {rnd + 1}: ep=2 {speeds[2][-1]:,.0f} tok/s | ep=1 (replicated, dp2) "
                  f"{speeds[1][-1]:,.0f} tok/s | {speeds[2][-1] / speeds[1][-1]:.2f}x", flush=True)
    ratio = statistics.median(a / b for a, b in zip(speeds[2], speeds[1]))
    print(f"whole runs, {args.config} {args.ep_overrides} on 2 ranks, {args.ep_steps} steps: "
          f"ep=2 / ep=1 tokens/s = {ratio:.2f}x")
    return {"ep2_tok_s": speeds[2], "ep1_tok_s": speeds[1], "ratio": ratio}


# ---------------------------------------------------------------- (c): MoE vs dense, equal time

def recipe_models(args) -> dict:
    """The recipe's MoE model and its dense counterpart, built in-process from the config (with
    the smoke's smaller shape under --smoke)."""
    from hpctrain import config
    from hpctrain.model import build_model_from_section

    out, shape = {}, SMOKE_MODEL if args.smoke else []
    for name, overrides in (("moe", shape), ("dense", [*shape, "--model.moe_experts=0"])):
        cfg = config.load(args.config, overrides)
        torch.manual_seed(0)
        model = build_model_from_section(dataclasses.asdict(cfg.model))
        out[name] = (model, cfg, overrides)
    return out


def step_time_ratio(models: dict, reps: int) -> tuple[float, dict]:
    """Median over repetitions of (MoE step time / dense step time): fwd + bwd + AdamW, on one
    thread as the runs (env())."""
    torch.set_num_threads(1)
    steps, times = {}, {k: [] for k in models}
    for name, (model, cfg, _) in models.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.block_size + 1))

        def step(model=model, opt=opt, x=x):
            logits = model(x[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps[name] = step
    for rep in range(reps + 1):
        for name in (list(steps) if rep % 2 else list(steps)[::-1]):
            t0 = time.perf_counter()
            steps[name]()
            if rep:
                times[name].append(time.perf_counter() - t0)
    ratio = statistics.median(m / d for m, d in zip(times["moe"], times["dense"]))
    return ratio, {k: statistics.median(v) for k, v in times.items()}


def train_run(args, name: str, overrides: list[str], steps: int, tmp: Path, extra: list[str]) -> dict:
    rundir = tmp / f"{name}_{steps}"
    cmd = [sys.executable, "-m", "hpctrain", "train", "--config", args.config, f"--run.dir={rundir}",
           f"--data.path={args.data}", f"--train.steps={steps}", f"--checkpoint.interval={steps}",
           *overrides, *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=3600)
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"error: bench/moe.py: the {name} run failed ({r.returncode}): {' '.join(cmd)}\n"
                 f"{r.stderr[-3000:]}")
    recs = [json.loads(ln) for ln in (rundir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    elapsed, curve, losses = 0.0, [], []
    for rec in recs:
        elapsed += rec.get("step_time_s", 0.0)
        if "loss" in rec:
            losses.append(rec["loss"])
        if "val_loss" in rec:
            curve.append((rec["step"], round(elapsed, 2), rec["val_loss"]))
    return {"steps": steps, "train_s": elapsed, "wall_s": wall, "val": curve[-1][2], "curve": curve,
            "first_loss": losses[0], "last_loss": losses[-1]}


def val_at(curve: list, seconds: float) -> float:
    """The validation loss of the last evaluation at or before `seconds` of training time."""
    return [v for _, t, v in curve if t <= seconds * 1.0001][-1]


def part_recipe(args) -> dict:
    models = recipe_models(args)
    counts = {k: (m.num_params(), m.active_params()) for k, (m, _, _) in models.items()}
    ratio, step_s = step_time_ratio(models, args.calib_reps)
    moe_cfg = models["moe"][1]
    moe_steps = args.steps or moe_cfg.train.steps
    dense_steps = max(1, round(moe_steps * ratio))
    print(f"recipe {args.config}: MoE {counts['moe'][0] / 1e6:.2f}M params, {counts['moe'][1] / 1e6:.3f}M "
          f"active | dense {counts['dense'][0] / 1e6:.2f}M (all active) | step time MoE / dense = "
          f"{ratio:.2f} (median of {args.calib_reps}: {step_s['moe'] * 1e3:.0f} / {step_s['dense'] * 1e3:.0f} ms)"
          f" -> MoE {moe_steps} steps, dense {dense_steps} steps")
    extra = SMOKE_TRAIN if args.smoke else []
    runs: dict = {"moe": [], "dense": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = ("moe", "dense") if rnd % 2 == 0 else ("dense", "moe")
            for name in order if not args.smoke else ("moe",):
                steps = moe_steps if name == "moe" else dense_steps
                run = train_run(args, name, models[name][2], steps, Path(tmp), extra)
                runs[name].append(run)
                print(f"round {rnd + 1} {name:<5}: {steps} steps, train {run['train_s']:.1f} s, wall "
                      f"{run['wall_s']:.1f} s, loss {run['first_loss']:.4f} -> {run['last_loss']:.4f}, "
                      f"val {run['val']:.4f}", flush=True)
    return summarize(runs, counts, ratio, moe_steps, dense_steps)


# --smoke: the recipe's keys at a quarter of its size (2 layers, 64 wide, 8 experts of 64, top-2)
SMOKE_MODEL = ["--model.n_layer=2", "--model.n_embd=64", "--model.moe_expert_hidden=64",
               "--model.ffn_hidden=128", "--model.block_size=32", "--train.micro_batch_size=8"]
SMOKE_TRAIN = ["--train.lr=3e-3", "--train.warmup_steps=2", "--train.eval_interval=12",
               "--train.eval_batches=2", "--train.log_interval=4"]


def summarize(runs: dict, counts: dict, ratio: float, moe_steps: int, dense_steps: int) -> dict:
    out = {"params": {k: {"total": v[0], "active": v[1]} for k, v in counts.items()},
           "step_time_ratio": ratio, "steps": {"moe": moe_steps, "dense": dense_steps},
           "runs": runs}
    if runs["dense"]:
        moe_val = statistics.median(r["val"] for r in runs["moe"])
        dense_val = statistics.median(r["val"] for r in runs["dense"])
        at_moe_time = statistics.median(val_at(d["curve"], m["train_s"])
                                        for m, d in zip(runs["moe"], runs["dense"]))
        time_ratio = statistics.median(m["train_s"] / d["train_s"] for m, d in zip(runs["moe"], runs["dense"]))
        print(f"equal wall time (train s MoE / dense = {time_ratio:.2f}): val MoE {moe_val:.4f} vs dense "
              f"{dense_val:.4f} (dense at the MoE's training time, last eval: {at_moe_time:.4f}); "
              f"MoE lower: {'yes' if moe_val < dense_val else 'no'}")
        out.update(moe_val=moe_val, dense_val=dense_val, time_ratio=time_ratio)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="layer,ep,recipe", help="comma-separated: layer, ep, recipe")
    ap.add_argument("--smoke", action="store_true", help="toy sizes and 12 MoE steps (seconds; for tests)")
    ap.add_argument("--shapes", default=SHAPES, help="layer part: WIDTHxEXPERT_WIDTHxTOKENS_PER_RANK,...")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20, help="layer part: repetitions (medians)")
    ap.add_argument("--ep-steps", type=int, default=60, help="ep part: steps per whole run")
    ap.add_argument("--ep-rounds", type=int, default=2, help="ep part: ep=2/ep=1 pairs, order alternating")
    ap.add_argument("--ep-overrides", default="", help="ep part: config overrides, e.g. '--model.n_embd=512'")
    ap.add_argument("--config", default="configs/moe_recipe.toml")
    ap.add_argument("--data", default="data/shakespeare_bytes", help="byte-level dataset (make demo builds it)")
    ap.add_argument("--steps", type=int, default=0, help="MoE steps (0: the config's train.steps)")
    ap.add_argument("--rounds", type=int, default=1, help="recipe part: MoE/dense pairs, order alternating")
    ap.add_argument("--calib-reps", type=int, default=10, help="step-time measurements per model")
    ap.add_argument("--layer-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layer_worker:
        return layer_worker(args)
    if args.smoke:
        args.shapes, args.reps, args.steps, args.calib_reps, args.rounds = SMOKE_SHAPES, 3, 12, 2, 1
        args.ep_steps, args.ep_rounds = 8, 1
    result = {}
    parts = {"layer": part_layer, "ep": part_ep, "recipe": part_recipe}
    for name in args.part.split(","):
        if name not in parts:
            sys.exit(f"error: bench/moe.py --part: {name!r} is not one of {', '.join(parts)}")
        result[name] = parts[name](args)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
