"""`python -m hpctrain sample`: generate text from a committed checkpoint (single process).

Owns: resolving which checkpoint to load (a run dir, a checkpoint root or one step dir), rebuilding the
model from the config stored in the checkpoint, and decoding with the dataset's tokenizer. Loading
goes through the checkpoint manager (verified, never unpickled).
"""
from __future__ import annotations

import argparse
import math

import torch

from hpctrain.errors import UserError


def _print_real_words(text: str, dataset: str) -> None:
    from hpctrain.sample_words import MIN_LETTERS, real_word_fraction, training_vocabulary

    fraction, n = real_word_fraction(text, training_vocabulary(dataset))
    print(f"# real words: {fraction:.0%} of {n} sampled words (letters only, >= {MIN_LETTERS}) are in "
          f"the training text of {dataset}")


def _check_args(args) -> None:
    """One UserError naming the flag, before anything is loaded."""
    if args.tokens < 1:
        raise UserError(f"sample --tokens {args.tokens}: must be >= 1 (tokens to generate)")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UserError(f"sample --temperature {args.temperature}: must be a finite number >= 0 "
                        f"(0 = greedy)")
    if args.top_k < 0:
        raise UserError(f"sample --top-k {args.top_k}: must be >= 0 (0 = every token)")


def _load(path):
    """(the model of checkpoint `path`, eval mode; its trainer entry): rebuilt from the [model]
    section saved with it, the weights loaded through the checkpoint manager (verified)."""
    from hpctrain.checkpoint import CheckpointManager, disk_format
    from hpctrain.model import build_model_from_section

    saved = disk_format.read_trainer_state(path, use="sample").get("trainer") or {}
    if not isinstance(saved.get("config"), dict) or not saved["config"].get("model") \
            or not isinstance(saved.get("tokenizer"), dict):
        raise UserError(f"{path / disk_format.TRAINER_STATE_FILE}: no config.model or tokenizer "
                        f"(not a checkpoint of `hpctrain train`); sample a training run's checkpoint")
    model = build_model_from_section(saved["config"]["model"])
    state = {"model": model.state_dict()}
    mgr = CheckpointManager(path.parent, keep=1, rank=0, world_size=1)
    mgr.load(path, state)  # loads only the keys present: the model, not the optimizer
    model.load_state_dict(state["model"])
    return model.eval(), saved


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hpctrain sample",
                                     description="Generate text from a trained checkpoint.")
    parser.add_argument("--checkpoint", required=True,
                        help="run dir, checkpoint root, or a checkpoint step dir (newest committed is used)")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--tokens", type=int, default=200, help="number of tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample from the k most likely tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--real-words", metavar="DATASET", default=None,
                        help="also print the fraction of sampled words (letters only, >= 3 letters) "
                             "found in DATASET's training text: how much of the sample is real words")
    args = parser.parse_args(argv)
    _check_args(args)

    from data_tools.tokenizers import dataset_tokenizer
    from hpctrain.checkpoint.cli import resolve_checkpoint
    from hpctrain.distributed import init_distributed, teardown

    ctx = init_distributed("gloo", timeout_s=120)
    try:
        if ctx.world_size > 1:
            raise UserError(f"sample runs as one process but was started as {ctx.world_size} ranks: "
                            f"run `python -m hpctrain sample ...` without mpiexec/srun")
        path = resolve_checkpoint(args.checkpoint, use="sample")
        model, saved = _load(path)
        tok = dataset_tokenizer(saved["tokenizer"], saved["config"].get("data", {}).get("path", ""))
        ids = tok.encode(args.prompt)
        if len(ids) == 0:
            ids = [saved["tokenizer"]["eot_id"]]
        gen = torch.Generator().manual_seed(args.seed)
        out = model.generate(torch.tensor([list(ids)], dtype=torch.long), args.tokens,
                             temperature=args.temperature, top_k=args.top_k or None, generator=gen)
        print(f"# checkpoint {path} (step {saved['step']})")
        print(tok.decode(out[0].tolist()))
        if args.real_words:  # the generated part only: the prompt's words would count as real
            _print_real_words(tok.decode(out[0][len(ids):].tolist()), args.real_words)
    finally:
        teardown()
    return 0
