"""`mpiexec -n 2 python -m data_tools shard --format chat` writes the same bytes as 1 rank
(tokens, loss masks, manifest), with conversations spread over ranks and shards."""
import os

import pytest

from tests.chat_files import chatml_folder, conversations, write_jsonl
from tests.conftest import mpirun

pytestmark = pytest.mark.mpi


def test_chat_shard_two_ranks_byte_identical(tmp_path):
    tok = chatml_folder(tmp_path / "tok")
    data = write_jsonl(tmp_path / "chat.jsonl", conversations(50))
    outs = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}"
        mpirun(n, ["-m", "data_tools", "shard", "--format", "chat", "--input", data, "--output",
                   out, "--tokenizer", tok, "--eot-token", "<|endoftext|>", "--shard-tokens",
                   "900", "--val-fraction", "0.2", "--round-bytes", "4000", "--no-progress"],
               timeout=240, check=True)
        outs[n] = {name: (out / name).read_bytes() for name in sorted(os.listdir(out))}
    names = list(outs[1])
    assert sum(n.startswith("train_") for n in names) >= 5 and any(n.startswith("val_") for n in names)
    assert outs[2] == outs[1]
    r = mpirun(1, ["-m", "data_tools", "verify", tmp_path / "n2"], timeout=120, check=True)
    assert "OK" in r.stdout
