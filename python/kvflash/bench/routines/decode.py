"""Decode tok/s vs context, with an A/A control."""
from __future__ import annotations

import statistics

from ..common import MIB, BenchConfig, Progress, ctx_label, decode_steps, kv_resident_bytes, summarize, text_tokens
from ..report import Result
from ._shared import (
    BASE_COLS,
    _base,
    _decode_window,
    _long_note,
    _modes,
    _open_modes,
    _policy_note,
    _ratio,
    _spread,
    _verdict,
)


def run_decode(cfg: BenchConfig) -> Result:
    """Decode tok/s vs context: one growing session per mode, extended to each context in turn
    (cheaper than a fresh prefill per context and per repeat; decode cost depends only on the
    cache's occupied extent, which is the same either way).  An A/A control (a second session of the
    --control configuration: the full cache, or kvflash at the first pool) runs the same way; modes
    run interleaved per repeat (order rotated), ratios are per repeat (paired), and a ratio counts as a
    measured difference only outside the control's spread.  Each repeat times the same number of
    tokens in every mode, through generate(): --steps, or for a scored policy 4 rescore periods + 1
    at that context, so its rescoring is inside the tok/s."""
    # Long on purpose: the same shape as run_ab: the timing loop, then rows, per-repeat ratios and the verdict over
    # the raw rows it built.
    ctxs = sorted(set(cfg.contexts))
    scored = cfg.policy not in (None, "lru")
    windows = {D: _decode_window(cfg, D) if scored else cfg.decode_steps for D in ctxs}
    margin = cfg.repeats * max(windows.values()) + 64
    max_ctx = max(ctxs) + margin
    pool0 = cfg.pools[0]
    ctl = ("control", None, None) if cfg.control == "full" else ("control", pool0, cfg.policy)
    modes = _modes(cfg) + [ctl]
    base_of_ctl = modes[0] if ctl[1] is None else ("kvflash", pool0, cfg.policy)
    sessions, na = _open_modes(cfg, modes, max_ctx, dedupe_fallback=False)
    live = [m for m in modes if m in sessions]
    any_s = next(iter(sessions.values()))
    toks = text_tokens(any_s, max_ctx)
    res = Result("decode", f"decode tok/s vs context (greedy through generate(), median ± spread of "
                 f"{cfg.repeats} interleaved repeats) with an A/A control ({cfg.control} vs {cfg.control})",
                 BASE_COLS + [("pool", "pool"), ("policy", "policy"), ("context", "context"),
                              ("decode_tok_s", "decode tok/s"), ("window", "tokens timed"),
                              ("rescores", "rescores in window"), ("rescore_share", "rescore % of window"),
                              ("compute_ms_tok", "compute ms/tok"),
                              ("kv_resident_mib", "KV resident MiB"), ("host_mib", "host MiB"),
                              ("vs_full", "vs full (median of medians)"),
                              ("speed_ratio", "decode ratio per repeat (median, min-max)")])
    with Progress(len(ctxs) * len(live) * (1 + cfg.repeats), "decode", cfg.quiet) as pb:
        for D in ctxs:
            for m in live:
                s = sessions[m]
                while s.n_past < D:
                    k = min(512, D - s.n_past)
                    s.prefill(toks[s.n_past:s.n_past + k])
                    pb.note(f"prefill {m[0]}{'' if m[1] is None else m[1]} {s.n_past}/{D}")
                pb.advance(1)
            for r in range(cfg.repeats):
                k = r % len(live)
                for m in live[k:] + live[:k]:   # each mode takes each place in turn
                    s = sessions[m]
                    ctx0, st0 = s.n_past, s.stats
                    pb.note(f"{ctx_label(D)} {m[0]}: timing")
                    dt, cms = decode_steps(s, windows[D])
                    st = s.stats
                    res.raw.append({**_base(cfg, s), "mode": m[0], "pool": m[1], "policy": s.policy.name,
                                    "context": D, "n_past_start": ctx0, "repeat": r, "steps": windows[D],
                                    "seconds": dt, "tok_s": windows[D] / dt, "compute_ms": cms,
                                    "window_rescores": st["rescores"] - st0["rescores"],
                                    "window_rescore_ms": st["rescore_ms"] - st0["rescore_ms"],
                                    "kv_resident_bytes": kv_resident_bytes(s),
                                    "host_bytes": int(st["host_kv_mib"] * MIB), "page_outs": st["page_outs"],
                                    "page_ins": st["page_ins"], "rescores": st["rescores"]})
                    pb.advance(1, note=f"{ctx_label(D)} {m[0]} {windows[D] / dt:.1f} tok/s")
    for D in ctxs:
        full_stat = None
        by = {m: {x["repeat"]: x for x in res.raw if x["context"] == D and x["mode"] == m[0] and x["pool"] == m[1]}
              for m in live}
        ratios = {}
        for m in modes:
            row = {**_base(cfg, any_s), "mode": ("full (A/A control)" if ctl[1] is None else "kvflash (A/A control)")
                   if m is ctl else m[0], "pool": "-" if m[1] is None else m[1],
                   "policy": "-" if m[1] is None else (m[2] or "lru"), "context": D}
            if m in na:
                row.update(decode_tok_s=f"n/a: {na[m]}")
                res.rows.append(row)
                continue
            rr = list(by[m].values())
            wall = sum(x["seconds"] for x in rr)
            tok = summarize(x["tok_s"] for x in rr)
            row.update(policy="-" if m[1] is None else rr[-1]["policy"], decode_tok_s=tok, window=windows[D],
                       rescores=summarize(x["window_rescores"] for x in rr),
                       rescore_share=f"{100 * sum(x['window_rescore_ms'] for x in rr) / 1e3 / wall:.1f}%"
                       if wall else None,
                       compute_ms_tok=summarize(x["compute_ms"] / x["steps"] for x in rr),
                       kv_resident_mib=rr[-1]["kv_resident_bytes"] / MIB, host_mib=rr[-1]["host_bytes"] / MIB)
            if m is modes[0]:
                full_stat = tok
                row["vs_full"] = "1.00x"
            else:
                row["vs_full"] = _ratio(tok, full_stat)
                ref = by.get(base_of_ctl if m is ctl else modes[0], {})
                dr = [x["tok_s"] / ref[i]["tok_s"] for i, x in by[m].items() if i in ref]
                if dr:
                    ratios[m] = dr
                    row["speed_ratio"] = f"{statistics.median(dr):.2f}x ({_spread(dr)})"
            res.rows.append(row)
        cr = ratios.get(ctl)
        for m in modes[1:-1]:
            dr = ratios.get(m)
            if dr and cr:
                res.notes.append(f"{ctx_label(D)} pool {m[1]}: kvflash/full " + _verdict(dr, cr))
    res.notes += [f"modes run interleaved per repeat (order rotated); one growing session per mode; natural-text "
                  f"tokens; max_ctx {max_ctx}; per-repeat ratios: kvflash over full, the control over "
                  f"{'full' if ctl[1] is None else f'kvflash pool {pool0}'}",
                  ("a scored policy: each repeat decodes max(--steps, 4 rescore periods + 1) tokens in every mode "
                   "(rescores inside the tok/s; a growing session keeps its rescore phase, so a window holds 3-4)"
                   if scored else
                   f"policy {cfg.policy or 'lru'} does not rescore: {cfg.decode_steps} tokens per repeat"),
                  "full cache's KV resident = its allocation at this run's max_ctx; see `memory` for the ledger "
                  "at each context"]
    for pool in cfg.pools:
        a = [r for r in res.rows if r["mode"] == "kvflash" and r["pool"] == pool and isinstance(r.get("decode_tok_s"), dict)]
        if len(a) >= 2:
            lo, hi = a[0], a[-1]
            res.notes.append(f"pool {pool}: decode at {ctx_label(hi['context'])} ÷ at {ctx_label(lo['context'])} = "
                             f"{_ratio(hi['decode_tok_s'], lo['decode_tok_s'])} (flat = 1.00x)")
    res.notes += _policy_note(sessions) + [f"n/a {m[0]} pool {m[1]}: {why}" for m, why in na.items()]
    if (n := _long_note(cfg, max_ctx)):
        res.notes.append(n)
    return res
