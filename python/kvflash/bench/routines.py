"""The bench routines.  Each takes a BenchConfig and returns a report.Result.

Every comparison is made inside one run, interleaved (full then kvflash, the order alternating per
repeat), so drift of a shared machine hits both sides; spreads are printed, never hidden.
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from .common import (MIB, BenchConfig, Progress, Unavailable, ctx_label, decode_steps, kv_resident_bytes, log,
                     model_label, open_session, summarize, text_tokens)
from .needle import NeedleBuilder, score
from .report import Result

BASE_COLS = [("model", "model"), ("threads", "threads"), ("kv_type", "kv")]


def _base(cfg: BenchConfig, s=None) -> dict:
    return {"model": model_label(cfg.model), "threads": s.threads if s is not None else cfg.threads,
            "kv_type": cfg.kv_type}


def _modes(cfg: BenchConfig) -> list:
    """(label, pool, policy) for decode/prefill/ab: the full cache, then kvflash per pool."""
    return [("full", None, None)] + [("kvflash", p, cfg.policy) for p in cfg.pools]


def _long_note(cfg: BenchConfig, max_ctx: int) -> Optional[str]:
    from .common import _n_ctx_train
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


# ----------------------------------------------------------------------------- decode
def run_decode(cfg: BenchConfig) -> Result:
    """Decode tok/s vs context: one growing session per mode, extended to each context in turn
    (cheaper than a fresh prefill per context and per repeat; decode cost depends only on the
    cache's occupied extent, which is the same either way).  An A/A control (a second session of the
    --control configuration: the full cache, or kvflash at the first pool) runs the same way; modes
    run interleaved per repeat (order rotated), ratios are per repeat (paired), and a ratio counts as a
    measured difference only outside the control's spread.  Each repeat times the same number of
    tokens in every mode, through generate(): --steps, or for a scored policy 4 rescore periods + 1
    at that context, so its rescoring is inside the tok/s."""
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
                outside = min(dr) > max(cr) or max(dr) < min(cr)
                res.notes.append(f"{ctx_label(D)} pool {m[1]}: kvflash/full {statistics.median(dr):.2f}x "
                                 f"({_spread(dr)}) vs A/A {statistics.median(cr):.2f}x ({_spread(cr)}) — " +
                                 ("outside the control's spread: a real difference" if outside else
                                  "overlaps the control's spread: not a measured difference"))
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


# ----------------------------------------------------------------------------- prefill
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


# ----------------------------------------------------------------------------- memory
def _proc_mem() -> dict:
    """This process's memory now (bytes), from /proc/self/status: VmRSS = RssAnon (RAM the process
    holds) + RssFile (mapped file pages: page cache the kernel can drop and re-read) + RssShmem."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _memory_base(cfg: BenchConfig) -> dict:
    """RSS of a process that has imported kvflash and the bench, before any session (the floor)."""
    import kvflash  # noqa: F401
    return _proc_mem()


def _memory_cell(cfg: BenchConfig, D: int, pool, host: str) -> dict:
    """One cell of the ledger, in a process of its own: open the session, write the context's
    positions through the pager (the allocations a prefill makes, without the model compute), and
    read the stats and the process's memory."""
    import tempfile
    tmp = tempfile.TemporaryDirectory(prefix="kvflash-mem-") if host == "file" else None
    try:
        kw = {"host": "file", "host_path": os.path.join(tmp.name, "host.kv")} if tmp else {}
        try:
            s = open_session(cfg, max_ctx=D, pool=pool, policy=cfg.policy if pool == "auto" else "lru", **kw)
        except Unavailable:
            s = open_session(cfg, max_ctx=D, pool=pool, policy="lru", **kw)
        pg = s.runtime.pager
        prefill_s = None
        if cfg.memory_prefill:   # a real prefill: weights, compute buffers and all
            toks = text_tokens(s, D)
            t0 = time.perf_counter()
            for i in range(0, D, 512):
                s.prefill(toks[i:i + 512])
            prefill_s = time.perf_counter() - t0
        elif s.kvflash:
            C = pg.chunk_tokens
            for c0 in range(0, D, C):
                if pg.alloc_span(c0, min(C, D - c0)) is None:
                    raise RuntimeError(f"pager had no room at position {c0} (pool {pool}, context {D})")
        mem = _proc_mem()
        return {"base": _base(cfg, s), "kvflash": s.kvflash, "pool_tokens": s.runtime.pool_tokens,
                "chunk_bytes": pg.chunk_bytes, "chunk_tokens": pg.chunk_tokens, "stats": s.stats,
                "pager_stats": pg.stats, "resident_bytes": kv_resident_bytes(s), "pool_bytes": s.runtime.pool_bytes,
                "swa_bytes": s.runtime.swa_bytes, "auto_reason": s.auto_reason, "mem": mem,
                "prefill_s": prefill_s}
    finally:
        if tmp:
            tmp.cleanup()


