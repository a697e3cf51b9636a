"""The KV ledger and the process memory per cell, each cell in a process of its own."""
from __future__ import annotations

import os
import time

from ..common import MIB, WEIGHT_PLACEMENT, BenchConfig, Progress, Unavailable, ctx_label, kv_resident_bytes, open_session, text_tokens
from ..report import Result
from ._shared import BASE_COLS, _base, _long_note


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
                "prefill_s": prefill_s, "placement": (s.model_path.name, list(s.runtime.model.weight_placement))}
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
                WEIGHT_PLACEMENT[c["placement"][0]] = c["placement"][1]   # the cell's process opened the model
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
    if cfg.device != "cpu":
        res.notes.append(f"sessions on {cfg.device}: KV resident is the size of the buffers the pool (and sliding "
                         f"rings) hold in the device's memory; host = the device's pinned host buffers; RSS is this "
                         f"process's (on lavapipe the device's memory is this process's RAM too)")
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
