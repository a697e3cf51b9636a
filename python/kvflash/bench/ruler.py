"""RULER-style retrieval tasks for the `ruler` routine, generated here from the task definitions.

Five tasks, each a prompt of a chosen token length ending in a question and a primed answer:

- ``single``: one needle ("the <kind> filed under <key> is <value>"), the value a 7-digit number, a word
  or a UUID (the three kinds rotate over the trials); asked for by its key.
- ``multikey``: the same needle plus three distractor needles of the same form (other keys, other values
  of the same kind) at other depths; asked for the one key.
- ``multivalue``: four needles with the same key and four different values; all four must be returned.
- ``multiquery``: two needles with different keys; both values must be returned (asked at once).
- ``aggregate``: no haystack, a long comma-separated word list in which three words occur far more often
  than any other; asked for the three most frequent words.  Answering needs most of the context at once,
  which chunk selection is expected to struggle with (the guard).

RULER's other families, as its paper describes them (run by name: ``--tasks vt,cwe,fwe``; the default
task list is the five above, so earlier commands measure what they measured):

- ``vt`` (variable tracking): a value is assigned to one variable, then passed along a chain of
  VT_HOPS assignments, each variable to the next (five variables in all), the statements spread through
  the haystack in chain order (one at the trial's depth); asked for every variable that ends up holding
  the value.
- ``cwe`` (common words extraction): no haystack, a word list where CWE_COMMON words occur CWE_FREQ times
  each (30, fewer when the list is too short to hold them in half of it) and every other word CWE_RARE
  (3) times (once where the common words could not reach twice that); the number of rare words grows with
  the length; asked for the ten common words.
- ``fwe`` (frequent words extraction): no haystack, a "coded text" of invented words drawn from a Zeta
  (Zipf) distribution with exponent FWE_ALPHA (2.0) over the split's coded vocabulary; asked for the
  three most frequent (redrawn until the third is strictly ahead of the fourth).

Haystacks for the needle tasks (and vt): ``filler`` (one short paragraph repeated: every chunk looks alike),
``ledger`` (town records full of 3-6 digit numbers and codes, from `_ledger.py`) and the corpus genres
(`corpus/`: one long document of the genre per split and seed, its own split's text; a needle goes between
two of its units, on a line of its own except in ``wiki``'s running prose).

Splits, never mixed: ``tuning`` (what selection parameters are chosen on) and ``reporting`` (what committed
figures are measured on).  They share no wording, no key word and no value word (the word lists are split
by index parity) and draw their trials from separate seed spaces.  A trial is fixed by (split, task,
haystack, seed, index): the target's depth cycles through DEPTHS (evenly spread; a corpus genre starts the
cycle at its own place in the genre list, so a run of one trial per genre spreads over the depths too),
everything else comes from a seeded RNG, so every mode and policy sees the same prompt.

Scored as RULER scores these tasks (vt, cwe and fwe included): the share of the expected values that occur in the answer
(case-insensitive; digit groups may be separated by commas or spaces), averaged over trials; ``all``
records whether every value was there.
"""
from __future__ import annotations

import dataclasses
import random
import re
import uuid
from typing import Optional

from . import corpus
from .corpus._base import fit_tokens
from ._ledger import ledger_text
from .common import haystack_text
from .needle import sentence_units

TASKS = ("single", "multikey", "multivalue", "multiquery", "aggregate", "vt", "cwe", "fwe")
NEEDLE_TASKS = TASKS[:4]
HAYSTACK_TASKS = NEEDLE_TASKS + ("vt",)      # tasks placed in a haystack
LIST_TASKS = ("aggregate", "cwe", "fwe")     # tasks without one: the whole prompt is the list
HAYSTACKS = ("filler", "ledger")
GENRE_HAYSTACKS = corpus.GENRES
VT_HOPS = 4
CWE_COMMON, CWE_FREQ, CWE_RARE = 10, 30, 3
FWE_ALPHA, FWE_TOP = 2.0, 3
# the coded words' letters: no coded word of one split can be spelled with the other's
CODED_LETTERS = {"tuning": "abcdefghijklm", "reporting": "nopqrstuvwxyz"}
SPLITS = ("tuning", "reporting")
KINDS = ("number", "word", "uuid")
DEPTHS = (5, 18, 31, 44, 56, 69, 82, 95)   # the target needle's depth, percent of the haystack, cycled
N_DISTRACTORS = 3
N_VALUES = 4
N_QUERIES = 2
N_COMMON = 3

