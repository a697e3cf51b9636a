"""Where needed chunks rank under qk's contrast baselines (issue 40): one prompt read per trial, every variant
scored on that one history.

    taskset -c 0 python bench/qk_contrast.py --model gemma3-270m --context 8192 --pool 512 --exact-prefill \
        --tasks multiquery,multikey,single,multivalue --haystacks code,chat,csv,wiki,manual --out a.jsonl
    python bench/qk_contrast.py --analyse a.jsonl b.jsonl > table.md

Each trial is the ruler bench's trial 0 of a task and haystack (split tuning unless --split says otherwise),
read by a pooled session (16-token chunks read in 64-token pieces: chunk_tokens='auto' for a 512-token pool)
whose qk captures 8 + 248 queries. Per token, the attention of the last 8 captured queries over the first
quarter of the paged layers (qk's auto layers), minus a baseline: `cN` the 8 queries ending N tokens earlier
(c0: none; c32 was qk's default), `minA-B` the element-wise minimum of several such baselines (A ... B
tokens back); then qk's peak aggregate (spread 4, carry 16). c32 is checked against the core's own scorer.
`--shape`: instead of the baselines, the scoring's other settings at contrast 64 (the default since b29604f):
queries (8, 16, 24), layers (auto, twice auto, all paged), spread (2-16) and carry (0-32); `q8` (the
default until spread 8 replaced spread 4; `q8 s8` is the default now) is checked against the core's scorer. `--trial N`: the ruler bench's trial N (other prompts). `--windows`: the core's scorer at qk's defaults with 1-4
query windows (`w1` = one window).
For each needle: the worst rank of its chunks among the unprotected ones (rank_of); a trial is kept under a
variant when every needle ranks below the free slots. --analyse prints kept counts per task and variant, and
the ranks summed (each capped at 50).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

N_QUERIES = 8
MAX_CONTRAST = 248
OFFSETS = (16, 24, 32, 48, 64, 96, 128, 192, 248)
MINS = {"min32-248": (32, 64, 128, 248), "min64-248": (64, 128, 248), "min32-128": (32, 64, 128),
        "min16-248": (16, 32, 64, 128, 248), "min_all": OFFSETS}


def variant_scores(rt, n_chunks: int, chunk_tokens: int, n_layers: int) -> dict:
    import numpy as np
    from kvflash import _core
    nc = rt.n_captured

    def att(first):
        return rt.history_attention(q_first=first, q_count=N_QUERIES, n_layers=n_layers).astype(np.float64)
    last = att(nc - N_QUERIES)
    base = {o: att(nc - N_QUERIES - o) for o in OFFSETS}
    xs = {"c0": last} | {f"c{o}": last - base[o] for o in OFFSETS}
    xs |= {name: last - np.min([base[o] for o in offs], axis=0) for name, offs in MINS.items()}
    chunk_of = _chunk_of(len(last), chunk_tokens, n_chunks)
    return {k: _core.chunk_peaks(x, chunk_of, n_chunks, 4, 16) for k, x in xs.items()}


def _chunk_of(n_tokens: int, chunk_tokens: int, n_chunks: int):
    """Each history position's chunk (-1 past the scored chunks), as chunk_peaks takes it."""
    import numpy as np
    c = np.arange(n_tokens) // chunk_tokens
    return np.where(c < n_chunks, c, -1).astype(np.int32)


def shape_variants(auto_layers: int, n_paged: int) -> dict:
    """name -> (n_queries, contrast, n_layers, spread, carry): qk's peak scoring around its defaults."""
    two = min(2 * auto_layers, n_paged)
    return {"q8": (8, 64, auto_layers, 4, 16), "q16": (16, 64, auto_layers, 4, 16), "q24": (24, 64, auto_layers, 4, 16),
            f"q8 L{two}": (8, 64, two, 4, 16), f"q8 L{n_paged}": (8, 64, n_paged, 4, 16),
            "q8 s8": (8, 64, auto_layers, 8, 16), "q8 k32": (8, 64, auto_layers, 4, 32),
            "q16 k32": (16, 64, auto_layers, 4, 32), f"q16 L{two}": (16, 64, two, 4, 16),
            "q8 s2": (8, 64, auto_layers, 2, 16), "q8 s6": (8, 64, auto_layers, 6, 16),
            "q8 s12": (8, 64, auto_layers, 12, 16), "q8 s16": (8, 64, auto_layers, 16, 16),
            "q8 s8 k0": (8, 64, auto_layers, 8, 0), "q8 s8 k8": (8, 64, auto_layers, 8, 8),
            "q16 s8": (16, 64, auto_layers, 8, 16), "q8 s8 c32": (8, 32, auto_layers, 8, 16)}


def shape_scores(rt, n_chunks: int, chunk_tokens: int, variants: dict) -> dict:
    import numpy as np
    from kvflash import _core
    nc, memo = rt.n_captured, {}

    def att(first, count, layers):
        if (first, count, layers) not in memo:
            memo[first, count, layers] = rt.history_attention(q_first=first, q_count=count,
                                                              n_layers=layers).astype(np.float64)
        return memo[first, count, layers]
    xs = {name: att(nc - q, q, layers) - att(nc - q - c, q, layers)
          for name, (q, c, layers, _, _) in variants.items()}
    chunk_of = _chunk_of(len(next(iter(xs.values()))), chunk_tokens, n_chunks)
    return {name: _core.chunk_peaks(xs[name], chunk_of, n_chunks, spread, carry)
            for name, (_, _, _, spread, carry) in variants.items()}


