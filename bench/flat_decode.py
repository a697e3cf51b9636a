"""Decode flatness with a fixed pool: the same pool at a short and a long context, timed interleaved.

    python bench/flat_decode.py --pool 2048 --short 2048 --long 32768 --rounds 8 --steps 32 --threads 2

Two kvflash sessions (same model, same pool) are filled to the two contexts once; then rounds of
`--steps` greedy decode steps alternate between them (order flipped every round), so machine noise hits
both alike.  Prints medians, min/max and the long ÷ short ratio (1.00 = flat).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import kvflash
from kvflash.bench.common import text_tokens  # natural-text tokens, as the bench uses


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pool", type=int, default=2048)
    ap.add_argument("--short", type=int, default=2048)
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    max_ctx = a.long + a.rounds * a.steps + 64
    sess = {}
    for name, ctx in (("short", a.short), ("long", a.long)):
        s = kvflash.Session(a.model, max_ctx=max_ctx, kvflash=a.pool, policy="lru", threads=a.threads,
                            allow_long_ctx=True, verbose=False)
        toks = text_tokens(s, ctx)
        t0 = time.perf_counter()
        for i in range(0, ctx, 512):
            s.prefill(toks[i:i + 512])
        print(f"[flat] {name}: prefilled {s.n_past} tokens in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        sess[name] = s
    rates = {"short": [], "long": []}
    for r in range(a.rounds):
        for name in (("short", "long") if r % 2 == 0 else ("long", "short")):
            s = sess[name]
            rt = s.runtime
            tok = int(np.argmax(s.logits()))
            t0 = time.perf_counter()
            for _ in range(a.steps):
                tok = rt.eval_sample(np.asarray([tok], dtype=np.int32))
            rates[name].append(a.steps / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["long"] / med["short"]
    per_round = [l / s for s, l in zip(rates["short"], rates["long"])]
    print(f"| context | pool | decode tok/s median | min | max |\n|---:|---:|---:|---:|---:|")
    for name, ctx in (("short", a.short), ("long", a.long)):
        print(f"| {ctx} | {a.pool} | {med[name]:.2f} | {min(rates[name]):.2f} | {max(rates[name]):.2f} |")
    print(f"\nlong ÷ short (medians): **{ratio:.3f}**; per-round ratios median {statistics.median(per_round):.3f} "
          f"(min {min(per_round):.3f}, max {max(per_round):.3f}); {a.rounds} rounds × {a.steps} steps, "
          f"threads {a.threads}, resident KV {sess['long'].stats['resident_kv_mib']:.2f} MiB at both contexts")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rates": rates, "ratio": ratio, "per_round": per_round}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
