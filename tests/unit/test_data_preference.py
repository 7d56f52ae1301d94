"""`shard --format preference`: each pair's chosen and rejected ids equal transformers'
apply_chat_template of prompt + completion, their masks mark the completion's assistant tokens
(transformers' assistant mask without the prompt's turns), a pair stays one document and one
batch index across shard boundaries, and bad rows are one error naming file:line."""
import json

import pytest

from data_tools.format import DataError, read_manifest
from data_tools.shard import shard_dataset
from data_tools.verify import verify_dataset
from hpctrain.data.pairs import PreferencePairs
from tests.chat_files import chatml_folder
from tests.preference_files import preference_rows, write_rows

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return chatml_folder(tmp_path_factory.mktemp("chatml"))


def shard_pairs(rows, tmp_path, tok_dir, fmt="preference", **kw):
    out = tmp_path / "data"
    shard_dataset([str(write_rows(tmp_path / "prefs.jsonl", rows))], str(out),
                  tokenizer=str(tok_dir), val_fraction=0, progress=False, format=fmt,
                  eot_token=EOT, log=lambda m: None, **kw)
    return out


def as_messages(value, role):
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def expected_side(hf, row, side):
    """(ids, mask) transformers gives prompt + completion: its assistant mask, prompt tokens 0."""
    prompt = as_messages(row["prompt"], "user")
    got = hf.apply_chat_template(prompt + as_messages(row[side], "assistant"), tokenize=True,
                                 return_dict=True, return_assistant_tokens_mask=True)
    head = len(hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                      return_dict=True)["input_ids"])
    mask = list(got["assistant_masks"])
    return list(got["input_ids"]), [0] * head + mask[head:]


def test_pairs_equal_transformers_and_mask_only_the_completion(tok_dir, tmp_path):
    from transformers import AutoTokenizer

    rows = preference_rows(30)
    data = shard_pairs(rows, tmp_path, tok_dir, shard_tokens=700)
    m = read_manifest(str(data))
    assert (m["format_version"], m["format"], m["n_documents"]["train"]) == (2, "preference", 30)
    assert len(m["shards"]) >= 4 and verify_dataset(str(data)) == []  # pairs span shards
    hf = AutoTokenizer.from_pretrained(str(tok_dir.parent), local_files_only=True)
    pairs = PreferencePairs(str(data), m, "train", block_size=512)
    assert len(pairs) == 30
    prompt_turns_seen = 0
    for k, row in enumerate(rows):
        for side, (ids, mask) in zip(("chosen", "rejected"), pairs.sides(k)):
            want_ids, want_mask = expected_side(hf, row, side)
            assert ids.tolist() == want_ids and mask.tolist() == want_mask, (k, side)
            assert 0 < mask.sum() < len(mask)
        prompt_turns_seen += any(t["role"] == "assistant" for t in row["prompt"])
    assert prompt_turns_seen >= 5  # prompts with an earlier assistant turn, kept out of the mask


def test_batch_keeps_each_pair_together_cut_and_padded(tok_dir, tmp_path):
    rows = preference_rows(12)
    data = shard_pairs(rows, tmp_path, tok_dir, shard_tokens=300)
    m = read_manifest(str(data))
    full, short = (PreferencePairs(str(data), m, "train", block_size=t) for t in (400, 32))
    batch = full.batch([7, 2, 9])
    assert batch.tokens.shape == (6, 401) and batch.mask.shape == (6, 400)
    assert batch.pairs.tolist() == [7, 2, 9]
    for row, pair in enumerate([7, 2, 9]):
        for side, (ids, mask) in enumerate(full.sides(pair)):
            got = batch.tokens[side * 3 + row]
            assert got[:ids.size].tolist() == ids.tolist()
            assert (got[ids.size:] == full.eot).all()  # padded with end-of-text ...
            assert batch.mask[side * 3 + row].tolist() == (mask[1:].tolist() + [0.0] * (401 - ids.size))
    cut = short.batch([7])
    assert cut.tokens.shape == (2, 33) and cut.tokens[0].tolist() == full.sides(7)[0][0][:33].tolist()


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "hi", "chosen": "a"}, "needs 'prompt', 'chosen' and 'rejected'"),
    ({"prompt": "hi", "chosen": "a", "rejected": [{"role": "user", "content": "b"}]},
     "'rejected' has no assistant message"),
    ({"prompt": [], "chosen": "a", "rejected": "b"}, "'prompt' is neither a string"),
    ({"prompt": "hi", "chosen": [{"role": "robot", "content": "a"}], "rejected": "b"}, "role 'robot'"),
])
def test_bad_row_is_one_error_naming_file_and_line(tok_dir, tmp_path, row, problem):
    rows = [json.loads(json.dumps(r)) for r in preference_rows(2)] + [row]
    with pytest.raises(DataError) as e:
        shard_pairs(rows, tmp_path, tok_dir)
    assert "prefs.jsonl:3" in str(e.value) and problem in str(e.value) and "\n" not in str(e.value)


def test_pairs_reader_refuses_a_chat_dataset(tok_dir, tmp_path):
    convs = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}]
    data = tmp_path / "chat"
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in convs * 3))
    shard_dataset([str(path)], str(data), tokenizer=str(tok_dir), val_fraction=0, progress=False,
                  format="chat", eot_token=EOT, log=lambda m: None)
    with pytest.raises(DataError, match="not a preference dataset"):
        PreferencePairs(str(data), read_manifest(str(data)), "train", 64)
