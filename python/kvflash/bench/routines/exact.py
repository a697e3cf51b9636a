"""Exact mode against the full cache: the same greedy tokens, and decode tok/s (issue 19)."""
from __future__ import annotations

import statistics
import time

from ..common import BenchConfig, Progress, ctx_label, open_session, text_tokens, token_hash
from ..report import Result
from ._shared import BASE_COLS, _base, _long_note, _spread, _verdict

SUFFIX = 64   # each prompt's own tokens after the shared context


def _first_difference(a: list, b: list) -> int:
    """Index of the first token where a and b differ (-1: none, over the shorter length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1)


def run_exact(cfg: BenchConfig) -> Result:
    """Per context: one full-cache session and one exact-mode session (pool --pool, policy --policy)
    prefill the same shared context once; then each of --prompts prompts (the shared context plus 64
    tokens of its own) is answered greedily with --gen-tokens tokens in both, and once more by the
    full cache as an A/A control, the three in an order rotated per prompt.  The exact session's
    tokens must equal the full cache's; decode tok/s is timed over the generate() call alone (its
    rescoring and verification included), ratios per prompt (paired) against the control's."""
    # Long on purpose: the timing loop, then one row per mode and context, as run_decode.
    n_gen, n_prompts = cfg.exact_tokens, cfg.exact_prompts
    pool = cfg.pools[0]
    res = Result("exact", f"exact mode vs the full cache: greedy tokens over {n_gen} tokens per prompt, and decode "
                 f"tok/s through generate() (median ± spread over {n_prompts} prompts, modes interleaved, an A/A "
                 f"control: the full cache once more)",
                 BASE_COLS + [("mode", "mode"), ("pool", "pool"), ("policy", "policy"), ("context", "context"),
                              ("identical", "tokens = full cache"), ("decode_tok_s", "decode tok/s"),
                              ("speed_ratio", "vs full per prompt (median, min-max)"),
                              ("acceptance", "drafts kept"), ("kept_per_round", "kept per round"),
                              ("verify_share", "verify % of decode"), ("prefill_s", "prefill s")])
    with Progress(len(cfg.contexts) * (2 + 3 * n_prompts), "exact", cfg.quiet) as pb:
        for D in cfg.contexts:
            shared = D - SUFFIX
            max_ctx = D + n_gen + 64
            full = open_session(cfg, max_ctx=max_ctx, pool=None)
            ex = open_session(cfg, max_ctx=max_ctx, pool=pool, policy=cfg.policy, exact=True,
                              exact_draft=cfg.exact_draft)
            toks = text_tokens(full, shared + SUFFIX * n_prompts).tolist()
            prefill_s = {}
            for name, s in (("full", full), ("exact", ex)):
                pb.note(f"{ctx_label(D)} {name}: prefill {shared}")
                t0 = time.perf_counter()
                # The last shared token on its own: truncate(shared) reads it again alone (one-token
                # arithmetic) before every later prompt, so the first prompt starts from those bits too
                # (from the batch's, Gemma-3's full cache parted from itself: the A/A control at 15/16).
                s.prefill(toks[:shared - 1])
                s.prefill(toks[shared - 1:shared])
                prefill_s[name] = time.perf_counter() - t0
                pb.advance(1)
            raw = []
            for i in range(n_prompts):
                suffix = toks[shared + i * SUFFIX:shared + (i + 1) * SUFFIX]
                order = [("full", full), ("exact", ex), ("control", full)]
                k = i % 3
                for name, s in order[k:] + order[:k]:
                    s.truncate(shared)
                    s.prefill(suffix)
                    st0 = s.stats
                    t0 = time.perf_counter()
                    for _ in s.generate(None, max_tokens=n_gen, temperature=0.0, ignore_eos=True):
                        pass
                    dt = time.perf_counter() - t0
                    st = s.stats
                    row = {**_base(cfg, s), "mode": name, "context": D, "prompt": i, "seconds": dt,
                           "tok_s": n_gen / dt, "tokens": list(s.tokens[D:])}
                    if name == "exact":
                        row.update({k2: st[k2] - st0[k2] for k2 in ("exact_rounds", "exact_drafted", "exact_kept")})
                        row["rescores"] = st["rescores"] - st0["rescores"]
                    raw.append(row)
                    pb.advance(1, note=f"{ctx_label(D)} prompt {i} {name} {n_gen / dt:.1f} tok/s")
            by = {(r["mode"], r["prompt"]): r for r in raw}
            same, firsts = 0, []
            for i in range(n_prompts):
                d = _first_difference(by[("exact", i)]["tokens"], by[("full", i)]["tokens"])
                same += d < 0
                if d >= 0:
                    firsts.append(f"prompt {i} at token {d}")
            ctl_firsts = [f"prompt {i} at token {d}" for i in range(n_prompts)
                          if (d := _first_difference(by[("control", i)]["tokens"], by[("full", i)]["tokens"])) >= 0]
            ctl_same = n_prompts - len(ctl_firsts)
            ratios = {m: [by[(m, i)]["tok_s"] / by[("full", i)]["tok_s"] for i in range(n_prompts)]
                      for m in ("exact", "control")}
            for m in ("full", "exact", "control"):
                rr = [by[(m, i)] for i in range(n_prompts)]
                tok = {"median": statistics.median(r["tok_s"] for r in rr), "min": min(r["tok_s"] for r in rr),
                       "max": max(r["tok_s"] for r in rr), "n": len(rr)}
                row = {**_base(cfg, full), "mode": "full (A/A control)" if m == "control" else m,
                       "pool": pool if m == "exact" else "-", "policy": ex.policy.name if m == "exact" else "-",
                       "context": D, "decode_tok_s": tok,
                       "prefill_s": f"{prefill_s[m]:.1f}" if m in prefill_s else "-"}
                if m == "exact":
                    dr, kp, rd = (sum(r[k2] for r in rr) for k2 in ("exact_drafted", "exact_kept", "exact_rounds"))
                    ver = sum(r["seconds"] for r in rr)
                    row.update(identical=f"{same}/{n_prompts}", acceptance=f"{kp}/{dr} ({100 * kp / max(dr, 1):.0f}%)",
                               kept_per_round=f"{kp / max(rd, 1):.2f}",
                               verify_share=f"{100 * ex.stats['verify_share']:.0f}%" if ver else None)
                elif m == "control":
                    row["identical"] = f"{ctl_same}/{n_prompts}"
                if m != "full":
                    row["speed_ratio"] = f"{statistics.median(ratios[m]):.2f}x ({_spread(ratios[m])})"
                res.rows.append(row)
            res.raw += [{k2: v for k2, v in r.items() if k2 != "tokens"} |
                        {"n_tokens": len(r["tokens"]), "tokens_sha256": token_hash(r["tokens"])} for r in raw]
            res.notes.append(f"{ctx_label(D)}: exact/full " + _verdict(ratios["exact"], ratios["control"]))
            if firsts:
                res.notes.append(f"{ctx_label(D)}: exact tokens differ from the full cache's: " + "; ".join(firsts))
            if ctl_firsts:
                res.notes.append(f"{ctx_label(D)}: the control's tokens differ from the full cache's (the same session "
                                 f"run again): " + "; ".join(ctl_firsts))
            if (n := _long_note(cfg, max_ctx)):
                res.notes.append(n)
            del full, ex
    res.notes.append(f"each prompt: a shared context of (context - {SUFFIX}) tokens of natural text, prefilled once "
                     f"per session, then {SUFFIX} tokens of its own (the session truncated back to the shared "
                     f"context between prompts); greedy, ignore_eos, {n_gen} tokens; tok/s over generate() alone")
    res.notes.append("verify % of decode: the exact session's time in verification passes over its whole decode "
                     "time in this run")
    return res