def run(a) -> int:
    import numpy as np
    import kvflash
    from kvflash import _core
    from kvflash.bench.ruler import RulerBuilder
    from kvflash.bench.routines._shared import passkey_chunks, rank_of
    from kvflash.scoring import QKPolicy

    s = kvflash.Session(model=a.model, max_ctx=a.context, kvflash=a.pool, chunk_tokens="auto",
                        exact_prefill=a.exact_prefill, policy=QKPolicy(contrast=MAX_CONTRAST), threads=a.threads,
                        verbose=False)
    builder = RulerBuilder(s, a.seed, split=a.split)
    n_layers = _core.qk_auto_layers(s.runtime.n_paged_layers)
    shapes = shape_variants(n_layers, s.runtime.n_paged_layers) if a.shape else None
    with open(a.out, "a") as f:
        for task in a.tasks.split(","):
            for hay in a.haystacks.split(","):
                tr = builder.trial(task, hay, a.trial, a.context - 64)
                t0 = time.perf_counter()
                s.reset()
                s.prefill(tr.ids)
                dt = time.perf_counter() - t0
                n_chunks = len(s.last_scores)
                table = s.pager.chunk_table()
                prot = table["protected"][:n_chunks]
                if a.windows:   # the core's own scorer at qk's defaults, one to four query windows
                    scores = {f"w{w}": s.runtime.qk_peak_scores(n_chunks, n_layers=n_layers, windows=w)
                              for w in (1, 2, 3, 4)}
                elif shapes:
                    scores = shape_scores(s.runtime, n_chunks, s.chunk_tokens, shapes)
                    core, mine = s.runtime.qk_peak_scores(n_chunks, n_layers=n_layers, spread=4), "q8"   # spread 4: the old default
                else:
                    scores = variant_scores(s.runtime, n_chunks, s.chunk_tokens, n_layers)
                    core, mine = s.runtime.qk_peak_scores(n_chunks, n_queries=N_QUERIES, contrast=32, spread=4,
                                                          n_layers=n_layers), "c32"
                if not a.windows and not np.allclose(core, scores[mine], rtol=1e-4, atol=1e-6):
                    raise SystemExit(f"the re-scoring differs from the core's {mine}: this tool is out of date")
                free = int(s.pager.n_blocks - np.count_nonzero(table["protected"] & (table["block"] >= 0)))
                per = [passkey_chunks(s, tr.ids, x) for x in tr.needles]
                rec = {"model": a.model, "context": a.context, "pool": a.pool, "split": a.split, "task": task,
                       "haystack": hay, "trial": a.trial, "depth": tr.depth, "exact_prefill": a.exact_prefill,
                       "chunk_tokens": s.chunk_tokens, "free": free, "prefill_s": dt,
                       "ranks": {k: [max((rank_of(sc, prot, c) for c in cs), default=None) for cs in per]
                                 for k, sc in scores.items()}}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(f"{task} {hay} {dt:.0f} s: " + "; ".join(f"{k} {v}" for k, v in list(rec["ranks"].items())[:4]),
                      file=sys.stderr, flush=True)
    return 0


def analyse(paths: list) -> int:
    recs = [json.loads(line) for p in paths for line in open(p)]
    if not recs:
        raise SystemExit("no trials in " + ", ".join(paths))
    tasks = sorted({r["task"] for r in recs})
    print("| variant | " + " | ".join(f"{t} kept" for t in tasks) + " | ranks summed (capped at 50) |")
    print("|---|" + "---:|" * (len(tasks) + 1))
    for v in recs[0]["ranks"]:
        cells, total = [], 0
        for t in tasks:
            rs = [r for r in recs if r["task"] == t]
            kept = sum(all(x is not None and 0 <= x < r["free"] or x == -1 for x in r["ranks"][v]) for r in rs)
            total += sum(min(50, 50 if x is None else max(x, 0)) for r in rs for x in r["ranks"][v])
            cells.append(f"{kept}/{len(rs)}")
        print(f"| {v} | " + " | ".join(cells) + f" | {total} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--analyse", nargs="+", metavar="JSONL", help="print the table of these runs' trials")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--exact-prefill", action="store_true")
    ap.add_argument("--tasks", default="multiquery,multikey,single,multivalue")
    ap.add_argument("--haystacks", default="code,chat,csv,wiki,manual,fiction,syslog,legal,email,config")
    ap.add_argument("--split", default="tuning", choices=("tuning", "reporting"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--trial", type=int, default=0, help="the ruler bench's trial index per task and haystack")
    ap.add_argument("--shape", action="store_true", help="score queries / layers / spread / carry variants at "
                                                         "contrast 64 instead of the contrast baselines")
    ap.add_argument("--windows", action="store_true", help="score with qk's defaults and 1-4 query windows "
                                                           "(QKPolicy(windows=W)), by the core")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="trials are appended to this JSONL file")
    a = ap.parse_args()
    if a.analyse:
        return analyse(a.analyse)
    if not a.out:
        ap.error("--out is needed to run trials")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
