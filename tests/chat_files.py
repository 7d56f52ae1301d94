"""What the chat-data tests share: a ChatML tokenizer folder made here (a byte-level BPE trained
on three plays + a tokenizer_config.json whose template marks assistant turns with
``{% generation %}``, so transformers can compute its own assistant mask), and 50 conversations
made of the plays' speeches (multi-turn, empty and missing system prompts, unicode, a
conversation ending on a user turn)."""
import json
import random

from tests.tokenizer_files import plays

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}"
          "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
          "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
UNICODE = ["café, naïve façade", "日本語のテキスト", "emoji 🙂🎭 and ß", "Ελληνικά — «quoted»"]


def chatml_folder(root, template=CHATML, eos="<|im_end|>"):
    """root/tokenizer.json + root/tokenizer_config.json; returns root/tokenizer.json."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(plays(3), vocab_size=3000, special_tokens=SPECIALS,
                            show_progress=False)
    root.mkdir(parents=True, exist_ok=True)
    bpe.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
              "pad_token": "<|endoftext|>", "model_max_length": 1 << 20}
    if template is not None:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return root / "tokenizer.json"


def speeches():
    """The plays' speeches: paragraphs of at least 40 characters, white space folded."""
    out = []
    for play in plays(3):
        for para in play.split("\n\n"):
            text = " ".join(para.split())
            if len(text) >= 40:
                out.append(text[:400])
    return out


def conversations(n=50, seed=0):
    rng, lines = random.Random(seed), speeches()
    convs = []
    for k in range(n):
        msgs = []
        if k % 3 == 0:
            msgs.append({"role": "system", "content": "" if k % 2 else "You are Hamlet."})
        for turn in range(rng.randint(1, 3)):
            for role in ("user", "assistant"):
                msgs.append({"role": role, "content": rng.choice(lines)})
        if k % 5 == 1:
            msgs[-1]["content"] += " " + UNICODE[k % len(UNICODE)]
        if k % 7 == 2:
            msgs.append({"role": "user", "content": rng.choice(lines)})  # ends on a user turn
        convs.append(msgs)
    return convs


def write_jsonl(path, convs):
    path.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n"
                            for c in convs), encoding="utf-8")
    return path
