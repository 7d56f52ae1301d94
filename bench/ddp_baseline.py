"""The reference a user would write instead of hpctrain: plain torchrun + DDP, nanoGPT style.

Run: torchrun --nproc_per_node 2 bench/ddp_baseline.py --data DIR --steps N [model/batch flags]
     torchrun --nproc_per_node 2 bench/ddp_baseline.py --data DIR --recipe --steps 2000 --save F.pt

Same GPT (hpctrain.model.GPT: the architecture is not what is being compared), same batch size,
precision and rank count as the hpctrain run it is compared with; eager as in PyTorch's DDP
tutorial and nanoGPT's CPU recipe, or with --compile as nanoGPT does by default on GPUs; random
windows from a np.memmap of the training shard, AdamW (decay on matrices only, as nanoGPT), grad
accumulation with no_sync, clipping.

Throughput mode (default): constant lr, prints one JSON line with the median tokens/s over the timed
steps (rank 0). Recipe mode (--recipe): nanoGPT's train.py loop to the end: linear warmup then
cosine to --min-lr, `estimate_loss` on rank 0 every --eval-interval steps (--eval-iters random
batches of the train and the val split, as nanoGPT), a JSON line per evaluation, and with --save
the final weights (rank 0) for the bench to score both sides on the same held-out windows.
"""
import argparse
import contextlib
import json
import math
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from data_tools.format import open_shard_layout, read_manifest, shards_of
from hpctrain.model import GPT, GPTConfig


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="dataset dir (hpctrain shard output)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps (timed steps in throughput mode)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (throughput mode)")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=257)
    ap.add_argument("--micro-batch", type=int, default=16, help="sequences per rank per micro-batch")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (nanoGPT's default)")
    ap.add_argument("--recipe", action="store_true", help="train to the end with schedule and evaluation")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup-iters", type=int, default=100)
    ap.add_argument("--beta2", type=float, default=0.99)
    ap.add_argument("--eval-interval", type=int, default=250)
    ap.add_argument("--eval-iters", type=int, default=20, help="batches per split per evaluation")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--save", default=None, help="recipe mode: write the final state_dict here")
    return ap.parse_args()


def open_split(data: str, split: str) -> np.ndarray:
    m = read_manifest(data)
    entry = shards_of(m, split)[0]
    lay = open_shard_layout(os.path.join(data, entry["file"]), entry, m)
    return np.memmap(lay.path, dtype=lay.dtype, mode="r", offset=lay.offset, shape=(lay.n_tokens,))


def nanogpt_lr(it: int, args) -> float:
    """nanoGPT's get_lr: linear warmup, cosine decay to min_lr at the last step."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    ratio = (it - args.warmup_iters) / max(1, args.steps - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio))) * (args.lr - args.min_lr)


def build(args):
    torch.manual_seed(args.seed)
    raw = GPT(GPTConfig(args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size))
    model = torch.compile(raw) if args.compile else raw  # as nanoGPT: compile first, then DDP
    model = DDP(model)
    params = [p for p in raw.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # foreach: PyTorch's multi-tensor path; on CPU AdamW's default is the slower per-tensor loop and
    # nanoGPT asks for the fused kernel only on CUDA, so this is already the better choice on CPU
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2), foreach=True)
    return raw, model, opt


class Batches:
    """nanoGPT's get_batch: B random windows of T + 1 tokens from a split's memmap."""

    def __init__(self, splits: dict, block_size: int, micro_batch: int, seed: int):
        self.splits, self.T, self.B = splits, block_size, micro_batch
        self.rng = np.random.default_rng(seed)

    def get(self, split):
        data, T = self.splits[split], self.T
        ix = self.rng.integers(0, len(data) - T - 1, self.B)
        xy = torch.from_numpy(np.stack([data[i:i + T + 1].astype(np.int64) for i in ix]))
        return xy[:, :-1], xy[:, 1:]


@torch.no_grad()
def estimate_loss(model, raw, batches: Batches, amp, eval_iters: int) -> dict:
    """nanoGPT: rank 0 only, both splits, then back to train mode."""
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = []
        for _ in range(eval_iters):
            x, y = batches.get(split)
            with amp:
                logits = raw(x)
            losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
        out[split] = sum(losses) / len(losses)
    model.train()
    return out


def train_step(model, opt, batches: Batches, amp, grad_accum: int):
    """One optimizer step: grad_accum micro-batches (no_sync but the last), clip, AdamW; the
    last micro-batch's loss (divided by grad_accum)."""
    for micro in range(grad_accum):
        x, y = batches.get("train")
        ctx = model.no_sync() if micro < grad_accum - 1 else contextlib.nullcontext()
        with ctx:
            with amp:
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / grad_accum
            loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def main():
    args = parse_args()
    t_launch = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    splits = {"train": open_split(args.data, "train")}
    if args.recipe:
        splits["val"] = open_split(args.data, "val")
    raw, model, opt = build(args)
    amp = (torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16"
           else contextlib.nullcontext())
    batches = Batches(splits, args.block_size, args.micro_batch, args.seed + rank)
    times = []
    total = args.steps + (0 if args.recipe else args.warmup)
    for step in range(total + (1 if args.recipe else 0)):
        if args.recipe and (step % args.eval_interval == 0 or step == total) and rank == 0:
            est = estimate_loss(model, raw, batches, amp, args.eval_iters)
            print(json.dumps({"step": step, "train_loss": est["train"], "val_loss": est["val"],
                              "wall_s": time.perf_counter() - t_launch}), flush=True)
        if step == total:
            break
        if args.recipe:
            for group in opt.param_groups:
                group["lr"] = nanogpt_lr(step, args)
        t0 = time.perf_counter()
        loss = train_step(model, opt, batches, amp, args.grad_accum)
        if not args.recipe:
            dist.all_reduce(loss.detach())  # the loss a user would log
        elif rank == 0 and step % 100 == 0:
            print(json.dumps({"step": step, "loss": loss.item() * args.grad_accum}), flush=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0 and args.recipe and args.save:
        torch.save(raw.state_dict(), args.save)
    if rank == 0 and not args.recipe:
        tok_per_step = args.micro_batch * args.block_size * args.grad_accum * world
        print(json.dumps({"tokens_per_s": tok_per_step / statistics.median(times),
                          "threads": torch.get_num_threads()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
