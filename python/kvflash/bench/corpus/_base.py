"""What the genres share: the split halves of every list, a document's units, timestamps."""
from __future__ import annotations

import dataclasses
import random

SPLITS = ("tuning", "reporting")


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"corpus split must be one of {SPLITS}, got {split!r} (there is no default: a caller "
                         f"names the data it draws)")
    return split


def half(xs: list, split: str) -> list:
    """The split's half of a list: even positions for tuning, odd for reporting (never both)."""
    check_split(split)
    return list(xs[0::2] if split == "tuning" else xs[1::2])


@dataclasses.dataclass(frozen=True)
class Unit:
    """One piece of a document (a line, a row, a sentence, a paragraph), its separator included.  `at`: the
    fields a needle placed right before this unit takes to fit there (indentation, a timestamp, a speaker,
    the leading cells of a table row)."""
    text: str
    at: dict


class Vocab:
    """A genre's lists cut to one split: every template and word list keeps only the split's half."""

    def __init__(self, lists: dict, split: str):
        self.split = check_split(split)
        self._d = {k: half(v, split) for k, v in lists.items()}
        for k, v in self._d.items():
            if not v:
                raise ValueError(f"list {k!r} has nothing in the {split} half")

    def __getitem__(self, key: str) -> list:
        return self._d[key]

    def lists(self) -> dict:
        """Every list of the split's half, by name (a copy)."""
        return {k: list(v) for k, v in self._d.items()}

    def pick(self, rng: random.Random, key: str):
        return rng.choice(self._d[key])


def hhmm(minutes: int) -> str:
    return f"{(minutes // 60) % 24:02d}:{minutes % 60:02d}"


def hms(seconds: int) -> str:
    return f"{(seconds // 3600) % 24:02d}:{(seconds // 60) % 60:02d}:{seconds % 60:02d}"


MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
WEEKDAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]


def cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def fit_tokens(build, n_tokens: int, budget: int, tries: int = 8, floor: bool = False):
    """The largest prompt that fits n_tokens, by adjusting a budget of haystack tokens.  build(budget) -> (n,
    result): the prompt built on that budget and its token count.  A prompt that fits and is within 32 tokens
    of n_tokens (or whose next step up overflowed) is taken; else the budget grows by the room left less 8
    (units counted alone count a little more than joined) or shrinks by the overflow plus 16, up to `tries`
    builds; floor: stop once the budget falls below 1.  Returns the largest fitting result, or None."""
    best, best_n, too_long = None, -1, False
    for _ in range(tries):
        n, result = build(budget)
        if n <= n_tokens:
            if best is None or n > best_n:
                best, best_n = result, n
            if n_tokens - n <= 32 or too_long:   # close enough, or the next step up overflowed
                return best
            budget += n_tokens - n - 8
        else:
            too_long = True
            budget -= n - n_tokens + 16
            if floor and budget < 1:
                break
    return best
