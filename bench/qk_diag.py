"""Why does qk rank a corpus needle out?  A probe on TUNING data only (issue 40).

For each tuning trial of each genre (the needle routine's prompts: same builder, seed, token budget), the
prompt is prefilled into a pooled session with the default qk policy (so the pooled prefill's selection and
K/V are the default's), capturing more queries than it reads.  Then, from that one history:

- the rank of the needle's chunk(s) under the prompt's real rescore and under QKPolicy variants (scored by the
  core, exactly as a session would: `--variants`);
- per-token attention arrays (`history_attention`: mean over a window of captured queries, max over heads and
  the first L paged layers) for query windows ending k tokens before the prompt's end and several L, the
  16-token sub-chunk masses and the per-chunk masses, saved to `<out>/<genre>-<trial>.npz` with the tokens,
  the needle's token span, the protected mask and the free slots, for offline analysis (`--analyse`);
- which tokens the scoring queries are, and what text the chunks that outrank the needle peak on.

    python bench/qk_diag.py --genres code,chat --trials 0,1,2,3 --context 4096 --pool 512 --threads 1 --out DIR
    python bench/qk_diag.py --analyse DIR

Tuning data only: the corpus genres' tuning documents, `prose` (the tuning split) and `prose-indirect` (the
tuning-indirect split).
"""
from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np

WINDOWS = (0, 8, 16, 24, 32, 48, 64, 96, 128)     # query windows of 8, ending k tokens before the end
LAYERS = (1, 2, 4, 8, 12, 16, 30)
DEFAULT_VARIANTS = [{}, {"n_queries": 8, "contrast": 0}, {"n_queries": 8, "contrast": 64}, {"n_queries": 16, "contrast": 0}, {"n_queries": 16, "contrast": 32}, {"n_queries": 16, "contrast": 64}, {"n_queries": 24, "contrast": 0}, {"n_queries": 24, "contrast": 32}, {"n_queries": 24, "contrast": 64}, {"n_queries": 32, "contrast": 0}, {"n_queries": 32, "contrast": 32}, {"n_queries": 32, "contrast": 64}, {"layers": 30}, {"layers": 4}, {"layers": 16}, {"n_queries": 24, "contrast": 32, "layers": 16}, {"carry": 0}, {"spread": 0}]


