"""What qk's query windows cost (issue 40): the rescore itself, timed on one prefilled history, and what it
adds per decoded token.

    python bench/qk_windows_price.py --model smollm2-135m --threads 2 --context 16384 --pool 1024 --rounds 7 \
        --out bench/results/qk-windows-price-smollm2-16k

One pooled session (qk's defaults but the windows under test captured) prefills a natural-text prompt (the bench's
haystack) of --context tokens, then decodes --decode tokens (decode ms/token, its own rescores excluded).  Then,
round by round in a rotating order, the core's qk scorer scores that one history with `w1` (one window),
`wN` (--windows N) and `w1-control` (one window again: what "no difference" looks like here), --repeats calls
each.  Reported: the median ms per rescore per mode, the per-round ratios wN / w1 and w1-control / w1 (median
and range), and each mode's rescore ms per decoded token at the session's rescore period (max(tau, n_past / 45)).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3, help="scorer calls per mode and round (their median)")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.rounds < 1 or a.repeats < 1 or a.decode < 1 or a.context < 1 or not 2 <= a.windows <= 16:
        ap.error("--rounds, --repeats, --decode, --context must be >= 1 and --windows in [2, 16]")
    import kvflash
    from kvflash.bench.common import decode_steps, machine_info, text_tokens
    from kvflash.scoring import QKPolicy

    t_start = time.time()
    pol = QKPolicy(windows=a.windows)   # captures what the widest mode reads
    s = kvflash.Session(kvflash.resolve_model(a.model), max_ctx=a.context + a.decode + 64, kvflash=a.pool,
                        policy=pol, threads=a.threads, verbose=False)
    prompt = text_tokens(s, a.context).tolist()
    t0 = time.perf_counter()
    s.prefill(prompt)
    prefill_s = time.perf_counter() - t0
    st0 = s.stats
    dt, _ = decode_steps(s, a.decode)
    st = s.stats
    decode_ms = (1e3 * dt - (st["rescore_ms"] - st0["rescore_ms"])) / a.decode
    view = s.chunk_view()
    modes = {"w1": 1, f"w{a.windows}": a.windows, "w1-control": 1}
    args = {m: QKPolicy(windows=w)._scorer().core_args(view.n_paged_layers) for m, w in modes.items()}
    ms: dict = {m: [] for m in modes}
    for r in range(a.rounds):
        order = list(modes)[r % len(modes):] + list(modes)[:r % len(modes)]
        for m in order:
            calls = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                view.qk_policy_scores(args[m])
                calls.append(1e3 * (time.perf_counter() - t0))
            ms[m].append(statistics.median(calls))
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{m} {ms[m][-1]:.1f} ms" for m in modes), file=sys.stderr,
              flush=True)
    wide = f"w{a.windows}"
    ratios = {f"{wide}/w1": [x / b for x, b in zip(ms[wide], ms["w1"])],
              "w1-control/w1": [x / b for x, b in zip(ms["w1-control"], ms["w1"])]}
    period = max(s.tau, s.n_past // 45)
    info = machine_info()
    dirty = " (dirty tree)" if info.get("kvflash_dirty") else ""
    cmd = "python bench/qk_windows_price.py " + " ".join(sys.argv[1:])
    line = lambda xs: f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"   # noqa: E731
    lines = [f"<!-- kvflash {str(info.get('kvflash_commit'))[:12]}{dirty}, {info['time']}, `{cmd}` -->",
             f"<!-- {info['cpu']}, {info['logical_cpus']} logical CPUs, threads {a.threads}, build "
             f"{json.dumps(info['build'])} -->", "",
             f"### qk's rescore with {a.windows} query windows against one: {a.model}, {s.n_past}-token history, "
             f"pool {a.pool}, {a.rounds} interleaved rounds of {a.repeats} calls per mode",
             "", "| mode | rescore ms (median) | rescore ms per decoded token (period " + str(period) + ") | "
             "% of decode (" + f"{decode_ms:.1f}" + " ms/token) |", "| --- | ---: | ---: | ---: |"]
    for m in modes:
        med = statistics.median(ms[m])
        lines.append(f"| {m} | {med:.1f} | {med / period:.3f} | {100 * med / period / decode_ms:.1f}% |")
    lines += ["", f"- per round, {wide} / w1: {line(ratios[wide + '/w1'])}; A/A w1-control / w1: "
                  f"{line(ratios['w1-control/w1'])}",
              f"- prefill {prefill_s:.1f} s; decode {decode_ms:.1f} ms/token over {a.decode} tokens (rescores "
              f"excluded); wall {time.time() - t_start:.0f} s"]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "table.md").write_text(text)
        (a.out / "results.json").write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "ms": ms,
                                                        "ratios": ratios, "decode_ms": decode_ms, "period": period,
                                                        "prefill_s": prefill_s, "machine": info}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