# Keys are adjective-noun pairs; the split takes every other word of each list, so no key word is shared.
ADJECTIVES = ["amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lofty", "mellow", "narrow", "olive", "pale", "quick", "rusty", "silent", "tidy", "upper", "vivid",
              "wary", "young", "bold", "crisp", "dim", "early", "fierce", "grand", "hasty", "idle", "loyal",
              "misty", "noble", "plain", "rapid", "sharp", "stout", "tame", "vast", "warm", "bitter", "clever",
              "damp", "fresh", "glossy", "humble"]
NOUNS = ["falcon", "lantern", "harbor", "meadow", "quarry", "ribbon", "saddle", "thimble", "anvil", "beacon",
         "cellar", "dagger", "emblem", "fountain", "goblet", "hammock", "island", "jacket", "kettle", "ladder",
         "mirror", "needle", "orchard", "pebble", "quiver", "rudder", "shovel", "tunnel", "umbrella", "violin",
         "wagon", "yarn", "badger", "canyon", "dolphin", "engine", "ferret", "garnet", "heron", "iceberg",
         "jigsaw", "kayak", "locket", "magnet", "nugget", "otter", "pillow", "raven"]
VALUE_WORDS = ["apricot", "bison", "cobalt", "dynamo", "eclipse", "fjord", "glacier", "hydrant", "igloo",
               "juniper", "kiwi", "lagoon", "mosaic", "nebula", "oasis", "paprika", "quartz", "radish",
               "sapphire", "tornado", "uranium", "vortex", "walrus", "xylophone", "yodel", "zeppelin",
               "avocado", "bamboo", "cactus", "dragonfly", "espresso", "flamingo", "gazelle", "hibiscus",
               "iguana", "jasmine", "koala", "lemur", "mango", "nutmeg", "octopus", "pelican", "quokka",
               "rhubarb", "saffron", "tulip", "unicorn", "vanilla", "wasabi", "yak", "zucchini", "acorn",
               "blizzard", "cinnamon", "daffodil", "emerald", "fennel", "geyser", "hazelnut", "indigo",
               "jellyfish", "kumquat", "lobster", "marigold"]

# (needle, single question, single prefix, plural question, plural prefix, two-key question, two-key prefix)
WORDINGS = {
    "tuning": dict(
        intro="Some records are hidden in the text below. Read it carefully: you will be asked about them.",
        needle="Note for the record: the {kind} filed under {key} is {value}.",
        q1="What is the {kind} filed under {key}?", p1="The {kind} filed under {key} is",
        qn="What are all the {kinds} filed under {key}?", pn="The {kinds} filed under {key} are",
        q2="What are the {kinds} filed under {key} and under {key2}?",
        p2="The {kinds} filed under {key} and under {key2} are",
        qa="Which three words occur most often in the list above?", pa="The three most frequent words are",
        vt_first="VAR {var} = {value}.", vt_next="VAR {var} = VAR {prev}.",
        qvt="Which variables are assigned the value {value}, directly or through other variables? List all of them.",
        pvt="Following the assignments, the variables assigned {value} are",
        qcwe="Which ten words occur most often in the list above?", pcwe="The ten most frequent words are",
        qfwe="Which three coded words appear most often in the coded text above?",
        pfwe="The three most frequent coded words are"),
    "reporting": dict(
        intro="A few facts are buried in the following text. Keep them in mind: there is a question at the end.",
        needle="Remember this: the hidden {kind} belonging to {key} is {value}.",
        q1="Which hidden {kind} belongs to {key}?", p1="The hidden {kind} belonging to {key} is",
        qn="Which hidden {kinds} belong to {key}? Give every one.", pn="The hidden {kinds} belonging to {key} are",
        q2="Which hidden {kinds} belong to {key} and to {key2}?",
        p2="The hidden {kinds} belonging to {key} and to {key2} are",
        qa="Name the three words that appear most frequently in the list above.",
        pa="The three most common words are",
        vt_first="Let {var} equal {value}.", vt_next="Let {var} equal {prev}.",
        qvt="Trace every assignment above: which variables end up holding {value}? Give all of them.",
        pvt="Every variable that ends up holding {value}:",
        qcwe="Name the ten words that appear most frequently in the list above.", pcwe="The ten most common words are",
        qfwe="Name the three coded words with the highest counts in the coded text above.",
        pfwe="The three coded words with the highest counts are"),
}
KIND_NOUN = {"number": ("number", "numbers"), "word": ("word", "words"), "uuid": ("identifier", "identifiers")}
ANSWER_HINT = {"number": "Answer with the number only.", "word": "Answer with the word only.",
               "uuid": "Answer with the identifier only."}