def _in_fresh_process(fn, *args):
    """fn(*args) in a new interpreter (spawn): a process's RSS only says something about one mode."""
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


def run_memory(cfg: BenchConfig) -> Result:
    """The KV ledger per context, and the memory a user's process holds.  Each cell runs in a process
    of its own: the session is opened and the pager driven through the context's positions -- the same
    allocations a prefill makes, without the model compute (`decode`, `prefill` and `ab` report the
    same pager stats after real prefills).  Resident bytes are the allocations (full cache at max_ctx =
    context, kvflash at the pool); host bytes are what the host store holds and has reserved; RSS is
    the process's, split into anonymous memory (RAM it holds) and mapped file pages (page cache)."""
    ctxs = sorted(set(cfg.contexts))
    res = Result("memory", "KV memory ledger and process memory per context",
                 BASE_COLS + [("mode", "mode"), ("host", "host"), ("pool", "pool"), ("context", "context"),
                              ("kv_resident_mib", "KV resident MiB"), ("host_mib", "host used MiB"),
                              ("host_reserved_mib", "host reserved MiB"), ("rss_mib", "RSS MiB"),
                              ("rss_anon_mib", "RSS anon MiB"), ("rss_file_mib", "RSS file MiB"),
                              ("rss_over_base_mib", "RSS over floor MiB"), ("prefill_s", "prefill s"),
                              ("resident_pct", "residency %"),
                              ("bytes_per_token", "KV B/token"), ("vs_full", "resident vs full"),
                              ("anon_vs_full", "RSS anon vs full")])
    cells = [("full", None, "ram")] + [("kvflash", p, "ram") for p in cfg.pools] + \
            [("kvflash", p, "file") for p in cfg.pools] + [("kvflash auto", "auto", "ram")]
    kind = lambda pool, host: "full" if pool is None else "auto" if pool == "auto" else host
    cells = [c for c in cells if kind(c[1], c[2]) in cfg.memory_cells]
    work = 1 + len(ctxs) * len(cells)
    autos = []
    with Progress(work, "memory", cfg.quiet) as pb:
        floor = _in_fresh_process(_memory_base, cfg)
        pb.advance(1, note=f"floor RSS {floor.get('VmRSS', 0) / MIB:.0f} MiB")
        for D in ctxs:
            full = None
            for label, pool, host in cells:
                if pool not in (None, "auto") and pool >= D:
                    pb.advance(1)
                    continue
                c = _in_fresh_process(_memory_cell, cfg, D, pool, host)
                st, mem = c["stats"], c["mem"]
                res_b = c["resident_bytes"]
                if label == "full":
                    full = c
                cb, C = c["chunk_bytes"], c["chunk_tokens"]
                row = {**c["base"], "mode": label, "host": host if c["kvflash"] else "-",
                       "pool": "-" if pool is None else c["pool_tokens"], "context": D,
                       "kv_resident_mib": res_b / MIB, "host_mib": st["host_kv_mib"],
                       "host_reserved_mib": c["pager_stats"]["host_reserved_bytes"] / MIB if c["kvflash"] else 0.0,
                       "rss_mib": mem.get("VmRSS", 0) / MIB, "rss_anon_mib": mem.get("RssAnon", 0) / MIB,
                       "rss_file_mib": mem.get("RssFile", 0) / MIB,
                       "rss_over_base_mib": (mem.get("VmRSS", 0) - floor.get("VmRSS", 0)) / MIB,
                       "prefill_s": c["prefill_s"],
                       "resident_pct": f"{100.0 * min(1.0, c['pool_tokens'] / D) if c['kvflash'] else 100.0:.1f}",
                       "bytes_per_token": cb // C if cb % C == 0 else cb / C,
                       "vs_full": None if full is None else f"{res_b / full['resident_bytes']:.3f}x",
                       "anon_vs_full": None if full is None or not full["mem"].get("RssAnon") else
                       f"{mem.get('RssAnon', 0) / full['mem']['RssAnon']:.3f}x"}
                if pool == "auto":
                    row["mode"] = "kvflash auto" if c["kvflash"] else "auto → full"
                    autos.append(f"auto at {ctx_label(D)}: pool {c['pool_tokens'] if c['kvflash'] else 'full'}"
                                 f" — {c['auto_reason'] or 'n/a'}")
                res.rows.append(row)
                res.raw.append({**row, "pager_stats": c["pager_stats"], "pool_bytes": c["pool_bytes"],
                                "swa_bytes": c["swa_bytes"], "auto_reason": c["auto_reason"], "proc_mem": mem,
                                "floor_mem": floor})
                pb.advance(1, note=f"{ctx_label(D)} {label} {host}")
    res.notes += ["KV resident = pool_bytes + swa_bytes (all paged and sliding-window KV the device holds); on "
                  "the CPU backend this is RAM too",
                  "host used = KV bytes in the host store after the context's positions were written; host reserved "
                  "= the store's capacity (RAM, or file size with host=file)",
                  ("RSS: each cell in a fresh process, after its session was opened and a real prefill of the "
                   "context's natural-text tokens (512-token pieces): weights, compute buffers and KV all in it; anon"
                   if cfg.memory_prefill else
                   "RSS: each cell in a fresh process, after its session was opened and the context's positions "
                   "were written through the pager (no model compute: weights that compute would touch and the "
                   "compute buffers are not in it); anon") + " = RAM held, file = mapped file pages (model weights read "
                  "so far, and the host store with host=file: page cache the kernel can drop); 'over floor' "
                  f"subtracts a process that only imported kvflash ({floor.get('VmRSS', 0) / MIB:.0f} MiB)",
                  "pools ≥ the context are skipped (they equal the full cache)"] + autos
    if (n := _long_note(cfg, max(ctxs))):
        res.notes.append(n)
    return res


