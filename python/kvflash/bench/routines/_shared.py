"""What the routines share: table columns, modes, sessions, needle helpers, ratios and the A/A verdict."""
from __future__ import annotations

import statistics
import time
from typing import Optional

import numpy as np

from ..common import BenchConfig, Unavailable, model_label, open_session

BASE_COLS = [("model", "model"), ("threads", "threads"), ("kv_type", "kv")]


def _base(cfg: BenchConfig, s=None) -> dict:
    return {"model": model_label(cfg.model), "threads": s.threads if s is not None else cfg.threads,
            "kv_type": cfg.kv_type}


def _modes(cfg: BenchConfig) -> list:
    """(label, pool, policy) for decode/prefill/ab: the full cache, then kvflash per pool."""
    return [("full", None, None)] + [("kvflash", p, cfg.policy) for p in cfg.pools]


def _long_note(cfg: BenchConfig, max_ctx: int) -> Optional[str]:
    from ..common import _n_ctx_train
    n = _n_ctx_train(cfg)
    if max_ctx > n:
        return (f"contexts above the model's trained {n} tokens run with allow_long_ctx=True: positions past "
                f"the trained range change the text, not the cost, so speed and memory are valid there")
    return None


def _policy_note(sessions: dict) -> list:
    notes = []
    for (label, pool, pol), s in sessions.items():
        if s is not None and getattr(s, "bench_fallback", False):
            notes.append(f"pool {pool}: policy {pol!r} ran as {s.policy.name!r} — {s.banner.splitlines()[0]}")
    return notes


def _ratio(a: Optional[dict], b: Optional[dict]) -> Optional[str]:
    if not a or not b or a.get("median") in (None, 0) or b.get("median") in (None, 0):
        return None
    return f"{a['median'] / b['median']:.2f}x"



def _needle_modes(cfg: BenchConfig) -> list:
    full = [("full", None, None)] if cfg.needle_full else []
    return full + [("kvflash", p, pol) for p in cfg.pools for pol in cfg.policies]


def _open_modes(cfg: BenchConfig, modes: list, max_ctx: int, dedupe_fallback: bool):
    sessions, na = {}, {}
    for m in modes:
        try:
            # a "+reread" / "+exact" label: the same mode with the settle's re-read (Session(prefill_reread=True))
            # or with exact prefill, beside the plain one in a routine that compares them; a routine without
            # such labels leaves the flags to the config
            kw = {}
            if m[1] is not None:
                for suffix, key in (("+reread", "prefill_reread"), ("+exact", "exact_prefill")):
                    if any(x[0].endswith(suffix) for x in modes):
                        kw[key] = m[0].endswith(suffix)
            s = open_session(cfg, max_ctx=max_ctx, pool=m[1], policy=m[2] or "lru", **kw)
        except Unavailable as e:
            na[m] = str(e)
            continue
        if dedupe_fallback and s.bench_fallback and ("kvflash", m[1], s.policy.name) in modes:
            na[m] = (f"no drafter found next to the model (would fall back to {s.policy.name}: see that column); "
                     f"pass --drafter PATH")
            continue
        sessions[m] = s
    return sessions, na


def _answer(s, ids: list, n: int, progress=None) -> tuple:
    """Fresh prefill of ids, then a greedy answer: (text, prefill seconds, snap) where snap is None, or
    (scores, protected, resident) as the prompt's rescore left them (before the answer is decoded).
    progress: the prefill's progress hook (Progress.prefill_note)."""
    s.reset()
    t0 = time.perf_counter()
    s.prefill(ids, progress=progress)
    dt = time.perf_counter() - t0
    scores = None
    if s.last_scores is not None:
        table = s.pager.chunk_table()
        n = len(s.last_scores)
        scores = (s.last_scores, table["protected"][:n].copy(), table["block"][:n] >= 0)
    text = "".join(s.generate(None, max_tokens=n, temperature=0.0, stop=["\n"]))
    return text, dt, scores


