"""The Python API, `hpctrain.load(path)` (hpctrain/api.py), and the decoding it shares with `hpctrain
sample` (hpctrain/model/sampling.py): which checkpoint a path means, the weights loaded as saved,
eval mode, the run's tokenizer, one-line errors naming the path; greedy = the argmax chain of
`logits`; top-k = 1 and a tiny top-p are greedy at any temperature; the processed scores equal
transformers' logits processors; seeded sampling repeats; eos ends a row. Against transformers
(a test-only dependency, offline): a Hugging Face folder built here and our own export give the
logits and the greedy tokens of transformers' generate(do_sample=False), and our parameter counts
are its num_parameters().
"""
from __future__ import annotations

import shutil
import sys

import pytest
import torch

import hpctrain
from hpctrain.checkpoint import CheckpointManager
from hpctrain.errors import UserError
from hpctrain.model import build_model_from_section
from hpctrain.model.params import hf_param_counts
from hpctrain.model.sampling import keep_top_k, keep_top_p, penalize_repetition, process_logits
from tests.conftest import run_cmd
from tests.hf_models import OFFLINE, make_hf_model

# an untied GQA Llama on the byte tokenizer (257 ids, end-of-text 256)
SECTION = {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "block_size": 32,
           "vocab_size": 257, "ffn_hidden": 48, "dropout": 0.0}
TOKENIZER = {"name": "bytes", "vocab_size": 257, "eot_id": 256}
PROMPT = list(b"KING ")


