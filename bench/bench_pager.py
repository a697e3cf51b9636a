#!/usr/bin/env python
"""Pager micro-benchmark (CPU backend, through the Python API).

1. Page-out + page-in of one 64-token chunk at SmolLM2-135M geometry (30 layers,
   n_embd_k = n_embd_v = 3 KV heads x 64 = 192, q8_0), timed as `p.evict(c)` then
   `p.recall(c)` on a dirty chunk (so both directions really copy; checked through the
   stats byte counters), against a plain numpy memcpy of the same bytes (chunk_bytes
   each way), interleaved in the same run.  Python call overhead is part of the pager
   timing; a no-op pager call (`p.slot_of(0)`) is timed alongside to show its size.
2. reselect() over 1,000 chunks with 10% of them resident (pool 6,400 tokens = 100
   blocks): total time, chunks moved, and the bookkeeping left after subtracting the
   copies (page-outs x per-chunk page-out time + page-ins x per-chunk page-in time, from
   part 1); plus the same scores a second time (nothing moves: pure bookkeeping), and a
   1-layer f16 geometry where copies are nearly free.

Usage: python bench/bench_pager.py [--repeats N] [-o md|json] [--out DIR]
Progress goes to stderr; the table (or JSON) to stdout; --out DIR writes pager.md and
pager.json (raw per-repeat numbers and the configuration).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

import numpy as np

import kvflash

C = 64
SMOLLM2 = dict(n_layers=30, n_embd_k=192, n_embd_v=192, kv_type="q8_0", chunk_tokens=C)
TINY = dict(n_layers=1, n_embd_k=32, n_embd_v=32, kv_type="f16", chunk_tokens=C)
ns = time.perf_counter_ns


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def machine_info():
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return dict(cpu=cpu, cores=os.cpu_count(), usable_cores=usable, ggml_version=kvflash.ggml_version,
                ggml_commit=kvflash.ggml_commit, kvflash=kvflash.__version__, python=platform.python_version(),
                numpy=np.__version__, platform=platform.platform(), loadavg_at_start=list(os.getloadavg()))


def summ(xs_ns):
    us = [x / 1e3 for x in xs_ns]
    return dict(median_us=statistics.median(us), min_us=min(us), max_us=max(us), mean_us=statistics.fmean(us),
                n=len(us))


# --------------------------------------------------------------------------- 1. one chunk

def bench_chunk(repeats, warmup=20):
    p = kvflash.Pager(pool_tokens=512, max_ctx=64 * C, **SMOLLM2)
    for c in range(12):  # 8 blocks: chunks 0, 7..11 resident (0 sink, 7..11 tail), rest paged out
        p.alloc_span(c * C, C)
    p.recall(2)  # one unprotected resident chunk to bounce: evicts LRU 6
    x = 2
    assert p.chunk_table()["block"][x] >= 0 and not p.chunk_table()["protected"][x]
    cb = p.chunk_bytes
    rng = np.random.default_rng(0)
    dev = rng.integers(0, 256, cb, dtype=np.uint8)
    host = np.empty_like(dev)
    log(f"[chunk] chunk_bytes={cb} ({cb / 2**20:.3f} MiB), {repeats} repeats + {warmup} warm-up")

    ev, rc, mc_out, mc_in, noop = [], [], [], [], []
    for r in range(warmup + repeats):
        p.alloc_span(x * C, 1)  # rewrite one position: resident, so no copy, but dirty
        assert p.chunk_table()["dirty"][x]
        s0 = p.stats

        def pager():
            t0 = ns(); p.evict(x); t1 = ns(); ok = p.recall(x); t2 = ns()
            assert ok
            return t1 - t0, t2 - t1

        def memcpy():
            t0 = ns(); np.copyto(host, dev); t1 = ns(); np.copyto(dev, host); t2 = ns()
            return t1 - t0, t2 - t1

        if r % 2:  # alternate the order so neither side always runs cache-warm
            a = pager(); b = memcpy()
        else:
            b = memcpy(); a = pager()
        t0 = ns(); p.slot_of(0); t1 = ns()
        s1 = p.stats
        assert s1["page_outs"] - s0["page_outs"] == 1 and s1["bytes_out"] - s0["bytes_out"] == cb, "evict did not copy"
        assert s1["page_ins"] - s0["page_ins"] == 1 and s1["bytes_in"] - s0["bytes_in"] == cb, "recall did not copy"
        assert s1["clean_skips"] == s0["clean_skips"]
        if r >= warmup:
            ev.append(a[0]); rc.append(a[1]); mc_out.append(b[0]); mc_in.append(b[1]); noop.append(t1 - t0)
    # no-op call overhead averaged over a tight loop (timer resolution)
    k = 20000
    t0 = ns()
    for _ in range(k):
        p.slot_of(0)
    loop_noop = (ns() - t0) / k
    p.check_invariants()

    pager_rt = [a + b for a, b in zip(ev, rc)]
    mc_rt = [a + b for a, b in zip(mc_out, mc_in)]
    ratio_per_repeat = [a / b for a, b in zip(pager_rt, mc_rt)]
    res = dict(
        chunk_bytes=cb, repeats=repeats, warmup=warmup,
        page_out=summ(ev), page_in=summ(rc), pager_roundtrip=summ(pager_rt),
        memcpy_out=summ(mc_out), memcpy_in=summ(mc_in), memcpy_roundtrip=summ(mc_rt),
        noop_call=summ(noop), noop_call_loop_mean_us=loop_noop / 1e3,
        ratio_median=statistics.median(pager_rt) / statistics.median(mc_rt),
        ratio_of_ratios_median=statistics.median(ratio_per_repeat),
        gbps_pager=2 * cb / statistics.median(pager_rt),  # bytes/ns == GB/s
        gbps_memcpy=2 * cb / statistics.median(mc_rt),
        raw_ns=dict(page_out=ev, page_in=rc, memcpy_out=mc_out, memcpy_in=mc_in, noop_call=noop),
    )
    log(f"[chunk] pager {res['pager_roundtrip']['median_us']:.1f} us, memcpy {res['memcpy_roundtrip']['median_us']:.1f}"
        f" us, ratio {res['ratio_median']:.2f}, no-op call {res['noop_call']['median_us']:.2f} us")
    return res


# --------------------------------------------------------------------------- 2. reselect

def bench_reselect(repeats, geom, per_chunk_out_ns, per_chunk_in_ns, n_chunks=1000, keep_frac=0.10, label=""):
    pool = int(n_chunks * keep_frac) * C
    p = kvflash.Pager(pool_tokens=pool, max_ctx=n_chunks * C, **geom)
    assert p.n_chunks == n_chunks
    log(f"[reselect{label}] pool {p.pool_tokens} tokens = {p.n_blocks} blocks, {n_chunks} chunks, "
        f"chunk_bytes={p.chunk_bytes}; filling...")
    t0 = ns()
    for c in range(n_chunks):
        assert p.alloc_span(c * C, C) is not None
    log(f"[reselect{label}] filled in {(ns() - t0) / 1e9:.2f} s; host {p.stats['host_bytes'] / 2**20:.0f} MiB")
    rng = np.random.default_rng(1)
    rows = []
    for r in range(repeats + 1):  # the first is a warm-up (it also pages out the dirty fill)
        scores = rng.random(n_chunks, dtype=np.float32)
        s0 = p.stats
        t0 = ns(); moved = p.reselect(scores); t1 = ns()
        s1 = p.stats
        t2 = ns(); moved2 = p.reselect(scores); t3 = ns()
        s2 = p.stats
        assert moved2 == 0 and s2["page_ins"] == s1["page_ins"] and s2["page_outs"] == s1["page_outs"]
        outs = s1["page_outs"] - s0["page_outs"]
        ins = s1["page_ins"] - s0["page_ins"]
        skips = s1["clean_skips"] - s0["clean_skips"]
        assert outs + skips + ins == moved
        copies = outs * per_chunk_out_ns + ins * per_chunk_in_ns
        row = dict(total_ns=t1 - t0, moved=moved, page_outs=outs, page_ins=ins, clean_skips=skips,
                   copies_est_ns=copies, bookkeeping_ns=(t1 - t0) - copies, same_scores_ns=t3 - t2)
        if r:
            rows.append(row)
    # Per-chunk cost of a cold page-in in this store: recall random host chunks one by one (each
    # evicts a clean, already-backed chunk: no copy out).  Used for a second, tighter estimate.
    # Scores are cleared first: with scores, the victim is often the chunk recalled just before
    # (its score is low), so its block would be reused cache-hot; LRU picks an old, cold block.
    p.clear_scores()
    cold = []
    host = np.flatnonzero((p.chunk_table()["block"] < 0) & (p.chunk_table()["host"] >= 0))
    for c in rng.choice(host, size=min(50, len(host)), replace=False):
        s0 = p.stats
        t0 = ns(); assert p.recall(int(c)); t1 = ns()
        s1 = p.stats
        assert s1["page_ins"] - s0["page_ins"] == 1 and s1["page_outs"] == s0["page_outs"]
        cold.append(t1 - t0)
    cold_in = statistics.median(cold)
    for row in rows:
        row["copies_cold_est_ns"] = row["page_outs"] * per_chunk_out_ns + row["page_ins"] * cold_in
        row["bookkeeping_cold_ns"] = row["total_ns"] - row["copies_cold_est_ns"]
    p.check_invariants()
    med = lambda k: statistics.median(x[k] for x in rows) / 1e6  # noqa: E731
    res = dict(
        geometry=geom, pool_tokens=p.pool_tokens, n_blocks=p.n_blocks, n_chunks=n_chunks, chunk_bytes=p.chunk_bytes,
        repeats=repeats,
        total_ms=dict(median=med("total_ns"), min=min(x["total_ns"] for x in rows) / 1e6,
                      max=max(x["total_ns"] for x in rows) / 1e6),
        moved_median=statistics.median(x["moved"] for x in rows),
        page_ins_median=statistics.median(x["page_ins"] for x in rows),
        page_outs_median=statistics.median(x["page_outs"] for x in rows),
        clean_skips_median=statistics.median(x["clean_skips"] for x in rows),
        copies_est_ms_median=med("copies_est_ns"),
        bookkeeping_ms=dict(median=med("bookkeeping_ns"), min=min(x["bookkeeping_ns"] for x in rows) / 1e6,
                            max=max(x["bookkeeping_ns"] for x in rows) / 1e6),
        cold_page_in_us=dict(median=cold_in / 1e3, min=min(cold) / 1e3, max=max(cold) / 1e3, n=len(cold)),
        copies_cold_est_ms_median=med("copies_cold_est_ns"),
        bookkeeping_cold_ms=dict(median=med("bookkeeping_cold_ns"), min=min(x["bookkeeping_cold_ns"] for x in rows) / 1e6,
                                 max=max(x["bookkeeping_cold_ns"] for x in rows) / 1e6),
        same_scores_ms=dict(median=med("same_scores_ns"), min=min(x["same_scores_ns"] for x in rows) / 1e6,
                            max=max(x["same_scores_ns"] for x in rows) / 1e6),
        raw=rows,
    )
    log(f"[reselect{label}] total {res['total_ms']['median']:.3f} ms, moved {res['moved_median']}, "
        f"bookkeeping {res['bookkeeping_ms']['median']:.3f} ms, same scores {res['same_scores_ms']['median']:.3f} ms")
    return res


# --------------------------------------------------------------------------- report

def to_markdown(res):
    # Long on purpose: one report, section after section, as it is printed.
    m, ch, rs, rt = res["machine"], res["chunk"], res["reselect"], res["reselect_tiny"]
    f = lambda s: f"{s['median_us']:.1f} | {s['min_us']:.1f} | {s['max_us']:.1f}"  # noqa: E731
    g = lambda s: f"{s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f}"  # noqa: E731
    L = [
        "# Pager micro-benchmark",
        "",
        f"Command: `{res['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable); ggml {m['ggml_version']} "
        f"({m['ggml_commit']}); kvflash {m['kvflash']}; Python {m['python']}, numpy {m['numpy']}; CPU backend. "
        f"Date: {res['date']}. Load average at start: {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])} "
        "(a shared machine: other jobs may run concurrently, so compare rows within this run, not across runs).",
        "",
        f"## One chunk: page-out + page-in vs memcpy (SmolLM2-135M geometry)",
        "",
        f"30 layers, n_embd_k = n_embd_v = 192, q8_0, 64-token chunk = {ch['chunk_bytes']:,} bytes "
        f"({ch['chunk_bytes'] / 2**20:.3f} MiB) each way. {ch['repeats']} repeats (after {ch['warmup']} warm-up), "
        "pager and memcpy interleaved (order alternating). Pager = `p.evict(c)` then `p.recall(c)` from Python on a "
        "dirty chunk (every timed call verified to move exactly chunk_bytes through the stats counters); "
        "memcpy = `np.copyto` of a preallocated buffer of chunk_bytes, both directions.",
        "",
        "| measurement | median µs | min µs | max µs |",
        "|---|---|---|---|",
        f"| pager page-out (`evict`) | {f(ch['page_out'])} |",
        f"| pager page-in (`recall`) | {f(ch['page_in'])} |",
        f"| **pager out + in** | {f(ch['pager_roundtrip'])} |",
        f"| memcpy out | {f(ch['memcpy_out'])} |",
        f"| memcpy in | {f(ch['memcpy_in'])} |",
        f"| **memcpy out + in** | {f(ch['memcpy_roundtrip'])} |",
        f"| no-op pager call (`p.slot_of(0)`), single timed call | {f(ch['noop_call'])} |",
        "",
        f"**Ratio pager / memcpy (medians): {ch['ratio_median']:.2f}x** (median of per-repeat ratios "
        f"{ch['ratio_of_ratios_median']:.2f}x); pager {ch['gbps_pager']:.1f} GB/s vs memcpy {ch['gbps_memcpy']:.1f} GB/s "
        "(2 x chunk_bytes / median round trip).",
        f"The pager timing includes two Python->C++ calls; one no-op call costs {ch['noop_call_loop_mean_us']:.2f} µs "
        f"(mean over a 20,000-call loop; {ch['noop_call']['median_us']:.2f} µs timed singly, which includes the timer).",
        "A page copy is one `ggml_backend_tensor_get/set` per layer and K/V (60 contiguous copies of "
        f"{ch['chunk_bytes'] // 60:,} bytes); both sides run cache-warm here (the same ~0.75 MiB bounced each repeat).",
        "",
        "## reselect: 1,000 chunks, 10% resident",
        "",
    ]
    for name, r in (("SmolLM2-135M geometry (q8_0, 30 layers)", rs), ("1 layer, n_embd 32, f16 (copies ~free)", rt)):
        L += [
            f"### {name}",
            "",
            f"pool {r['pool_tokens']} tokens = {r['n_blocks']} blocks, max_ctx {r['n_chunks'] * C} = "
            f"{r['n_chunks']} chunks all written, chunk_bytes {r['chunk_bytes']:,}; random scores per repeat; "
            f"{r['repeats']} repeats after one warm-up. Protected: sink + 5 tail chunks, so 94 blocks are chosen by score.",
            "",
            "| measurement | median | min | max |",
            "|---|---|---|---|",
            f"| `reselect(scores)`, new random scores, ms | {g(r['total_ms'])} |",
            f"| chunks moved (outs + ins) | {r['moved_median']:.0f} | | |",
            f"| of which page-ins / copied page-outs / clean skips | {r['page_ins_median']:.0f} / "
            f"{r['page_outs_median']:.0f} / {r['clean_skips_median']:.0f} | | |",
            f"| copies (page-outs x page-out time + page-ins x page-in time), ms | {r['copies_est_ms_median']:.3f} | | |",
            f"| bookkeeping = total - copies (warm copy estimate), ms | {g(r['bookkeeping_ms'])} |",
            f"| cold page-in of one chunk from this store (`recall` of a random host chunk), µs | "
            f"{r['cold_page_in_us']['median']:.1f} | {r['cold_page_in_us']['min']:.1f} | {r['cold_page_in_us']['max']:.1f} |",
            f"| copies with the cold page-in time, ms | {r['copies_cold_est_ms_median']:.3f} | | |",
            f"| bookkeeping = total - copies (cold copy estimate), ms | {g(r['bookkeeping_cold_ms'])} |",
            f"| **`reselect` with the same scores again (moves nothing: pure bookkeeping)**, ms | {g(r['same_scores_ms'])} |",
            "",
        ]
    L += [
        "**Bookkeeping** (direct measurements, no subtraction): `reselect` with unchanged scores over 1,000 chunks takes "
        f"**{rs['same_scores_ms']['median']:.3f} ms** (SmolLM2 geometry) / {rt['same_scores_ms']['median']:.3f} ms (1 layer); "
        f"a full `reselect` moving {rt['moved_median']:.0f} chunks at the 1-layer geometry (8 KiB chunks, copies "
        f"included) takes **{rt['total_ms']['median']:.3f} ms**. The pager code does not depend on the geometry except "
        "through the copies (one ggml tensor get/set per layer and K/V), so at SmolLM2 geometry the reselect time is "
        f"copies: {rs['total_ms']['median']:.1f} ms for {rs['page_ins_median']:.0f} page-ins is "
        f"{rs['total_ms']['median'] * 1e3 / max(1, rs['page_ins_median']):.0f} µs per 0.75 MiB chunk "
        f"({rs['chunk_bytes'] * max(1, rs['page_ins_median']) / (rs['total_ms']['median'] * 1e6):.1f} GB/s), i.e. "
        "DRAM-bound cold copies into cold pool blocks. The subtraction rows above are estimates and not reliable to "
        "better than a few ms: single-chunk timings do not reproduce the copy cost inside reselect.",
        "",
        "Notes: the warm copy estimate uses the per-chunk times of the one-chunk benchmark above (the same chunk "
        "bounced, cache-warm). Inside reselect the host buffers and pool blocks are spread over hundreds of MiB (cold), "
        "so real copies are slower and `total - warm copies` overstates the bookkeeping; the cold estimate times single "
        "`recall`s of random host chunks of the same store (each includes one Python call and a victim pick, so it slightly "
        "overstates the copy). The same-scores call (nothing moves) and the 1-layer geometry measure the bookkeeping "
        "directly. Clean evictions (chunks recalled earlier and not modified) are not copied, hence 0 copied page-outs in "
        "steady state. Target: bookkeeping < 1 ms.",
        "",
    ]
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200, help="timed repeats for the one-chunk benchmark "
                    "(reselect uses repeats // 10, at least 5)")
    ap.add_argument("-o", "--output", choices=["md", "json"], default="md", help="format printed to stdout")
    ap.add_argument("--out", help="directory to write pager.md and pager.json into")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    res = dict(command="python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), machine=machine_info())
    log(f"[bench] {res['machine']['cpu']}, ggml {res['machine']['ggml_version']}")
    res["chunk"] = ch = bench_chunk(args.repeats)
    out_ns = ch["page_out"]["median_us"] * 1e3
    in_ns = ch["page_in"]["median_us"] * 1e3
    rr = max(5, args.repeats // 10)
    res["reselect"] = bench_reselect(rr, SMOLLM2, out_ns, in_ns)
    # For the tiny geometry, measure its own per-chunk copy cost the same way (it is small).
    p = kvflash.Pager(pool_tokens=512, max_ctx=16 * C, **TINY)
    for c in range(9):
        p.alloc_span(c * C, C)
    assert p.recall(1)
    o, i = [], []
    for _ in range(200):
        p.alloc_span(C, 1)
        t0 = ns(); p.evict(1); t1 = ns(); p.recall(1); t2 = ns()
        o.append(t1 - t0); i.append(t2 - t1)
    res["reselect_tiny"] = bench_reselect(rr, TINY, statistics.median(o), statistics.median(i), label=" tiny")
    res["reselect_tiny"]["per_chunk_out_us"] = statistics.median(o) / 1e3
    res["reselect_tiny"]["per_chunk_in_us"] = statistics.median(i) / 1e3
    res["config"] = dict(chunk_geometry=SMOLLM2, tiny_geometry=TINY, chunk_pool_tokens=512,
                         reselect_chunks=1000, reselect_keep=0.10, repeats=args.repeats, reselect_repeats=rr)

    md = to_markdown(res)
    print(md if args.output == "md" else json.dumps(res, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pager.md"), "w") as f:
            f.write(md)
        with open(os.path.join(args.out, "pager.json"), "w") as f:
            json.dump(res, f, indent=1)
        log(f"[bench] wrote {args.out}/pager.md and pager.json")


if __name__ == "__main__":
    main()
