"""The first run's table: one long prompt answered from a small pool, and what that buys at decode."""
from __future__ import annotations

import statistics

from ..common import MIB, BenchConfig, Progress, ctx_label, decode_steps, kv_resident_bytes, summarize
from ..needle import make_builder, score
from ..report import Result
from ._shared import BASE_COLS, _answer, _base, _first_haystack, _open_modes, _spread, _split_note, _verdict


def run_demo(cfg: BenchConfig) -> Result:
    """A document of a few thousand tokens with one fact in it (a reporting-split needle prompt, asked through
    the chat template), answered by the full cache, a second full cache (the A/A control) and kvflash (first
    --pool, --policy).  Each session prefills the prompt once and answers greedily; then, in --repeats rounds
    with the modes interleaved and their order rotated, each decodes a window that holds one rescore period
    of a scored policy (+1 token, so its rescore is paid inside the window) and is truncated back to its
    answer, so every window starts at the same depth.  Decode ratios are per round (paired)."""
    D = cfg.contexts[0]
    pool = cfg.pools[0]
    modes = [("full", None, None), ("control", None, None), ("kvflash", pool, cfg.policy)]
    period = max(cfg.tau, D // 45)
    window = max(cfg.decode_steps, period + 1)
    res = Result("demo", f"{ctx_label(D)} prompt: full cache vs kvflash (pool {pool}, policy {cfg.policy}) with an "
                 f"A/A control: decode tok/s median ± farthest round, ratio vs full median (min-max) of per-round pairs, "
                 f"over {cfg.repeats} interleaved rounds of {window} tokens",
                 BASE_COLS + [("mode", "mode"), ("pool", "pool"), ("policy", "policy"),
                              ("prompt_tokens", "prompt tokens"), ("prefill_s", "prefill s"),
                              ("decode_tok_s", "decode tok/s"), ("speed_ratio", "decode vs full (min-max)"),
                              ("kv_resident_mib", "KV resident MiB"), ("host_mib", "host MiB"),
                              ("answer", "answer"), ("correct", "right")])
    with Progress(len(modes) * (cfg.repeats + 1), "demo", cfg.quiet) as pb:
        sessions, na = _open_modes(cfg, modes, D, dedupe_fallback=False)
        if na:
            raise RuntimeError("; ".join(f"{m[0]}: {why}" for m, why in na.items()))
        any_s = next(iter(sessions.values()))
        builder = make_builder(any_s, cfg.seed, cfg.split, _first_haystack(cfg))
        trial = builder.trial(0, D - cfg.answer_tokens - window - 2, cfg.depths)
        first = {}
        for m, s in sessions.items():
            hook = pb.prefill_note(f"{m[0]}: ")
            ans, dt, _ = _answer(s, trial.ids, cfg.answer_tokens, progress=hook)
            first[m] = {"answer": ans.strip(), "correct": score(ans, trial.value), "prefill_s": dt, "n0": s.n_past}
            pb.advance(1, note=f"{m[0]}: prefill {dt:.1f} s, answer {ans.strip()!r}")
        for r in range(cfg.repeats):
            order = list(sessions.items())
            k = r % len(order)
            for m, s in order[k:] + order[:k]:
                st0 = s.stats
                pb.note(f"round {r + 1}/{cfg.repeats} {m[0]}: decode {window}")
                dt, cms = decode_steps(s, window)
                st = s.stats
                res.raw.append({**_base(cfg, s), "mode": m[0], "round": r, "pool": m[1], "context": D,
                                "decode_ctx": first[m]["n0"], "decode_tokens": window, "decode_s": dt,
                                "decode_tok_s": window / dt, "compute_ms": cms,
                                "window_rescores": st["rescores"] - st0["rescores"],
                                "window_rescore_ms": st["rescore_ms"] - st0["rescore_ms"],
                                "page_outs": st["page_outs"], "page_ins": st["page_ins"]})
                s.truncate(first[m]["n0"])   # untimed: the next round decodes from the same depth
                pb.advance(1, note=f"round {r + 1} {m[0]}: {window / dt:.1f} tok/s")
        by = {m: {x["round"]: x for x in res.raw if x["mode"] == m[0]} for m in modes}

        def paired(m):   # per round: m's tok/s over the full cache's
            return [by[m][i]["decode_tok_s"] / by[modes[0]][i]["decode_tok_s"] for i in by[m] if i in by[modes[0]]]

        ratios = {m: paired(m) for m in modes[1:]}
        for m in modes:
            s = sessions[m]
            rr = list(by[m].values())
            row = {**_base(cfg, s), "mode": "full (A/A control)" if m is modes[1] else m[0],
                   "pool": "-" if m[1] is None else m[1], "policy": "-" if m[1] is None else s.policy.name,
                   "prompt_tokens": len(trial.ids), "prefill_s": first[m]["prefill_s"],
                   "decode_tok_s": summarize(x["decode_tok_s"] for x in rr),
                   "kv_resident_mib": kv_resident_bytes(s) / MIB, "host_mib": s.stats["host_kv_mib"],
                   "answer": first[m]["answer"], "correct": "yes" if first[m]["correct"] else "no"}
            if m in ratios and ratios[m]:
                row["speed_ratio"] = f"{statistics.median(ratios[m]):.2f}x ({_spread(ratios[m])})"
            res.rows.append(row)
    kv, ctl = modes[2], modes[1]
    full_mib, kv_mib = res.rows[0]["kv_resident_mib"], res.rows[2]["kv_resident_mib"]
    rescores = [x["window_rescores"] for x in by[kv].values()]
    res.notes += [
        f"decode kvflash/full: {_verdict(ratios[kv], ratios[ctl])}",
        f"KV resident: kvflash {kv_mib:.1f} MiB = {kv_mib / full_mib:.3f} of the full cache's {full_mib:.1f} MiB "
        f"(the full cache is allocated at max_ctx = {D}; kvflash holds {pool} slots and pages the rest to host RAM)",
        f"the passkey is {trial.value} (needle at {trial.depth}% of the document); each decode window ({window} "
        f"tokens from the answer's end, greedy) holds {min(rescores)}-{max(rescores)} of the policy's rescores, "
        f"paid inside it",
        _split_note(cfg, [_first_haystack(cfg)]),
    ]
    return res
