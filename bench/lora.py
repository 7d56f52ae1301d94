"""LoRA (lora.rank, hpctrain/parallel/lora.py) against full fine-tuning: peak memory (RSS) and
training tokens/s of the same Llama, one process per measurement (#53).

Run:  python bench/lora.py [--rounds 3] [--steps 4] [--rank 8] [--targets wq,wk,wv,wo]

The model: a Llama of 4 blocks, 256 wide, vocabulary 8,192, 128 tokens, micro-batch 4 (512
tokens per step, 7.6M parameters), fp32, AdamW as training builds it (model/optim.py: over the
parameters that train). Each round starts one child process for full fine-tuning and one for LoRA,
alternating (the reference beside our figure in one run); a child builds the model (LoRA:
apply_lora + init_adapters, as train/model_setup.py does), takes one warm-up step, then times
`--steps` steps (forward, backward, AdamW): tokens/s on the wall clock, and tokens per CPU-second
of the process (its threads' time: what a loaded machine does not distort). Memory: the child's
peak RSS (getrusage ru_maxrss) minus its RSS before the model was built (torch's own import), i.e.
weights, gradients, optimizer state and the step's activations. Medians over rounds; ratios LoRA / full taken per round.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SECTION = dict(arch="llama", n_layer=4, n_head=4, n_kv_head=4, n_embd=256, block_size=128,
               vocab_size=8192, dropout=0.0)
MICRO_BATCH = 4


def rss_mib() -> float:
    """This process's resident set now (Linux /proc), MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def child(variant: str, steps: int, rank: int, targets: str) -> dict:
    """One measurement: {tokens_per_s, peak_mib (above start), trainable}."""
    import torch

    from hpctrain.config_schema import LoraConfig, TrainConfig
    from hpctrain.model import build_model_from_section
    from hpctrain.model.optim import build_optimizer
    from hpctrain.parallel.lora import apply_lora, init_adapters
    from hpctrain.parallel.runner import lm_loss

    start = rss_mib()
    torch.manual_seed(0)
    model = build_model_from_section(SECTION)
    if variant == "lora":
        lora = LoraConfig(rank=rank, alpha=2.0 * rank, targets=targets)
        apply_lora(model, lora)
        init_adapters(model, lora, 0)
    opt = build_optimizer(model, TrainConfig(steps=steps, micro_batch_size=MICRO_BATCH, lr=1e-4))
    g = torch.Generator().manual_seed(1)

    def step():
        tokens = torch.randint(0, SECTION["vocab_size"], (MICRO_BATCH, SECTION["block_size"] + 1), generator=g)
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()  # warm-up: AdamW's state exists from here
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    tokens = steps * MICRO_BATCH * SECTION["block_size"]
    rate, cpu_rate = tokens / (time.perf_counter() - t0), tokens / (time.process_time() - cpu0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"tokens_per_s": rate, "tokens_per_cpu_s": cpu_rate, "peak_mib": peak - start,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "params": sum(p.numel() for p in model.parameters())}


def measure(variant: str, a) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", variant, "--steps", str(a.steps),
                          "--rank", str(a.rank), "--targets", a.targets],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="wq,wk,wv,wo")
    ap.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.steps, a.rank, a.targets)))
        return 0
    runs = {"full": [], "lora": []}
    for _ in range(a.rounds):
        for variant in runs:  # alternating: full, lora, full, lora, ...
            runs[variant].append(measure(variant, a))
    full, lora = runs["full"], runs["lora"]
    print(f"Llama {SECTION['n_layer']} x {SECTION['n_embd']}, vocab {SECTION['vocab_size']:,}, "
          f"{MICRO_BATCH} x {SECTION['block_size']} tokens per step, fp32; LoRA rank {a.rank} on "
          f"{a.targets}; {a.rounds} rounds of {a.steps} steps, medians")
    print("| | trainable params | peak RSS above start, MiB | tokens/s | tokens per CPU-second |")
    print("|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r[0]['trainable']:,} of {r[0]['params']:,} | "
              f"{statistics.median(x['peak_mib'] for x in r):,.0f} | "
              f"{statistics.median(x['tokens_per_s'] for x in r):,.0f} | "
              f"{statistics.median(x['tokens_per_cpu_s'] for x in r):,.0f} |")
    mem = statistics.median(lo["peak_mib"] / f["peak_mib"] for lo, f in zip(lora, full))
    speed = statistics.median(lo["tokens_per_s"] / f["tokens_per_s"] for lo, f in zip(lora, full))
    cpu = statistics.median(lo["tokens_per_cpu_s"] / f["tokens_per_cpu_s"] for lo, f in zip(lora, full))
    print(f"LoRA / full: memory x{mem:.2f}, tokens/s x{speed:.2f}, tokens per CPU-second x{cpu:.2f} "
          f"(per-round ratios, median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
