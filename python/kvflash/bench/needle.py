"""Needle-in-a-haystack prompts: a passkey sentence at a depth of natural prose, asked for at the end.

Data splits, never mixed: **tuning** (what policy parameters were and may be chosen on:
haystack.txt's procedural prose, the four TUNING_WORDINGS, trials drawn from `--seed`, 1234 by
default), **tuning-indirect** (tuning data too: the same prose, four TUNING_INDIRECT_WORDINGS whose
question names the needle with a generic noun and whose answer prefix repeats none of its rare words,
trials from a seed space of their own) and **reporting** (what committed quality figures are measured on: two haystacks --
"prose", the same procedural prose at other positions, and "ledger", town records full of numbers
that can distract (_ledger.py) -- the REPORTING_WORDINGS, which no tuning run used, and trials drawn
from a seed space of their own).  A trial is fixed by (split, haystack, seed, index): depth =
depths[i % len(depths)], a wording, a 5-digit value absent from the rest of the prompt and a starting
sentence, all from a seeded RNG, so every mode (full, lru, drafter, qk) sees the same prompts.

The corpus genres (`corpus/`: code, chat, csv, wiki, manual, fiction, syslog, legal, email, config) are
haystacks too: `make_builder` returns a `corpus.NeedleBuilder` for them, with the corpus's own tuning and
reporting documents, wordings and seeds (its docstring says how they are kept apart).  `ask="raw"` puts the
question without the chat template (here: the document, the question and "Answer: " with the answer prefix;
in the corpus: the document continued in its own form).
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Optional

from ._ledger import ledger_text
from .common import haystack_text

# (needle, question, answer prefix).  Tuning: every drafter/qk parameter search so far ran on these.
TUNING_WORDINGS = [
    ("The passkey is {v}. Remember it.", "What is the passkey mentioned in the text above?", "The passkey is"),
    ("Important note: the secret passkey is {v}.", "What is the secret passkey given in the text above?",
     "The passkey is"),
    ("Write this down, the pass key to the archive is {v}.", "What is the pass key to the archive?",
     "The passkey is"),
    ("The code that opens the vault, also called the passkey, is {v}.", "What is the passkey that opens the vault?",
     "The passkey is"),
]
# Tuning too, added after qk missed on the one indirect reporting wording: the question and the answer prefix
# name the needle by a common noun ("the code", "the tally"), not by a rare word like "passkey".  No noun of
# these occurs in a reporting wording.
TUNING_INDIRECT_WORDINGS = [
    ("Scratched into the bench by the mill was the code to the garden gate, {v}.",
     "What is the code to the garden gate?", "The code is"),
    ("For the town's books, the blue wagon carries registration {v}.",
     "What registration does the blue wagon carry?", "The registration is"),
    ("Among the baker's papers was a ticket, and the ticket read {v}.",
     "What did the baker's ticket read?", "The ticket read"),
    ("At the end of the harvest the shepherd's tally came to {v}.",
     "What did the shepherd's tally come to?", "The tally came to"),
]
# Reporting: held out from every tuning run.
REPORTING_WORDINGS = [
    ("One more thing to keep in mind: the magic number for the lighthouse is {v}.",
     "What is the magic number for the lighthouse?", "The magic number for the lighthouse is"),
    ("Among these notes is the combination of the captain's strongbox, which is {v}.",
     "What is the combination of the captain's strongbox?", "The combination is"),
    ("A reminder for the reader: the special verification figure is {v}.",
     "What is the special verification figure mentioned in the text?", "The special verification figure is"),
    ("The archivist's private reference, which you will be asked about, is {v}.",
     "What is the archivist's private reference?", "The archivist's private reference is"),
]
ANSWER_PREFIX = "The passkey is"
SPLITS = ("tuning", "tuning-indirect", "reporting")
TUNING_SPLITS = ("tuning", "tuning-indirect")
HAYSTACKS = {"prose": haystack_text, "ledger": ledger_text}


@dataclasses.dataclass
class Trial:
    index: int
    depth: int        # percent of the haystack before the needle
    value: str
    wording: int
    ids: list         # the full prompt, chat template applied, answer prefix appended
    needle_token: int  # approximate token position of the needle


def sentence_units(text: str) -> list:
    """A haystack cut into the units a needle may be placed between: sentences (each with its trailing
    space), and section titles (a paragraph without a full stop) kept on a line of their own."""
    sents: list[str] = []
    for p in (p.strip() for p in text.split("\n\n")):
        if not p:
            continue
        if "." not in p and "?" not in p:   # a section title: keep as its own line
            sents.append("\n\n" + p + "\n\n")
            continue
        sents.extend(x + " " for x in re.split(r"(?<=[.?!])\s+", p) if x)
    return sents


class NeedleBuilder:
    """Builds prompts for one tokenizer; sentences are tokenized once and reused across contexts."""

    def __init__(self, session, seed: int = 1234, split: str = "tuning", haystack: str = "prose", ask: str = "chat"):
        if ask not in ("chat", "raw"):
            raise ValueError(f"ask must be chat or raw, got {ask!r}")
        self.ask = ask
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if haystack not in HAYSTACKS:
            raise ValueError(f"haystack must be one of {sorted(HAYSTACKS)}, got {haystack!r}")
        if split in TUNING_SPLITS and haystack != "prose":
            raise ValueError(f"the {split} split has one haystack, 'prose'; the ledger haystack is reporting data")
        self.s = session
        self.seed = seed
        self.split, self.haystack = split, haystack
        self.wordings = {"tuning": TUNING_WORDINGS, "tuning-indirect": TUNING_INDIRECT_WORDINGS,
                         "reporting": REPORTING_WORDINGS}[split]
        sents = sentence_units(HAYSTACKS[haystack]())
        self.sents = sents
        self.lens = [len(session.tokenize(x, add_special=False)) for x in sents]

    def _render(self, body: str, question: str, prefix: str = ANSWER_PREFIX) -> list:
        tok = self.s.tokenizer
        msgs = [{"role": "user", "content": body.strip() + "\n\n" + question + " Answer with the number only."}]
        if tok.chat_template and self.ask == "chat":
            text = tok.apply_chat_template(msgs, add_generation_prompt=True) + prefix
        else:  # a base model (e.g. gemma-3-270m's GGUF has no template): plain question and answer
            text = msgs[0]["content"] + "\nAnswer: " + prefix
        bos = tok.bos_id
        bos_text = tok.token_text(bos) if bos is not None else "\0"
        return self.s.tokenize(text, add_special=not text.startswith(bos_text), parse_special=True)

    def trial(self, i: int, n_tokens: int, depths: list) -> Trial:
        """Trial i as a prompt of at most n_tokens tokens."""
        if self.split == "tuning":   # the tuning trials as every tuning run drew them
            rng = random.Random(self.seed * 1000003 + i)
        else:                        # a seed space of its own (str seeds hash the same in every process)
            rng = random.Random(f"kvflash-{self.split}:{self.haystack}:{self.seed}:{i}")
        depth = depths[i % len(depths)]
        value = str(rng.randint(10000, 99999))
        w = i % len(self.wordings)
        tmpl, question, prefix = self.wordings[w]
        start = rng.randrange(len(self.sents))
        needle = tmpl.format(v=value)
        overhead = len(self._render(needle, question, prefix))
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
            rest = "".join(self.sents[x] for x in picked)
            while value in rest:     # the ledger has 5-digit numbers: the passkey must occur once
                value = str(rng.randint(10000, 99999))
                needle = tmpl.format(v=value)
            body = "".join(self.sents[x] for x in picked[:cut]) + needle + " " + \
                   "".join(self.sents[x] for x in picked[cut:])
            ids = self._render(body, question, prefix)
            if len(ids) <= n_tokens:
                return Trial(i, depth, value, w, ids, needle_token=acc + overhead // 2)
            budget -= len(ids) - n_tokens + 16
        raise ValueError(f"could not fit a needle prompt in {n_tokens} tokens")


def make_builder(session, seed: int, split: str, haystack: str, ask: str = "chat"):
    """The needle builder for a haystack: NeedleBuilder for prose and ledger, corpus.NeedleBuilder for a corpus
    genre (splits tuning and reporting only: tuning-indirect is the prose haystack's)."""
    from . import corpus
    if haystack in corpus.GENRES:
        if split not in corpus.SPLITS:
            raise ValueError(f"the corpus genres have the splits {corpus.SPLITS}, not {split!r}")
        return corpus.NeedleBuilder(session, seed, split, haystack, ask=ask)
    return NeedleBuilder(session, seed, split=split, haystack=haystack, ask=ask)


def score(answer: str, value: str) -> bool:
    """Exact: the value appears in the answer, thousands separators, spaces and case ignored (a passkey's
    digits as before; a corpus code or name whole)."""
    def norm(x: str) -> str:
        return x.replace(",", "").replace(" ", "").lower()
    return norm(value) in norm(answer)
