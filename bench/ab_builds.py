"""Decode tok/s of two or more kvflash installs (builds), interleaved in one run, with an A/A control.

    python bench/ab_builds.py --build before=/path/venv-old/bin/python --build after=.venv/bin/python \
        --build after-again=.venv/bin/python --contexts 2048,8192 --pool 2048 --rounds 7 --steps 32

Each --build NAME=PYTHON starts one worker process with that interpreter (so each imports its own
kvflash).  A worker prefills one session per context (same model, pool, policy, natural-text tokens)
and then waits; the driver asks one worker at a time to decode --steps greedy tokens through
generate() and report the seconds, so no two workers compute at once (ggml's threads would thrash).
The order of the builds rotates every round.  `--session NAME:KEY=VALUE` gives one build's sessions a
Session keyword of their own (an integer, e.g. `--session c16:chunk_tokens=16`), so two configurations of
one install compare the same way.  Naming the same interpreter twice is the A/A control:
a difference between two builds counts only outside the spread of the control's per-round ratio.
Prints a table per context (median, min-max tok/s; per-round ratio to the first build) and writes
--json with every round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

WORKER = r"""
import os, sys, time, json
import kvflash
from kvflash.bench.common import text_tokens
cfg = json.loads(sys.argv[1])
out = sys.stdout
sys.stdout = sys.stderr          # keep the protocol line-clean
sess = {}
for D in cfg["contexts"]:
    s = kvflash.Session(cfg["model"], max_ctx=D + cfg["margin"], kvflash=cfg["pool"], policy=cfg["policy"],
                        threads=cfg["threads"], allow_long_ctx=True, verbose=False, kv_type=cfg["kv_type"],
                        **cfg["session_kw"])
    toks = text_tokens(s, D)
    for i in range(0, D, 512):
        s.prefill(toks[i:i + 512])
    sess[D] = s
any_s = next(iter(sess.values()))
print(json.dumps({"ready": kvflash.__file__, "weight_bytes": os.path.getsize(any_s.model_path),
                  "pool_bytes": int(any_s.runtime.pool_bytes)}), file=out, flush=True)
for line in sys.stdin:
    D, n = map(int, line.split())
    s = sess[D]
    t0 = time.perf_counter()
    for _ in s.generate(None, max_tokens=n, temperature=0.0, ignore_eos=True):
        pass
    print(json.dumps({"s": time.perf_counter() - t0}), file=out, flush=True)
