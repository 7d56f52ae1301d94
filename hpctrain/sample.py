"""`python -m hpctrain sample`: generate text from a committed checkpoint (single process).

Owns: the command's flags and what it prints. Which checkpoint a path means, rebuilding the model
from the config stored in it, loading (through the checkpoint manager: verified, never unpickled)
and the dataset's tokenizer are the Python API's (hpctrain/api.py, `hpctrain.load`); choosing
tokens is hpctrain/model/sampling.py's.
"""
from __future__ import annotations

import argparse

from hpctrain.errors import UserError


def _print_real_words(text: str, dataset: str) -> None:
    from hpctrain.sample_words import MIN_LETTERS, real_word_fraction, training_vocabulary

    fraction, n = real_word_fraction(text, training_vocabulary(dataset))
    print(f"# real words: {fraction:.0%} of {n} sampled words (letters only, >= {MIN_LETTERS}) are in "
          f"the training text of {dataset}")


def _check_args(args) -> None:
    """One UserError naming the flag, before anything is loaded."""
    from hpctrain.model.sampling import check_sampling

    if args.tokens < 1:
        raise UserError(f"sample --tokens {args.tokens}: must be >= 1 (tokens to generate)")
    problem = check_sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    if problem is not None:
        flag, _, rest = problem.partition(" ")
        raise UserError(f"sample --{flag.replace('_', '-')} {rest}")
    from hpctrain.api import resolve_device

    try:
        resolve_device(args.device)
    except UserError as e:  # "device 'x': ..." -> "sample --device 'x': ..."
        raise UserError(f"sample --{e}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpctrain sample",
        description="Generate text from a trained checkpoint (in Python: hpctrain.load(path)"
                    ".generate(...), README \"Python API\"). The next token is chosen as "
                    "transformers' generate() does: the repetition penalty, then temperature, "
                    "top-k and top-p.")
    parser.add_argument("--checkpoint", required=True,
                        help="run dir, checkpoint root, or a checkpoint step dir (newest committed is used)")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--tokens", type=int, default=200, help="number of tokens to generate (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="divides the logits before sampling: < 1 sharper, > 1 flatter; "
                             "0 = greedy (always the most likely token); default %(default)s")
    parser.add_argument("--top-k", type=int, default=50,
                        help="sample from the k most likely tokens only (0 = all; default %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: only the most likely tokens whose probabilities "
                             "add up to p (in (0, 1]; 1 = all, the default; the most likely is always kept)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="> 1 makes tokens already in the text (prompt included) less likely: "
                             "a positive logit is divided by it, a negative one multiplied "
                             "(1 = off, the default; 1.1-1.3 is usual)")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="stop at the tokenizer's end-of-text token (default: write --tokens "
                             "tokens, end-of-text ones included)")
    parser.add_argument("--seed", type=int, default=0,
                        help="sampling seed (default %(default)s): the same seed, the same text")
    parser.add_argument("--device", default="cpu",
                        help="where the model runs: cpu, cuda, cuda:1 (the GPU's numerics may "
                             "choose other tokens than the CPU's; default %(default)s)")
    parser.add_argument("--real-words", metavar="DATASET", default=None,
                        help="also print the fraction of sampled words (letters only, >= 3 letters) "
                             "found in DATASET's training text: how much of the sample is real words")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    _check_args(args)

    from hpctrain.api import load_as
    from hpctrain.checkpoint import disk_format
    from hpctrain.distributed import init_distributed, teardown

    ctx = init_distributed("gloo", timeout_s=120)
    try:
        if ctx.world_size > 1:
            raise UserError(f"sample runs as one process but was started as {ctx.world_size} ranks: "
                            f"run `python -m hpctrain sample ...` without mpiexec/srun")
        lm = load_as(args.checkpoint, device=args.device, use="sample")
        if lm.tokenizer is None:
            raise UserError(f"{lm.path / disk_format.TRAINER_STATE_FILE}: no tokenizer (not a "
                            f"checkpoint of `hpctrain train`); sample a training run's checkpoint")
        ids = lm.encode(args.prompt) or [lm.tokenizer.eot_id]
        out = lm.generate(ids, args.tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop_at_eos=args.stop_at_eos)
        print(f"# checkpoint {lm.path} (step {lm.step})")
        print(lm.decode(out))
        if args.real_words:  # the generated part only: the prompt's words would count as real
            _print_real_words(lm.decode(out[len(ids):]), args.real_words)
    finally:
        teardown()
    return 0
