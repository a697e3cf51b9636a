"""The bench routines.  Each takes a BenchConfig and returns a report.Result.

Every comparison is made inside one run, interleaved (full then kvflash, the order alternating per
repeat), so drift of a shared machine hits both sides; spreads are printed, never hidden.
"""
from __future__ import annotations

import importlib.util
import os
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
    cache's occupied extent, which is the same either way)."""
    ctxs = sorted(set(cfg.contexts))
    margin = cfg.repeats * cfg.decode_steps + 64
    max_ctx = max(ctxs) + margin
    modes = _modes(cfg)
    sessions, na = _open_modes(cfg, modes, max_ctx, dedupe_fallback=False)
    live = [m for m in modes if m in sessions]
    any_s = next(iter(sessions.values()))
    toks = text_tokens(any_s, max_ctx)
    res = Result("decode", f"decode tok/s vs context ({cfg.decode_steps} greedy steps per repeat, "
                 f"median ± spread of {cfg.repeats})",
                 BASE_COLS + [("pool", "pool"), ("policy", "policy"), ("context", "context"),
                              ("decode_tok_s", "decode tok/s"), ("compute_ms_tok", "compute ms/tok"),
                              ("kv_resident_mib", "KV resident MiB"), ("host_mib", "host MiB"),
                              ("vs_full", "vs full")])
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
                order = live if r % 2 == 0 else list(reversed(live))
                for m in order:
                    s = sessions[m]
                    ctx0 = s.n_past
                    pb.note(f"{ctx_label(D)} {m[0]}: timing")
                    dt, cms = decode_steps(s, cfg.decode_steps)
                    st = s.stats
                    res.raw.append({**_base(cfg, s), "mode": m[0], "pool": m[1], "policy": s.policy.name,
                                    "context": D, "n_past_start": ctx0, "repeat": r, "steps": cfg.decode_steps,
                                    "seconds": dt, "tok_s": cfg.decode_steps / dt,
                                    "compute_ms": cms, "kv_resident_bytes": kv_resident_bytes(s),
                                    "host_bytes": int(st["host_kv_mib"] * MIB), "page_outs": st["page_outs"],
                                    "page_ins": st["page_ins"], "rescores": st["rescores"]})
                    pb.advance(1, note=f"{ctx_label(D)} {m[0]} {cfg.decode_steps / dt:.1f} tok/s")
    for D in ctxs:
        full_stat = None
        for m in modes:
            row = {**_base(cfg, any_s), "mode": m[0], "pool": "-" if m[1] is None else m[1],
                   "policy": "-" if m[1] is None else (m[2] or "lru"), "context": D}
            if m in na:
                row.update(decode_tok_s=f"n/a: {na[m]}")
                res.rows.append(row)
                continue
            rr = [x for x in res.raw if x["context"] == D and x["mode"] == m[0] and x["pool"] == m[1]]
            tok = summarize(x["tok_s"] for x in rr)
            row.update(policy="-" if m[1] is None else rr[-1]["policy"], decode_tok_s=tok,
                       compute_ms_tok=summarize(x["compute_ms"] / x["steps"] for x in rr),
                       kv_resident_mib=rr[-1]["kv_resident_bytes"] / MIB, host_mib=rr[-1]["host_bytes"] / MIB)
            if m[1] is None:
                full_stat = tok
                row["vs_full"] = "1.00x"
            else:
                row["vs_full"] = _ratio(tok, full_stat)
            res.rows.append(row)
    res.notes += [f"modes run interleaved per repeat (order reversed on odd repeats); one growing session per "
                  f"mode; natural-text tokens; max_ctx {max_ctx}",
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
        if s.kvflash:
            C = pg.chunk_tokens
            for c0 in range(0, D, C):
                if pg.alloc_span(c0, min(C, D - c0)) is None:
                    raise RuntimeError(f"pager had no room at position {c0} (pool {pool}, context {D})")
        mem = _proc_mem()
        return {"base": _base(cfg, s), "kvflash": s.kvflash, "pool_tokens": s.runtime.pool_tokens,
                "chunk_bytes": pg.chunk_bytes, "chunk_tokens": pg.chunk_tokens, "stats": s.stats,
                "pager_stats": pg.stats, "resident_bytes": kv_resident_bytes(s), "pool_bytes": s.runtime.pool_bytes,
                "swa_bytes": s.runtime.swa_bytes, "auto_reason": s.auto_reason, "mem": mem}
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
                              ("rss_over_base_mib", "RSS over floor MiB"), ("resident_pct", "residency %"),
                              ("bytes_per_token", "KV B/token"), ("vs_full", "resident vs full"),
                              ("anon_vs_full", "RSS anon vs full")])
    cells = [("full", None, "ram")] + [("kvflash", p, "ram") for p in cfg.pools] + \
            [("kvflash", p, "file") for p in cfg.pools] + [("kvflash auto", "auto", "ram")]
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
                  "RSS: each cell in a fresh process, after its session was opened and the context's positions "
                  "were written through the pager (no model compute: weights that compute would touch and the "
                  "compute buffers are not in it); anon = RAM held, file = mapped file pages (model weights read "
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


