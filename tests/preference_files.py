"""What the DPO tests share: a toy preference set made here from the plays' speeches
(tests/chat_files.py): the prompt is one speech, the chosen completion the speech that follows it,
the rejected completion the same words shuffled; every third prompt a conversation with a system
message and an earlier exchange (its assistant turn must stay out of the mask), every fourth
completion a plain string (TRL's rows allow both)."""
import json
import random

from tests.chat_files import speeches


def preference_rows(n=64, seed=0, length=120):
    rng, lines = random.Random(seed), speeches()
    rows = []
    for k in range(n):
        i = rng.randrange(len(lines) - 1)
        prompt, answer = lines[i][:length], lines[i + 1][:length]
        words = answer.split()
        rng.shuffle(words)
        msgs = [{"role": "user", "content": prompt}]
        if k % 3 == 0:
            msgs = [{"role": "system", "content": "Continue the play."},
                    {"role": "user", "content": lines[i - 1][:40]},
                    {"role": "assistant", "content": lines[i - 1][40:80] or "Ay."}] + msgs
        chosen, rejected = answer, " ".join(words)
        if k % 4:
            chosen = [{"role": "assistant", "content": chosen}]
            rejected = [{"role": "assistant", "content": rejected}]
        rows.append({"prompt": msgs, "chosen": chosen, "rejected": rejected})
    return rows


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path