def passkey_chunks(s, ids: list, value: str) -> list:
    """Every chunk holding a byte of the passkey, in order ([] if the digits are not in the prompt): a
    passkey can straddle a chunk edge, and the answer needs all of its digits resident."""
    data, ends = s.tokenizer.bytes_of(ids, skip_special=True)
    off = data.find(value.encode())
    if off < 0:
        return []
    first = int(np.searchsorted(ends, off, side="right")) // s.chunk_tokens
    last = int(np.searchsorted(ends, off + len(value.encode()) - 1, side="right")) // s.chunk_tokens
    return list(range(first, last + 1))


def rank_of(scores: np.ndarray, protected: np.ndarray, chunk: int) -> int:
    """0-based rank of `chunk` among the chunks a policy chooses from (not protected: not the sink, not
    the tail window), best score first, ties in chunk order; -1 when the chunk is protected."""
    cand = np.where(~np.asarray(protected[:len(scores)], dtype=bool))[0]
    order = cand[np.argsort(-np.asarray(scores)[cand], kind="stable")]
    hit = np.where(order == chunk)[0]
    return int(hit[0]) if len(hit) else -1


def span_rank(ranks: list) -> int:
    """The rank that decides whether a passkey spanning several chunks is kept whole: the worst of its
    chunks' ranks (-1, protected, counts as kept); -1 when every chunk is protected."""
    return max(ranks) if ranks else -1


def rank_text(ranks: list) -> str:
    """One trial's ranks for a table: 'p' for a protected chunk, '+' between the chunks of a passkey that
    straddles a chunk edge (e.g. '0+5': the first digits' chunk ranked 0, the last digits' 5)."""
    return "+".join("p" if r < 0 else str(r) for r in ranks)


def _trials_for(cfg, builder, D, reserve):
    return [builder.trial(i, D - reserve, cfg.depths) for i in range(cfg.needles)]


def _first_haystack(cfg: BenchConfig) -> str:
    """ab and demo's one haystack: the first asked for on reporting data; on tuning data prose, or a corpus
    genre named first (its tuning documents)."""
    from ..corpus import GENRES
    first = cfg.haystacks[0] if cfg.haystacks else "prose"
    if cfg.split == "reporting" or (cfg.split == "tuning" and first in GENRES):
        return first
    return "prose"


def _split_note(cfg: BenchConfig, haystacks: list) -> str:
    from ..corpus import ABOUT
    if cfg.split != "reporting":
        hs = "" if list(haystacks) == ["prose"] else f", haystacks {', '.join(haystacks)}"
        return (f"TUNING data (split {cfg.split}, seed {cfg.seed}{hs}): the prompts policy parameters were chosen "
                f"on; not a result")
    what = {"prose": "prose = procedural prose without digits",
            "ledger": "ledger = town records full of 3-6 digit numbers and codes",
            **{g: f"{g} = {a} (corpus: reporting documents, wordings and names)" for g, a in ABOUT.items()}}
    return (f"reporting data (split reporting, seed {cfg.seed}, haystacks {', '.join(haystacks)}; wordings held out "
            f"from every tuning run): " + "; ".join(what[h] for h in haystacks))


def _decode_window(cfg: BenchConfig, D: int) -> int:
    """Tokens timed per ab trial: at least decode_steps, and rescore_periods whole rescore periods of a
    scored policy at this context (+1, so the last period's rescore falls inside the window)."""
    period = max(cfg.tau, D // 45)
    return max(cfg.decode_steps, cfg.rescore_periods * period + 1)


def _spread(xs: list) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def _verdict(dr: list, cr: list) -> str:
    """kvflash/full per-trial ratios against the A/A control's: a difference counts only outside its spread."""
    outside = min(dr) > max(cr) or max(dr) < min(cr)
    return (f"{statistics.median(dr):.2f}x ({_spread(dr)}) vs A/A {statistics.median(cr):.2f}x ({_spread(cr)}) — " +
            ("outside the control's spread: a real difference" if outside else
             "overlaps the control's spread: not a measured difference"))