def run_paging(cfg: BenchConfig) -> Result:
    """Page-out / page-in per 64-token chunk against a plain memcpy of the same bytes, and reselect cost,
    on a standalone Pager with the model's KV geometry (all paged layers, K and V)."""
    import kvflash
    from kvflash.models import resolve_model
    m = kvflash.Model(str(resolve_model(cfg.model)), 1)
    hp = m.hparams
    n_layers = len(m.global_layers)
    n_embd_k = hp["head_dim"] * hp["n_head_kv"]
    ext = _bench_pager_module()
    res = Result("paging", f"paging cost per 64-token chunk ({n_layers} layers × K+V, {cfg.kv_type}; "
                 f"median ± spread over chunks × {cfg.repeats} repeats)",
                 BASE_COLS + [("pool", "pool"), ("op", "op"), ("per", "per"), ("ms", "ms"),
                              ("gib_s", "GiB/s"), ("vs_memcpy", "vs memcpy")])
    rng = np.random.default_rng(cfg.seed)
    with Progress(len(cfg.pools) * cfg.repeats, "paging", cfg.quiet) as pb:
        for pool in cfg.pools:
            samples = {"page_out": [], "page_out_warm": [], "page_in": [], "memcpy": [], "reselect": [], "reselect_per_chunk": []}
            moved_all = []
            chunk_b = None
            for r in range(cfg.repeats):
                max_ctx = pool * 4
                p = kvflash.Pager(pool_tokens=pool, max_ctx=max_ctx, n_layers=n_layers, n_embd_k=n_embd_k,
                                  kv_type=cfg.kv_type)
                C = p.chunk_tokens
                chunk_b = p.chunk_bytes
                for layer in range(n_layers):   # touch the pool so first-touch faults are not timed
                    p.k_rows(layer)[:] = rng.integers(0, 255, p.k_rows(layer).shape, dtype=np.uint8)
                    p.v_rows(layer)[:] = rng.integers(0, 255, p.v_rows(layer).shape, dtype=np.uint8)
                n_fill = pool // C
                for c in range(n_fill):
                    p.alloc_span(c * C, C)
                table = p.chunk_table()
                victims = [c for c in range(n_fill) if table["block"][c] >= 0 and not table["protected"][c]]
                # page-out: dirty, never-paged chunks (a real copy each)
                for c in victims:
                    t0 = time.perf_counter_ns()
                    p.evict(c)
                    samples["page_out"].append((time.perf_counter_ns() - t0) / 1e6)
                # page-in: each into a block its eviction freed
                for c in victims:
                    t0 = time.perf_counter_ns()
                    ok = p.recall(c)
                    samples["page_in"].append((time.perf_counter_ns() - t0) / 1e6)
                    assert ok
                # page-out again into host buffers already touched (steady state: rewrite, then evict)
                for c in victims:
                    p.alloc_span(c * C, C)
                    t0 = time.perf_counter_ns()
                    p.evict(c)
                    samples["page_out_warm"].append((time.perf_counter_ns() - t0) / 1e6)
                    p.recall(c)
                src = rng.integers(0, 255, chunk_b, dtype=np.uint8)
                dst = np.empty_like(src)
                np.copyto(dst, src)
                for _ in range(max(8, len(victims))):
                    t0 = time.perf_counter_ns()
                    np.copyto(dst, src)
                    samples["memcpy"].append((time.perf_counter_ns() - t0) / 1e6)
                # reselect: fill 4x the pool, then ask for ~20 chunks to swap (10 out, 10 in)
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
                p.check_invariants()
                pb.advance(1, note=f"pool {pool}")
            mc = summarize(samples["memcpy"])
            gib = lambda ms: chunk_b / 2**30 / (ms / 1e3) if ms else None
            for op, per in [("page_out", "chunk"), ("page_out_warm", "chunk"), ("page_in", "chunk"), ("memcpy", "chunk"),
                            ("reselect", f"~{int(np.median(moved_all))} chunks moved"),
                            ("reselect_per_chunk", "chunk moved")]:
                st = summarize(samples[op])
                row = {**_base(cfg), "pool": pool, "op": op, "per": per, "ms": st}
                if per == "chunk":
                    row["gib_s"] = gib(st["median"])
                    row["vs_memcpy"] = f"{st['median'] / mc['median']:.2f}x" if mc["median"] else None
                res.rows.append(row)
                res.raw += [{**_base(cfg), "pool": pool, "op": op, "ms": v} for v in samples[op]]
    res.notes += [f"chunk = {chunk_b} bytes ({chunk_b / 2**20:.2f} MiB); page-out of a dirty chunk, page-in "
                  "into a free block; memcpy = numpy copy of the same byte count between warm buffers",
                  "timed from Python around one native call (~1 µs of call overhead included)",
                  "page_out: first eviction into fresh host slab memory (page faults included); page_out_warm: a rewritten "
                  "chunk evicted again into its existing host buffer",
                  "reselect: up to 10 low-scored resident chunks out and as many high-scored host chunks in (a pool has "
                  "only pool/64 - 6 unprotected blocks)"]
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