MULTI_HINT = "Answer with all of them, separated by commas."
FILLER = ("The hills are quiet and the river is slow. A cart goes by on the road. Birds sing in the hedge. "
          "Then the day goes on as it did before. ")


def target_depth(haystack: str, i: int) -> int:
    """The target needle's depth (percent) in trial i: DEPTHS cycled, a corpus genre starting at its index in
    the genre list (filler and ledger at the first), so that one trial per genre covers the depths."""
    start = GENRE_HAYSTACKS.index(haystack) if haystack in GENRE_HAYSTACKS else 0
    return DEPTHS[(i + start) % len(DEPTHS)]


def _half(xs: list, split: str) -> list:
    return xs[0::2] if split == "tuning" else xs[1::2]


def aggregate_vocabulary(split: str) -> list:
    """Words for the aggregation list: the prose haystack's words and this module's lists, split by parity."""
    words = set(re.findall(r"\b[a-z]{4,10}\b", haystack_text())) | set(ADJECTIVES) | set(NOUNS) | set(VALUE_WORDS)
    return _half(sorted(words), split)


def cwe_vocabulary(split: str) -> list:
    """Words for the common-words list: the aggregation vocabulary and the corpus genres' words of the split,
    minus every word the other split has (so none is shared), sorted."""
    def words(sp: str) -> set:
        out = set(aggregate_vocabulary(sp))
        for g in corpus.GENRES:
            for xs in corpus.vocab(g, sp).lists().values():
                for x in xs:
                    if isinstance(x, str):
                        out |= set(re.findall(r"\b[a-z]{4,12}\b", x))
        return out
    other = "reporting" if split == "tuning" else "tuning"
    return sorted(words(split) - words(other))


def coded_word(rng: random.Random, split: str) -> str:
    letters = CODED_LETTERS[split]
    return "".join(rng.choice(letters) for _ in range(rng.randint(4, 7)))


@dataclasses.dataclass
class RulerTrial:
    task: str
    haystack: str
    index: int
    kind: str
    depth: Optional[int]   # the target needle's depth (percent); None for aggregate
    values: list           # every string the answer must hold
    ids: list              # the prompt, answer prefix included
    answer_tokens: int     # tokens the answer may take
    needles: list = dataclasses.field(default_factory=list)   # the sentence holding each value (key and value)
    inserted: list = dataclasses.field(default_factory=list)  # every sentence inserted, distractors included


