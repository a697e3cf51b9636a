"""What chunk_tokens='auto' costs against 64-token chunks (issue 40): one pooled prompt and a decode window,
the same session settings but the paging granularity, with an A/A control.

    python bench/chunk_price.py --model smollm2-135m --threads 2 --context 8192 --pool 512 --policy qk \
        --rounds 5 --decode 128 --out bench/results/chunk-price-smollm2-8k-512

Modes, interleaved round by round (the order rotates each round): `c64` (chunk_tokens=64, the Python API's
default), `auto` (chunk_tokens='auto': the core's rule for the pool, e.g. 16-token chunks read in 64-token
pieces for a 512-token pool) and `c64-control` (c64 again: what "no difference" looks like on this machine).
Each mode opens a fresh session per round, prefills the same natural-text prompt (the bench's haystack; it
outgrows the pool, so the prefill is a pooled one) and decodes greedily through generate() (a scored policy's
rescoring paid as a user pays it).  Reported: median prefill seconds and decode tok/s per mode, and the
per-round ratios auto / c64 and control / c64 (median and range).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _ratio_line(name: str, xs: list) -> str:
    return f"{name}: {statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--policy", default="qk")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.rounds < 1 or a.decode < 1 or a.context < 1:
        ap.error("--rounds, --decode and --context must be >= 1")
    import kvflash
    from kvflash import _core
    from kvflash.bench.common import decode_steps, machine_info, text_tokens

    path = str(kvflash.resolve_model(a.model))
    max_ctx = a.context + a.decode + 64
    modes = {"c64": 64, "auto": "auto", "c64-control": 64}
    geometry = _core.auto_chunk_geometry(a.pool)
    rows: dict = {m: {"prefill_s": [], "decode_tps": []} for m in modes}
    prompt = None
    t_start = time.time()
    for r in range(a.rounds):
        order = list(modes)[r % len(modes):] + list(modes)[:r % len(modes)]
        for m in order:
            s = kvflash.Session(path, max_ctx=max_ctx, kvflash=a.pool, policy=a.policy, threads=a.threads,
                                chunk_tokens=modes[m], verbose=False)
            if prompt is None:
                prompt = text_tokens(s, a.context).tolist()
            t0 = time.perf_counter()
            s.prefill(prompt)
            pre = time.perf_counter() - t0
            dt, _ = decode_steps(s, a.decode)
            rows[m]["prefill_s"].append(pre)
            rows[m]["decode_tps"].append(a.decode / dt)
            rows[m]["chunk_tokens"] = s.chunk_tokens
            print(f"round {r + 1}/{a.rounds} {m} (chunk {s.chunk_tokens}): prefill {pre:.1f} s, "
                  f"decode {a.decode / dt:.1f} tok/s", file=sys.stderr, flush=True)
            del s
    ratio = {}
    for key in ("prefill_s", "decode_tps"):
        base = rows["c64"][key]
        ratio[key] = {"auto/c64": [x / b for x, b in zip(rows["auto"][key], base)],
                      "control/c64": [x / b for x, b in zip(rows["c64-control"][key], base)]}
    info = machine_info()
    dirty = " (dirty tree)" if info.get("kvflash_dirty") else ""
    cmd = "python bench/chunk_price.py " + " ".join(sys.argv[1:])
    lines = [f"<!-- kvflash {str(info.get('kvflash_commit'))[:12]}{dirty}, {info['time']}, `{cmd}` -->",
             f"<!-- {info['cpu']}, {info['logical_cpus']} logical CPUs, threads {a.threads}, build "
             f"{json.dumps(info['build'])} -->", "",
             f"### chunk_tokens='auto' against 64-token chunks: {a.model}, {a.context}-token prompt, pool {a.pool}, "
             f"policy {a.policy}, {a.rounds} interleaved rounds, {a.decode} decoded tokens",
             "", "| mode | chunk | prefill s (median) | decode tok/s (median) |", "| --- | ---: | ---: | ---: |"]
    for m in modes:
        lines.append(f"| {m} | {rows[m]['chunk_tokens']} | {statistics.median(rows[m]['prefill_s']):.2f} | "
                     f"{statistics.median(rows[m]['decode_tps']):.2f} |")
    lines += ["", f"- auto's geometry for pool {a.pool}: chunk {geometry[0]}, prefill piece "
                  f"{geometry[1] or geometry[0]} tokens",
              "- prefill seconds per round, " + _ratio_line("auto / c64", ratio["prefill_s"]["auto/c64"]) + "; A/A "
              + _ratio_line("control / c64", ratio["prefill_s"]["control/c64"]),
              "- decode tok/s per round, " + _ratio_line("auto / c64", ratio["decode_tps"]["auto/c64"]) + "; A/A "
              + _ratio_line("control / c64", ratio["decode_tps"]["control/c64"]),
              f"- wall {time.time() - t_start:.0f} s"]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "table.md").write_text(text)
        (a.out / "results.json").write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "rows": rows,
                                                        "ratios": ratio, "machine": info}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
