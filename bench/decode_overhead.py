"""Where a decode step's time goes at a short context (issue 21): the session's generate() loop against the
core's one-token eval, split into the graph compute and the work around it.

    python bench/decode_overhead.py --model smollm2-135m --threads 2 --context 256 --steps 64 --rounds 7 \
        --json bench/results/decode-vs-llama-amd/overhead.json

Modes, interleaved round by round (the order alternates): `generate` (Session.generate, greedy, the path
`bench/ab_builds.py` times), `eval_sample` (the core's evaluate-and-sample call, the one generate makes per
token), `eval` (the core's eval alone, the argmax taken in numpy), and `eval-ggml` (the same with
ggml_flash_attn_ext instead of kvflash's attention op).  For the core modes the runtime's own counters
split the step: graph compute, inputs and masks, graph building; the rest is the binding and the caller.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--pool", type=int, default=2048)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import kvflash
    from kvflash import _core
    from kvflash.bench.common import text_tokens
    path = str(kvflash.resolve_model(a.model))
    sess = kvflash.Session(path, max_ctx=a.context + a.steps * (a.rounds + 2) + 64, kvflash=a.pool, policy="lru",
                           threads=a.threads, verbose=False)
    prompt = np.asarray(text_tokens(sess, a.context), dtype=np.int32)
    model = sess.model
    rts = {"eval": _core.Runtime(model, max_ctx=a.context + a.steps + 64, pool_tokens=a.pool),
           "eval-ggml": _core.Runtime(model, max_ctx=a.context + a.steps + 64, pool_tokens=a.pool, attn="ggml")}
    res = {m: {"ms": [], "compute_ms": [], "mask_ms": [], "graph_ms": []} for m in
           ("generate", "eval_sample", "eval", "eval-ggml")}

    def core_round(m, rt, sample):
        rt.reset()
        lg = rt.eval(prompt)
        tok = int(np.argmax(lg))
        s0 = dict(rt.timings)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            if sample:
                tok = rt.eval_sample(np.array([tok], dtype=np.int32))
            else:
                tok = int(np.argmax(rt.eval(np.array([tok], dtype=np.int32))))
        dt = (time.perf_counter() - t0) / a.steps
        s1 = rt.timings
        res[m]["ms"].append(1e3 * dt)
        for k, key in (("compute_ms", "compute_ms"), ("mask_ms", "mask_ms"), ("graph_ms", "graph_ms")):
            res[m][k].append((s1[key] - s0[key]) / a.steps)

    for r in range(a.rounds):
        order = ["generate", "eval_sample", "eval", "eval-ggml"]
        if r % 2:
            order.reverse()
        for m in order:
            if m == "generate":
                sess.reset()
                sess.prefill(prompt.tolist())
                n0 = sess.runtime.n_past
                t0 = time.perf_counter()
                for _ in sess.generate(None, max_tokens=a.steps, temperature=0.0, ignore_eos=True):
                    pass
                n = sess.runtime.n_past - n0
                res[m]["ms"].append(1e3 * (time.perf_counter() - t0) / max(n, 1))
            else:
                core_round(m, rts["eval" if m == "eval_sample" else m], m == "eval_sample")
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{m} {v['ms'][-1]:.2f} ms" for m, v in res.items()),
              flush=True)
    med = lambda v: statistics.median(v) if v else float("nan")   # noqa: E731
    print(f"\n{a.model}, {a.threads} threads, context {a.context}, pool {a.pool}, {a.steps} steps x {a.rounds} rounds, "
          f"interleaved\n")
    print("| mode | ms per token (median) | tok/s | graph compute ms | inputs + masks ms | graph build ms | rest ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m, v in res.items():
        c, k, g = med(v["compute_ms"]), med(v["mask_ms"]), med(v["graph_ms"])
        rest = med(v["ms"]) - (c + k + g) if v["compute_ms"] else float("nan")
        print(f"| {m} | {med(v['ms']):.2f} | {1e3 / med(v['ms']):.1f} | {c:.2f} | {k:.3f} | {g:.3f} | {rest:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