"""


def read_bandwidth(nbytes: float) -> float:
    """Bytes per second of one plain read pass (one thread) over about nbytes: the pool attention bench's
    read pass, over one pool sized to hold them (its attention op runs too, and is ignored)."""
    from kvflash import _core
    row = 4 * 68   # q8_0 rows of 4 KV heads of 64
    n_kv = max(64, int(nbytes / (2 * row)))
    r = _core.bench_pool_attention(n_kv, 64, 4, 4, kv_type="q8_0", n_threads=1, n_layers=1, iters=3, seed=0)
    return r["kv_bytes"] / statistics.median(r["read_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="append", required=True, help="NAME=PYTHON (two or more; repeat one for A/A)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="2048")
    ap.add_argument("--pool", type=int, default=2048)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-type", default="q8_0", help="the sessions' KV type (f16, q8_0, q4_0)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--session", action="append", default=[],
                    help="NAME:KEY=VALUE, a Session keyword (integer value) for build NAME's sessions; repeatable")
    ap.add_argument("--floor", action="store_true",
                    help="also time a one-thread read pass per round and print the physical floor per context")
    a = ap.parse_args()
    builds = []
    for b in a.build:
        name, sep, py = b.partition("=")
        if not sep or not name or not py:
            ap.error(f"--build takes NAME=PYTHON, got {b!r}")
        builds.append((name, py))
    if len(builds) < 2 or len({n for n, _ in builds}) != len(builds):
        ap.error("give two or more --build entries with distinct names")
    if a.rounds < 5:
        ap.error("--rounds must be at least 5 (medians over >= 5 repeats)")
    session_kw: dict = {n: {} for n, _ in builds}
    for item in a.session:
        name, sep, kv = item.partition(":")
        key, sep2, val = kv.partition("=")
        if not sep or not sep2 or name not in session_kw or not key:
            ap.error(f"--session takes NAME:KEY=VALUE with NAME a --build name, got {item!r}")
        try:
            session_kw[name][key] = int(val)
        except ValueError:
            ap.error(f"--session {item!r}: the value must be an integer")
    ctxs = [int(x) for x in a.contexts.split(",")]
    cfg = {"model": a.model, "contexts": ctxs, "pool": a.pool, "policy": a.policy, "threads": a.threads,
           "kv_type": a.kv_type,
           "margin": a.rounds * a.steps + 64}
    workers = {}
    sizes = {}
    for name, py in builds:   # one prefills at a time: each waits for the previous to be ready
        p = subprocess.Popen([py, "-c", WORKER, json.dumps({**cfg, "session_kw": session_kw[name]})],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        t0 = time.perf_counter()
        ready = json.loads(p.stdout.readline())
        sizes = {"weights": ready["weight_bytes"], "pool": ready["pool_bytes"]}
        print(f"[ab_builds] {name}: {ready['ready']} prefilled {ctxs} in {time.perf_counter() - t0:.0f}s",
              file=sys.stderr)
        workers[name] = p
    rates = {(n, D): [] for n, _ in builds for D in ctxs}
    # the physical floor: weights + the pool KV a token reads at each context, over this machine's
    # one-thread read bandwidth, measured once per round between the decode runs (never beside one)
    floor_bytes = {D: sizes["weights"] + sizes["pool"] * min(D, a.pool) / a.pool for D in ctxs}
    read_bw = []
    names = [n for n, _ in builds]
    for r in range(a.rounds):
        k = r % len(names)
        for D in ctxs:
            for n in names[k:] + names[:k]:
                w = workers[n]
                w.stdin.write(f"{D} {a.steps}\n")
                w.stdin.flush()
                dt = json.loads(w.stdout.readline())["s"]
                rates[(n, D)].append(a.steps / dt)
        if a.floor:
            read_bw.append(read_bandwidth(max(floor_bytes.values())))
        print(f"[ab_builds] round {r + 1}/{a.rounds} done", file=sys.stderr)
    for w in workers.values():
        w.stdin.close()
        w.wait()
    ref = names[0]
    print(f"decode tok/s, {a.model}, {a.kv_type} KV, pool {a.pool}, policy {a.policy}, {a.threads} threads, {a.steps} steps per "
          f"round, {a.rounds} rounds interleaved (order rotated); ratio per round to {ref!r}\n")
    bw = statistics.median(read_bw) if read_bw else None
    print("| context | build | tok/s median | min-max | ratio to first (median) | per-round ratio min-max |"
          + (" floor tok/s (weights + pool KV / read bandwidth) | measured / floor |" if bw else ""))
    print("|---:|---|---:|---:|---:|---:|" + ("---:|---:|" if bw else ""))
    for D in ctxs:
        for n in names:
            x = rates[(n, D)]
            rr = [u / v for u, v in zip(x, rates[(ref, D)])]
            extra = ""
            if bw:
                fl = bw / floor_bytes[D]
                extra = f" {fl:.0f} | {statistics.median(x) / fl:.2f} |"
            print(f"| {D} | {n} | {statistics.median(x):.2f} | {min(x):.2f}-{max(x):.2f} | "
                  f"{statistics.median(rr):.3f} | {min(rr):.3f}-{max(rr):.3f} |" + extra)
    if bw:
        print(f"\nfloor: weights {sizes['weights'] / 2**20:.1f} MiB + pool KV read at each context (pool "
              f"{sizes['pool'] / 2**20:.1f} MiB when full) over a one-thread read pass of that size: "
              f"{bw / 2**30:.2f} GiB/s (median of {len(read_bw)} rounds, min-max "
              f"{min(read_bw) / 2**30:.2f}-{max(read_bw) / 2**30:.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": {**cfg, "builds": dict(builds), "session_kw": session_kw, "rounds": a.rounds,
                                  "steps": a.steps},
                       "tok_s": {f"{n}@{D}": v for (n, D), v in rates.items()},
                       "read_bytes_per_s": read_bw, "floor_bytes": floor_bytes, "sizes": sizes}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
