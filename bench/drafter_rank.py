"""Where does the drafter (or qk) rank the passkey chunk?  A probe for scoring ideas, on TUNING data only.

For each needle trial (the bench's prompts: same builder, seed and token budget as `bench needle`), a
fresh DrafterPolicy with each requested variant scores the whole prompt once, as the session does when
a prompt outgrows the pool, and this prints the rank of the chunk holding the passkey among the chunks
the policy chooses from (not the sink, not the tail window).  Rank < free slots means the chunk is kept.
No target forward pass runs, so one variant costs one drafter feed (~15 s at 8K on 2 cores).

Each variant is a dict of DrafterPolicy keywords: `{}` is the policy's defaults (16 queries, contrast 32,
spread 4); `{"n_queries": 8, "contrast": 0, "spread": 0}` is the reference's plain scoring.

`--policy qk`: the variants are QKPolicy keyword dicts, scored on the target itself: each trial is
prefilled into a pooled target session (capturing as many queries as the largest variant needs), and
every variant scores that session's history, paged-out keys included.

    python bench/drafter_rank.py --policy qk --model smollm2-135m --context 4096 --pool 512 --trials 0,1,2,3,4,5 \
        --variants '[{}, {"aggregate": "peak", "n_queries": 16, "contrast": 32, "spread": 4}]'

    python bench/drafter_rank.py --model gemma3-270m --drafter smollm2-135m --context 8192 --pool 768 \
        --trials 2,3,10 --variants '[{}, {"n_queries": 8, "contrast": 0, "spread": 0}, {"spread": 0}]'
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

import kvflash
from kvflash.bench.needle import make_builder
from kvflash.bench.routines import passkey_chunks, rank_of, rank_text, span_rank
from kvflash.models import resolve_model
from kvflash.scoring import DrafterPolicy, QKPolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--policy", choices=["drafter", "qk"], default="drafter",
                    help="which policy's variants to rank (qk: QKPolicy keywords, scored on the target)")
    ap.add_argument("--drafter", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--pool", type=int, default=768)
    ap.add_argument("--trials", default="0,1,2,3")
    ap.add_argument("--depths", default="10,50,90")
    ap.add_argument("--answer-tokens", type=int, default=12, help="as the needle routine reserves (default 12)")
    ap.add_argument("--variants", default="[{}]", help="JSON list of DrafterPolicy keyword dicts")
    ap.add_argument("--sink", type=int, default=1, help="sink chunks (the session's default 1)")
    ap.add_argument("--tail", type=int, default=4, help="tail window chunks (the session's default 4)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--split", choices=["tuning", "tuning-indirect"], default="tuning",
                    help="tuning prompts only: the four passkey wordings, or the indirect ones")
    ap.add_argument("--haystack", default="prose",
                    help="prose (default), or a corpus genre (code, chat, csv, wiki, manual, fiction, syslog, "
                         "legal, email, config: its tuning documents and wordings; --split tuning)")
    ap.add_argument("--ask", choices=["chat", "raw"], default="chat",
                    help="the question through the chat template (default) or as a raw completion")
    a = ap.parse_args()
    variants = json.loads(a.variants)
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        raise SystemExit("--variants must be a JSON list of objects, e.g. '[{}, {\"n_queries\": 16}]'")
    depths = [int(x) for x in a.depths.split(",")]
    if a.policy == "qk":
        qks = [QKPolicy(**v) for v in variants]
        cap = QKPolicy(aggregate="peak", n_queries=max(q.n_queries for q in qks),
                       contrast=max(q.n_capture for q in qks) - max(q.n_queries for q in qks))
        s = kvflash.Session(a.model, max_ctx=a.context, kvflash=a.pool, policy=cap, threads=a.threads)
    else:
        s = kvflash.Session(a.model, max_ctx=a.context, kvflash=a.pool, policy="lru", threads=a.threads)
    C = s.chunk_tokens
    drafter = str(resolve_model(a.drafter))
    if a.haystack == "ledger":
        raise SystemExit("the ledger haystack is reporting data; a parameter search runs on tuning data only")
    builder = make_builder(s, a.seed, a.split, a.haystack, ask=a.ask)  # a parameter search: tuning data only
    print(f"split {a.split}, haystack {a.haystack} ({a.ask}), model {a.model}, drafter {a.drafter}, context {a.context}, pool {a.pool}; rank of the passkey chunk "
          f"among the unprotected chunks (a+b: the passkey straddles a chunk edge; kept when every rank < free)")
    for i in (int(x) for x in a.trials.split(",")):
        t = builder.trial(i, a.context - a.answer_tokens - 1, depths)
        n_chunks = -(-len(t.ids) // C)
        protected = np.zeros(n_chunks, dtype=bool)
        protected[: a.sink] = True
        protected[max(0, n_chunks - a.tail - 1):] = True   # the tail window plus the chunk being filled
        # the trial's chunk table over the target session's scorer handles (the drafter reads its target there)
        view = dataclasses.replace(s.chunk_view(), n_chunks=n_chunks, chunk_tokens=C, n_past=len(t.ids),
                                   tokens=np.asarray(t.ids, dtype=np.int32), resident=np.zeros(n_chunks, dtype=bool),
                                   protected=protected, on_host=None, pool_chunks=a.pool // C)
        chunks = passkey_chunks(s, t.ids, t.value)   # more than one when the passkey straddles a chunk edge
        if a.policy == "qk":   # the target's own history: a real pooled prefill
            s.reset()
            s.prefill(t.ids)
            view = s.chunk_view()
        free = view.pool_chunks - int(view.protected.sum())
        ranks = []
        for v in variants:
            p = QKPolicy(**v) if a.policy == "qk" else DrafterPolicy(drafter, threads=a.threads, **v)
            sc = p.score(view)
            rr = [rank_of(sc, view.protected, c) for c in chunks]
            ranks.append((json.dumps(v), rank_text(rr), span_rank(rr) < free))
        print(f"trial {i} depth {t.depth}% passkey chunk {'+'.join(map(str, chunks))}/{view.n_chunks} free {free}: " +
              ", ".join(f"{k} → {r}{'' if kept else ' (not kept)'}" for k, r, kept in ranks), flush=True)


if __name__ == "__main__":
    main()
