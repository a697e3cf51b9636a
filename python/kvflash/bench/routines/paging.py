"""Page-out / page-in per chunk, cold and warm, against memcpy."""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import numpy as np

from ..common import WEIGHT_PLACEMENT, BenchConfig, Progress, summarize
from ..report import Result
from ._shared import BASE_COLS, _base


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
    if cfg.device != "cpu":
        return _run_paging_device(cfg)
    # Long on purpose: seven measurements on one pager in a fixed order (cold before warm, cache flushes between),
    # each depending on the state the previous left; one place keeps that order visible.
    import kvflash
    from kvflash.models import resolve_model
    m = kvflash.Model(str(resolve_model(cfg.model)), 1)
    WEIGHT_PLACEMENT[Path(m.path).name] = list(m.weight_placement)
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


def _run_paging_device(cfg: BenchConfig) -> Result:
    """Page-out / page-in per chunk through a GPU's pool (Pager(device=...): the pool in device memory, the host
    store in the device's pinned host buffers, each page event an async copy on the device's queue).  One: a
    single chunk's page event and then Pager.fence(), i.e. its latency to completion.  Queued: every evictable
    chunk's page events issued back to back and one fence, per chunk (what a reselect or a prefill's evictions
    pay).  clean: a recalled, unmodified chunk evicted again (its host copy is current: no copy)."""
    import kvflash
    from kvflash.models import resolve_model
    m = kvflash.Model(str(resolve_model(cfg.model)), 1)
    WEIGHT_PLACEMENT[Path(m.path).name] = list(m.weight_placement)
    hp = m.hparams
    n_layers = len(m.global_layers)
    n_embd_k = hp["head_dim"] * hp["n_head_kv"]
    ops = ["page_out_one", "page_in_one", "page_out_queued", "page_in_queued", "page_out_clean"]
    res = Result("paging", f"paging cost per 64-token chunk through {cfg.device}'s pool ({n_layers} layers × K+V, "
                 f"{cfg.kv_type}; median ± spread over chunks × {cfg.repeats} repeats)",
                 BASE_COLS + [("device", "device"), ("pool", "pool"), ("op", "op"), ("per", "per"), ("ms", "ms"),
                              ("gib_s", "GiB/s")])
    rng = np.random.default_rng(cfg.seed)

    def timed(fn):
        t0 = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - t0) / 1e6

    chunk_b = None
    with Progress(len(cfg.pools) * cfg.repeats, "paging", cfg.quiet) as pb:
        for pool in cfg.pools:
            samples = {k: [] for k in ops}
            for r in range(cfg.repeats):
                p = kvflash.Pager(pool_tokens=pool, max_ctx=pool * 4, n_layers=n_layers, n_embd_k=n_embd_k,
                                  kv_type=cfg.kv_type, device=cfg.device)
                C, chunk_b = p.chunk_tokens, p.chunk_bytes
                slots = np.arange(pool, dtype=np.int64)
                for layer in range(n_layers):   # every row written, so a page-out moves real bytes
                    for v in (False, True):
                        rows = p.read_rows(layer, v=v)
                        p.write_rows(layer, slots, rng.integers(0, 255, rows.shape, dtype=np.uint8), v=v)
                for c in range(pool // C):
                    p.alloc_span(c * C, C)
                p.fence()
                table = p.chunk_table()
                victims = [c for c in range(pool // C) if table["block"][c] >= 0 and not table["protected"][c]]

                def one(op, c):
                    return timed(lambda: (op(c), p.fence()))
                half = victims[: len(victims) // 2]
                rest = victims[len(victims) // 2:]
                samples["page_out_one"] += [one(p.evict, c) for c in half]      # dirty: the device -> host copy
                samples["page_in_one"] += [one(p.recall, c) for c in half]      # host -> device
                samples["page_out_clean"] += [one(p.evict, c) for c in half]    # recalled, unmodified: no copy
                for c in half:
                    p.recall(c)
                p.fence()
                ms = timed(lambda: ([p.evict(c) for c in rest], p.fence()))
                samples["page_out_queued"].append(ms / len(rest))
                ms = timed(lambda: ([p.recall(c) for c in rest], p.fence()))
                samples["page_in_queued"].append(ms / len(rest))
                p.check_invariants()
                pb.advance(1, note=f"pool {pool}")
            for op in ops:
                st = summarize(samples[op])
                row = {**_base(cfg), "device": cfg.device, "pool": pool, "op": op,
                       "per": "chunk" if op.endswith("one") or op.endswith("clean") else
                       "chunk, all queued then one fence", "ms": st}
                if not op.endswith("clean") and st["median"]:
                    row["gib_s"] = chunk_b / 2**30 / (st["median"] / 1e3)
                res.rows.append(row)
                res.raw += [{**_base(cfg), "device": cfg.device, "pool": pool, "op": op, "ms": v} for v in samples[op]]
    res.notes += [f"chunk = {chunk_b} bytes ({chunk_b / 2**20:.2f} MiB) over every paged layer's K and V; timed from "
                  "Python around the native calls and Pager.fence() (the copies completed)",
                  "one: a single chunk's page event, then fence; queued: the evictable chunks' page events issued "
                  "back to back (half the pool's evictable chunks), one fence, time / chunks; page_out_clean: a recalled, "
                  "unmodified chunk evicted again (its host copy is current, so nothing is copied)"]
    return res
