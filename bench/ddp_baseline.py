"""The reference a user would write instead of hpctrain: plain torchrun + DDP, nanoGPT style.

Run: torchrun --nproc_per_node 2 bench/ddp_baseline.py --data DIR --steps N [model/batch flags]

Same GPT (hpctrain.model.GPT: the architecture is not what is being compared), same batch size,
precision and rank count as the hpctrain run it is compared with; eager as in PyTorch's DDP
tutorial, or with --compile as nanoGPT does by default; random windows from a np.memmap of
the training shard, AdamW, grad accumulation with no_sync, clipping. Prints one JSON line with the
median tokens/s over the timed steps (rank 0).
"""
import argparse
import contextlib
import json
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=257)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (nanoGPT's default)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    m = read_manifest(args.data)
    entry = shards_of(m, "train")[0]
    lay = open_shard_layout(os.path.join(args.data, entry["file"]), entry, m)
    tokens = np.memmap(lay.path, dtype=lay.dtype, mode="r", offset=lay.offset, shape=(lay.n_tokens,))

    torch.manual_seed(1337)
    cfg = GPTConfig(args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size)
    model = GPT(cfg)
    if args.compile:  # as nanoGPT: compile first, then wrap in DDP
        model = torch.compile(model)
    model = DDP(model)
    # foreach: PyTorch's multi-tensor path; on CPU AdamW's default is the slower per-tensor loop and
    # nanoGPT asks for the fused kernel only on CUDA, so this is already the better choice on CPU
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    amp = (torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16"
           else contextlib.nullcontext())
    rng = np.random.default_rng(rank)
    T, B = args.block_size, args.micro_batch

    def get_batch():
        ix = rng.integers(0, len(tokens) - T - 1, B)
        xy = torch.from_numpy(np.stack([tokens[i:i + T + 1].astype(np.int64) for i in ix]))
        return xy[:, :-1], xy[:, 1:]

    times = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        for micro in range(args.grad_accum):
            x, y = get_batch()
            ctx = model.no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext()
            with ctx:
                with amp:
                    logits = model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / args.grad_accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())  # the loss a user would log
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    tok_per_step = B * T * args.grad_accum * world
    if rank == 0:
        print(json.dumps({"tokens_per_s": tok_per_step / statistics.median(times),
                          "threads": torch.get_num_threads()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