def _answer(s, ids: list, n: int) -> tuple[str, float]:
    s.reset()
    t0 = time.perf_counter()
    s.prefill(ids)
    dt = time.perf_counter() - t0
    text = "".join(s.generate(None, max_tokens=n, temperature=0.0, stop=["\n"]))
    return text, dt


def _passkey_chunk(s, ids: list, value: str) -> Optional[int]:
    """The chunk holding the passkey's first byte (None if the digits are not in the prompt)."""
    data, ends = s.tokenizer.bytes_of(ids, skip_special=True)
    off = data.find(value.encode())
    if off < 0:
        return None
    return int(np.searchsorted(ends, off, side="right")) // s.chunk_tokens


def _trials_for(cfg, builder, D, reserve):
    return [builder.trial(i, D - reserve, cfg.depths) for i in range(cfg.needles)]


def run_needle(cfg: BenchConfig) -> Result:
    """Recall of a passkey at depths of a natural-text haystack: full cache, then each policy at each pool,
    on the same prompts; greedy answer through the chat template, scored exact."""
    ctxs = sorted(set(cfg.contexts))
    modes = _needle_modes(cfg)
    res = Result("needle", f"needle-in-a-haystack recall (passkey, depths {'/'.join(map(str, cfg.depths))}%, "
                 f"{cfg.needles} per cell)",
                 BASE_COLS + [("context", "context"), ("mode", "mode"), ("pool", "pool"), ("policy", "policy"),
                              ("residency", "residency %"), ("needle", f"needle /{cfg.needles}"),
                              ("by_depth", "by depth"), ("resident", "passkey chunk resident"),
                              ("prefill_s", "prefill s")])
    builder = None
    notes = set()
    with Progress(len(ctxs) * cfg.needles * len(modes), "needle", cfg.quiet) as pb:
        for D in ctxs:
            sessions, na = _open_modes(cfg, modes, D, dedupe_fallback=True)
            if not sessions:
                raise RuntimeError("no mode could be opened")
            any_s = next(iter(sessions.values()))
            builder = builder or NeedleBuilder(any_s, cfg.seed)
            trials = _trials_for(cfg, builder, D, cfg.answer_tokens + 1)
            pb.advance(cfg.needles * len(na))
            for t in trials:
                for m, s in sessions.items():
                    pb.note(f"{ctx_label(D)} {m[0]} {m[1] or ''} {m[2] or ''} depth {t.depth}%")
                    ans, dt = _answer(s, t.ids, cfg.answer_tokens)
                    ok = score(ans, t.value)
                    st = s.stats
                    c = _passkey_chunk(s, t.ids, t.value)
                    kept = None if m[1] is None or c is None else bool(s.pager.chunk_table()["block"][c] >= 0)
                    res.raw.append({**_base(cfg, s), "context": D, "mode": m[0], "pool": m[1],
                                    "policy": s.policy.name if m[1] else None, "trial": t.index, "depth": t.depth,
                                    "prompt_tokens": len(t.ids), "value": t.value, "answer": ans, "correct": ok,
                                    "prefill_s": dt, "residency_pct": st["residency_pct"],
                                    "page_outs": st["page_outs"], "page_ins": st["page_ins"],
                                    "rescores": st["rescores"], "passkey_chunk": c, "passkey_resident": kept})
                    pb.advance(1, note=f"{ctx_label(D)} {m[0]} {m[2] or ''}: {'ok' if ok else 'miss'}")
            for m in modes:
                row = {**_base(cfg, any_s), "context": D, "mode": m[0], "pool": "-" if m[1] is None else m[1],
                       "policy": "-" if m[1] is None else m[2],
                       "residency": 100.0 if m[1] is None else round(100.0 * min(1.0, m[1] / D), 1)}
                if m in na:
                    row["needle"] = "n/a"
                    row["by_depth"] = na[m]
                    notes.add(f"{m[2]}: {na[m]}")
                else:
                    rr = [x for x in res.raw if x["context"] == D and x["mode"] == m[0] and x["pool"] == m[1]
                          and (m[1] is None or x["policy"] == sessions[m].policy.name)]
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
                    if sessions[m].bench_fallback:
                        row["policy"] = f"{m[2]}→{sessions[m].policy.name}"
                res.rows.append(row)
            del sessions
    res.notes += [f"scored exact: the passkey's digits appear in the greedy answer (max {cfg.answer_tokens} tokens, "
                  f"stop at newline); the assistant turn is primed with \"The passkey is\"",
                  "haystack: procedural public-domain prose shipped as kvflash/bench/haystack.txt (see _prose.py)",
                  "kvflash keeps the sink chunk and the last 5 chunks resident: LRU finds a needle only there",
                  "passkey chunk resident: after the answer, the chunk holding the passkey's first digit holds "
                  "a pool block (a policy that kept it and still missed met the model's limit, not its own)"]
    res.notes += sorted(notes)
    if (n := _long_note(cfg, max(ctxs))):
        res.notes.append(n)
    return res


