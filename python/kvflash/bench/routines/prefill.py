"""Fresh prefill of a prompt, full cache vs pooled, with an A/A control."""
from __future__ import annotations

import statistics
import time

from ..common import MIB, BenchConfig, Progress, ctx_label, kv_resident_bytes, summarize, text_tokens
from ..report import Result
from ._shared import BASE_COLS, _base, _long_note, _modes, _open_modes, _ratio, _spread, _verdict


def run_prefill(cfg: BenchConfig) -> Result:
    """Fresh prefill of a D-token natural-text prompt: full cache vs pooled (kvflash) prefill, with an
    A/A control (a second session of the --control configuration: the full cache, or kvflash at the
    first pool).  Modes run interleaved per repeat (order rotated), ratios are per repeat (paired), and a
    ratio counts as a measured difference only outside the control's spread."""
    ctxs = sorted(set(cfg.contexts))
    max_ctx = max(ctxs)
    pool0 = cfg.pools[0]
    ctl = ("control", None, None) if cfg.control == "full" else ("control", pool0, cfg.policy)
    # --prefill-reread / --exact-prefill: beside each pool's plain prefill, the same with the settle's re-read
    # of the chosen chunks / with exact prefill (every piece attends the pool and the host store)
    modes = _modes(cfg)
    if cfg.prefill_reread:
        modes += [("kvflash+reread", p, cfg.policy) for p in cfg.pools]
    if cfg.exact_prefill:
        modes += [("kvflash+exact", p, cfg.policy) for p in cfg.pools]
    modes += [ctl]
    base_of_ctl = modes[0] if ctl[1] is None else ("kvflash", pool0, cfg.policy)
    sessions, na = _open_modes(cfg, modes, max_ctx, dedupe_fallback=False)
    live = [m for m in modes if m in sessions]
    any_s = next(iter(sessions.values()))
    toks = text_tokens(any_s, max_ctx)
    res = Result("prefill", f"prefill seconds per context (fresh prompt, median ± spread of {cfg.repeats} "
                 f"interleaved repeats) with an A/A control ({cfg.control} vs {cfg.control})",
                 BASE_COLS + [("pool", "pool"), ("context", "context"), ("prefill_s", "prefill s"),
                              ("prefill_tok_s", "prefill tok/s"), ("kv_resident_mib", "KV resident MiB"),
                              ("host_mib", "host MiB"), ("speedup", "speedup vs full (median of medians)"),
                              ("speed_ratio", "speedup per repeat (median, min-max)")])
    work = sum(D for D in ctxs) * cfg.repeats * len(live)
    with Progress(work, "prefill", cfg.quiet) as pb:
        for D in ctxs:
            for r in range(cfg.repeats):
                k = r % len(live)
                for m in live[k:] + live[:k]:   # each mode takes each place in turn
                    s = sessions[m]
                    s.reset()
                    pb.note(f"{ctx_label(D)} {m[0]}{'' if m[1] is None else m[1]}")
                    st0 = s.stats
                    t0 = time.perf_counter()
                    s.prefill(toks[:D])
                    dt = time.perf_counter() - t0
                    st = s.stats
                    res.raw.append({**_base(cfg, s), "mode": m[0], "pool": m[1], "context": D, "repeat": r,
                                    "seconds": dt, "exact_prefill": bool(getattr(s, "exact_prefill", False)),
                                    "kv_resident_bytes": kv_resident_bytes(s),
                                    "host_bytes": int(st["host_kv_mib"] * MIB), "page_outs": st["page_outs"],
                                    # the settle's share: its rescore, and the re-read of the chosen chunks
                                    "rescore_s": (st["rescore_ms"] - st0["rescore_ms"]) / 1e3,
                                    "reread_tokens": st["reread_tokens"] - st0["reread_tokens"],
                                    "reread_s": (st["reread_ms"] - st0["reread_ms"]) / 1e3})
                    pb.advance(D, note=f"{ctx_label(D)} {m[0]} {dt:.1f}s")
    for D in ctxs:
        full = None
        by = {m: {x["repeat"]: x for x in res.raw if x["context"] == D and x["mode"] == m[0] and x["pool"] == m[1]}
              for m in live}
        ratios = {}
        for m in modes:
            row = {**_base(cfg, any_s), "mode": ("full (A/A control)" if ctl[1] is None else "kvflash (A/A control)")
                   if m is ctl else m[0], "pool": "-" if m[1] is None else m[1], "context": D}
            if m in na:
                row["prefill_s"] = f"n/a: {na[m]}"
                res.rows.append(row)
                continue
            rr = list(by[m].values())
            sec = summarize(x["seconds"] for x in rr)
            row.update(prefill_s=sec, prefill_tok_s=summarize(D / x["seconds"] for x in rr),
                       kv_resident_mib=rr[-1]["kv_resident_bytes"] / MIB, host_mib=rr[-1]["host_bytes"] / MIB)
            if m is modes[0]:
                full, row["speedup"] = sec, "1.00x"
            else:
                row["speedup"] = _ratio(full, sec)
                # per repeat: the reference's seconds over this mode's (> 1: this mode is faster)
                ref = by.get(base_of_ctl if m is ctl else modes[0], {})
                dr = [ref[i]["seconds"] / x["seconds"] for i, x in by[m].items() if i in ref]
                if dr:
                    ratios[m] = dr
                    row["speed_ratio"] = f"{statistics.median(dr):.2f}x ({_spread(dr)})"
            res.rows.append(row)
        cr = ratios.get(ctl)
        for m in modes[1:-1]:
            dr = ratios.get(m)
            if dr and cr:
                res.notes.append(f"{ctx_label(D)} pool {m[1]}{m[0][len('kvflash'):].replace('+', ' +')}: "
                                 f"full/kvflash prefill seconds " + _verdict(dr, cr))
            plain = by.get(("kvflash", m[1], m[2]), {})
            if m[0] != "kvflash" and plain:
                # the variant's price, paired per repeat: its prefill's seconds over the plain pooled prefill's
                rr = [x["seconds"] / plain[i]["seconds"] for i, x in by[m].items() if i in plain]
                ctl_rr = [by[ctl][i]["seconds"] / plain[i]["seconds"] for i in by[ctl] if i in plain] \
                    if ctl[1] == m[1] else []
                xs = list(by[m].values())
                what = "the settle's re-read" if m[0].endswith("+reread") else "exact prefill"
                res.notes.append(f"{ctx_label(D)} pool {m[1]}: prefill with {what} over the plain "
                                 f"pooled prefill, per repeat: {statistics.median(rr):.2f}x ({_spread(rr)})" +
                                 (f"; A/A (control over plain) {statistics.median(ctl_rr):.2f}x ({_spread(ctl_rr)})"
                                  if ctl_rr else "") +
                                 (f"; the re-read itself: {statistics.median(x['reread_tokens'] for x in xs):.0f} "
                                  f"tokens in {statistics.median(x['reread_s'] for x in xs):.2f} s, the settle's "
                                  f"rescore {statistics.median(x['rescore_s'] for x in xs):.2f} s (medians)"
                                  if m[0].endswith("+reread") else ""))
    res.notes.append("a prompt longer than the pool prefills in 64-token pieces with live eviction; "
                     f"the full cache is allocated at max_ctx {max_ctx} and attends over its occupied extent")
    res.notes.append("modes run interleaved per repeat (order rotated), each from a reset session; per-repeat "
                     "ratios: the full cache's seconds over kvflash's, and the control's reference's over the "
                     f"control's ({'full' if ctl[1] is None else f'kvflash pool {pool0}'})")
    if (n := _long_note(cfg, max_ctx)):
        res.notes.append(n)
    return res
