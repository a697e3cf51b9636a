"""A chat's next turn over a long history: tokens read again and the turn's time against a re-prefill.

On a model with recurrent layers (qwen35) a turn cannot cut the cache anywhere for free: the state is
rewound to the nearest host checkpoint and the tokens from there are read again.  This routine measures
what that costs a user, per mode (the full cache and each pool): the tokens evaluated by the turn (the
goal: the new tokens plus at most one chunk), the turn's seconds, and both against reading the whole
conversation again.
"""
from __future__ import annotations

import statistics
import time

from ..common import BenchConfig, Progress, ctx_label, summarize, text_tokens
from ..report import Result
from ._shared import BASE_COLS, _base, _long_note, _modes, _open_modes, _spread

REPLY_TOKENS = 16     # the assistant's answer, generated
USER_TOKENS = 40      # the user's next message
# The next request's prompt holds the reply without its last REDRAWN tokens (a chat template that
# strips the reasoning from earlier turns drops them all; one that closes the turn differently, a few): the
# prompt leaves the cache REDRAWN tokens back, more than the recurrent state's snapshots (8) take back.
REDRAWN = 12


def run_chat(cfg: BenchConfig) -> Result:
    """Per context D and mode: prefill D tokens of history (timed: what a turn costs that reads it all
    again), then per repeat one turn: a greedy reply of REPLY_TOKENS, then the history plus the reply plus
    USER_TOKENS new tokens through Session.continue_to (timed; tokens evaluated counted).  Modes are
    interleaved per repeat, the order rotated; the history grows by a turn a repeat."""
    ctxs = sorted(set(cfg.contexts))
    modes = _modes(cfg)
    max_ctx = max(ctxs) + cfg.repeats * (REPLY_TOKENS + USER_TOKENS + 2) + 64
    res = Result("chat", f"a chat's next turn: tokens read again and seconds, against re-reading the conversation "
                 f"(reply {REPLY_TOKENS} tokens, the next prompt leaving the cache {REDRAWN} tokens back, then "
                 f"{USER_TOKENS} new; median ± spread of {cfg.repeats} turns)",
                 BASE_COLS + [("pool", "pool"), ("policy", "policy"), ("context", "history"),
                              ("prefill_s", "prefill of the history s"), ("turn_s", "turn s (continue_to)"),
                              ("reread", "tokens evaluated by the turn"), ("over_new", "beyond the new tokens"),
                              ("turn_vs_prefill", "turn / prefill per turn"), ("checkpoints", "host checkpoints")])
    sessions, na = _open_modes(cfg, modes, max_ctx, dedupe_fallback=False)
    for m, why in na.items():
        res.notes.append(f"{m[0]} pool {m[1]}: {why}")
    order = list(sessions)
    with Progress(len(ctxs) * len(order) * (1 + cfg.repeats), "chat", cfg.quiet) as pb:
        for D in ctxs:
            hist = {}
            for m in order:
                s = sessions[m]
                s.reset()
                toks = text_tokens(s, D + cfg.repeats * USER_TOKENS)
                t0 = time.perf_counter()
                s.prefill(toks[:D].tolist(), progress=pb.prefill_note(f"{ctx_label(D)} {m[0]}: "))
                hist[m] = (time.perf_counter() - t0, toks)
                pb.advance(1, note=f"{ctx_label(D)} {m[0]} prefill {hist[m][0]:.1f}s")
            for r in range(cfg.repeats):
                k = r % len(order)
                for m in order[k:] + order[:k]:
                    s = sessions[m]
                    t_prefill, toks = hist[m]
                    for _ in s.generate(None, max_tokens=REPLY_TOKENS, temperature=0.0, ignore_eos=True):
                        pass
                    new = toks[D + r * USER_TOKENS:D + (r + 1) * USER_TOKENS].tolist()
                    want = list(s.tokens)[:len(s.tokens) - REDRAWN] + new
                    e0 = s.runtime.timings["tokens"]
                    t0 = time.perf_counter()
                    s.continue_to(want)
                    dt = time.perf_counter() - t0
                    reread = s.runtime.timings["tokens"] - e0
                    res.raw.append({**_base(cfg, s), "mode": m[0], "pool": m[1], "context": D, "repeat": r,
                                    "prefill_s": t_prefill, "turn_s": dt, "reread": reread, "new": len(new),
                                    "n_past": s.n_past, "checkpoints": list(s.runtime.checkpoints)})
                    pb.advance(1, note=f"{ctx_label(D)} {m[0]} turn {dt:.2f}s, {reread} tokens")
    chunk = {m: sessions[m].chunk_tokens for m in order}
    for D in ctxs:
        for m in order:
            rr = [x for x in res.raw if x["context"] == D and x["mode"] == m[0] and x["pool"] == m[1]]
            over = [x["reread"] - x["new"] for x in rr]
            ratios = [x["turn_s"] / x["prefill_s"] for x in rr]
            res.rows.append({**_base(cfg, sessions[m]), "pool": m[1] or "-", "policy": sessions[m].policy.name if m[1] else "-",
                             "context": D, "prefill_s": rr[0]["prefill_s"], "turn_s": summarize(x["turn_s"] for x in rr),
                             "reread": summarize(x["reread"] for x in rr), "over_new": f"{min(over)}-{max(over)}",
                             "turn_vs_prefill": f"{statistics.median(ratios) * 100:.2f}% ({_spread([q * 100 for q in ratios])}%)",
                             "checkpoints": len(rr[-1]["checkpoints"])})
            res.notes.append(f"{ctx_label(D)} {m[0]}{'' if m[1] is None else ' pool ' + str(m[1])}: a turn evaluated "
                             f"{min(x['reread'] for x in rr)}-{max(x['reread'] for x in rr)} tokens for "
                             f"{USER_TOKENS} new (goal: at most one chunk, {chunk[m]}, beyond them: "
                             f"{'met' if max(over) <= chunk[m] else 'NOT met'}); the turn took "
                             f"{statistics.median(ratios) * 100:.2f}% of the history's prefill")
    res.notes.append(f"tokens evaluated: the runtime's count over continue_to; the prompt leaves the cache {REDRAWN} "
                     "tokens back (the reply's tail not in it), so a dense cache cuts there for free while a "
                     "model with recurrent layers rewinds its state to the host checkpoint at or before the cut and "
                     "reads from there: the tokens beyond the new ones are the distance from that checkpoint to the "
                     "cut; prefill: the history read from a reset session, once per mode")
    if (n := _long_note(cfg, max_ctx)):
        res.notes.append(n)
    return res