# ----------------------------------------------------------------------------- paging
def _bench_pager_module():
    """A colleague's bench/bench_pager.py, when this runs from a source checkout that has it."""
    cands = [os.environ.get("KVFLASH_BENCH_PAGER")]
    here = Path(__file__).resolve()
    cands += [str(p / "bench" / "bench_pager.py") for p in list(here.parents)[:5]]
    cands.append(str(Path.cwd() / "bench" / "bench_pager.py"))
    for c in cands:
        if c and Path(c).is_file():
            spec = importlib.util.spec_from_file_location("_kvflash_bench_pager", c)
            mod = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(mod)
            except Exception:
                continue
            return mod
    return None


def _llc_bytes() -> int:
    """The largest CPU cache's size (bytes), from sysfs; 64 MiB when unknown."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            txt = (d / "size").read_text().strip()
            mult = {"K": 1024, "M": 2**20, "G": 2**30}.get(txt[-1:], 1)
            best = max(best, int(txt.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or 64 * 2**20


def run_paging(cfg: BenchConfig) -> Result:
    """Page-out / page-in per 64-token chunk, cold and warm, against a memcpy of the same bytes in the
    same state, and reselect cost, on a standalone Pager with the model's KV geometry (all paged layers,
    K and V).  Cold page-out: the first write into host memory never touched (page faults included);
    warm page-out: a rewritten chunk evicted again into its touched host buffer (both page-outs read the
    pool rows from DRAM, as evicting an old chunk does).  Cold page-in: the chunk's host
    bytes evicted from the CPU caches first (a buffer twice the last-level cache is streamed before each
    recall); warm page-in: recalled right after its own eviction.  The memcpy rows copy the same bytes
    from a buffer in the same state (flushed, or just written)."""
    import kvflash
    from kvflash.models import resolve_model
    m = kvflash.Model(str(resolve_model(cfg.model)), 1)
    hp = m.hparams
    n_layers = len(m.global_layers)
    n_embd_k = hp["head_dim"] * hp["n_head_kv"]
    ext = _bench_pager_module()
    res = Result("paging", f"paging cost per 64-token chunk ({n_layers} layers × K+V, {cfg.kv_type}; "
                 f"median ± spread over chunks × {cfg.repeats} repeats), cold and warm",
                 BASE_COLS + [("pool", "pool"), ("op", "op"), ("per", "per"), ("ms", "ms"),
                              ("gib_s", "GiB/s"), ("vs_memcpy", "vs memcpy in the same state")])
    rng = np.random.default_rng(cfg.seed)
    flush = np.ones(2 * _llc_bytes() // 8, dtype=np.int64)

    def flush_caches():
        flush[::8] += 1   # touches every cache line of a buffer twice the LLC

    ops = ["page_out_cold", "page_out_warm", "page_in_cold", "page_in_warm", "memcpy_cold", "memcpy_warm",
           "reselect", "reselect_per_chunk", "reselect_noop"]
    with Progress(len(cfg.pools) * cfg.repeats, "paging", cfg.quiet) as pb:
        for pool in cfg.pools:
            samples = {k: [] for k in ops}
            moved_all = []
            chunk_b = None
            for r in range(cfg.repeats):
                max_ctx = pool * 4
                p = kvflash.Pager(pool_tokens=pool, max_ctx=max_ctx, n_layers=n_layers, n_embd_k=n_embd_k,
                                  kv_type=cfg.kv_type)
                C = p.chunk_tokens
                chunk_b = p.chunk_bytes
                for layer in range(n_layers):   # touch the pool so its first-touch faults are not timed
                    p.k_rows(layer)[:] = rng.integers(0, 255, p.k_rows(layer).shape, dtype=np.uint8)
                    p.v_rows(layer)[:] = rng.integers(0, 255, p.v_rows(layer).shape, dtype=np.uint8)
                n_fill = pool // C
                for c in range(n_fill):
                    p.alloc_span(c * C, C)
                table = p.chunk_table()
                victims = [c for c in range(n_fill) if table["block"][c] >= 0 and not table["protected"][c]]
                for c in victims:   # cold page-out: dirty, never paged, host memory never touched
                    t0 = time.perf_counter_ns()
                    p.evict(c)
                    samples["page_out_cold"].append((time.perf_counter_ns() - t0) / 1e6)
                for c in victims:   # cold page-in: host bytes out of the CPU caches
                    flush_caches()
                    t0 = time.perf_counter_ns()
                    ok = p.recall(c)
                    samples["page_in_cold"].append((time.perf_counter_ns() - t0) / 1e6)
                    if not ok:
                        raise RuntimeError(f"recall of chunk {c} found no free block")
                for c in victims:   # warm: rewrite, evict into the touched host buffer, recall at once
                    p.alloc_span(c * C, C)
                    flush_caches()   # an evicted chunk is an old one: its pool rows come from DRAM
                    t0 = time.perf_counter_ns()
                    p.evict(c)
                    t1 = time.perf_counter_ns()
                    p.recall(c)
                    t2 = time.perf_counter_ns()
                    samples["page_out_warm"].append((t1 - t0) / 1e6)
                    samples["page_in_warm"].append((t2 - t1) / 1e6)
                srcs = [rng.integers(0, 255, chunk_b, dtype=np.uint8) for _ in range(4)]
                dst = np.empty_like(srcs[0])
                np.copyto(dst, srcs[0])
                for i in range(max(8, len(victims))):
                    src = srcs[i % len(srcs)]
                    flush_caches()
                    t0 = time.perf_counter_ns()
                    np.copyto(dst, src)
                    t1 = time.perf_counter_ns()
                    np.copyto(dst, src)
                    t2 = time.perf_counter_ns()
                    samples["memcpy_cold"].append((t1 - t0) / 1e6)
                    samples["memcpy_warm"].append((t2 - t1) / 1e6)
                # reselect: fill 4x the pool, then ask for ~20 chunks to swap (10 out, 10 in); then the same
                # scores again (nothing moves: the bookkeeping alone)
                for c in range(n_fill, max_ctx // C):
                    p.alloc_span(c * C, C)
                for _ in range(3):
                    table = p.chunk_table()
                    n = p.n_chunks
                    res_c = [c for c in range(n) if table["block"][c] >= 0 and not table["protected"][c]]
                    host_c = [c for c in range(n) if table["block"][c] < 0 and table["materialised"][c]]
                    k = min(10, len(res_c), len(host_c))
                    scores = np.zeros(n, dtype=np.float32)
                    scores[res_c] = 1.0
                    out = rng.choice(res_c, k, replace=False)
                    inn = rng.choice(host_c, k, replace=False)
                    scores[out] = 0.0
                    scores[inn] = 2.0
                    t0 = time.perf_counter_ns()
                    moved = p.reselect(scores)
                    ms = (time.perf_counter_ns() - t0) / 1e6
                    samples["reselect"].append(ms)
                    samples["reselect_per_chunk"].append(ms / max(1, moved))
                    moved_all.append(moved)
                    t0 = time.perf_counter_ns()
                    again = p.reselect(scores)
                    samples["reselect_noop"].append((time.perf_counter_ns() - t0) / 1e6)
                    if again:
                        raise RuntimeError(f"a repeated reselect moved {again} chunks")
                p.check_invariants()
                pb.advance(1, note=f"pool {pool}")
            gib = lambda ms: chunk_b / 2**30 / (ms / 1e3) if ms else None
            base_of = {"page_out_cold": "memcpy_cold", "page_in_cold": "memcpy_cold", "page_out_warm": "memcpy_cold",
                       "page_in_warm": "memcpy_warm"}
            for op in ops:
                per = ("chunk" if not op.startswith("reselect") else
                       f"~{int(np.median(moved_all))} chunks moved" if op == "reselect" else
                       "chunk moved" if op == "reselect_per_chunk" else "call, nothing moved")
                st = summarize(samples[op])
                row = {**_base(cfg), "pool": pool, "op": op, "per": per, "ms": st}
                if per == "chunk":
                    row["gib_s"] = gib(st["median"])
                    if op in base_of:
                        mc = summarize(samples[base_of[op]])
                        row["vs_memcpy"] = f"{st['median'] / mc['median']:.2f}x" if mc["median"] else None
                res.rows.append(row)
                res.raw += [{**_base(cfg), "pool": pool, "op": op, "ms": v} for v in samples[op]]
    res.notes += [f"chunk = {chunk_b} bytes ({chunk_b / 2**20:.2f} MiB), timed from Python around one native call "
                  "(~1 µs of call overhead included)",
                  "page_out_cold: first eviction of a dirty chunk into host memory never touched (page faults "
                  "included); page_out_warm: a rewritten chunk evicted again into its existing host buffer; both "
                  "read the pool rows from DRAM (caches flushed first, as for an old chunk) and are set against "
                  "memcpy_cold",
                  f"page_in_cold: recall after a {flush.nbytes // 2**20} MiB buffer (2x the last-level cache) was "
                  "streamed, so the host bytes come from DRAM; page_in_warm: recall right after the chunk's own "
                  "eviction (its bytes still cached)",
                  "memcpy_cold / memcpy_warm: numpy copy of the same byte count into a touched buffer, source "
                  "flushed from the caches / just copied (both ends cached); page_in_warm is set against memcpy_warm",
                  "reselect: up to 10 low-scored resident chunks out and as many high-scored host chunks in (a pool "
                  "has only pool/64 - 6 unprotected blocks); reselect_noop: the same scores again, nothing moves "
                  "(the bookkeeping alone)"]
    if ext is not None:
        res.notes.append(f"bench_pager.py found at {getattr(ext, '__file__', '?')}: run it for the pager "
                         f"micro-benchmarks it adds")
    return res


# ----------------------------------------------------------------------------- needle / ab
def _needle_modes(cfg: BenchConfig) -> list:
    return [("full", None, None)] + [("kvflash", p, pol) for p in cfg.pools for pol in cfg.policies]


def _open_modes(cfg: BenchConfig, modes: list, max_ctx: int, dedupe_fallback: bool):
    sessions, na = {}, {}
    for m in modes:
        try:
            s = open_session(cfg, max_ctx=max_ctx, pool=m[1], policy=m[2] or "lru")
        except Unavailable as e:
            na[m] = str(e)
            continue
        if dedupe_fallback and s.bench_fallback and ("kvflash", m[1], s.policy.name) in modes:
            na[m] = (f"no drafter found next to the model (would fall back to {s.policy.name}: see that column); "
                     f"pass --drafter PATH")
            continue
        sessions[m] = s
    return sessions, na


def _answer(s, ids: list, n: int) -> tuple:
    """Fresh prefill of ids, then a greedy answer: (text, prefill seconds, snap) where snap is None, or
    (scores, protected, resident) as the prompt's rescore left them (before the answer is decoded)."""
    s.reset()
    t0 = time.perf_counter()
    s.prefill(ids)
    dt = time.perf_counter() - t0
    scores = None
    if s.last_scores is not None:
        table = s.pager.chunk_table()
        n = len(s.last_scores)
        scores = (s.last_scores, table["protected"][:n].copy(), table["block"][:n] >= 0)
    text = "".join(s.generate(None, max_tokens=n, temperature=0.0, stop=["\n"]))
    return text, dt, scores


