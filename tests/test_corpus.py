"""The reporting corpus (kvflash.bench.corpus) and RULER's vt / cwe / fwe: sizes, determinism, needles at
their depths, and the tuning / reporting split kept apart (no shared 8-word sequence, no shared wording)."""
import collections
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinygguf import write_small_llama  # noqa: E402

from kvflash.bench import corpus, ruler  # noqa: E402

N = 8   # n-gram length, in \w+ words


def _grams(text: str) -> set:
    w = re.findall(r"\w+", text.lower())
    return {tuple(w[i:i + N]) for i in range(len(w) - N + 1)}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    import kvflash
    path = write_small_llama(tmp_path_factory.mktemp("corpus") / "tiny.gguf", seed=5)
    return kvflash.Session(path, max_ctx=2048, kvflash=None, threads=1, verbose=False)


@pytest.mark.parametrize("genre", corpus.GENRES)
def test_documents_sized_and_deterministic(genre):
    assert len(corpus.GENRES) >= 8
    for split in corpus.SPLITS:
        a = corpus.document(genre, split, 3, 0, n_chars=6000)
        assert a.text == corpus.document(genre, split, 3, 0, n_chars=6000).text   # fixed by its seed
        assert a.text != corpus.document(genre, split, 4, 0, n_chars=6000).text
        assert a.text != corpus.document(genre, split, 3, 1, n_chars=6000).text
        assert 6000 - 400 <= len(a.text) <= 6000 and sum(a.sizes) == len(a.text), (split, len(a.text))
        assert a.split == split and isinstance(a.end, dict)
        words = corpus.document(genre, split, 3, 0, n_tokens=700, count=lambda t: len(t.split()))
        assert 600 <= sum(words.sizes) <= 700 and words.text.startswith(a.text[:200])
        big = corpus.document(genre, split, 3, 0, n_chars=60_000)
        assert 59_000 <= len(big.text) <= 60_000 and big.text.startswith(a.text)


def test_splits_share_no_text():
    """No 8-word sequence is shared by tuning and reporting documents of a genre, and none of a reporting
    document comes from the old tuning haystack (haystack.txt)."""
    from kvflash.bench.common import haystack_text
    old_tuning = _grams(haystack_text())
    for genre in corpus.GENRES:
        grams = {}
        for split in corpus.SPLITS:
            grams[split] = set()
            for seed, index in ((1, 0), (2, 5), (1234, "ruler")):
                grams[split] |= _grams(corpus.document(genre, split, seed, index, n_chars=25_000).text)
        shared = grams["tuning"] & grams["reporting"]
        assert not shared, (genre, sorted(shared)[:3])
        assert not grams["reporting"] & old_tuning, genre
        # the halves of every list are disjoint: no template or word of one split is in the other
        t, r = corpus.vocab(genre, "tuning").lists(), corpus.vocab(genre, "reporting").lists()
        for key in t:
            common = {repr(x) for x in t[key]} & {repr(x) for x in r[key]} - {"''"}
            assert not common, (genre, key, common)


def test_wordings_disjoint():
    """Each genre has >= 4 wordings per split (all three value kinds); tuning and reporting share no needle, question, answer prefix
    or raw continuation, and no word of 5+ letters outside the generic ones; name values never overlap."""
    from kvflash.bench.corpus._wordings import GENERIC
    def content(w):
        text = " ".join(w[k] for k in ("needle", "question", "answer"))
        text = re.sub(r"\{\w+\}", " ", text)
        return {x for x in re.findall(r"[a-z][a-z'-]+", text.lower()) if len(x) >= 5} - GENERIC
    assert not set(corpus.NAMES["tuning"]) & set(corpus.NAMES["reporting"])
    n = collections.Counter()
    for genre in corpus.GENRES:
        ws = {sp: corpus.wordings(genre, sp) for sp in corpus.SPLITS}
        for sp in corpus.SPLITS:
            assert len(ws[sp]) >= 4 and {w["kind"] for w in ws[sp]} == {"number", "code", "name"}, genre
            n[sp] += len(ws[sp])
        for key in ("needle", "question", "answer", "raw"):
            assert not {w[key] for w in ws["tuning"]} & {w[key] for w in ws["reporting"]}, (genre, key)
        tw = set().union(*(content(w) for w in ws["tuning"]))
        rw = set().union(*(content(w) for w in ws["reporting"]))
        assert not tw & rw, (genre, tw & rw)
    assert n["tuning"] >= 40 and n["reporting"] >= 40
    for bad in ("tuning-indirect", "", None):   # no default split, nothing else accepted
        with pytest.raises(ValueError, match="split"):
            corpus.document("code", bad, 1, n_chars=100)
    with pytest.raises(ValueError):
        corpus.document("haiku", "tuning", 1, n_chars=100)


