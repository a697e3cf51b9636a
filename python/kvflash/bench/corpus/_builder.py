"""Needle prompts over the corpus: a document of the genre, one needle at a depth, the question asked
through the chat template or as a raw completion."""
from __future__ import annotations

import dataclasses
import random

from . import GENRES, HINT, NAMES, Stream, check_genre, wordings
from ._base import check_split, fit_tokens

ASKS = ("chat", "raw")


@dataclasses.dataclass
class Trial:
    index: int
    depth: int         # percent of the document before the needle
    value: str
    wording: int
    ids: list          # the whole prompt (chat: template applied, answer prefix appended; raw: the completion)
    needle_token: int  # approximate token position of the needle
    needle: str = ""   # the needle unit as placed
    genre: str = ""
    ask: str = "chat"
    needle_at: int = 0   # characters of the document before the needle
    doc_chars: int = 0   # characters of the document, needle included


def draw_value(rng: random.Random, kind: str, split: str) -> str:
    if kind == "number":
        return str(rng.randint(10000, 99999))
    if kind == "code":
        return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2)) + f"-{rng.randint(1000, 9999)}"
    if kind == "name":
        return rng.choice(NAMES[split])
    raise ValueError(f"unknown value kind {kind!r}")


class NeedleBuilder:
    """Needle trials of one genre and split for one tokenizer.  A trial is fixed by (split, genre, seed,
    index): its document (`corpus.units(genre, split, seed, index)`), its wording (index mod 4), its value
    and its depth (depths[index mod len(depths)]); `ask` chooses how the question is put."""

    def __init__(self, session, seed: int, split: str, genre: str, ask: str = "chat"):
        if ask not in ASKS:
            raise ValueError(f"ask must be one of {ASKS}, got {ask!r}")
        self.s, self.seed = session, seed
        self.split, self.genre, self.ask = check_split(split), check_genre(genre), ask
        self.haystack = genre
        self.wordings = wordings(genre, split)

    def _count(self, text: str) -> int:
        return len(self.s.tokenize(text, add_special=False))

    def render(self, body: str, w: dict, at: dict, end: dict) -> list:
        tok = self.s.tokenizer
        if self.ask == "raw":   # the document continued in its own form; no template, BOS as the model wants
            return self.s.tokenize(body + w["raw"].format(**end), add_special=True)
        content = body.strip() + "\n\n" + w["question"].format(**at) + " " + HINT[w["kind"]]
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
            text += w["answer"]
        else:   # a base model without a template: plain question and answer (as needle.NeedleBuilder does)
            text = content + "\nAnswer: " + w["answer"]
        bos = tok.bos_id
        bos_text = tok.token_text(bos) if bos is not None else "\0"
        return self.s.tokenize(text, add_special=not text.startswith(bos_text), parse_special=True)

    def trial(self, i: int, n_tokens: int, depths: list) -> Trial:
        """Trial i as a prompt of at most n_tokens tokens."""
        rng = random.Random(f"kvflash-corpus-needle/{self.split}/{self.genre}/{self.seed}/{i}")
        depth = depths[i % len(depths)]
        wi = i % len(self.wordings)
        w = self.wordings[wi]
        value = draw_value(rng, w["kind"], self.split)
        stream = Stream(self.genre, self.split, self.seed, i, count=self._count)
        stream.take(1)
        first = stream.units[0].at
        overhead = len(self.render(w["needle"].format(v=value, **first), w, first, stream.units[1].at))

        def build(budget):
            nonlocal value
            k = stream.take(budget)
            units, sizes = stream.units[:k], stream.sizes[:k]
            total = sum(sizes)
            acc, cut = 0, k
            for j in range(1, k):   # never before the first unit (a title, a header row, a module docstring)
                acc += sizes[j - 1]
                if acc >= depth / 100 * total:
                    cut = j
                    break
            else:
                acc = total
            at = stream.units[cut].at   # the unit the needle goes before (the end fields at the very end)
            end = stream.units[k].at
            doc = "".join(u.text for u in units)
            tries = 0
            while value.lower() in doc.lower() or value.lower() in w["raw"].format(**end).lower():
                value = draw_value(rng, w["kind"], self.split)   # the value must occur once in the prompt
                tries += 1
                if tries > 1000:
                    raise ValueError(f"no {w['kind']} value absent from the {self.genre} document")
            needle = w["needle"].format(v=value, **at)
            pre = "".join(u.text for u in units[:cut])
            body = pre + needle + "".join(u.text for u in units[cut:])
            ids = self.render(body, w, at, end)
            return len(ids), Trial(i, depth, value, wi, ids,
                                   needle_token=acc + (overhead if self.ask == "chat" else 0) // 2, needle=needle,
                                   genre=self.genre, ask=self.ask, needle_at=len(pre), doc_chars=len(body))
        best = fit_tokens(build, n_tokens, max(1, n_tokens - overhead - 8), floor=True)
        if best is not None:
            return best
        raise ValueError(f"could not fit a {self.genre} needle prompt in {n_tokens} tokens")


__all__ = ["ASKS", "GENRES", "NeedleBuilder", "Trial", "draw_value"]
