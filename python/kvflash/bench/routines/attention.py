"""The CPU pool attention op alone: K/V bytes read per second against a plain read pass of the same bytes."""
from __future__ import annotations

import statistics

from ..common import BenchConfig, Progress, model_label, summarize
from ..report import Result
from ._shared import _spread

GIB = 2**30


def run_attention(cfg: BenchConfig) -> Result:
    """Decode attention over the pool, the op alone (no model around it): per (KV type, pool, threads,
    kernel) a graph of one decode query's attention over each paged layer's pool (the model's geometry,
    random K/V rows, every slot visible), timed per iteration beside a one-thread read pass over the same
    K/V bytes and a memcpy of them, all three interleaved in one loop.  Bandwidth = K/V bytes / seconds;
    the ratio to the read pass is per iteration.  For q8_0 / q4_0 K both kernels run: f32 dots (the
    runtime's: on AVX-512 VNNI builds the tiled kernel, elsewhere dequantized rows) and the integer dots
    against a quantized query (quant_dots), so their ratio is taken in one run."""
    import kvflash
    from kvflash import _core
    from kvflash.models import resolve_model
    m = kvflash.Model(str(resolve_model(cfg.model)), 1)
    hp = m.hparams
    n_layers = len(m.global_layers)
    D, H, Hkv = int(hp["head_dim"]), int(hp["n_head"]), int(hp["n_head_kv"])
    kv_types = cfg.attn_kv_types
    tiled = bool(_core.pool_attention_tiled_available())
    threads = cfg.attn_threads
    res = Result("attention", f"pool attention op alone: one decode query over {n_layers} layers' pools "
                 f"(head_dim {D}, {H} heads, {Hkv} KV heads; median ± spread of {cfg.repeats} interleaved iterations)",
                 [("model", "model"), ("kv_type", "kv"), ("pool", "pool"), ("threads", "threads"),
                  ("kernel", "kernel"), ("n_split", "ranges"), ("attn_ms", "attention ms (all layers)"),
                  ("us_layer", "µs per layer"), ("attn_gib_s", "attention GiB/s"), ("read_gib_s", "read pass GiB/s"),
                  ("copy_gib_s", "memcpy GiB/s"), ("vs_read", "vs read pass per iteration (median, min-max)"),
                  ("vs_rows", "speedup vs the f32 row kernel (median of medians)"), ("kv_mib", "K/V MiB read")])
    # (name, tiled, quant_dots); the first is the runtime's kernel for that KV type
    quant_kernels = ([("f32 dots, tiled (keys widened in registers; the runtime's)", True, False),
                      ("f32, row at a time (dequantized rows)", False, False),
                      ("int8 dots, tiled (quantized query)", True, True)] if tiled else
                     [("f32, row at a time (dequantized rows; the runtime's)", False, False),
                      ("int8 dots, row at a time (quantized query)", False, True)])
    cells = [(t, p, th, k) for t in kv_types for p in cfg.pools for th in threads
             for k in (quant_kernels if t in ("q8_0", "q4_0") else
                       [("f32, row at a time (dequantized rows; the runtime's)", False, False)])]
    with Progress(len(cells), "attention", cfg.quiet) as pb:
        rows_ms = {}
        for t, p, th, (kernel, use_tiled, quant) in cells:
            r = _core.bench_pool_attention(p, D, H, Hkv, kv_type=t, n_threads=th, n_layers=n_layers,
                                           iters=cfg.repeats, seed=cfg.seed, quant_dots=quant, tiled=use_tiled)
            kv = r["kv_bytes"]
            ratios = [(kv / a) / (kv / b) for a, b in zip(r["attn_s"], r["read_s"])]
            a = summarize(x * 1e3 for x in r["attn_s"])
            row = {"model": model_label(cfg.model), "kv_type": t, "pool": p, "threads": th, "kernel": kernel,
                   "n_split": r["n_split"], "attn_ms": a, "us_layer": a["median"] * 1e3 / n_layers,
                   "attn_gib_s": summarize(kv / x / GIB for x in r["attn_s"]),
                   "read_gib_s": summarize(kv / x / GIB for x in r["read_s"]),
                   "copy_gib_s": summarize(kv / x / GIB for x in r["copy_s"]),
                   "vs_read": f"{statistics.median(ratios):.2f}x ({_spread(ratios)})", "kv_mib": kv / 2**20}
            if not use_tiled and not quant:
                rows_ms[(t, p, th)] = a["median"]
            res.rows.append(row)
            res.raw += [{"kv_type": t, "pool": p, "threads": th, "kernel": kernel, "iteration": i, "attn_s": x,
                         "read_s": y, "copy_s": z} for i, (x, y, z) in enumerate(zip(r["attn_s"], r["read_s"],
                                                                                      r["copy_s"]))]
            pb.advance(1, note=f"{t} pool {p} t{th} {kernel.split(' (')[0]} {a['median']:.2f} ms")
    for row in res.rows:
        if not row["kernel"].startswith("f32, row"):
            ref = rows_ms.get((row["kv_type"], row["pool"], row["threads"]))
            if ref:
                row["vs_rows"] = f"{ref / row['attn_ms']['median']:.2f}x"
    res.notes += [
        "one iteration = the attention of every paged layer for one decode token (one graph, the threads as given), "
        "a read pass over the same K/V bytes (one thread, every byte loaded once) and a memcpy of them, in an order "
        "rotated per iteration; bandwidth = the K/V bytes of all layers' pools / seconds",
        "the pools of all layers together are the bytes a decode token reads; where they fit the last-level cache "
        "(its size is in machine.json) both the op and the read pass run from it",
        "kernels of one cell run one after another (each interleaved with its own read pass and memcpy), so "
        "the speedup column compares medians of neighbouring runs, without an A/A control",
        "ranges: the split-K ranges per KV head the runtime would choose for this pool and thread count",
    ]
    return res
