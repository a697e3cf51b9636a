"""Oracle residency for one RULER-style trial: does the model answer when we choose the resident chunks?

The ruler routine's trial (same prompt, same session settings) is prefilled once per pool under LRU and
saved; then for each residency spec the snapshot is restored, the prompt settles under that spec's policy
(as the routine settles each policy) and the model answers greedily.  This separates "the policy ranked the
wrong chunks" from "the model does not answer from this pool with the needles resident".

    python bench/ruler_oracle.py --context 8192 --task multiquery --haystack wiki --trial 0 \
        --residencies 16,8 --keep "qk;qk+n1;qk+intro;qk+n1+intro;needles;n2"

Specs ('+'-joined terms, ';'-separated):
  qk        qk's ranking (today's defaults); without it, the chunks the terms name and then the latest ones
  needles   every chunk holding a needle sentence (key and value), forced resident
  nK        those chunks and K chunks either side
  intro     the prompt's opening instruction (the chunks before the document)
  question  the chunks from the question's start to the prompt's end
  c1,c2,... those chunks
  topK      qk's K best-ranked chunks (of those it chooses from), forced resident
  rS        the chunks no other term names in a random order (seed S) instead of the latest first
  qk alone is the core's native qk; qk+... scores qk through the Python callback (the same scores)
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from kvflash.bench.common import BenchConfig, open_session
from kvflash.bench.routines._shared import passkey_chunks
from kvflash.bench.routines.ruler import _answer
from kvflash.bench.ruler import RulerBuilder, score
from kvflash.policies import LRUPolicy, Requirements
from kvflash.scoring import QKPolicy


class Forced:
    """Scores that put the named chunks first; the rest ranked by qk (`base`) or by recency (base None).  Scored
    through the callback (qk's own scores read from the view), so it is not the core's native qk path."""
    name = "oracle"

    def __init__(self, chunks: list, base=None, fill_seed=None):
        self.chunks, self.base, self.fill_seed = sorted(set(chunks)), base, fill_seed
        q = base if base is not None else QKPolicy()
        self.requirements = Requirements(n_capture=q.n_capture, chunk_summaries=q.needs_chunk_summaries)

    def score(self, view):
        x = self.base.score(view) if self.base is not None else None
        if x is not None:
            x = np.asarray(x, dtype=np.float32).copy()
        elif self.fill_seed is not None:   # the rest in a random order of its own
            x = np.random.default_rng(self.fill_seed).random(view.n_chunks).astype(np.float32)
        else:
            x = np.arange(view.n_chunks, dtype=np.float32) / view.n_chunks
        hi = float(np.max(x)) + 1.0 if len(x) else 1.0
        for c in self.chunks:
            if c < len(x):
                x[c] = hi
        return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--task", default="multiquery")
    ap.add_argument("--haystack", default="wiki")
    ap.add_argument("--trial", type=int, default=0)
    ap.add_argument("--residencies", default="16", help="pool denominators, e.g. 16,8")
    ap.add_argument("--keep", default="qk", help="';'-separated residency specs (see the module doc)")
    ap.add_argument("--split", default="reporting")
    ap.add_argument("--chunk-tokens", type=int, default=16)
    ap.add_argument("--prefill-piece", type=int, default=64)
    ap.add_argument("--pooled-prefill", action="store_true", help="the pooled prefill (default: exact prefill)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    cfg = BenchConfig(model=a.model, threads=a.threads, split=a.split, chunk_tokens=a.chunk_tokens,
                      prefill_piece=a.prefill_piece, exact_prefill=not a.pooled_prefill)
    D, ct = a.context, a.chunk_tokens
    full = open_session(cfg, max_ctx=D, pool=None)
    builder = RulerBuilder(full, cfg.seed, split=cfg.split)
    tr = builder.trial(a.task, a.haystack, a.trial, D - cfg.answer_tokens)
    ids = tr.ids
    full.reset()
    full.prefill(ids)
    ans, _ = _answer(full, tr.answer_tokens)
    full_line = f"full cache: {ans!r} score {score(ans, tr.values):.2f}"
    del full
    n_chunks = (len(ids) + ct - 1) // ct
    needles = intro = q_at = None   # the prompt's layout in the pooled sessions' chunks (set by the first)

    tmp = tempfile.mkdtemp(prefix="kvflash-ruler-oracle-")
    snap = os.path.join(tmp, "prefill.kvfs")
    for r in [int(x) for x in a.residencies.split(",")]:
        qk = QKPolicy()
        s = open_session(cfg, max_ctx=D, pool=D // r, policy=qk)
        if needles is None:
            needles = [passkey_chunks(s, ids, x) for x in tr.needles]
            intro = passkey_chunks(s, ids, builder.w["intro"])
            data, ends = s.tokenizer.bytes_of(ids, skip_special=True)
            qoff = data.rfind(b"\n\n")   # the question follows the document's last blank line
            q_at = int(np.searchsorted(ends, qoff, side="right")) // ct if qoff >= 0 else None
            print(f"trial {a.task}:{a.haystack}:{a.trial} at {D}: {len(ids)} tokens ({n_chunks} chunks of {ct}), "
                  f"values {tr.values}, needle chunks {needles}, intro chunks 0-{intro[-1] if intro else '?'}, "
                  f"question from chunk {q_at}")
            print(full_line)
        s.policy = LRUPolicy()
        s.reset()
        s.prefill(ids)
        s.save(snap)
        # qk's ranking of the chunks it chooses from (for the topK terms)
        s.policy = qk
        s._settle_prompt(ids)
        prot = s.pager.chunk_table()["protected"]
        sc = np.asarray(s.last_scores)
        cand = np.where(~np.asarray(prot[:len(sc)], dtype=bool))[0]
        qk_order = cand[np.argsort(-sc[cand], kind="stable")].tolist()
        for spec in a.keep.split(";"):
            terms = [t.strip() for t in spec.split("+") if t.strip()]
            forced: list = []
            fill_seed = None
            for t in terms:
                if t == "qk":
                    continue
                if t[0] == "r" and t[1:].isdigit():
                    fill_seed = int(t[1:])
                    continue
                if t.startswith("top") and t[3:].isdigit():
                    forced += qk_order[:int(t[3:])]
                elif t == "needles":
                    forced += [c for cs in needles for c in cs]
                elif t[0] == "n" and t[1:].isdigit():
                    k = int(t[1:])
                    forced += [c + d for cs in needles for c in cs for d in range(-k, k + 1) if 0 <= c + d < n_chunks]
                elif t == "intro" and intro:
                    forced += list(range(0, intro[-1] + 1))
                elif t == "question" and q_at is not None:
                    forced += list(range(q_at, n_chunks))
                elif all(p.isdigit() for p in t.split(",")):
                    forced += [int(p) for p in t.split(",")]
                else:
                    raise SystemExit(f"unknown term {t!r} in {spec!r}")
            pol = (QKPolicy() if terms == ["qk"] else
                   Forced(forced, base=QKPolicy() if "qk" in terms else None, fill_seed=fill_seed))
            s.policy = LRUPolicy()
            s.restore(snap)
            s.policy = pol
            s._settle_prompt(ids)
            table = s.pager.chunk_table()
            res = np.where(table["block"] >= 0)[0].tolist()
            free = int(s.pager.n_blocks - np.count_nonzero(table["protected"] & (table["block"] >= 0)))
            miss = sorted(set(forced) - set(res))
            kept = [all(c in res for c in cs) for cs in needles]
            ans, _ = _answer(s, tr.answer_tokens)
            print(f"1/{r} (pool {s.runtime.pool_tokens}, {free} free) {spec}: needles kept {kept}, forced "
                  f"{len(set(forced))} (not resident: {miss or '-'}) -> {ans!r} score {score(ans, tr.values):.2f}")
            print(f"    resident: {res}")
        del s
    os.remove(snap)
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
