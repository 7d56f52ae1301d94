"""`train-tokenizer` (HF byte-level BPE, offline) and `shard --tokenizer PATH/tokenizer.json`."""
import sys

import numpy as np

from data_tools.corpora import shakespeare_files
from data_tools.format import read_manifest, sha256_file
from data_tools.shard import shard_dataset
from data_tools.tokenizers import get_tokenizer
from data_tools.train_tokenizer import train_tokenizer
from tests.conftest import run_cmd


def test_train_is_deterministic_and_shard_records_it(tmp_path):
    plays = shakespeare_files()[:3]
    a = train_tokenizer(plays, str(tmp_path / "a"), vocab_size=1000)
    r = run_cmd([sys.executable, "-m", "data_tools", "train-tokenizer", "--input", *plays,
                 "--output", tmp_path / "b" / "tok.json", "--vocab-size", "1000"], timeout=120,
                check=True)
    assert "vocab 1000" in r.stdout
    assert sha256_file(a["path"]) == sha256_file(str(tmp_path / "b" / "tok.json"))
    tok = get_tokenizer(a["path"])
    assert tok.vocab_size == 1000 and tok.name == "bpe-" + sha256_file(a["path"])[:12]
    text = open(plays[0], encoding="utf-8").read()[:5000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < 0.6 * len(text)  # it learned merges
    assert tok.eot_id not in tok.encode("a <|endoftext|> b").tolist()  # text stays text
    out = tmp_path / "data"
    m = shard_dataset(plays, str(out), tokenizer=a["path"], val_fraction=0.0, progress=False,
                      log=lambda s: None)
    assert m["tokenizer"]["name"] == tok.name and m["tokenizer"]["file"] == "tokenizer.json"
    assert sha256_file(str(out / "tokenizer.json")) == m["tokenizer"]["sha256"]
    assert read_manifest(str(out))["tokenizer"]["vocab_size"] == 1000
    from data_tools.verify import verify_dataset

    assert verify_dataset(str(out)) == []
    (out / "tokenizer.json").write_text((out / "tokenizer.json").read_text() + " ")
    assert "tokenizer.json: sha256 does not match" in verify_dataset(str(out))[0]
    # and the dataset can be replaced in place (tokenizer.json counts as ours)
    shard_dataset(plays[:1], str(out), tokenizer=a["path"], val_fraction=0.0,
                  progress=False, log=lambda s: None)
    assert read_manifest(str(out))["n_documents"]["train"] == 1
    assert np.asarray(ids).max() < 1000
