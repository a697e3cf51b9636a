"""Needle-in-a-haystack prompts: a passkey sentence at a depth of natural prose, asked for at the end.

The haystack is haystack.txt (procedural prose, see _prose.py; it holds no digits).  A trial is
fixed by its index: depth = depths[i % len(depths)], a wording, a 5-digit value and a starting
sentence all drawn from a seeded RNG, so every mode (full, lru, drafter, qk) sees the same prompts.
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Optional

from .common import haystack_text

WORDINGS = [
    ("The passkey is {v}. Remember it.", "What is the passkey mentioned in the text above?"),
    ("Important note: the secret passkey is {v}.", "What is the secret passkey given in the text above?"),
    ("Write this down, the pass key to the archive is {v}.", "What is the pass key to the archive?"),
    ("The code that opens the vault, also called the passkey, is {v}.", "What is the passkey that opens the vault?"),
]
ANSWER_PREFIX = "The passkey is"


@dataclasses.dataclass
class Trial:
    index: int
    depth: int        # percent of the haystack before the needle
    value: str
    wording: int
    ids: list         # the full prompt, chat template applied, answer prefix appended
    needle_token: int  # approximate token position of the needle


class NeedleBuilder:
    """Builds prompts for one tokenizer; sentences are tokenized once and reused across contexts."""

    def __init__(self, session, seed: int = 1234):
        self.s = session
        self.seed = seed
        text = haystack_text()
        paras = [p.strip() for p in text.split("\n\n") if p.strip()]
        sents: list[str] = []
        for p in paras:
            if "." not in p and "?" not in p:   # a section title: keep as its own line
                sents.append("\n\n" + p + "\n\n")
                continue
            sents.extend(x + " " for x in re.split(r"(?<=[.?!])\s+", p) if x)
        self.sents = sents
        self.lens = [len(session.tokenize(x, add_special=False)) for x in sents]

    def _render(self, body: str, question: str) -> list:
        tok = self.s.tokenizer
        msgs = [{"role": "user", "content": body.strip() + "\n\n" + question + " Answer with the number only."}]
        if tok.chat_template:
            text = tok.apply_chat_template(msgs, add_generation_prompt=True) + ANSWER_PREFIX
        else:  # a base model (e.g. gemma-3-270m's GGUF has no template): plain question and answer
            text = msgs[0]["content"] + "\nAnswer: " + ANSWER_PREFIX
        bos = tok.bos_id
        bos_text = tok.token_text(bos) if bos is not None else "\0"
        return self.s.tokenize(text, add_special=not text.startswith(bos_text), parse_special=True)

    def trial(self, i: int, n_tokens: int, depths: list) -> Trial:
        """Trial i as a prompt of at most n_tokens tokens."""
        rng = random.Random(self.seed * 1000003 + i)
        depth = depths[i % len(depths)]
        value = str(rng.randint(10000, 99999))
        w = i % len(WORDINGS)
        needle, question = WORDINGS[w][0].format(v=value), WORDINGS[w][1]
        start = rng.randrange(len(self.sents))
        overhead = len(self._render(needle, question))
        budget = max(0, n_tokens - overhead - 8)
        for _ in range(6):
            picked, total, k = [], 0, start
            while total < budget:
                picked.append(k % len(self.sents))
                total += self.lens[k % len(self.sents)]
                k += 1
            if total > budget and picked:
                picked.pop()
            # needle after the sentence where the running count crosses depth% of the haystack
            acc, cut = 0, len(picked)
            for j, idx in enumerate(picked):
                if acc >= depth / 100 * total:
                    cut = j
                    break
                acc += self.lens[idx]
            body = "".join(self.sents[x] for x in picked[:cut]) + needle + " " + \
                   "".join(self.sents[x] for x in picked[cut:])
            ids = self._render(body, question)
            if len(ids) <= n_tokens:
                return Trial(i, depth, value, w, ids, needle_token=acc + overhead // 2)
            budget -= len(ids) - n_tokens + 16
        raise ValueError(f"could not fit a needle prompt in {n_tokens} tokens")


def score(answer: str, value: str) -> bool:
    """Exact: the passkey's digits appear in the answer (thousands separators ignored)."""
    return value in answer.replace(",", "").replace(" ", "")
