"""What a rescore costs per decoded token."""
from __future__ import annotations

import time

from ..common import BenchConfig, Progress, Unavailable, ctx_label, open_session, text_tokens
from ..report import Result
from ._shared import BASE_COLS, _base


def run_rescore(cfg: BenchConfig) -> Result:
    """What a scored policy costs per decoded token: a pooled session prefills a D-token text prompt,
    then decodes until it has rescored `repeats` times; rescore time (drafter feed + scoring, or the qk
    pass over every key) is amortised over the decoded tokens and set against the decode time.  For
    the drafter, the reference's way (re-read the whole history into the drafter at every rescore) is
    timed in the same run on the same history."""
    # Long on purpose: one timing loop per policy and its table rows, with the reference's re-read cost computed
    # beside it.
    ctxs = sorted(set(cfg.contexts))
    pool = cfg.pools[0]
    pols = [p for p in cfg.policies if p != "lru"] or ["qk"]
    notes: set = set()
    res = Result("rescore", f"rescore cost per decoded token (pool {pool}, {cfg.repeats} rescores per cell)",
                 BASE_COLS + [("context", "context"), ("policy", "policy"), ("period", "rescore every"),
                              ("decode_ms", "decode ms/token"), ("rescore_ms", "rescore ms"),
                              ("amortised_ms", "rescore ms/token"), ("share", "% of decode"),
                              ("reread_ms", "full re-read ms"), ("reread_share", "re-read % of decode")])
    with Progress(len(ctxs) * len(pols), "rescore", cfg.quiet) as pb:
        for D in ctxs:
            for pol in pols:
                try:
                    s = open_session(cfg, max_ctx=D, pool=pool, policy=pol)
                except Unavailable as e:
                    res.rows.append({**_base(cfg), "context": D, "policy": pol, "decode_ms": f"n/a: {e}"})
                    pb.advance(1)
                    continue
                if s.bench_fallback:
                    res.rows.append({**_base(cfg, s), "context": D, "policy": f"{pol}→{s.policy.name}",
                                     "decode_ms": "n/a: no drafter (pass --drafter)"})
                    pb.advance(1)
                    continue
                period = max(s.tau, D // 45)
                n_decode = cfg.repeats * period + 1
                toks = text_tokens(s, D)[: D - n_decode - 8]
                pb.note(f"{ctx_label(D)} {pol}: prefill {len(toks)}")
                s.prefill(toks)
                st0 = s.stats
                pb.note(f"{ctx_label(D)} {pol}: decode {n_decode}")
                t0 = time.perf_counter()
                n = sum(1 for _ in s.generate(None, max_tokens=n_decode, temperature=0.0, ignore_eos=True))
                wall = time.perf_counter() - t0
                st = s.stats
                n_resc = st["rescores"] - st0["rescores"]
                resc_ms = st["rescore_ms"] - st0["rescore_ms"]
                n_tok = s.n_past - len(toks)
                decode_ms = (1e3 * wall - resc_ms) / max(1, n_tok)
                row = {**_base(cfg, s), "context": D, "policy": s.policy.name, "period": period,
                       "decode_ms": decode_ms, "rescore_ms": resc_ms / max(1, n_resc),
                       "amortised_ms": resc_ms / max(1, n_tok), "share": f"{100 * resc_ms / max(1, n_tok) / decode_ms:.1f}%"}
                raw = {**row, "rescores": n_resc, "decoded": n_tok, "wall_s": wall, "prefill_tokens": len(toks)}
                if s.policy.name == "drafter":
                    # the reference's rescore: the drafter reads the whole history again
                    pb.note(f"{ctx_label(D)} drafter: full re-read of {s.n_past} tokens")
                    from kvflash.scoring import DrafterPolicy
                    pol_obj = s.policy
                    # same drafter and layers, a full cache, a fresh start: the whole history read again
                    ref = DrafterPolicy(pol_obj.path, threads=pol_obj.threads, n_queries=pol_obj.n_queries,
                                        kv_type=pol_obj.kv_type, layers=pol_obj.layers_used, pool=None,
                                        aggregate=pol_obj.aggregate, contrast=pol_obj.contrast,
                                        spread=pol_obj.spread)
                    view = s.chunk_view()
                    ref.load(view.target)
                    t1 = time.perf_counter()
                    ref.score(view)
                    reread = 1e3 * (time.perf_counter() - t1)
                    del ref
                    row["reread_ms"] = reread
                    row["reread_share"] = f"{100 * reread / period / decode_ms:.0f}%"
                    raw["reread_ms"] = reread
                q = getattr(s.policy, "n_queries", None)
                if s.policy.name == "drafter":
                    extra = f", minus the scores of the queries {s.policy.contrast} tokens earlier" \
                        if getattr(s.policy, "contrast", 0) else ""
                    notes.add(f"drafter: fed only the tokens added since its last rescore (each token once) through "
                              f"its own paged cache, then its last {q} queries attend over every key of its "
                              f"history{extra}; full re-read = a fresh full-cache drafter (same layers) reads the "
                              f"whole history and scores, the reference's way, amortised over the same period")
                elif q is not None:
                    notes.add(f"{s.policy.name}: the target's last {q} queries attend over every key of the "
                              f"history (pool + host store)")
                res.raw.append(raw)
                res.rows.append(row)
                pb.advance(1, note=f"{ctx_label(D)} {pol}: {row['share']}")
                del s
    res.notes += ["decode ms/token excludes rescores; rescore ms/token = all rescore time / tokens decoded; "
                  "a scored policy rescores every max(tau, history/45) decoded tokens"] + sorted(notes)
    return res
