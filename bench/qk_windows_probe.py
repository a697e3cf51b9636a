"""Where needles rank under qk's query windows, raw and chat-template asks (issue 40), on TUNING data.

    taskset -c 0 python bench/qk_windows_probe.py --genres chat,code,csv,wiki,manual,fiction,syslog,legal,email,config \
        --ask raw --out DIR          # then --ask chat
    python bench/qk_windows_probe.py --analyse DIR > table.md

Each trial (the needle routine's prompts, split tuning, seed 1234, 3 per genre at depths 10/50/90%) is prefilled
into a pooled session (qk's defaults, 16-token chunks read in 64-token pieces) that captures 200 queries; the
per-token attention of each 8-query window ending k = 0, 8, ..., 184 tokens before the end (first 8 paged layers:
qk's auto layers for SmolLM2) is saved with the needle's chunks.  --analyse scores every variant from those arrays
with the core's chunk_peaks (spread 8, carry 16): `w1` one window minus the window 64 tokens earlier (qk's
default scoring), `q16` / `q24` the mean of two / three windows, and `wN` / `wN-own` N windows ranked by their best
rank, against the one baseline (what the core's QKPolicy(windows=N) does) or each against its own 64 tokens
earlier.  A trial is kept when each needle chunk ranks below the free slots.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os

import numpy as np


def dump(a) -> None:
    import kvflash
    from kvflash.bench.needle import make_builder
    from kvflash.bench.routines._shared import passkey_chunks
    from kvflash.scoring import QKPolicy
    os.makedirs(a.out, exist_ok=True)
    pol = QKPolicy()
    pol.n_capture = 200
    s = kvflash.Session(a.model, max_ctx=a.context, kvflash=a.pool, policy=pol, threads=1, chunk_tokens=16,
                        prefill_piece=64)
    for genre in a.genres.split(","):
        b = make_builder(s, 1234, "tuning", genre, ask=a.ask)   # tuning data only
        for i in (int(x) for x in a.trials.split(",")):
            t = b.trial(i, a.context - 13, [10, 50, 90])
            s.reset()
            s.prefill(t.ids)
            v = s.chunk_view()
            nc = v.n_captured
            arr = {f"w{k}": v.history_attention(q_first=nc - 8 - k, q_count=8, n_layers=8) for k in range(0, 192, 8)}
            np.savez_compressed(f"{a.out}/{a.ask}-{genre}-{i}.npz", chunks=np.array(passkey_chunks(s, t.ids, t.value)),
                                protected=v.protected.copy(), free=v.pool_chunks - int(v.protected.sum()),
                                C=s.chunk_tokens, n_chunks=len(v.protected), **arr)
            print(genre, i, a.ask, flush=True)


def variants(d, C: int, n_chunks: int) -> dict:
    from kvflash import _core
    co = np.arange(len(d["w0"])) // C
    co = np.where(co < n_chunks, co, -1).astype(np.int32)

    def peaks(x):
        return np.asarray(_core.chunk_peaks(np.asarray(x, np.float64), co, n_chunks, 8, 16))

    def w(k):
        return d[f"w{k}"].astype(np.float64)

    def best_rank(scores):
        return -np.min([np.argsort(np.argsort(-c, kind="stable"), kind="stable") for c in scores], axis=0).astype(float)
    out = {"w1": peaks(w(0) - w(64)), "q16": peaks((w(0) + w(8)) / 2 - (w(64) + w(72)) / 2),
           "q24": peaks((w(0) + w(8) + w(16)) / 3 - (w(64) + w(72) + w(80)) / 3)}
    for n in (2, 3, 4):
        out[f"w{n}"] = best_rank([peaks(w(8 * j) - w(64)) for j in range(n)])
        out[f"w{n}-own"] = best_rank([peaks(w(8 * j) - w(8 * j + 64)) for j in range(n)])
    return out


def analyse(a) -> None:
    from kvflash.bench.routines._shared import rank_of
    kept, ranks, trials = collections.Counter(), collections.Counter(), collections.Counter()
    per_genre = collections.defaultdict(collections.Counter)
    for f in sorted(glob.glob(os.path.join(a.analyse, "*.npz"))):
        d = np.load(f)
        ask, genre = os.path.basename(f).split("-")[:2]
        trials[ask] += 1
        for name, sc in variants(d, int(d["C"]), int(d["n_chunks"])).items():
            r = [rank_of(sc, d["protected"], int(c)) for c in d["chunks"]]
            k = max(r) < int(d["free"])
            kept[name, ask] += k
            per_genre[name][ask, genre] += k
            ranks[name, ask] += sum(min(x, 50) for x in r)
    asks = sorted(trials)
    names = list(dict.fromkeys(n for n, _ in kept))
    print("| variant | " + " | ".join(f"{x} asks kept (of {trials[x]}) | ranks summed" for x in asks) +
          " | raw asks in the chat genre kept |")
    print("|---|" + "---:|---:|" * len(asks) + "---:|")
    for n in names:
        print(f"| {n} | " + " | ".join(f"{kept[n, x]} | {ranks[n, x]}" for x in asks) +
              f" | {per_genre[n]['raw', 'chat']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--genres", default="chat,code,csv,wiki,manual,fiction,syslog,legal,email,config")
    ap.add_argument("--trials", default="0,1,2")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--pool", type=int, default=256)
    ap.add_argument("--ask", choices=("raw", "chat"), default="raw")
    ap.add_argument("--out", default="qk-windows-probe")
    ap.add_argument("--analyse", help="a folder of dumps: print the table (no model run)")
    a = ap.parse_args()
    analyse(a) if a.analyse else dump(a)


if __name__ == "__main__":
    main()
