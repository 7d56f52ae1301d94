"""Chunked linear + cross-entropy (train.loss_chunk) against the plain loss: peak memory of one
micro-batch's forward + backward, and training tokens/s (#32).

Run:  python bench/chunked_loss.py [--vocab 50304 128256] [--chunk 128 512] [--rounds 4]
          [--steps 3] [--precision fp32|bf16] [--skip-speed]

The model is configs/shakespeare_gpt2.toml's (4 blocks, 128 wide, 128 tokens, micro-batch 8 =
1,024 tokens), one process, the same initial weights and batches on both sides.
- memory, per vocabulary: live tensor bytes during one forward + backward, from torch.profiler's
  allocation records paired by address and summed in time order (bench/plan_memory.py's method,
  the one the planner was checked against); parameters and their gradients from a previous step
  exist before the window, so the figure is the step's activations, logits and temporaries. Also
  the largest single tensor allocated in the window (the plain path's [1024 x V] logits);
- speed, at the first vocabulary: full training steps (forward, backward, AdamW), plain and each
  chunk size alternating in `--rounds` rounds of `--steps` steps (after one warm-up step each);
  median tokens/s per variant and its ratio to the plain loss, taken inside one run.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.plan_memory import allocation_records, live_peaks  # noqa: E402
from hpctrain.model import GPT, GPTConfig  # noqa: E402
from hpctrain.parallel.runner import lm_loss  # noqa: E402
from hpctrain.parallel.loss import chunked_lm_loss, use_chunked_head  # noqa: E402

SHAPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=128)
MICRO_BATCH = 8


def build(vocab: int, chunk: int, state=None) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, **SHAPE))
    if state is not None:
        model.load_state_dict(state)
    if chunk:
        use_chunked_head(model)
    return model


def step_loss(model: GPT, tokens: torch.Tensor, chunk: int, autocast) -> torch.Tensor:
    with autocast:
        out = model(tokens[:, :-1])
        if chunk:
            return chunked_lm_loss(out, model.lm_head.weight, tokens[:, 1:], chunk)
    return lm_loss(out, tokens[:, 1:])


def batch(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (MICRO_BATCH, SHAPE["block_size"] + 1), generator=g)


def peak_of_step(vocab: int, chunk: int, autocast) -> tuple[int, int, float]:
    """(peak live bytes, largest tensor bytes, loss) of one forward + backward after a warm-up."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model, tokens = build(vocab, chunk), batch(vocab, 1)
    step_loss(model, tokens, chunk, autocast).backward()  # grads exist, as in any later step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("steps"):
            loss = step_loss(model, tokens, chunk, autocast)
            loss.backward()
    records, mark = allocation_records(prof)
    largest = max((size for t, _, size, _ in records if t >= mark and size > 0), default=0)
    return live_peaks(records, mark).high, largest, loss.item()


def timed_steps(model, opt, vocab, chunk, steps, seed, autocast) -> float:
    t0 = time.perf_counter()
    for i in range(steps):
        step_loss(model, batch(vocab, seed + i), chunk, autocast).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * MICRO_BATCH * SHAPE["block_size"] / (time.perf_counter() - t0)


def speed(vocab: int, chunks: list[int], rounds: int, steps: int, autocast) -> dict[int, list]:
    """tokens/s per variant (0 = plain), the variants alternating round by round."""
    state = build(vocab, 0).state_dict()
    runs = {}
    for c in [0] + chunks:
        model = build(vocab, c, state)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        timed_steps(model, opt, vocab, c, 1, 99, autocast)  # warm-up
        runs[c] = (model, opt)
    rates = {c: [] for c in runs}
    for r in range(rounds):
        for c, (model, opt) in runs.items():
            rates[c].append(timed_steps(model, opt, vocab, c, steps, 1000 * r, autocast))
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[50304, 128256])
    ap.add_argument("--chunk", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--skip-speed", action="store_true")
    a = ap.parse_args()
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if a.precision == "bf16"
                else contextlib.nullcontext())
    mib = 2 ** 20
    print(f"model {SHAPE}, micro-batch {MICRO_BATCH} x {SHAPE['block_size']} tokens, "
          f"{a.precision}, torch threads {torch.get_num_threads()}")
    print("| vocab | loss | peak live MiB | largest tensor MiB | loss value |")
    print("|---|---|---|---|---|")
    for v in a.vocab:
        plain = None
        for c in [0] + a.chunk:
            peak, largest, loss = peak_of_step(v, c, autocast)
            plain = plain or peak
            name = "plain" if c == 0 else f"chunk {c}"
            ratio = "" if c == 0 else f" ({plain / peak:.1f}x less)"
            print(f"| {v:,} | {name} | {peak / mib:,.1f}{ratio} | {largest / mib:,.1f} | {loss:.6f} |")
    if a.skip_speed:
        return 0
    rates = speed(a.vocab[0], a.chunk, a.rounds, a.steps, autocast)
    print(f"\ntokens/s at vocab {a.vocab[0]:,} ({a.rounds} alternating rounds of {a.steps} steps; "
          f"median; ratio = median over rounds of the round's ratio to plain):")
    for c, r in rates.items():
        ratio = statistics.median(x / p for x, p in zip(r, rates[0]))
        print(f"  {'plain' if c == 0 else f'chunk {c}':>10}: {statistics.median(r):8,.0f}  "
              f"x{ratio:.2f}  (rounds: {', '.join(f'{x:,.0f}' for x in r)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