def run_ab(cfg: BenchConfig) -> Result:
    """The headline table: per context, full cache vs kvflash (first --pool, --policy): prefill s, decode
    tok/s, needle /N and KV resident, from the same trials (each trial: fresh prefill of a needle prompt,
    the greedy answer, then decode_steps timed at that context), interleaved full/kvflash per trial."""
    ctxs = sorted(set(cfg.contexts))
    pool = cfg.pools[0]
    modes = [("full", None, None), ("kvflash", pool, cfg.policy)]
    res = Result("ab", f"full cache vs kvflash (pool {pool}, policy {cfg.policy}): median ± spread over "
                 f"{cfg.needles} trials",
                 BASE_COLS + [("context", "context"), ("mode", "mode"), ("pool", "pool"), ("policy", "policy"),
                              ("prefill_s", "prefill s"), ("decode_tok_s", "decode tok/s"),
                              ("needle", f"needle /{cfg.needles}"), ("kv_resident_mib", "KV resident MiB"),
                              ("host_mib", "host MiB"), ("speed_ratio", "decode kvflash/full"),
                              ("prefill_ratio", "prefill full/kvflash")])
    builder = None
    notes = []
    with Progress(len(ctxs) * cfg.needles * len(modes), "ab", cfg.quiet) as pb:
        for D in ctxs:
            sessions, na = _open_modes(cfg, modes, D, dedupe_fallback=False)
            any_s = next(iter(sessions.values()))
            builder = builder or NeedleBuilder(any_s, cfg.seed)
            trials = _trials_for(cfg, builder, D, cfg.answer_tokens + cfg.decode_steps + 2)
            pb.advance(cfg.needles * len(na))
            for t in trials:
                order = list(sessions.items())
                if t.index % 2:
                    order.reverse()
                for m, s in order:
                    pb.note(f"{ctx_label(D)} {m[0]} trial {t.index + 1}/{cfg.needles}: prefill")
                    ans, dt = _answer(s, t.ids, cfg.answer_tokens)
                    ctx0 = s.n_past
                    pb.note(f"{ctx_label(D)} {m[0]} trial {t.index + 1}/{cfg.needles}: decode")
                    ddt, cms = decode_steps(s, cfg.decode_steps)
                    st = s.stats
                    ok = score(ans, t.value)
                    res.raw.append({**_base(cfg, s), "context": D, "mode": m[0], "pool": m[1],
                                    "policy": s.policy.name if m[1] else None, "trial": t.index, "depth": t.depth,
                                    "prompt_tokens": len(t.ids), "value": t.value, "answer": ans, "correct": ok,
                                    "prefill_s": dt, "decode_ctx": ctx0, "decode_s": ddt,
                                    "decode_tok_s": cfg.decode_steps / ddt, "compute_ms": cms,
                                    "kv_resident_bytes": kv_resident_bytes(s), "host_bytes": int(st["host_kv_mib"] * MIB),
                                    "page_outs": st["page_outs"], "page_ins": st["page_ins"],
                                    "rescores": st["rescores"]})
                    pb.advance(1, note=f"{ctx_label(D)} {m[0]}: {cfg.decode_steps / ddt:.1f} tok/s, "
                                       f"{'ok' if ok else 'miss'}")
            full = {}
            for m in modes:
                row = {**_base(cfg, any_s), "context": D, "mode": m[0], "pool": "-" if m[1] is None else m[1],
                       "policy": "-" if m[1] is None else m[2]}
                if m in na:
                    row["decode_tok_s"] = f"n/a: {na[m]}"
                    res.rows.append(row)
                    continue
                s = sessions[m]
                if m[1] is not None and s.bench_fallback:
                    row["policy"] = f"{m[2]}→{s.policy.name}"
                    notes.append(f"policy {m[2]!r} fell back: {s.banner.splitlines()[0]}")
                rr = [x for x in res.raw if x["context"] == D and x["mode"] == m[0]]
                row.update(prefill_s=summarize(x["prefill_s"] for x in rr),
                           decode_tok_s=summarize(x["decode_tok_s"] for x in rr),
                           needle=f"{sum(x['correct'] for x in rr)}/{len(rr)}",
                           kv_resident_mib=rr[-1]["kv_resident_bytes"] / MIB, host_mib=rr[-1]["host_bytes"] / MIB)
                if m[1] is None:
                    full = row
                else:
                    row["speed_ratio"] = _ratio(row["decode_tok_s"], full.get("decode_tok_s"))
                    row["prefill_ratio"] = _ratio(full.get("prefill_s"), row["prefill_s"])
                res.rows.append(row)
            del sessions
    res.notes += [f"each trial: fresh prefill of a needle prompt filling the context, greedy answer "
                  f"(≤ {cfg.answer_tokens} tokens), then {cfg.decode_steps} decode steps timed at that depth; "
                  f"full cache allocated at max_ctx = context",
                  "needle scored exact (digits in the answer); depths " + "/".join(map(str, cfg.depths)) + "%"]
    res.notes += sorted(set(notes))
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