class RulerBuilder:
    """Prompts of one split for one tokenizer; haystack sentences are tokenized once and reused."""

    def __init__(self, session, seed: int = 1234, split: str = "tuning"):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.s, self.seed, self.split = session, seed, split
        self.w = WORDINGS[split]
        self.keys = [f"{a}-{n}" for a in _half(ADJECTIVES, split) for n in _half(NOUNS, split)]
        self.value_words = _half(VALUE_WORDS, split)
        self._hay: dict = {}
        self._vocab = aggregate_vocabulary(split)
        self._vocab_lens: Optional[list] = None
        self._cwe_vocab: Optional[list] = None

    # -- pieces -------------------------------------------------------------
    def _haystack(self, name: str) -> tuple:
        if name not in self._hay:
            if name == "filler":
                text = FILLER * 4
            elif name == "ledger":
                text = ledger_text()
            elif name in GENRE_HAYSTACKS:   # one long document of the split's own text
                doc = corpus.document(name, self.split, self.seed, "ruler", n_chars=320_000)
                sents = [u.text for u in doc.units]
                lens = [len(self.s.tokenize(x, add_special=False)) for x in sents]
                self._hay[name] = (sents, lens, doc.text.lower(), " " if name == "wiki" else "\n")
                return self._hay[name]
            else:
                raise ValueError(f"haystack must be one of {HAYSTACKS + GENRE_HAYSTACKS}, got {name!r}")
            sents = sentence_units(text)
            lens = [len(self.s.tokenize(x, add_special=False)) for x in sents]
            self._hay[name] = (sents, lens, text.lower(), " ")
        return self._hay[name]

    def _render(self, body: str, question: str, prefix: str) -> list:
        tok = self.s.tokenizer
        content = self.w["intro"] + "\n\n" + body.strip() + "\n\n" + question
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True) + prefix
        else:  # a base model (gemma-3-270m's GGUF has no template): plain question and answer
            text = content + "\nAnswer: " + prefix
        bos = tok.bos_id
        bos_text = tok.token_text(bos) if bos is not None else "\0"
        return self.s.tokenize(text, add_special=not text.startswith(bos_text), parse_special=True)

    def _value(self, rng: random.Random, kind: str, taken: set, hay_lower: str) -> str:
        for _ in range(1000):
            if kind == "number":
                v = str(rng.randint(1_000_000, 9_999_999))
            elif kind == "word":
                v = rng.choice(self.value_words)
            elif kind == "var":   # a variable name: five capitals
                v = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            elif kind == "value5":
                v = str(rng.randint(10000, 99999))
            else:
                v = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            if v not in taken and v.lower() not in hay_lower:
                taken.add(v)
                return v
        raise ValueError(f"ran out of distinct {kind} values")

    def _rng(self, task: str, haystack: str, i: int) -> random.Random:
        return random.Random(f"kvflash-ruler-{self.split}:{task}:{haystack}:{self.seed}:{i}")

    # -- trials ---------------------------------------------------------------
    def trial(self, task: str, haystack: str, i: int, n_tokens: int) -> RulerTrial:
        """Trial i of a task as a prompt of at most n_tokens tokens."""
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        if task == "aggregate":
            return self._aggregate(i, n_tokens)
        if task == "cwe":
            return self._cwe(i, n_tokens)
        if task == "fwe":
            return self._fwe(i, n_tokens)
        if task == "vt":
            return self._vt(haystack, i, n_tokens)
        rng = self._rng(task, haystack, i)
        sents, lens, hay_lower, sep = self._haystack(haystack)
        kind = KINDS[i % len(KINDS)] if task == "single" else "number"
        depth = target_depth(haystack, i)
        noun, nouns = KIND_NOUN[kind]
        keys = rng.sample(self.keys, 1 + N_DISTRACTORS + N_QUERIES)
        taken: set = set()
        w = self.w
        if task in ("single", "multikey"):
            key, value = keys[0], self._value(rng, kind, taken, hay_lower)
            inserts = [(depth, w["needle"].format(kind=noun, key=key, value=value))]
            if task == "multikey":
                for k in keys[1:1 + N_DISTRACTORS]:
                    inserts.append((rng.randint(2, 98), w["needle"].format(kind=noun, key=k,
                                                                         value=self._value(rng, kind, taken,
                                                                                           hay_lower))))
            values = [value]
            question = w["q1"].format(kind=noun, key=key) + " " + ANSWER_HINT[kind]
            prefix = w["p1"].format(kind=noun, key=key)
            answer = 16 if kind != "uuid" else 40
        elif task == "multivalue":
            key = keys[0]
            values = [self._value(rng, kind, taken, hay_lower) for _ in range(N_VALUES)]
            ds = [depth] + [rng.randint(2, 98) for _ in range(N_VALUES - 1)]
            inserts = [(d, w["needle"].format(kind=noun, key=key, value=v)) for d, v in zip(ds, values)]
            question = w["qn"].format(kinds=nouns, key=key) + " " + MULTI_HINT
            prefix = w["pn"].format(kinds=nouns, key=key)
            answer = 12 * N_VALUES
        else:  # multiquery
            qkeys = keys[:N_QUERIES]
            values = [self._value(rng, kind, taken, hay_lower) for _ in qkeys]
            ds = [depth] + [rng.randint(2, 98) for _ in range(N_QUERIES - 1)]
            inserts = [(d, w["needle"].format(kind=noun, key=k, value=v)) for d, k, v in zip(ds, qkeys, values)]
            question = w["q2"].format(kinds=nouns, key=qkeys[0], key2=qkeys[1]) + " " + MULTI_HINT
            prefix = w["p2"].format(kinds=nouns, key=qkeys[0], key2=qkeys[1])
            answer = 12 * N_QUERIES
        ids = self._compose(rng, sents, lens, inserts, question, prefix, n_tokens, sep)
        return RulerTrial(task, haystack, i, kind, depth, values, ids, answer,
                          needles=[t for _, t in inserts[:len(values)]], inserted=[t for _, t in inserts])

    def _vt(self, haystack: str, i: int, n_tokens: int) -> RulerTrial:
        """Variable tracking: one value, a chain of VT_HOPS assignments (VT_HOPS + 1 variables), spread through
        the haystack in chain order, one statement at the trial's depth; every variable must be named."""
        rng = self._rng("vt", haystack, i)
        sents, lens, hay_lower, sep = self._haystack(haystack)
        taken: set = set()
        value = self._value(rng, "value5", taken, hay_lower)
        names = [self._value(rng, "var", taken, hay_lower) for _ in range(VT_HOPS + 1)]
        depth = target_depth(haystack, i)
        # one statement at the trial's depth, the others at random depths; in chain order along the text
        depths = sorted([depth] + [rng.uniform(2, 98) for _ in range(VT_HOPS)])
        stmts = [self.w["vt_first"].format(var=names[0], value=value)]
        stmts += [self.w["vt_next"].format(var=n, prev=p) for p, n in zip(names, names[1:])]
        inserts = list(zip(depths, stmts))
        question = self.w["qvt"].format(value=value) + " " + MULTI_HINT
        prefix = self.w["pvt"].format(value=value)
        ids = self._compose(rng, sents, lens, inserts, question, prefix, n_tokens, sep)
        return RulerTrial("vt", haystack, i, "var", depth, names, ids, 8 * len(names), needles=stmts)

    def _cwe(self, i: int, n_tokens: int) -> RulerTrial:
        """Common words extraction: CWE_COMMON words CWE_FREQ times each, the rest CWE_RARE times each."""
        rng = self._rng("cwe", "list", i)
        if self._cwe_vocab is None:
            self._cwe_vocab = cwe_vocabulary(self.split)
        vocab = self._cwe_vocab
        per_entry = sum(len(self.s.tokenize(" " + x + ",", add_special=False)) for x in vocab[:200]) / min(200, len(vocab))
        question, prefix = self.w["qcwe"] + " " + MULTI_HINT, self.w["pcwe"]
        overhead = len(self._render("", question, prefix)) + 8
        n_entries = int(max(0, n_tokens - overhead) / per_entry)
        for _ in range(8):
            common_each = min(CWE_FREQ, n_entries // (2 * CWE_COMMON))
            rare_each = CWE_RARE if common_each >= 2 * CWE_RARE else 1   # a short list: rare words once each
            if common_each < 2:
                raise ValueError(f"cwe: {n_tokens} tokens cannot hold {CWE_COMMON} common words twice each")
            n_rare_words = max(0, n_entries - common_each * CWE_COMMON) // rare_each
            words = list(vocab)
            rng.shuffle(words)
            pool = words
            extra = set()
            while len(pool) < CWE_COMMON + n_rare_words:   # a long list outgrows the real words: invented ones
                w = coded_word(rng, self.split)
                if w not in extra and w not in vocab:
                    extra.add(w)
                    pool = pool + [w]
            common, rare = pool[:CWE_COMMON], pool[CWE_COMMON:CWE_COMMON + n_rare_words]
            entries = [w for w in common for _ in range(common_each)] + [w for w in rare for _ in range(rare_each)]
            rng.shuffle(entries)
            ids = self._render("Here is a list of words: " + ", ".join(entries) + ".", question, prefix)
            if len(ids) <= n_tokens:
                return RulerTrial("cwe", "list", i, "word", None, common, ids, 8 * CWE_COMMON)
            n_entries -= int((len(ids) - n_tokens) / per_entry) + 8
        raise ValueError(f"could not fit the cwe list in {n_tokens} tokens")

    def _fwe(self, i: int, n_tokens: int) -> RulerTrial:
        """Frequent words extraction: coded words drawn from a Zeta distribution (exponent FWE_ALPHA) over the
        split's coded vocabulary; the FWE_TOP most frequent, strictly ahead of the next, are the answer."""
        import collections
        import itertools
        rng = self._rng("fwe", "list", i)
        question, prefix = self.w["qfwe"] + " " + MULTI_HINT, self.w["pfwe"]
        overhead = len(self._render("", question, prefix)) + 8
        vocab: list = []
        seen: set = set()
        while len(vocab) < 1000:
            w = coded_word(rng, self.split)
            if w not in seen:
                seen.add(w)
                vocab.append(w)
        cum = list(itertools.accumulate(1.0 / (k ** FWE_ALPHA) for k in range(1, len(vocab) + 1)))
        per_entry = sum(len(self.s.tokenize(" " + x, add_special=False)) for x in vocab[:200]) / 200
        n_entries = int(max(0, n_tokens - overhead) / per_entry)
        for _ in range(16):
            entries = rng.choices(vocab, cum_weights=cum, k=max(1, n_entries))
            counts = collections.Counter(entries).most_common(FWE_TOP + 1)
            if len(counts) > FWE_TOP and counts[FWE_TOP - 1][1] == counts[FWE_TOP][1]:
                continue   # a tie at the cut: draw again
            top = [w for w, _ in counts[:FWE_TOP]]
            ids = self._render("Here is a coded text: " + " ".join(entries) + ".", question, prefix)
            if len(ids) <= n_tokens:
                return RulerTrial("fwe", "list", i, "word", None, top, ids, 8 * FWE_TOP)
            n_entries -= int((len(ids) - n_tokens) / per_entry) + 8
        raise ValueError(f"could not fit the fwe text in {n_tokens} tokens")

    def _compose(self, rng, sents, lens, inserts, question, prefix, n_tokens, sep: str = " ") -> list:
        """Haystack sentences from a random start, each insert placed after the sentence where the running
        token count crosses its depth, as many sentences as fit n_tokens."""
        start = rng.randrange(len(sents))
        overhead = len(self._render(" ".join(t for _, t in inserts), question, prefix))

        def build(budget):
            picked, total, k = [], 0, start
            while total < budget:
                picked.append(k % len(sents))
                total += lens[k % len(sents)]
                k += 1
            if total > budget and picked:
                total -= lens[picked.pop()]
            cuts = []
            for d, text in inserts:
                acc, cut = 0, len(picked)
                for j, idx in enumerate(picked):
                    if acc >= d / 100 * total:
                        cut = j
                        break
                    acc += lens[idx]
                cuts.append((cut, text))
            cuts.sort(key=lambda x: x[0])
            parts, prev = [], 0
            for cut, text in cuts:
                parts.append("".join(sents[x] for x in picked[prev:cut]))
                parts.append(text + sep)
                prev = cut
            parts.append("".join(sents[x] for x in picked[prev:]))
            ids = self._render("".join(parts), question, prefix)
            return len(ids), ids
        best = fit_tokens(build, n_tokens, max(0, n_tokens - overhead - 8))
        if best is not None:
            return best
        raise ValueError(f"could not fit the prompt in {n_tokens} tokens")

    def _aggregate(self, i: int, n_tokens: int) -> RulerTrial:
        """A comma-separated list: N_COMMON words each at least 3x as often as any other word (and 30 times
        where the list is long enough), the rest drawn evenly from the split's vocabulary, shuffled."""
        rng = self._rng("aggregate", "list", i)
        if self._vocab_lens is None:
            self._vocab_lens = [len(self.s.tokenize(" " + x + ",", add_special=False)) for x in self._vocab]
        per_entry = sum(self._vocab_lens) / len(self._vocab_lens)
        common = rng.sample(self._vocab, N_COMMON)
        rest = [x for x in self._vocab if x not in common]
        question, prefix = self.w["qa"] + " " + MULTI_HINT, self.w["pa"]
        overhead = len(self._render("", question, prefix)) + 8
        n_entries = int(max(0, n_tokens - overhead) / per_entry)
        for _ in range(8):
            n_rare_each = max(1, -(-max(0, n_entries - 30 * N_COMMON) // len(rest)))
            # 30 each where the list is long enough (half of it at most), and 3x any rare word's count
            n_common_each = max(3 * n_rare_each, min(30, n_entries // (2 * N_COMMON)))
            n_rare = max(0, n_entries - n_common_each * N_COMMON)   # <= len(rest) * n_rare_each
            order = rest[:]
            rng.shuffle(order)
            entries = [c for c in common for _ in range(n_common_each)]
            entries += [order[j % len(order)] for j in range(n_rare)]   # round robin: none past n_rare_each
            rng.shuffle(entries)
            ids = self._render("Here is a list of words: " + ", ".join(entries) + ".", question, prefix)
            if len(ids) <= n_tokens:
                return RulerTrial("aggregate", "list", i, "word", None, common, ids, 24)
            n_entries -= int((len(ids) - n_tokens) / per_entry) + 8
        raise ValueError(f"could not fit the word list in {n_tokens} tokens")


_DIGIT_GAP = re.compile(r"(?<=\d)[,\s](?=\d)")


def score(answer: str, values: list) -> float:
    """RULER's string match over all values: the share of `values` that occur in the answer."""
    if not values:
        raise ValueError("score needs at least one expected value")
    a = _DIGIT_GAP.sub("", answer).lower()
    return sum(1 for v in values if v.lower() in a) / len(values)
