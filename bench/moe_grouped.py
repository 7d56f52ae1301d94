"""The experts' matmuls of one MoE layer: one grouped matmul per weight (hpctrain/model/moe.py: CPU
fp32 as is, CUDA bf16 with every group padded to 16 rows) against one matmul per expert (the
loop). Forward + backward of Experts over tokens routed top-k with a skewed (Zipf-like) load, the
two forms alternating, medians; the grouped output is checked against the loop's first.

Run:  python bench/moe_grouped.py [--tokens 8192] [--dim 1024] [--hidden 2816] [--experts 8]
                                  [--top-k 2] [--reps 20]
(the device is CUDA when there is one, with bf16 autocast; else the CPU in fp32)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hpctrain.model.moe import Experts, loop_swiglu


def skewed_counts(rows: int, experts: int) -> list[int]:
    weights = [1.0 / (e + 1) for e in range(experts)]
    counts = [int(rows * w / sum(weights)) for w in weights]
    counts[0] += rows - sum(counts)
    return counts


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    experts = Experts(args.experts, args.dim, args.hidden).to(device)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.02)
    counts = skewed_counts(args.tokens * args.top_k, args.experts)
    x = torch.randn(sum(counts), args.dim, device=device, requires_grad=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")

    def step(grouped: bool):
        with autocast:
            out = experts(x, counts) if grouped else loop_swiglu(x, experts.w1, experts.w3, experts.w2, counts)
        out.float().square().mean().backward()
        return out

    with torch.no_grad(), autocast:
        a, b = experts(x, counts).float(), loop_swiglu(x, experts.w1, experts.w3, experts.w2, counts).float()
    err = ((a - b).norm() / b.norm()).item()
    times = {"grouped": [], "loop": []}
    for rep in range(args.reps + 3):
        for name in (("grouped", "loop") if rep % 2 == 0 else ("loop", "grouped")):
            t = timed(lambda: step(name == "grouped"), device)
            if rep >= 3:
                times[name].append(t)
    g, lo = statistics.median(times["grouped"]), statistics.median(times["loop"])
    flops = 6 * 3 * sum(counts) * args.dim * args.hidden  # 3 matmuls, fwd + bwd
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"device {name}; {args.experts} experts, {args.tokens} tokens x top-{args.top_k}, "
          f"{args.dim}x{args.hidden}, loads {counts}; grouped vs loop relative error {err:.2e}")
    print(f"loop: {lo * 1e3:.2f} ms ({flops / lo / 1e12:.1f} TFLOP/s)  grouped: {g * 1e3:.2f} ms "
          f"({flops / g / 1e12:.1f} TFLOP/s)  grouped speedup: {lo / g:.2f}x")


if __name__ == "__main__":
    main()
