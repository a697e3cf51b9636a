"""The reporting corpus: ten genres of procedural documents, needles that fit each, two splits that never mix.

Genres (GENRES; `--haystacks code,chat,...` or `--haystacks corpus` for all ten): ``code`` (Python-like
modules), ``chat`` (multi-speaker IM log), ``csv`` (tables), ``wiki`` (encyclopedic articles), ``manual``
(appliance care and recipes), ``fiction`` (chapters with dialogue), ``syslog`` (syslog and HTTP access
lines), ``legal`` (contract clauses), ``email`` (threads with headers and quotes), ``config`` (YAML).  A
document is a list of units (lines, rows, sentences, paragraphs) generated from small word lists and
templates written here (`_genres.py`); no text is downloaded or copied, and nothing large is committed.

A document has any size: `document(genre, split, seed, index, n_chars=N)` takes units while their
characters fit N, or `n_tokens=N, count=fn` while their token counts (`fn(text)`, e.g. a tokenizer's
length) fit.  It is fixed by (split, genre, seed, index).

Needles (`_wordings.py`): four wordings per genre and split (three direct, one indirect: its question
paraphrases the needle), each a unit in the genre's own form (a code
comment, a chat message, the note cell of a CSV row, a sentence of an article, a "Note:" line of a manual, a
line of dialogue, a log line, a contract clause, a line of an e-mail body, a YAML key or comment) holding a
value of one kind (number: 5 digits; code: e.g. "KT-4821"; name: a person's name), asked two ways: through
the chat template (`question`, the assistant turn primed with `answer`) and as a raw completion (`raw`:
the document continued in its own form up to where the value belongs, e.g. ``GEOCODER_LICENSE_KEY = "``).
`NeedleBuilder` (`_builder.py`) places a needle after the unit where the running token count crosses the
trial's depth (trial i: wording i mod 4, depth i mod len(depths), so wordings and depths are not tied) and
checks that the value occurs once in the prompt.

Splits -- **tuning** (what parameters may be chosen on) and **reporting** (what committed figures are
measured on) -- are kept apart three ways, each by construction, not by chance:

1. Text: every template and word list of a genre is cut by position (`_base.half`): tuning documents are
   built from the even entries only, reporting documents from the odd ones, so no template and no
   vocabulary word of one split can reach a document of the other.  `Vocab` holds only its split's half.
2. Seeds: a document's RNG is seeded with the string ``kvflash-corpus/<split>/<genre>/<seed>/<index>``
   and a trial's with ``kvflash-corpus-needle/<split>/...``: the split is part of every seed, so no seed of
   one split draws the other's stream (and if it did, the halves in 1. would still differ).
3. Needles: each split has its own wordings (no word of five letters or more shared within a genre, except
   the generic ones in `_wordings.GENERIC`) and its own list of name values.

There is no default split anywhere in this package: every entry point takes `split` and refuses anything
but "tuning" or "reporting".  tests/test_corpus.py checks that tuning and reporting documents of every genre
share no 8-word sequence (word = ``\\w+``), that no reporting document shares one with the old tuning
haystack (haystack.txt), and that the wordings are disjoint as stated.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable, Iterator, Optional

from ._base import SPLITS, Unit, Vocab, check_split
from ._genres import GENERATORS
from ._wordings import HINT, NAMES, WORDINGS

GENRES = tuple(GENERATORS)
ABOUT = {g: GENERATORS[g][2] for g in GENRES}


def check_genre(genre: str) -> str:
    if genre not in GENERATORS:
        raise ValueError(f"genre must be one of {GENRES}, got {genre!r}")
    return genre


def vocab(genre: str, split: str) -> Vocab:
    return Vocab(GENERATORS[check_genre(genre)][0], split)


def units(genre: str, split: str, seed: int, index=0) -> Iterator[Unit]:
    """The endless unit stream of one document."""
    lists, gen, _ = GENERATORS[check_genre(genre)]
    rng = random.Random(f"kvflash-corpus/{check_split(split)}/{genre}/{seed}/{index}")
    return gen(rng, Vocab(lists, split))


class Stream:
    """A document's units, generated as far as asked, each measured once."""

    def __init__(self, genre: str, split: str, seed: int, index=0, count: Optional[Callable] = None):
        self._it = units(genre, split, seed, index)
        self._count = count or len
        self.units: list = []
        self.sizes: list = []

    def _grow(self, n: int) -> None:
        while len(self.units) < n:
            u = next(self._it)
            self.units.append(u)
            self.sizes.append(self._count(u.text))

    def take(self, budget: int) -> int:
        """How many leading units fit `budget` (at least one); the unit after them is generated too (its
        `at` fields are the document's end fields)."""
        k, total = 0, 0
        while True:
            self._grow(k + 2)
            if k > 0 and total + self.sizes[k] > budget:
                return k
            total += self.sizes[k]
            k += 1


@dataclasses.dataclass
class Document:
    genre: str
    split: str
    seed: int
    index: object
    units: list         # Unit, in order
    sizes: list         # per unit: characters, or tokens under `count`
    end: dict           # the `at` fields right after the last unit (a raw question continues from there)

    @property
    def text(self) -> str:
        return "".join(u.text for u in self.units)


def document(genre: str, split: str, seed: int, index=0, *, n_chars: Optional[int] = None,
             n_tokens: Optional[int] = None, count: Optional[Callable] = None) -> Document:
    """One document of a genre and split, at most n_chars characters, or at most n_tokens as `count` measures
    each unit (units counted alone: a joined text may tokenize a little shorter)."""
    if (n_chars is None) == (n_tokens is None):
        raise ValueError("give n_chars, or n_tokens with count")
    if n_tokens is not None and count is None:
        raise ValueError("n_tokens needs count, a callable giving a text's token count")
    st = Stream(genre, split, seed, index, count=None if n_chars is not None else count)
    k = st.take(n_chars if n_chars is not None else n_tokens)
    return Document(genre, split, seed, index, st.units[:k], st.sizes[:k], st.units[k].at)


def wordings(genre: str, split: str) -> list:
    return WORDINGS[check_genre(genre)][check_split(split)]


def score(answer: str, value: str) -> bool:
    """The value in the answer, case, spaces and thousands separators ignored (digits: needle.score's rule)."""
    def norm(s: str) -> str:
        return s.replace(",", "").replace(" ", "").lower()
    return norm(value) in norm(answer)


from ._builder import NeedleBuilder  # noqa: E402

__all__ = ["GENRES", "SPLITS", "ABOUT", "HINT", "NAMES", "WORDINGS", "Document", "NeedleBuilder", "Stream",
           "Unit", "document", "score", "units", "vocab", "wordings"]