@pytest.mark.parametrize("split", corpus.SPLITS)
def test_needles_at_depth_and_recoverable(session, split):
    """Every genre, both asks, every wording, depths 10/50/90/30: the prompt fits, holds its needle (the value once) about where
    asked, and ends with the question (chat) or the genre's own continuation (raw)."""
    from kvflash.bench.needle import make_builder
    s = session
    for genre in corpus.GENRES:
        for ask in corpus._builder.ASKS:
            b = make_builder(s, 1234, split, genre, ask=ask)
            for i, depth in enumerate((10, 50, 90, 30)):   # every wording (i mod 4)
                t = b.trial(i, 1200, [depth])
                text = s.detokenize(t.ids)
                assert 1200 - 250 <= len(t.ids) <= 1200, (genre, ask, len(t.ids))   # within a unit (fiction's ~250)
                assert t.depth == depth and text.count(t.value) == 1 and t.needle in text, (genre, ask, i)
                assert abs(100 * t.needle_at / t.doc_chars - depth) < 15, (genre, ask, depth, t.needle_at, t.doc_chars)
                w = b.wordings[t.wording]
                if ask == "chat":
                    assert w["question"].split("{")[0] in text and text.rstrip().endswith(w["answer"])
                else:
                    assert text.endswith(w["raw"].split("}")[-1]) and w["question"].split("{")[0] not in text
    with pytest.raises(ValueError):
        make_builder(s, 1, "tuning-indirect", "code")


def test_score():
    assert corpus.score("It is kt-4821.", "KT-4821") and corpus.score("Zosia  Pemberton", "Zosia Pemberton")
    assert corpus.score("48,213", "48213") and not corpus.score("4821", "48213")
    from kvflash.bench.needle import score
    assert score("The passkey is 12,345", "12345") and score("kt-4821", "KT-4821")


def test_ruler_new_tasks_and_genre_haystacks(session):
    """vt's chain is in order and complete, cwe's common words lead by 2x, fwe's top three lead strictly; the
    genre haystacks hold each value once; the new vocabularies do not cross splits."""
    s = session
    assert not set(ruler.cwe_vocabulary("tuning")) & set(ruler.cwe_vocabulary("reporting"))
    assert not set(ruler.CODED_LETTERS["tuning"]) & set(ruler.CODED_LETTERS["reporting"])
    w_t, w_r = ruler.WORDINGS["tuning"], ruler.WORDINGS["reporting"]
    assert set(w_t) == set(w_r) and not set(w_t.values()) & set(w_r.values())
    for split in ruler.SPLITS:
        b = ruler.RulerBuilder(s, 7, split=split)
        for hay in ("chat", "wiki"):
            for task in ("single", "multikey", "vt"):
                t = b.trial(task, hay, 1, 1500)
                text = s.detokenize(t.ids)
                assert 1500 - 250 <= len(t.ids) <= 1500, (task, hay, len(t.ids))
                assert all(n in text for n in t.needles)
                if task == "vt":
                    assert len(t.values) == ruler.VT_HOPS + 1 and text.count(t.needles[0]) == 1
                    at = [text.index(n) for n in t.needles]
                    assert at == sorted(at), (hay, at)   # chain order along the text
                else:
                    assert text.count(t.values[0]) == 1
        agg = b.trial("cwe", "list", 0, 1500)
        words = re.findall(r"[a-z]+", s.detokenize(agg.ids).split("list of words:")[1].split(".")[0])
        counts = collections.Counter(words)
        assert len(agg.values) == ruler.CWE_COMMON and set(w for w, _ in counts.most_common(ruler.CWE_COMMON)) == set(agg.values)
        assert min(counts[w] for w in agg.values) >= 2 * max(c for w, c in counts.items() if w not in agg.values)
        fwe = b.trial("fwe", "list", 0, 1500)
        coded = re.findall(r"[a-z]+", s.detokenize(fwe.ids).split("coded text:")[1].split(".")[0])
        assert coded and all(set(x) <= set(ruler.CODED_LETTERS[split]) for x in coded)
        top = collections.Counter(coded).most_common(ruler.FWE_TOP + 1)
        assert [w for w, _ in top[:ruler.FWE_TOP]] == fwe.values and top[-2][1] > top[-1][1]
    assert ruler.score("HPLAH, INUFC and tjsca", ["HPLAH", "INUFC", "TJSCA", "UCQUW"]) == 0.75


def test_ruler_target_depths_spread_over_the_genres():
    """One trial per genre puts the target at every depth of the cycle (trial 0 of each genre starts it at the
    genre's place); filler and ledger keep the plain cycle, so their trials are the ones measured before."""
    first = [ruler.target_depth(g, 0) for g in corpus.GENRES]
    assert set(first) == set(ruler.DEPTHS) and len(corpus.GENRES) >= len(ruler.DEPTHS)
    for g in corpus.GENRES:
        assert sorted(ruler.target_depth(g, i) for i in range(len(ruler.DEPTHS))) == sorted(ruler.DEPTHS)
    for h in ruler.HAYSTACKS:
        assert [ruler.target_depth(h, i) for i in range(10)] == [ruler.DEPTHS[i % len(ruler.DEPTHS)] for i in range(10)]


def test_cli_corpus_options(capsys):
    from kvflash.bench import cli
    p = cli.build_parser()
    args = p.parse_args(["needle", "--haystacks", "prose,corpus", "--ask", "chat,raw"])
    cli._validate(p, args)
    assert args.haystacks == ["prose"] + list(corpus.GENRES)
    cfg = cli.config_for(args, "needle")
    assert cfg.asks == ["chat", "raw"] and cfg.haystacks[-1] == "config"
    for bad in (["needle", "--haystacks", "code", "--split", "tuning-indirect"], ["needle", "--ask", "shout"],
                ["needle", "--haystacks", "haiku"], ["ruler", "--haystacks", "prose,chat"],
                ["ruler", "--tasks", "vt,nope"]):
        with pytest.raises(SystemExit):
            cli.main(bad)
        assert "error" in capsys.readouterr().err, bad