def dump(a) -> None:
    import kvflash
    from kvflash.bench.needle import make_builder
    from kvflash.bench.routines import passkey_chunks, rank_of, rank_text
    from kvflash.scoring import QKPolicy

    os.makedirs(a.out, exist_ok=True)
    pol = QKPolicy()                       # the default qk: the prefill selects as a user's session does
    nq = 8
    pol.n_capture = max(WINDOWS) + nq      # keep more queries than it reads (its scoring is unchanged)
    ct = a.chunk_tokens if a.chunk_tokens == "auto" else int(a.chunk_tokens)
    s = kvflash.Session(a.model, max_ctx=a.context, kvflash=a.pool, policy=pol, threads=a.threads,
                        chunk_tokens=ct, prefill_piece=a.prefill_piece, exact_prefill=a.exact_prefill)
    C = s.chunk_tokens
    variants = json.loads(a.variants)
    depths = [int(x) for x in a.depths.split(",")]
    for genre in a.genres.split(","):
        split, hay = ("tuning-indirect", "prose") if genre == "prose-indirect" else ("tuning", genre)
        builder = make_builder(s, a.seed, split, hay, ask=a.ask)   # tuning data only
        for i in (int(x) for x in a.trials.split(",")):
            t = builder.trial(i, a.context - a.answer_tokens - 1, depths)
            s.reset()
            s.prefill(t.ids)
            view = s.chunk_view()
            n = len(t.ids)
            n_cap = view.n_captured
            chunks = passkey_chunks(s, t.ids, t.value)
            prot = view.protected.copy()
            free = view.pool_chunks - int(prot.sum())
            real = s.last_scores
            arrays = {}
            for k in WINDOWS:
                f = n_cap - nq - k
                if f < 0:
                    continue
                for L in (LAYERS if k in (0, 32) else (8,)):
                    arrays[f"w{k}_L{L}"] = view.history_attention(q_first=f, q_count=nq, n_layers=L)
            for j in range(nq):                                 # each of the last 8 queries alone
                arrays[f"q{j}_L8"] = view.history_attention(q_first=n_cap - nq + j, q_count=1, n_layers=8)
            groups = (np.arange(n) // 16).astype(np.int32)
            for k in (0, 32):
                arrays[f"g16w{k}_L8"] = view.history_attention(q_first=n_cap - nq - k, q_count=nq, n_layers=8,
                                                               groups=groups)
            arrays["chunkmass_w0_L8"] = view.history_attention(q_first=n_cap - nq, q_count=nq, n_layers=8,
                                                               per_chunk=True)
            data, ends = view.token_bytes()
            off = data.find(t.value.encode())
            tok0 = int(np.searchsorted(ends, off, side="right"))
            tok1 = int(np.searchsorted(ends, off + len(t.value.encode()) - 1, side="right"))
            ranks = []
            for v in variants:
                sc = QKPolicy(**v).score(view)
                rr = [rank_of(sc, prot, c) for c in chunks]
                ranks.append(rank_text(rr))
            real_rank = rank_text([rank_of(real, prot, c) for c in chunks]) if real is not None else "-"
            np.savez_compressed(os.path.join(a.out, f"{genre}-{i}.npz"), tokens=np.asarray(t.ids, np.int32),
                                needle=np.array([tok0, tok1]), chunks=np.array(chunks), protected=prot,
                                free=free, real=real if real is not None else np.zeros(0), C=C,
                                n_cap=n_cap, **arrays)
            qtext = s.detokenize(t.ids[-nq:])
            btext = s.detokenize(t.ids[-nq - 32:-32])
            meta = dict(genre=genre, trial=i, depth=t.depth, wording=t.wording, value=t.value, chunks=chunks,
                        free=free, real=real_rank, variants=dict(zip(a.variants_names(variants), ranks)),
                        queries=qtext, contrast_queries=btext, needle_tokens=[tok0, tok1])
            with open(os.path.join(a.out, f"{genre}-{i}.json"), "w") as fh:
                json.dump(meta, fh, indent=1)
            print(json.dumps(meta), flush=True)


def chunk_peak(x, C, n_chunks, spread=4, carry=16):
    """The core's chunk_peaks (scoring.cpp) in numpy: each token the peak of `spread` either side, and, just
    below the source, of the `carry` before that; a chunk its peak token."""
    x = np.asarray(x, float)
    n = len(x)
    pad = np.concatenate([np.full(spread, -np.inf), x, np.full(spread, -np.inf)])
    y = np.max(np.lib.stride_tricks.sliding_window_view(pad, 2 * spread + 1), axis=1) if spread else x.copy()
    if carry > spread:
        xc = x - (np.abs(x) * 1e-6 + 1e-30)
        for d in range(spread + 1, carry + 1):
            y[d:] = np.maximum(y[d:], xc[:-d])
    m = min(n, n_chunks * C)
    yy = np.full(n_chunks * C, -np.inf)
    yy[:m] = y[:m]
    out = yy.reshape(n_chunks, C).max(axis=1)
    return out


def rank(sc, prot, c):
    cand = np.flatnonzero(~prot[: len(sc)])
    order = cand[np.argsort(-sc[cand], kind="stable")]
    w = np.flatnonzero(order == c)
    return int(w[0]) if len(w) else -1


def analyse(a) -> None:
    files = sorted(glob.glob(os.path.join(a.analyse, "*.npz")))
    print(f"{len(files)} trials")
    for f in files:
        z = np.load(f)
        meta = json.load(open(f[:-4] + ".json"))
        C, prot, chunks = int(z["C"]), z["protected"], list(z["chunks"])
        nch = len(prot)

        def rk(sc):
            return "+".join(str(rank(sc, prot, c)) for c in chunks)
        out = {"real": meta["real"]}
        base = z["w0_L8"]
        for k in (0, 16, 32, 64, 128):
            key = f"w{k}_L8"
            if k == 0:
                out["c0"] = rk(chunk_peak(base, C, nch))
            elif key in z:
                out[f"c{k}"] = rk(chunk_peak(base - z[key], C, nch))
        for L in LAYERS:
            if f"w0_L{L}" in z and f"w32_L{L}" in z:
                out[f"L{L}"] = rk(chunk_peak(z[f"w0_L{L}"] - z[f"w32_L{L}"], C, nch))
        g0, g32 = z["g16w0_L8"], z["g16w32_L8"]
        sub = (g0 - g32)
        out["sub16"] = rk(np.array([sub[c * C // 16:(c + 1) * C // 16].max() for c in range(nch)]))
        out["sub16nc"] = rk(np.array([g0[c * C // 16:(c + 1) * C // 16].max() for c in range(nch)]))
        out["chunkmass"] = rk(z["chunkmass_w0_L8"][:nch])
        # which of the last 8 queries carries the needle: each alone, minus the contrast window (query 7 = the last)
        out["single"] = ",".join(rk(chunk_peak(z[f"q{j}_L8"] - z["w32_L8"], C, nch)) for j in range(8))
        # windows of 8 queries ending k tokens before the end (the question sits inside 8..32), contrast 32 later
        out["win"] = ",".join(rk(chunk_peak(z[f"w{k}_L8"] - z[f"w{k + 32}_L8"], C, nch))
                              for k in (0, 8, 16, 24) if f"w{k + 32}_L8" in z)
        print(f"{meta['genre']:8s} t{meta['trial']} d{meta['depth']:>2} w{meta['wording']} free {meta['free']}: "
              + " ".join(f"{k}={v}" for k, v in out.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--genres", default="code,chat,csv,wiki,manual,fiction,syslog,legal,email,config")
    ap.add_argument("--trials", default="0,1,2,3")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--depths", default="10,50,90")
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--ask", choices=["chat", "raw"], default="chat")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--chunk-tokens", default="auto", help="the session's chunk_tokens (the bench's --chunk-tokens)")
    ap.add_argument("--prefill-piece", type=int, default=None, help="the session's prefill_piece")
    ap.add_argument("--exact-prefill", action="store_true", help="read the prompt exactly (Session(exact_prefill=True))")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default=json.dumps(DEFAULT_VARIANTS))
    ap.add_argument("--out", default="qk-diag")
    ap.add_argument("--analyse", help="a folder of dumps to analyse (no model run)")
    a = ap.parse_args()
    a.variants_names = lambda vs: [json.dumps(v, sort_keys=True) for v in vs]
    if a.analyse:
        analyse(a)
    else:
        dump(a)


if __name__ == "__main__":
    main()
