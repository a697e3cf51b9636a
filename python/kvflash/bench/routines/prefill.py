"""Fresh prefill of a prompt, full cache vs pooled."""
from __future__ import annotations

import time

from ..common import MIB, BenchConfig, Progress, ctx_label, kv_resident_bytes, summarize, text_tokens
from ..report import Result
from ._shared import BASE_COLS, _base, _long_note, _modes, _open_modes, _ratio


def run_prefill(cfg: BenchConfig) -> Result:
    """Fresh prefill of a D-token natural-text prompt: full cache vs pooled (kvflash) prefill."""
    ctxs = sorted(set(cfg.contexts))
    max_ctx = max(ctxs)
    modes = _modes(cfg)
    sessions, na = _open_modes(cfg, modes, max_ctx, dedupe_fallback=False)
    live = [m for m in modes if m in sessions]
    any_s = next(iter(sessions.values()))
    toks = text_tokens(any_s, max_ctx)
    res = Result("prefill", f"prefill seconds per context (fresh prompt, median ± spread of {cfg.repeats})",
                 BASE_COLS + [("pool", "pool"), ("context", "context"), ("prefill_s", "prefill s"),
                              ("prefill_tok_s", "prefill tok/s"), ("kv_resident_mib", "KV resident MiB"),
                              ("host_mib", "host MiB"), ("speedup", "speedup vs full")])
    work = sum(D for D in ctxs) * cfg.repeats * len(live)
    with Progress(work, "prefill", cfg.quiet) as pb:
        for D in ctxs:
            for r in range(cfg.repeats):
                for m in (live if r % 2 == 0 else list(reversed(live))):
                    s = sessions[m]
                    s.reset()
                    pb.note(f"{ctx_label(D)} {m[0]}{'' if m[1] is None else m[1]}")
                    t0 = time.perf_counter()
                    s.prefill(toks[:D])
                    dt = time.perf_counter() - t0
                    st = s.stats
                    res.raw.append({**_base(cfg, s), "mode": m[0], "pool": m[1], "context": D, "repeat": r,
                                    "seconds": dt, "kv_resident_bytes": kv_resident_bytes(s),
                                    "host_bytes": int(st["host_kv_mib"] * MIB), "page_outs": st["page_outs"]})
                    pb.advance(D, note=f"{ctx_label(D)} {m[0]} {dt:.1f}s")
    for D in ctxs:
        full = None
        for m in modes:
            row = {**_base(cfg, any_s), "mode": m[0], "pool": "-" if m[1] is None else m[1], "context": D}
            if m in na:
                row["prefill_s"] = f"n/a: {na[m]}"
                res.rows.append(row)
                continue
            rr = [x for x in res.raw if x["context"] == D and x["mode"] == m[0] and x["pool"] == m[1]]
            sec = summarize(x["seconds"] for x in rr)
            row.update(prefill_s=sec, prefill_tok_s=summarize(D / x["seconds"] for x in rr),
                       kv_resident_mib=rr[-1]["kv_resident_bytes"] / MIB, host_mib=rr[-1]["host_bytes"] / MIB)
            if m[1] is None:
                full, row["speedup"] = sec, "1.00x"
            else:
                row["speedup"] = _ratio(full, sec)
            res.rows.append(row)
    res.notes.append("a prompt longer than the pool prefills in 64-token pieces with live eviction; "
                     f"the full cache is allocated at max_ctx {max_ctx} and attends over its occupied extent")
    if (n := _long_note(cfg, max_ctx)):
        res.notes.append(n)
    return res
