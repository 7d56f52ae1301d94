"""train.compile's two forms on one machine, in one process (#32): the regional compile the trainer
uses (each block's forward compiled in place: hpctrain.parallel.activation.compile_regions) against
torch.compile of the whole model (what the first two GPU sessions measured), and eager as the
reference. The three models start from the same weights; their steps are timed in alternation
(rounds x steps each, the median round), so a machine that speeds up or slows down during the run
moves all three alike.

Run:  python bench/compile_modes.py [--model gpt2|llama|moe] [--rounds 3] [--steps 10]
          [--micro-batch 16] [--block 1024] [--vocab 257]

Printed: one line per form: tokens/s, the ratio to eager, the first (compiling) steps' seconds, and
the loss after the last step (the three must agree to bf16 precision: the same math). The step is
bench/step_profile.py's (bf16 autocast on CUDA, fused AdamW); no data loader, no collectives.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hpctrain.parallel.activation import compile_regions  # noqa: E402
from step_profile import SHAPES, build, make_step, timed_steps  # noqa: E402

FORMS = ("eager", "regional", "whole")


def compiled_form(model: torch.nn.Module, form: str) -> torch.nn.Module:
    if form == "regional":
        compile_regions(model)
        return model
    if form == "whole":
        return torch.compile(model)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="gpt2")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is printed")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per form per round")
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing (the compile happens here)")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=257)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = build(args, device)
    steps, warm_s, losses = {}, {}, {}
    for form in FORMS:
        model = compiled_form(copy.deepcopy(base), form)
        steps[form] = make_step(model, args, device)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            losses[form] = steps[form]()
        if device == "cuda":
            torch.cuda.synchronize()
        warm_s[form] = time.perf_counter() - t0
    rates = {form: [] for form in FORMS}
    for _ in range(args.rounds):
        for form in FORMS:
            wall = timed_steps(steps[form], args.steps, device)
            rates[form].append(args.steps * args.micro_batch * args.block / wall)
    for form in FORMS:
        losses[form] = float(steps[form]().detach())
    eager = statistics.median(rates["eager"])
    print(f"== {args.model}: {args.micro_batch} x {args.block} tokens, {device}, "
          f"{args.rounds} rounds x {args.steps} steps")
    for form in FORMS:
        rate = statistics.median(rates[form])
        print(f"{form:9s} {rate:12,.0f} tok/s  {rate / eager:5.2f}x eager  first {args.warmup} steps "
              f"{warm_s[form]:6.1f} s  loss {losses[form]:.4f}  (rounds: "
              f"{', '.join(f'{r:,.0f}' for r in rates[form])})")


if __name__ == "__main__":
    main()