def _passkey_chunk(s, ids: list, value: str) -> Optional[int]:
    """The chunk holding the passkey's first byte (None if the digits are not in the prompt)."""
    data, ends = s.tokenizer.bytes_of(ids, skip_special=True)
    off = data.find(value.encode())
    if off < 0:
        return None
    return int(np.searchsorted(ends, off, side="right")) // s.chunk_tokens


def rank_of(scores: np.ndarray, protected: np.ndarray, chunk: int) -> int:
    """0-based rank of `chunk` among the chunks a policy chooses from (not protected: not the sink, not
    the tail window), best score first, ties in chunk order; -1 when the chunk is protected."""
    cand = np.where(~np.asarray(protected[:len(scores)], dtype=bool))[0]
    order = cand[np.argsort(-np.asarray(scores)[cand], kind="stable")]
    hit = np.where(order == chunk)[0]
    return int(hit[0]) if len(hit) else -1


def _trials_for(cfg, builder, D, reserve):
    return [builder.trial(i, D - reserve, cfg.depths) for i in range(cfg.needles)]


def _split_note(cfg: BenchConfig, haystacks: list) -> str:
    if cfg.split != "reporting":
        return (f"TUNING data (split {cfg.split}, seed {cfg.seed}): the prompts policy parameters were chosen on; "
                f"not a result")
    what = {"prose": "prose = procedural prose without digits",
            "ledger": "ledger = town records full of 3-6 digit numbers and codes"}
    return (f"reporting data (split reporting, seed {cfg.seed}, haystacks {', '.join(haystacks)}; wordings held out "
            f"from every tuning run): " + "; ".join(what[h] for h in haystacks))


