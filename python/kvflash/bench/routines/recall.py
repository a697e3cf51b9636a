"""Needle-in-a-haystack recall per policy and pool (the `needle` routine)."""
from __future__ import annotations

import numpy as np

from ..common import BenchConfig, Progress, ctx_label, summarize
from ..corpus import GENRES
from ..needle import make_builder, score
from ..report import Result
from ._shared import (
    BASE_COLS,
    _answer,
    _base,
    _long_note,
    _needle_modes,
    _open_modes,
    _split_note,
    _trials_for,
    passkey_chunks,
    rank_of,
    rank_text,
    span_rank,
)


def run_needle(cfg: BenchConfig) -> Result:
    """Recall of a passkey at depths of a haystack: full cache, then each policy at each pool, on the same
    prompts; greedy answer through the chat template, scored exact.  Per scored policy, the passkey
    chunk's rank under the prompt's rescore is recorded (rank < free slots: the policy kept it)."""
    # Long on purpose: trials x haystacks x modes over shared builders and sessions, then one row per cell with its
    # ranks.
    ctxs = sorted(set(cfg.contexts))
    modes = _needle_modes(cfg)
    if cfg.split == "reporting":
        hays = list(cfg.haystacks)
    elif cfg.split == "tuning":   # prose, or the corpus genres' tuning documents when asked for by name
        hays = [h for h in cfg.haystacks if h in GENRES or h == "prose"] or ["prose"]
    else:
        hays = ["prose"]
    asks = list(cfg.asks or ["chat"])
    ask_col = [("ask", "ask")] if asks != ["chat"] else []
    res = Result("needle", f"needle-in-a-haystack recall ({cfg.split} split, depths "
                 f"{'/'.join(map(str, cfg.depths))}%, {cfg.needles} per cell and haystack)",
                 BASE_COLS + [("context", "context"), ("haystack", "haystack")] + ask_col +
                             [("mode", "mode"), ("pool", "pool"),
                              ("policy", "policy"), ("residency", "residency %"), ("needle", f"needle /{cfg.needles}"),
                              ("by_depth", "by depth"), ("resident", "passkey chunk resident"),
                              ("ranks", "passkey chunk rank per trial (free slots)"), ("prefill_s", "prefill s")])
    notes = set()
    builders: dict = {}
    cells = [(h, a) for h in hays for a in asks]
    with Progress(len(ctxs) * len(cells) * cfg.needles * len(modes), "needle", cfg.quiet) as pb:
        for D in ctxs:
            sessions, na = _open_modes(cfg, modes, D, dedupe_fallback=True)
            if not sessions:
                raise RuntimeError("no mode could be opened")
            any_s = next(iter(sessions.values()))
            for hay, ask in cells:
                if (hay, ask) not in builders:
                    builders[(hay, ask)] = make_builder(any_s, cfg.seed, cfg.split, hay, ask=ask)
                trials = _trials_for(cfg, builders[(hay, ask)], D, cfg.answer_tokens + 1)
                pb.advance(cfg.needles * len(na))
                for t in trials:
                    for m, s in sessions.items():
                        pb.note(f"{ctx_label(D)} {hay} {m[0]} {m[1] or ''} {m[2] or ''} depth {t.depth}%")
                        ans, dt, scores = _answer(s, t.ids, cfg.answer_tokens, progress=pb.prefill_note(
                            f"{ctx_label(D)} {hay} {m[0]} depth {t.depth}%: "))
                        ok = score(ans, t.value)
                        st = s.stats
                        cs = passkey_chunks(s, t.ids, t.value)
                        blocks = s.pager.chunk_table()["block"]
                        kept = None if m[1] is None or not cs else all(bool(blocks[c] >= 0) for c in cs)
                        rank = ranks = free = None
                        if m[1] is not None and scores is not None and cs:
                            sc, prot, resident = scores
                            ranks = [rank_of(sc, prot, c) for c in cs]
                            rank = span_rank(ranks)
                            free = int(s.pager.n_blocks - np.count_nonzero(prot & resident))
                        res.raw.append({**_base(cfg, s), "context": D, "split": cfg.split, "haystack": hay,
                                        **({"ask": ask} if ask_col else {}), "mode": m[0], "pool": m[1],
                                        "policy": s.policy.name if m[1] else None,
                                        "trial": t.index, "depth": t.depth, "wording": t.wording,
                                        "prompt_tokens": len(t.ids), "value": t.value, "answer": ans, "correct": ok,
                                        "prefill_s": dt, "residency_pct": st["residency_pct"],
                                        "page_outs": st["page_outs"], "page_ins": st["page_ins"],
                                        "rescores": st["rescores"], "passkey_chunk": cs[0] if cs else None,
                                        "passkey_chunks": " ".join(map(str, cs)), "passkey_resident": kept,
                                        "passkey_rank": rank, "passkey_ranks": None if ranks is None else
                                        rank_text(ranks), "free_slots": free})
                        pb.advance(1, note=f"{ctx_label(D)} {hay} {m[0]} {m[2] or ''}: {'ok' if ok else 'miss'}")
                for m in modes:
                    row = {**_base(cfg, any_s), "context": D, "haystack": hay, **({"ask": ask} if ask_col else {}),
                           "mode": m[0],
                           "pool": "-" if m[1] is None else m[1], "policy": "-" if m[1] is None else m[2],
                           "residency": 100.0 if m[1] is None else round(100.0 * min(1.0, m[1] / D), 1)}
                    if m in na:
                        row["needle"] = "n/a"
                        row["by_depth"] = na[m]
                        notes.add(f"{m[2]}: {na[m]}")
                        res.rows.append(row)
                        continue
                    rr = [x for x in res.raw if x["context"] == D and x["haystack"] == hay and x.get("ask", ask) == ask
                          and x["mode"] == m[0]
                          and x["pool"] == m[1] and (m[1] is None or x["policy"] == sessions[m].policy.name)]
                    rr = rr[-cfg.needles:]
                    row["needle"] = f"{sum(x['correct'] for x in rr)}/{len(rr)}"
                    row["by_depth"] = " ".join(
                        f"{d}%:{sum(x['correct'] for x in rr if x['depth'] == d)}/{sum(1 for x in rr if x['depth'] == d)}"
                        for d in cfg.depths if any(x["depth"] == d for x in rr))
                    row["prefill_s"] = summarize(x["prefill_s"] for x in rr)
                    if m[1] is not None:
                        kk = [x for x in rr if x["passkey_resident"] is not None]
                        hit = sum(1 for x in kk if x["passkey_resident"] and x["correct"])
                        row["resident"] = (f"{sum(x['passkey_resident'] for x in kk)}/{len(kk)} "
                                           f"(answered {hit})")
                        rk = [x for x in rr if x["passkey_rank"] is not None]
                        if rk:
                            row["ranks"] = " ".join(x["passkey_ranks"] for x in rk) + f" ({rk[-1]['free_slots']})"
                    if sessions[m].bench_fallback:
                        row["policy"] = f"{m[2]}→{sessions[m].policy.name}"
                    res.rows.append(row)
            del sessions
    res.notes += [_split_note(cfg, hays),
                  f"scored exact: the passkey's digits appear in the greedy answer (max {cfg.answer_tokens} tokens, "
                  f"stop at newline); the assistant turn is primed with the wording's answer prefix" +
                  ("; a corpus value (a number, a code, a name) counts whole, case and spaces ignored"
                   if any(h in GENRES for h in hays) else ""),
                  f"kvflash keeps the sink chunk and the last {(4 if cfg.tail_chunks is None else cfg.tail_chunks) + 1} "
                  f"chunks (the tail window and the chunk being written) resident: LRU finds a needle only there",
                  "passkey chunk resident: after the answer, every chunk holding a digit of the passkey holds "
                  "a pool block (a policy that kept them and still missed met the model's limit, not its own)",
                  "rank: where the prompt's rescore put the passkey chunk among the chunks the policy chooses from "
                  "(0 = best; p = protected, i.e. in the sink or tail window; a+b: the passkey straddles a chunk "
                  "edge, a is its first digits' chunk, b its last digits'); the number in brackets is the free "
                  "slots (pool blocks not held by protected chunks): kept when every rank < free slots"]
    if ask_col:
        res.notes.append("ask: chat = the question through the model's chat template (a model without one: the "
                         "question and 'Answer:' in plain text), the answer primed; raw = no template: prose and "
                         "ledger end with the question and 'Answer:', a corpus genre continues its document in its "
                         "own form up to where the value belongs")
    res.notes += sorted(notes)
    if (n := _long_note(cfg, max(ctxs))):
        res.notes.append(n)
    return res
