"""The experts' grouped matmul (hpctrain/model/moe.py: one torch._grouped_mm per weight for all
local experts; CPU fp32 as is, CUDA bf16 with every group padded to 16 rows) against one matmul
per expert (the loop, loop_swiglu: what the layer ran before, and still runs where torch has no
grouped matmul for the tensors at hand), in one run, alternating, medians, ratios.

Run:  python bench/moe_grouped.py [--part layer|experts] [--experts 8,16,32,64] [--tokens 768]
                                  [--dim 128] [--hidden 128] [--top-k 2] [--reps 10] [--threads 0]
                                  [--clock wall|cpu]
  layer    (default) the whole MoE layer (MoEFeedForward: router, sort, dispatch, experts, gates,
           combine) over `--tokens` tokens routed top-k by its own router, forward + backward of
           a loss on its output; tokens/s per path. Before timing, both paths' losses and every
           gradient (input, router, experts) are compared.
  experts  the Experts module alone over tokens x top-k rows with a skewed (Zipf-like) load.
The default shape is configs/moe_recipe.toml's layer (128 wide, experts 128 wide, 12 x 64 tokens,
top-2). The device is CUDA when there is one, with bf16 autocast; else the CPU in fp32 (--threads
0: torch's default thread count). bench/gpu_session.sh's GPU figure: --part experts --experts 8
--tokens 8192 --dim 1024 --hidden 2816 --reps 20.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hpctrain.model import moe  # noqa: E402
from hpctrain.model.moe import Experts, MoEConfig, MoEFeedForward, init_moe_, loop_swiglu  # noqa: E402


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def skewed_counts(rows: int, experts: int) -> list[int]:
    weights = [1.0 / (e + 1) for e in range(experts)]
    counts = [int(rows * w / sum(weights)) for w in weights]
    counts[0] += rows - sum(counts)
    return counts


def timed(fn, device: str, clock=time.perf_counter) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = clock()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return clock() - t0


class LoopExperts:
    """moe._grouped_mm_fits (and CUDA's) answering False inside: the layer takes the loop."""

    def __enter__(self):
        self.saved = moe._grouped_mm_fits, moe._cuda_grouped_mm_fits
        moe._grouped_mm_fits = moe._cuda_grouped_mm_fits = lambda *tensors: False

    def __exit__(self, *exc):
        moe._grouped_mm_fits, moe._cuda_grouped_mm_fits = self.saved


def layer_setup(args, n_experts: int, device: str):
    """(step(grouped) -> (loss, grads), rows routed) for one MoE layer of `n_experts`."""
    torch.manual_seed(0)
    layer = MoEFeedForward(args.dim, args.hidden, MoEConfig(n_experts=n_experts, top_k=args.top_k)).to(device)
    init_moe_(layer, 0.02, 0.02)
    x = torch.randn(args.tokens, args.dim, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    params = [p for p in layer.parameters() if p.requires_grad]

    def step(grouped: bool):
        xi = x.clone().requires_grad_()
        with autocast, (LoopExperts() if not grouped else torch.enable_grad()):
            loss = layer(xi).float().square().mean()
        grads = torch.autograd.grad(loss, [xi, *params])
        return loss.detach(), grads

    return step, args.tokens


def experts_setup(args, n_experts: int, device: str):
    """(step(grouped) -> (loss, grads), rows) for the Experts module alone, skewed loads."""
    torch.manual_seed(0)
    experts = Experts(n_experts, args.dim, args.hidden).to(device)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.02)
    counts = skewed_counts(args.tokens * args.top_k, n_experts)
    x = torch.randn(sum(counts), args.dim, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")

    def step(grouped: bool):
        xi = x.clone().requires_grad_()
        with autocast:
            out = experts(xi, counts) if grouped else loop_swiglu(xi, experts.w1, experts.w3, experts.w2, counts)
        loss = out.float().square().mean()
        return loss.detach(), torch.autograd.grad(loss, [xi, *experts.parameters()])

    return step, args.tokens


def parity(step) -> tuple[float, float]:
    """(|loss difference| / loss, the largest relative difference of a gradient): grouped vs loop."""
    (lg, gg), (ll, gl) = step(True), step(False)
    grad_err = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                   for a, b in zip(gg, gl))
    return abs(lg.item() - ll.item()) / abs(ll.item()), grad_err


def measure(args, n_experts: int, device: str) -> dict:
    setup = layer_setup if args.part == "layer" else experts_setup
    step, tokens = setup(args, n_experts, device)
    loss_err, grad_err = parity(step)
    times = {"grouped": [], "loop": []}
    for rep in range(args.reps + 2):
        for name in (("grouped", "loop") if rep % 2 == 0 else ("loop", "grouped")):
            t = timed(lambda: step(name == "grouped"), device, CLOCKS[args.clock])
            if rep >= 2:  # two warm-up rounds
                times[name].append(t)
    g, lo = statistics.median(times["grouped"]), statistics.median(times["loop"])
    return {"experts": n_experts, "loop_tok_s": tokens / lo, "grouped_tok_s": tokens / g,
            "speedup": lo / g, "loss_rel_diff": loss_err, "grad_rel_diff": grad_err}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("layer", "experts"), default="layer")
    ap.add_argument("--experts", default="8,16,32,64", help="comma-separated expert counts")
    ap.add_argument("--tokens", type=int, default=768, help="tokens per step (configs/moe_recipe.toml: 12 x 64)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128, help="each expert's SwiGLU width")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="cpu: the process's CPU time, not wall time: steady on a machine others "
                         "load; with --threads 1 only (OpenMP's threads spin while they wait, and "
                         "that counts) and on CPUs only (a GPU's time is not the process's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name(0) if device == "cuda" else cpu_model()
    print(f"{args.part}: {name}, {torch.get_num_threads()} threads, torch {torch.__version__}, load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}; {args.tokens} tokens x top-{args.top_k}, "
          f"{args.dim} x {args.hidden} experts, forward + backward, medians of {args.reps} ({args.clock} time)")
    print("| experts | loop tokens/s | grouped tokens/s | grouped / loop | loss rel. diff | grad rel. diff |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (int(e) for e in args.experts.split(",")):
        r = measure(args, n, device)
        print(f"| {n} | {r['loop_tok_s']:,.0f} | {r['grouped_tok_s']:,.0f} | {r['speedup']:.2f}x | "
              f"{r['loss_rel_diff']:.1e} | {r['grad_rel_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