def run_needle(cfg: BenchConfig) -> Result:
    """Recall of a passkey at depths of a haystack: full cache, then each policy at each pool, on the same
    prompts; greedy answer through the chat template, scored exact.  Per scored policy, the passkey
    chunk's rank under the prompt's rescore is recorded (rank < free slots: the policy kept it)."""
    ctxs = sorted(set(cfg.contexts))
    modes = _needle_modes(cfg)
    hays = list(cfg.haystacks) if cfg.split == "reporting" else ["prose"]
    res = Result("needle", f"needle-in-a-haystack recall ({cfg.split} split, depths "
                 f"{'/'.join(map(str, cfg.depths))}%, {cfg.needles} per cell and haystack)",
                 BASE_COLS + [("context", "context"), ("haystack", "haystack"), ("mode", "mode"), ("pool", "pool"),
                              ("policy", "policy"), ("residency", "residency %"), ("needle", f"needle /{cfg.needles}"),
                              ("by_depth", "by depth"), ("resident", "passkey chunk resident"),
                              ("ranks", "passkey chunk rank per trial (free slots)"), ("prefill_s", "prefill s")])
    notes = set()
    builders: dict = {}
    with Progress(len(ctxs) * len(hays) * cfg.needles * len(modes), "needle", cfg.quiet) as pb:
        for D in ctxs:
            sessions, na = _open_modes(cfg, modes, D, dedupe_fallback=True)
            if not sessions:
                raise RuntimeError("no mode could be opened")
            any_s = next(iter(sessions.values()))
            for hay in hays:
                if hay not in builders:
                    builders[hay] = NeedleBuilder(any_s, cfg.seed, split=cfg.split, haystack=hay)
                trials = _trials_for(cfg, builders[hay], D, cfg.answer_tokens + 1)
                pb.advance(cfg.needles * len(na))
                for t in trials:
                    for m, s in sessions.items():
                        pb.note(f"{ctx_label(D)} {hay} {m[0]} {m[1] or ''} {m[2] or ''} depth {t.depth}%")
                        ans, dt, scores = _answer(s, t.ids, cfg.answer_tokens)
                        ok = score(ans, t.value)
                        st = s.stats
                        c = _passkey_chunk(s, t.ids, t.value)
                        kept = None if m[1] is None or c is None else bool(s.pager.chunk_table()["block"][c] >= 0)
                        rank = free = None
                        if m[1] is not None and scores is not None and c is not None:
                            sc, prot, resident = scores
                            rank = rank_of(sc, prot, c)
                            free = int(s.pager.n_blocks - np.count_nonzero(prot & resident))
                        res.raw.append({**_base(cfg, s), "context": D, "split": cfg.split, "haystack": hay,
                                        "mode": m[0], "pool": m[1], "policy": s.policy.name if m[1] else None,
                                        "trial": t.index, "depth": t.depth, "wording": t.wording,
                                        "prompt_tokens": len(t.ids), "value": t.value, "answer": ans, "correct": ok,
                                        "prefill_s": dt, "residency_pct": st["residency_pct"],
                                        "page_outs": st["page_outs"], "page_ins": st["page_ins"],
                                        "rescores": st["rescores"], "passkey_chunk": c, "passkey_resident": kept,
                                        "passkey_rank": rank, "free_slots": free})
                        pb.advance(1, note=f"{ctx_label(D)} {hay} {m[0]} {m[2] or ''}: {'ok' if ok else 'miss'}")
                for m in modes:
                    row = {**_base(cfg, any_s), "context": D, "haystack": hay, "mode": m[0],
                           "pool": "-" if m[1] is None else m[1], "policy": "-" if m[1] is None else m[2],
                           "residency": 100.0 if m[1] is None else round(100.0 * min(1.0, m[1] / D), 1)}
                    if m in na:
                        row["needle"] = "n/a"
                        row["by_depth"] = na[m]
                        notes.add(f"{m[2]}: {na[m]}")
                        res.rows.append(row)
                        continue
                    rr = [x for x in res.raw if x["context"] == D and x["haystack"] == hay and x["mode"] == m[0]
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
                            row["ranks"] = " ".join("p" if x["passkey_rank"] < 0 else str(x["passkey_rank"])
                                                    for x in rk) + f" ({rk[-1]['free_slots']})"
                    if sessions[m].bench_fallback:
                        row["policy"] = f"{m[2]}→{sessions[m].policy.name}"
                    res.rows.append(row)
            del sessions
    res.notes += [_split_note(cfg, hays),
                  f"scored exact: the passkey's digits appear in the greedy answer (max {cfg.answer_tokens} tokens, "
                  f"stop at newline); the assistant turn is primed with the wording's answer prefix",
                  "kvflash keeps the sink chunk and the last 5 chunks resident: LRU finds a needle only there",
                  "passkey chunk resident: after the answer, the chunk holding the passkey's first digit holds "
                  "a pool block (a policy that kept it and still missed met the model's limit, not its own)",
                  "rank: where the prompt's rescore put the passkey chunk among the chunks the policy chooses from "
                  "(0 = best; p = protected, i.e. in the sink or tail window); the number in brackets is the free "
                  "slots (pool blocks not held by protected chunks): rank < free slots means kept"]
    res.notes += sorted(notes)
    if (n := _long_note(cfg, max(ctxs))):
        res.notes.append(n)
    return res


def _decode_window(cfg: BenchConfig, D: int) -> int:
    """Tokens timed per ab trial: at least decode_steps, and rescore_periods whole rescore periods of a
    scored policy at this context (+1, so the last period's rescore falls inside the window)."""
    period = max(cfg.tau, D // 45)
    return max(cfg.decode_steps, cfg.rescore_periods * period + 1)


def _spread(xs: list) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def run_ab(cfg: BenchConfig) -> Result:
    """The headline table: per context, full cache vs kvflash (first --pool, --policy), and an A/A control
    (a second session of the --control configuration, run the same way): prefill s, decode tok/s over a
    window that pays for the policy's rescoring, needle /N and KV resident, from the same trials.  Each
    trial: a fresh prefill of a needle prompt, the greedy answer, then the decode window timed through
    generate(); the modes run interleaved per trial (order rotated), and the ratios are per trial, so a
    drift of the machine hits both sides of each ratio."""
    ctxs = sorted(set(cfg.contexts))
    pool = cfg.pools[0]
    ctl = ("control", None, None) if cfg.control == "full" else ("control", pool, cfg.policy)
    modes = [("full", None, None), ctl, ("kvflash", pool, cfg.policy)]
    res = Result("ab", f"full cache vs kvflash (pool {pool}, policy {cfg.policy}) with an A/A control "
                 f"({cfg.control} vs {cfg.control}): median ± spread over {cfg.needles} interleaved trials",
                 BASE_COLS + [("context", "context"), ("mode", "mode"), ("pool", "pool"), ("policy", "policy"),
                              ("prefill_s", "prefill s"), ("decode_tok_s", "decode tok/s"),
                              ("window", "tokens timed"), ("rescores", "rescores in window"),
                              ("rescore_share", "rescore % of window"), ("needle", f"needle /{cfg.needles}"),
                              ("kv_resident_mib", "KV resident MiB"), ("host_mib", "host MiB"),
                              ("speed_ratio", "decode ratio (median, min-max)"),
                              ("prefill_ratio", "prefill ratio (median, min-max)")])
    builder = None
    notes = []
    with Progress(len(ctxs) * cfg.needles * len(modes), "ab", cfg.quiet) as pb:
        for D in ctxs:
            n_dec = _decode_window(cfg, D)
            sessions, na = _open_modes(cfg, modes, D, dedupe_fallback=False)
            any_s = next(iter(sessions.values()))
            builder = builder or NeedleBuilder(any_s, cfg.seed, split=cfg.split,
                                               haystack=cfg.haystacks[0] if cfg.split == "reporting" else "prose")
            trials = _trials_for(cfg, builder, D, cfg.answer_tokens + n_dec + 2)
            pb.advance(cfg.needles * len(na))
            for t in trials:
                order = list(sessions.items())
                k = t.index % len(order)
                order = order[k:] + order[:k]   # each mode takes each place in turn
                for m, s in order:
                    pb.note(f"{ctx_label(D)} {m[0]} trial {t.index + 1}/{cfg.needles}: prefill")
                    ans, dt, _ = _answer(s, t.ids, cfg.answer_tokens)
                    ctx0 = s.n_past
                    st0 = s.stats
                    pb.note(f"{ctx_label(D)} {m[0]} trial {t.index + 1}/{cfg.needles}: decode {n_dec}")
                    ddt, cms = decode_steps(s, n_dec)
                    st = s.stats
                    ok = score(ans, t.value)
                    resc_ms = st["rescore_ms"] - st0["rescore_ms"]
                    res.raw.append({**_base(cfg, s), "context": D, "mode": m[0], "pool": m[1],
                                    "policy": s.policy.name if m[1] else None, "trial": t.index, "depth": t.depth,
                                    "prompt_tokens": len(t.ids), "value": t.value, "answer": ans, "correct": ok,
                                    "prefill_s": dt, "decode_ctx": ctx0, "decode_tokens": n_dec, "decode_s": ddt,
                                    "decode_tok_s": n_dec / ddt, "compute_ms": cms,
                                    "window_rescores": st["rescores"] - st0["rescores"], "window_rescore_ms": resc_ms,
                                    "kv_resident_bytes": kv_resident_bytes(s), "host_bytes": int(st["host_kv_mib"] * MIB),
                                    "page_outs": st["page_outs"], "page_ins": st["page_ins"],
                                    "rescores": st["rescores"]})
                    pb.advance(1, note=f"{ctx_label(D)} {m[0]}: {n_dec / ddt:.1f} tok/s, "
                                       f"{'ok' if ok else 'miss'}")
            by = {m: {x["trial"]: x for x in res.raw if x["context"] == D and x["mode"] == m[0]} for m in modes}

            def paired(m, key, inv=False):   # per-trial ratio m / full (full / m when inv)
                out = []
                for i, x in by[m].items():
                    f = by[modes[0]].get(i)
                    if f and x[key] and f[key]:
                        out.append(f[key] / x[key] if inv else x[key] / f[key])
                return out

            ratios = {}
            for m in modes:
                row = {**_base(cfg, any_s), "context": D, "mode": "full (A/A control)" if m is ctl and ctl[1] is None
                       else "kvflash (A/A control)" if m is ctl else m[0],
                       "pool": "-" if m[1] is None else m[1], "policy": "-" if m[1] is None else m[2]}
                if m in na:
                    row["decode_tok_s"] = f"n/a: {na[m]}"
                    res.rows.append(row)
                    continue
                s = sessions[m]
                if m[1] is not None and s.bench_fallback:
                    row["policy"] = f"{m[2]}→{s.policy.name}"
                    notes.append(f"policy {m[2]!r} fell back: {s.banner.splitlines()[0]}")
                rr = list(by[m].values())
                wall = sum(x["decode_s"] for x in rr)
                row.update(prefill_s=summarize(x["prefill_s"] for x in rr),
                           decode_tok_s=summarize(x["decode_tok_s"] for x in rr), window=n_dec,
                           rescores=summarize(x["window_rescores"] for x in rr),
                           rescore_share=f"{100 * sum(x['window_rescore_ms'] for x in rr) / 1e3 / wall:.1f}%"
                           if wall else None,
                           needle=f"{sum(x['correct'] for x in rr)}/{len(rr)}",
                           kv_resident_mib=rr[-1]["kv_resident_bytes"] / MIB, host_mib=rr[-1]["host_bytes"] / MIB)
                if m is not modes[0]:
                    # per trial: the control over full when the control is the full cache, the control over
                    # kvflash when it is kvflash; kvflash over full
                    if m is ctl and ctl[1] is not None:
                        dr = [by[m][i]["decode_tok_s"] / by[modes[2]][i]["decode_tok_s"] for i in by[m] if i in by[modes[2]]]
                        pr = [by[modes[2]][i]["prefill_s"] / by[m][i]["prefill_s"] for i in by[m] if i in by[modes[2]]]
                    else:
                        dr, pr = paired(m, "decode_tok_s"), paired(m, "prefill_s", inv=True)
                    ratios[m] = (dr, pr)
                    if dr:
                        row["speed_ratio"] = f"{statistics.median(dr):.2f}x ({_spread(dr)})"
                        row["prefill_ratio"] = f"{statistics.median(pr):.2f}x ({_spread(pr)})"
                res.rows.append(row)
            kv = modes[2]
            if kv in ratios and ctl in ratios and ratios[kv][0] and ratios[ctl][0]:
                dr, cr = ratios[kv][0], ratios[ctl][0]
                outside = min(dr) > max(cr) or max(dr) < min(cr)
                verdict = ("outside the control's spread: a real difference" if outside else
                           "overlaps the control's spread: not a measured difference")
                notes.append(f"{ctx_label(D)}: decode kvflash/full {statistics.median(dr):.2f}x ({_spread(dr)}) vs "
                             f"A/A {statistics.median(cr):.2f}x ({_spread(cr)}) — {verdict}")
            del sessions
    res.notes += [f"each trial: fresh prefill of a needle prompt, greedy answer (≤ {cfg.answer_tokens} tokens), then "
                  f"a decode window timed through generate() (max({cfg.decode_steps} steps, {cfg.rescore_periods} "
                  f"rescore periods + 1); a scored policy rescores every max(tau, history/45) tokens, and that time "
                  f"is inside the window and in its tok/s); the full cache is allocated at max_ctx = context",
                  f"A/A control: a second session of the {cfg.control} configuration, run the same way in the same "
                  f"trials; its ratio's spread is the noise floor (a speedup counts only outside it); ratios are "
                  f"per trial (paired), the {'control over full' if cfg.control == 'full' else 'control over kvflash'} "
                  f"for the control row",
                  "needle scored exact (digits in the answer); depths " + "/".join(map(str, cfg.depths)) + "%; " +
                  _split_note(cfg, cfg.haystacks[:1] if cfg.split == "reporting" else ["prose"])]
    res.notes += list(dict.fromkeys(notes))
    if (n := _long_note(cfg, max(ctxs))):
        res.notes.append(n)
    return res


# ----------------------------------------------------------------------------- rescore cost
def run_rescore(cfg: BenchConfig) -> Result:
    """What a scored policy costs per decoded token: a pooled session prefills a D-token text prompt,
    then decodes until it has rescored `repeats` times; rescore time (drafter feed + scoring, or the qk
    pass over every key) is amortised over the decoded tokens and set against the decode time.  For
    the drafter, the reference's way (re-read the whole history into the drafter at every rescore) is
    timed in the same run on the same history."""
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
                    ref.load(s)
                    view = s.chunk_view()
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


ROUTINES = {"decode": run_decode, "memory": run_memory, "paging": run_paging, "prefill": run_prefill,
            "needle": run_needle, "ab": run_ab, "rescore": run_rescore}
