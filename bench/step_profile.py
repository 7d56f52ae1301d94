"""Where one training step's time goes, op by op: a model-level profile (torch.profiler) of
forward + loss + backward + fused AdamW, for the GPU sessions' MFU work (#32, #34).

Run:  python bench/step_profile.py [--model moe|llama|gpt2] [--steps 3] [--warmup 5] [--top 25]
          [--micro-batch 16] [--block 1024] [--vocab 257] [--trace FILE.json]

The models are bench/gpu_session.sh's throughput shapes (12 x 768, 12 heads; llama: 4 kv heads;
moe: 8 experts of 1024, top-2), built from hpctrain/model with the same bf16 autocast as
train.precision = bf16 (CUDA) or fp32 (CPU). Printed: the ops with the most self device time
(CPU time where there is no GPU), the host syncs per step (cudaStreamSynchronize,
cudaDeviceSynchronize, device->host copies), and the device's busy share of the step's wall time
(kernel time / wall), which says whether the step is launch- or sync-bound rather than
compute-bound. Not the trainer: no data loader, no collectives, no metrics (bench/gpu_session.sh
measures those end to end).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hpctrain.model import build_model_from_section  # noqa: E402
from hpctrain.parallel.runner import lm_loss  # noqa: E402

SHAPES = {
    "gpt2": dict(arch="gpt2"),
    "llama": dict(arch="llama", n_kv_head=4),
    "moe": dict(arch="llama", n_kv_head=4, moe_experts=8, moe_top_k=2, moe_expert_hidden=1024),
}
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def build(args, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    section = dict(n_layer=12, n_head=12, n_embd=768, block_size=args.block,
                   vocab_size=args.vocab, **SHAPES[args.model])
    return build_model_from_section(section).to(device)


def make_step(model, args, device: str):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.micro_batch, args.block + 1), generator=gen).to(device)

    def step():
        with autocast:
            logits = model(x[:, :-1])
        loss = lm_loss(logits, x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def report(prof, args, device: str, wall_s: float) -> None:
    """The ops (aten level) by the device time of the kernels they launched; the device's busy time
    is the kernels' own sum (the op rows hold the same time again: summing both counts it twice)."""
    events = prof.key_averages()
    on_gpu = device == "cuda"
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    busy = sum(getattr(e, key, 0) for e in (kernels if on_gpu else ops))
    print(f"{'op':60s} {'calls':>7s} {'self ms':>9s} {'share':>6s}")
    for e in sorted(ops, key=lambda e: getattr(e, key, 0), reverse=True)[:args.top]:
        t = getattr(e, key, 0)
        print(f"{e.key[:60]:60s} {e.count // args.steps:7d} {t / 1e3 / args.steps:9.2f} {t / max(busy, 1):6.1%}")
    syncs = {e.key: e.count // args.steps for e in events if e.key in SYNC_OPS}
    dtoh = sum(e.count for e in events if "Memcpy DtoH" in e.key) // args.steps
    print(f"per step: wall {wall_s / args.steps * 1e3:.1f} ms unprofiled, {'kernel' if on_gpu else 'cpu'} time "
          f"{busy / 1e3 / args.steps:.1f} ms profiled (busy share {busy / 1e6 / wall_s:.1%}), "
          f"host syncs {syncs}, device->host copies {dtoh}, kernels launched "
          f"{sum(e.count for e in kernels) // args.steps}")


def timed_steps(step, steps: int, device: str) -> float:
    """Wall seconds of `steps` steps without the profiler (its own overhead inflates the wall)."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="moe")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--warmup", type=int, default=5, help="steps before the profile")
    ap.add_argument("--top", type=int, default=25, help="ops printed")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=257)
    ap.add_argument("--trace", default="", help="also write a Chrome trace (chrome://tracing, Perfetto)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(args, device)
    step = make_step(model, args, device)
    for _ in range(args.warmup):
        step()
    wall = timed_steps(step, args.steps, device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, acc_events=True) as prof:
        timed_steps(step, args.steps, device)
    print(f"== {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{args.micro_batch} x {args.block} tokens, {device}, {args.steps} steps")
    report(prof, args, device, wall)
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
