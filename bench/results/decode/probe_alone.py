"""Is kvflash decode at 8K slower than at 2K/16K, and does max_ctx or a full-cache neighbour matter?"""
import sys, time, statistics as st
import kvflash
from kvflash.bench.common import text_tokens, decode_steps
maxctx = int(sys.argv[1]); ctxs = [int(x) for x in sys.argv[2].split(",")]
s = kvflash.Session("smollm2-135m", max_ctx=maxctx, kvflash=2048, policy="lru", threads=2, verbose=False, allow_long_ctx=True)
toks = text_tokens(s, maxctx)
for D in ctxs:
    while s.n_past < D:
        k = min(512, D - s.n_past); s.prefill(toks[s.n_past:s.n_past + k])
    r = []
    for _ in range(5):
        dt, cms = decode_steps(s, 32); r.append(32 / dt)
    print(f"max_ctx {maxctx} ctx {D}: median {st.median(r):.1f} tok/s ({min(r):.1f}-{max(r):.1f})", flush=True)
