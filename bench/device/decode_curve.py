"""Decode curve: tokens/s against context length, full cache vs kvflash, on one backend.

A random-weight GGUF of a chosen geometry is written with tests/tinygguf.py (no
model files travel to the GPU machine); each cache mode prefills progressively to
every context in the list and times greedy decode steps there.  Results go to
DIR/decode_curve.jsonl (one line per point, written as it is measured, so a run cut
off by its time budget keeps what it had), DIR/decode_curve.json and a plot
DIR/decode_curve.png (when matplotlib is present).

    python bench/device/decode_curve.py --device cuda --geometry 0.5b --contexts 8k,16k,32k,64k,128k \
        --pool 4096 --out $OUT --budget 240

--device is passed to kvflash._core.Model(path, n_threads, device=...): "cuda" needs a
KVFLASH_CUDA build (weights, pool and graphs on the GPU, paging through the pinned slab).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

# Geometries (llama arch, tied embeddings, f16 weights).  "0.5b" is ~0.51e9 parameters.
GEOMETRIES = {
    "tiny": dict(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=256, n_vocab=None),
    "small": dict(n_layer=8, n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_ff=1536, n_vocab=8192),
    "0.5b": dict(n_layer=24, n_embd=1024, n_head=16, n_head_kv=4, head_dim=64, n_ff=5632, n_vocab=32000),
}


def n_params(g: dict, n_vocab: int) -> int:
    q = g["n_embd"] * g["n_head"] * g["head_dim"]
    kv = 2 * g["n_embd"] * g["n_head_kv"] * g["head_dim"]
    o = g["n_head"] * g["head_dim"] * g["n_embd"]
    ffn = 3 * g["n_embd"] * g["n_ff"]
    return g["n_layer"] * (q + kv + o + ffn + 2 * g["n_embd"]) + n_vocab * g["n_embd"] + g["n_embd"]


def parse_ctx(s: str) -> list[int]:
    out = []
    for p in s.split(","):
        p = p.strip().lower()
        if p:
            out.append(int(float(p[:-1]) * 1024) if p.endswith("k") else int(p))
    return sorted(set(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="0.5b")
    ap.add_argument("--contexts", default="8k,16k,32k,64k,128k")
    ap.add_argument("--pool", type=int, default=4096, help="kvflash pool tokens")
    ap.add_argument("--kv-type", default="q8_0")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--modes", default="kvflash,full")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prefill-slice", type=int, default=4096, help="tokens per eval call while prefilling")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run (stops between points)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "decode_curve.jsonl"
    jsonl.write_text("")

    from kvflash import _core as core
    from tinygguf import write_tiny_model

    g = dict(GEOMETRIES[args.geometry])
    contexts = parse_ctx(args.contexts)
    max_ctx = contexts[-1] + args.decode_steps + 64
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.geometry}.gguf"
        t0 = time.monotonic()
        info = write_tiny_model(path, "llama", weight_type="f16", seed=5, ctx_len=max(max_ctx, 4096),
                                weight_scale=1.0, **g)
        V = len(info["vocab"]["tokens"])
        del info  # the float64 copies of the weights
        params = n_params(g, V)
        print(f"[decode-curve] geometry {args.geometry}: {params / 1e9:.3f}e9 params, vocab {V}, "
              f"gguf {path.stat().st_size / 2**20:.0f} MiB written in {time.monotonic() - t0:.1f}s", flush=True)
        model = core.Model(str(path), args.threads, device=args.device)
        free, total = model.device_memory()
        print(f"[decode-curve] model on {model.device}: {model.weight_bytes / 2**20:.0f} MiB of weights, "
              f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB after them", flush=True)
        rng = np.random.default_rng(0)
        stream = rng.integers(0, V, max_ctx).astype(np.int32)
        rows, stopped = [], None
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            pool = 0 if mode == "full" else args.pool
            rt = core.Runtime(model, max_ctx=max_ctx, pool_tokens=pool, kv_type=args.kv_type)
            n_past, tok = 0, None
            for ctx in contexts:
                if time.monotonic() - t_start > args.budget:
                    stopped = f"time budget {args.budget:.0f}s reached before {mode} @ {ctx}"
                    break
                t0 = time.monotonic()
                while n_past < ctx:
                    m = min(args.prefill_slice, ctx - n_past)
                    logits = rt.eval(stream[n_past:n_past + m], False)
                    n_past += m
                    tok = int(np.argmax(logits))
                t_prefill = time.monotonic() - t0
                times = []
                for _ in range(args.decode_steps + 2):
                    t1 = time.monotonic()
                    logits = rt.eval(np.array([tok], np.int32), False)
                    times.append(time.monotonic() - t1)
                    tok = int(np.argmax(logits))
                    n_past += 1
                dec = times[2:]  # two warm-up steps (graph build, allocator growth)
                row = dict(mode=mode, device=args.device, geometry=args.geometry, params=params, ctx=ctx,
                           pool_tokens=rt.pool_tokens, pool_mib=rt.pool_bytes / 2**20, kv_type=args.kv_type,
                           decode_tok_s=len(dec) / sum(dec), decode_ms_median=1e3 * float(np.median(dec)),
                           prefill_s=t_prefill)
                rows.append(row)
                with open(jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"[decode-curve] {mode:8s} ctx {ctx:7d}: {row['decode_tok_s']:8.1f} tok/s "
                      f"(median {row['decode_ms_median']:.2f} ms), pool {row['pool_mib']:.0f} MiB, "
                      f"prefill {t_prefill:.1f}s", flush=True)
            del rt
            if stopped:
                break
    summary = dict(rows=rows, stopped=stopped, seconds=time.monotonic() - t_start,
                   ggml_version=getattr(core, "ggml_version", None), build_info=core.build_info())
    (out / "decode_curve.json").write_text(json.dumps(summary, indent=1))
    if stopped:
        print(f"[decode-curve] {stopped}", flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode in sorted({r["mode"] for r in rows}):
            rs = [r for r in rows if r["mode"] == mode]
            ax.plot([r["ctx"] for r in rs], [r["decode_tok_s"] for r in rs], marker="o",
                    label=f"{mode}" + (f" (pool {rs[0]['pool_tokens']})" if mode != "full" else ""))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tok/s")
        ax.set_title(f"decode curve, {args.geometry} random weights ({params / 1e9:.2f}B), {args.device}, "
                     f"KV {args.kv_type}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "decode_curve.png", dpi=110)
    except ImportError:
        print("[decode-curve] matplotlib missing: no plot", flush=True)
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