def random_model(seed: int):
    torch.manual_seed(seed)
    model = build_model_from_section(SECTION)
    with torch.no_grad():
        for p in model.parameters():  # not init-time values: every norm matters
            p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run dir with checkpoints at steps 10 and 20 of two different models (full checksums)."""
    run = tmp_path_factory.mktemp("api") / "run"
    mgr = CheckpointManager(run / "checkpoints", keep=3, rank=0, world_size=1, full_checksums=True)
    models = {10: random_model(1), 20: random_model(2)}
    for step, model in models.items():
        mgr.save(step, {"model": model.state_dict()},
                 {"step": step, "world_size": 1, "config": {"model": SECTION, "data": {"path": ""}},
                  "tokenizer": TOKENIZER})
    return run, models


@pytest.fixture(scope="module")
def lm(run):
    return hpctrain.load(run[0], device="cpu")


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_run_dir_gives_its_newest_checkpoint_or_the_step_asked_for(run, lm):
    path, models = run
    ckpts = path / "checkpoints"
    assert (lm.step, lm.path) == (20, ckpts / "step_00000020")
    assert same_weights(lm.model, models[20]) and not lm.model.training
    assert lm.device == torch.device("cpu") and next(lm.model.parameters()).device.type == "cpu"
    assert lm.model.lm_head.weight is not lm.model.tok_emb.weight  # untied stays untied
    older = hpctrain.load(path, step=10, device="cpu")
    assert older.step == 10 and same_weights(older.model, models[10])
    one = hpctrain.load(ckpts / "step_00000010", device="cpu")
    assert one.path == ckpts / "step_00000010" and same_weights(one.model, models[10])
    assert lm.tokenizer.name == "bytes" and lm.encode("KING ") == PROMPT
    assert lm.decode(PROMPT) == "KING " and lm.eos_ids == (256,)


def test_a_bad_path_or_step_is_one_user_error_naming_it(run, tmp_path):
    path, _ = run
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = {tmp_path / "nope": "no such file or directory", tmp_path / "file": "not a directory",
             tmp_path / "empty": "holds no checkpoint and no config.json"}
    for bad, words in cases.items():
        with pytest.raises(UserError) as e:
            hpctrain.load(bad)
        assert str(e.value).startswith(f"{bad}: {words}") and "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"checkpoints: no checkpoint of step 15 \(steps there: 20, 10\)$"):
        hpctrain.load(path, step=15)
    with pytest.raises(UserError, match="^device 'nonsense': not a device name"):
        hpctrain.load(path, device="nonsense")


def test_a_flipped_byte_is_caught_by_the_checksums(run, tmp_path):
    """Loading goes through the checkpoint manager: every data file against its checksum."""
    copy = tmp_path / "run"
    shutil.copytree(run[0], copy)
    step = copy / "checkpoints" / "step_00000020"
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        hpctrain.load(step, device="cpu")
    assert str(step) in str(e.value) and "xxh3_128" in str(e.value), str(e.value)


def test_logits_of_a_sequence_and_of_a_batch(lm, run):
    ids = PROMPT + [7, 200]
    one = lm.logits(ids)
    assert one.shape == (len(ids), 257) and one.dtype == torch.float32
    batch = lm.logits(torch.tensor([ids, ids[::-1]]))
    assert batch.shape == (2, len(ids), 257)
    with torch.no_grad():
        direct = run[1][20](torch.tensor([ids, ids[::-1]]))
    assert torch.equal(batch, direct)
    assert (batch[0] - one).abs().max().item() < 1e-5  # a batch of 1: other matmul blocking
    for bad in ([], [257], [-1], [[1.5]]):
        with pytest.raises(UserError, match="^ids: "):
            lm.logits(bad)


def argmax_chain(lm, ids: list[int], n: int, penalty: float = 1.0) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        last = lm.logits(ids[-lm.block_size:])[-1:]
        if penalty != 1.0:
            last = penalize_repetition(last, torch.tensor([ids]), penalty)
        ids.append(int(last.argmax()))
    return ids


def test_greedy_is_the_argmax_chain_of_the_logits(lm):
    want = argmax_chain(lm, PROMPT, 40)  # past block_size 32: the window slides
    assert lm.generate(PROMPT, 40, stop_at_eos=False) == want
    assert lm.generate(torch.tensor(PROMPT), 40, stop_at_eos=False) == want
    assert lm.generate(PROMPT, 40, repetition_penalty=1.8, stop_at_eos=False) == \
        argmax_chain(lm, PROMPT, 40, penalty=1.8) != want


def test_top_k_1_and_a_tiny_top_p_are_greedy_at_any_temperature(lm):
    greedy = lm.generate(PROMPT, 20, stop_at_eos=False)
    for temperature in (0.3, 1.0, 4.0):
        for seed in (0, 1):
            assert lm.generate(PROMPT, 20, temperature, top_k=1, seed=seed, stop_at_eos=False) == greedy
            assert lm.generate(PROMPT, 20, temperature, top_p=1e-6, seed=seed, stop_at_eos=False) == greedy
    sampled = lm.generate(PROMPT, 20, 4.0, seed=0, stop_at_eos=False)
    assert sampled != greedy  # the control: at 4.0 plain sampling leaves the greedy path


def test_seeded_sampling_repeats_and_another_seed_differs(lm, run):
    kw = dict(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.2, stop_at_eos=False)
    a = lm.generate(PROMPT, 30, seed=7, **kw)
    assert a == lm.generate(PROMPT, 30, seed=7, **kw)
    assert a == hpctrain.load(run[0], device="cpu").generate(PROMPT, 30, seed=7, **kw)
    assert a != lm.generate(PROMPT, 30, seed=8, **kw)


def test_generation_stops_at_eos(lm):
    free = lm.generate(PROMPT, 12, stop_at_eos=False)
    eos = free[len(PROMPT) + 3]  # pretend the 4th new token is the end of text
    lm_eos, lm.eos_ids = lm.eos_ids, (eos,)
    try:
        stopped = lm.generate(PROMPT, 12)
        assert stopped == free[:free.index(eos, len(PROMPT)) + 1]
        batch = lm.generate(torch.tensor([PROMPT, PROMPT[::-1]]), 12)
        assert batch[0].tolist()[:len(stopped)] == stopped
        assert set(batch[0, len(stopped):].tolist()) <= {eos}  # a finished row: padded with eos
        text = lm.generate("KING ", 12)  # text: without the final eos
        assert text == lm.decode(stopped[:-1])
    finally:
        lm.eos_ids = lm_eos


def test_bad_sampling_arguments_are_one_user_error(lm):
    for kw, words in ((dict(temperature=-1), "temperature -1"), (dict(top_p=0.0), "top_p 0.0"),
                      (dict(top_k=-2), "top_k -2"), (dict(repetition_penalty=0), "repetition_penalty 0"),
                      (dict(max_new_tokens=-1), "max_new_tokens -1")):
        with pytest.raises(UserError, match=f"^generate: {words}: must be"):
            lm.generate(PROMPT, **{"max_new_tokens": 3, **kw})


@pytest.mark.parametrize("penalty, temperature, top_k, top_p", [
    (1.0, 0.0, None, 1.0), (1.3, 0.0, None, 1.0), (0.7, 1.0, None, 1.0), (1.0, 0.7, 5, 1.0),
    (1.0, 1.3, None, 0.8), (1.5, 0.6, 20, 0.9), (1.2, 1.0, 1, 0.5), (1.0, 2.0, 300, 0.05)])
def test_processed_scores_equal_transformers(penalty, temperature, top_k, top_p):
    from transformers.generation.logits_process import (LogitsProcessorList,
                                                        RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 256, generator=g) * 3
    logits[0] = 0.0  # uniform: probabilities k / 256 exactly, a top_p of 0.5 falls on a boundary
    seen = torch.randint(0, 256, (4, 24), generator=g)
    seen[:, :6] = seen[:, 6:12]  # repeated ids: a token is penalized once
    chain = [RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1.0 else []
    if temperature > 0:
        chain.append(TemperatureLogitsWarper(temperature))
        chain += [TopKLogitsWarper(top_k)] if top_k else []
        chain += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    theirs = LogitsProcessorList(chain)(seen, logits.clone())
    ours = process_logits(logits.clone(), seen, temperature, top_k, top_p, penalty)
    kept = torch.isfinite(theirs)
    assert torch.equal(kept, torch.isfinite(ours))
    assert (ours[kept] - theirs[kept]).abs().max().item() <= 1e-6
    assert 1 <= int(kept.sum(-1).min()) and (top_p < 1.0 or top_k or temperature == 0 or kept.all())


def test_the_repetition_penalty_sees_the_whole_sequence_not_only_the_window():
    """As transformers (which has no window): a token written before the last block_size ones is
    still penalized. The model prefers 0, then 1, 2, ...; a strong penalty makes it walk on."""
    from hpctrain.model.sampling import generate

    def forward(ids):  # logits [B, t, V]: token v scores 10 - v, whatever the input
        return (10.0 - torch.arange(8.0)).expand(ids.shape[0], ids.shape[1], 8)

    out = generate(forward, torch.tensor([[7]]), 6, block_size=2, repetition_penalty=100.0)
    assert out.tolist() == [[7, 0, 1, 2, 3, 4, 5]]
    assert generate(forward, torch.tensor([[7]]), 3, block_size=2).tolist() == [[7, 0, 0, 0]]


def test_the_repetition_penalty_lowers_only_the_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out = penalize_repetition(logits, torch.tensor([[0, 1, 1]]), 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]  # positive / 2, negative x 2, others kept
    assert keep_top_k(logits, 2).isfinite().tolist() == [[True, False, True, False, False]]
    assert keep_top_p(logits, 1e-9).isfinite().sum().item() == 1


@pytest.mark.parametrize("kind", ["llama_gqa_untied", "qwen2_tied", "gpt2", "mixtral"])
def test_a_hugging_face_folder_generates_what_transformers_does(kind, tmp_path):
    hf = make_hf_model(kind, tmp_path)
    lm = hpctrain.load(tmp_path, device="cpu")
    assert lm.step is None and lm.tokenizer is None and not lm.model.training
    tokens = torch.randint(0, 131, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (lm.logits(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
    assert hf_param_counts(lm.model) == (hf.num_parameters(), hf.num_parameters(exclude_embeddings=True))
    eos = hf.generation_config.eos_token_id
    for prompt in tokens.tolist():
        theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                             max_new_tokens=20, do_sample=False, pad_token_id=eos)[0].tolist()
        assert lm.generate(prompt, 20) == theirs, kind


def test_our_export_generates_in_transformers_what_we_generate(run, lm, tmp_path):
    from transformers import AutoModelForCausalLM

    from hpctrain.export import export_hf

    out = export_hf(run[0], tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert hf_param_counts(lm.model) == (hf.num_parameters(), hf.num_parameters(exclude_embeddings=True))
    exported = hpctrain.load(out, device="cpu")
    assert exported.eos_ids == (256,)
    theirs = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                         max_new_tokens=20, do_sample=False, pad_token_id=256)[0].tolist()
    assert lm.generate(PROMPT, 20) == exported.generate(PROMPT, 20) == theirs


def test_sample_prints_what_the_api_generates(run, lm):
    r = run_cmd([sys.executable, "-m", "hpctrain", "sample", "--checkpoint", str(run[0]), "--prompt",
                 "KING ", "--tokens", "15", "--temperature", "0.9", "--top-p", "0.8",
                 "--repetition-penalty", "1.3", "--seed", "5"], timeout=120, check=True, env=OFFLINE)
    ids = lm.generate(PROMPT, 15, 0.9, top_k=50, top_p=0.8, repetition_penalty=1.3, seed=5,
                      stop_at_eos=False)
    assert r.stdout == f"# checkpoint {lm.path} (step 20)\n{lm.decode(ids)}\n"
    r = run_cmd([sys.executable, "-m", "hpctrain", "sample", "--checkpoint", str(run[0]), "--top-p",
                 "1.5"], timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == \
        "error: sample --top-p 1.5: must be in (0, 1] (1 = every token)"


def test_the_readme_example_runs(run, root, capsys):
    """README "Python API": its code block, run on this run dir instead of runs/demo."""
    import re

    text = (root / "README.md").read_text().split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert 'hpctrain.load("runs/demo")' in code
    exec(code.replace('"runs/demo"', repr(str(run[0]))), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("<LoadedModel Llama from ") and lines[-1].endswith(" True"), lines


def test_a_hugging_face_folder_brings_its_tokenizer(tmp_path):
    """tokenizer.json (its end-of-text found as `sample` finds it), or GPT-2's genuine vocab.json +
    merges.txt; text in, text out through it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from data_tools.tokenizer_files import write_hf_tokenizer

    make_hf_model("llama_gqa_untied", tmp_path / "words")
    vocab = {**{f"w{i}": i for i in range(130)}, "</s>": 130}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "words" / "tokenizer.json"))
    lm = hpctrain.load(tmp_path / "words", device="cpu")
    assert lm.encode("w5 w7") == [5, 7] and lm.tokenizer.eot_id == 130 and lm.eos_ids == (2,)
    ids = lm.generate([5, 7], 6)
    assert lm.generate("w5 w7", 6) == lm.decode([i for i in ids if i != 2])
    assert lm.decode(ids).startswith("w5 w7 ")

    make_hf_model("gpt2", tmp_path / "gpt2")
    write_hf_tokenizer({"name": "gpt2"}, "", str(tmp_path / "gpt2"))
    lm = hpctrain.load(tmp_path / "gpt2", device="cpu")  # its tokenizer.json first, as transformers
    assert lm.encode("Hello world") == [15496, 995]
    (tmp_path / "gpt2" / "tokenizer.json").unlink()  # then GPT-2's genuine vocab.json + merges.txt
    lm = hpctrain.load(tmp_path / "gpt2", device="cpu")
    assert lm.tokenizer.name == "gpt2" and lm.encode("Hello world") == [15496, 995]
