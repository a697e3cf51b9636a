"""Where does the pooled prefill lose multi-key retrieval?  A probe on TUNING data only (issue 40).

Per RULER-style trial (the ruler routine's builder, tuning split) the full cache answers, then each mode
prefills the same prompt into a pooled session, settles it as `Session.prefill` does (the qk rescore, the
tail re-read) and answers greedily.  Beside the answer's score, each mode's log-probability of the expected
value (teacher-forced over the pool, the continuous signal a handful of trials needs) and whether the chunks
holding every needle sentence were resident.

Modes (comma list, `--modes`):
  full        the full cache
  pool        the pooled prefill as a session makes it, then the settle (the baseline)
  pool:rN     the same, the settle re-reading the prompt's last N tokens instead of reeval_tokens' 64
  pool:sN     the pooled prefill with N sink chunks (the prompt's first N chunks never leave the pool)
  pool:pN     Session(prefill_rescore=N): the core rescores every N pooled pieces while it reads the prompt
  pool:xN     (the Python prototype of pool:p1) the pooled prefill read N tokens at a time, each piece followed by a qk rescore (its own last
              queries choose the residents the next piece attends; one token re-read), then the settle
  pool:nM     the pooled prefill with exact prefill switched on only for the target needle sentences' chunks
              and M tokens either side (is it the needle's own K/V the pooled prefill loses?)
  pool:aM     the same for every inserted sentence, the distractor keys' needles included
  pool:cM     two prefills: a pooled one and its settle choose the resident chunks; then the prompt is read again
              with exact prefill switched on only for those chunks (+-M tokens): an upper bound on re-reading the
              chosen chunks exactly after the settle (costs a second prefill; quality probe only)
  exact       exact prefill (every position attended, the host store read in place)
  reread      the pooled prefill as `pool`, then the settle with Session(prefill_reread=True): the chosen chunks
              the pooled pieces wrote are read again in place over the whole context (Runtime.reread), before
              the tail's re-read -- the in-place form of pool:c0 (one prefill, not two)

    python bench/prefill_diag.py --task multikey --context 4096 --residency 16 --trials 0,1,2,3 \
        --modes full,pool,pool:r256,pool:s4,exact --out DIR

Tuning data only: the split is fixed to `tuning`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np


def _exact_segments(s, ids: list, ranges: list, reread: int) -> None:
    """The pooled prefill with exact prefill switched on for the token ranges given (merged, clipped), the
    rest pooled under LRU, then the qk settle over the whole prompt."""
    from kvflash.policies import LRUPolicy
    from kvflash.scoring import QKPolicy
    merged: list = []
    for lo, hi in sorted((max(0, lo), min(len(ids) - 1, hi)) for lo, hi in ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        elif lo < hi:
            merged.append([lo, hi])
    cuts, at = [], 0
    for lo, hi in merged:
        cuts += [(at, lo, False), (lo, hi, True)]
        at = hi
    cuts.append((at, len(ids), False))
    s.reeval_tokens = reread
    s.policy = LRUPolicy()
    for lo, hi, exact in cuts:
        if hi <= lo:
            continue
        s.exact_prefill = exact
        s._configure_core()
        s.prefill(ids[lo:hi])
    s.exact_prefill = False
    s._configure_core()
    s.policy = QKPolicy()
    s._settle_prompt(ids)
    print(f"  exact for {sum(hi - lo for lo, hi in merged)} of {len(ids)} tokens in {len(merged)} ranges", flush=True)


def _logp_value(s, ids_value: list, first_logits: np.ndarray) -> float:
    """log p of the value's tokens given the prompt, teacher-forced (the runtime's eval over the pool)."""
    def lsm(x):
        x = x.astype(np.float64)
        m = x.max()
        return x - m - np.log(np.exp(x - m).sum())
    lp = float(lsm(first_logits)[ids_value[0]])
    if len(ids_value) > 1:
        rows = s.runtime.eval(np.asarray(ids_value[:-1], dtype=np.int32), True, False, False, None)
        for j, t in enumerate(ids_value[1:]):
            lp += float(lsm(rows[j])[t])
    return lp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--task", default="multikey")
    ap.add_argument("--haystacks", default="filler,ledger")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--residency", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=16)
    ap.add_argument("--prefill-piece", type=int, default=64)
    ap.add_argument("--trials", default="0,1,2,3")
    ap.add_argument("--modes", default="full,pool,pool:r256,exact")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import kvflash
    from kvflash.bench.routines._shared import passkey_chunks
    from kvflash.bench.routines.ruler import _answer as answer
    from kvflash.bench.ruler import RulerBuilder, score
    from kvflash.policies import LRUPolicy
    from kvflash.scoring import QKPolicy

    os.makedirs(a.out, exist_ok=True)
    D, pool = a.context, a.context // a.residency
    modes = a.modes.split(",")
    common = dict(max_ctx=D, threads=a.threads, seed=a.seed, verbose=False, chunk_tokens=a.chunk_tokens)
    full = kvflash.Session(a.model, kvflash=None, **common)
    sessions: dict = {}

    def pooled(sink: int, exact: bool, every: int):
        key = (sink, exact, every)
        if key not in sessions:
            sessions[key] = kvflash.Session(a.model, **common, kvflash=pool, policy=QKPolicy(), sink_chunks=sink,
                                            prefill_piece=a.prefill_piece, exact_prefill=exact,
                                            prefill_rescore=every)
        return sessions[key]

    builder = RulerBuilder(full, a.seed, split="tuning")
    tmp = tempfile.mkdtemp(prefix="kvflash-pdiag-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    snap = os.path.join(tmp, "settled.kvfs")
    log = open(os.path.join(a.out, "trials.jsonl"), "a")
    for hay in a.haystacks.split(","):
        for i in (int(x) for x in a.trials.split(",")):
            tr = builder.trial(a.task, hay, i, D - 64)
            value_ids = full.tokenize(" " + tr.values[0], add_special=False)
            rec = {"task": a.task, "haystack": hay, "trial": i, "context": D, "pool": pool, "values": tr.values,
                   "prompt_tokens": len(tr.ids), "modes": {}}
            for mode in modes:
                parts = mode.split(":")
                if parts[0] == "full":
                    s = full
                else:
                    opt = {p[0]: int(p[1:]) for p in parts[1:]}
                    s = pooled(opt.get("s", 1), parts[0] == "exact", opt.get("p", 0))
                s.prefill_reread = parts[0] == "reread"
                if s is not full:
                    s._configure_core()
                s.reset()
                t0 = time.perf_counter()
                if s is full:
                    s.prefill(tr.ids)
                elif "p" in opt:   # the prefill depends on the policy: read under qk, its settle included
                    s.reeval_tokens = opt.get("r", 64)
                    s.policy = QKPolicy()
                    s.prefill(tr.ids)
                elif "n" in opt or "a" in opt or "c" in opt:
                    C = s.chunk_tokens
                    if "n" in opt or "a" in opt:   # the target needle's sentences, or every inserted one
                        m = opt.get("n", opt.get("a"))
                        spans = [passkey_chunks(s, tr.ids, x) for x in (tr.needles if "n" in opt else tr.inserted)]
                        ranges = [(min(cs) * C - m, (max(cs) + 1) * C + m) for cs in spans if cs]
                    else:   # the chunks a first pooled prefill's settle chose, read exactly in a second prefill
                        s.reeval_tokens = opt.get("r", 64)
                        s.policy = LRUPolicy()
                        s.prefill(tr.ids)
                        s.policy = QKPolicy()
                        s._settle_prompt(tr.ids)
                        table = s.pager.chunk_table()
                        m = opt["c"]
                        tail = len(tr.ids) - s.reeval_tokens - 4 * C
                        ranges = [(c * C - m, (c + 1) * C + m) for c in range(len(table["block"]))
                                  if table["block"][c] >= 0 and 1 <= c and (c + 1) * C <= tail]
                        s.reset()
                    _exact_segments(s, tr.ids, ranges, opt.get("r", 64))
                elif "x" in opt:
                    # piece by piece under qk, each piece's settle rescoring and re-reading one token
                    s.policy = QKPolicy()
                    s.reeval_tokens = 1
                    s._configure_core()
                    K = opt["x"]
                    for j in range(0, len(tr.ids), K):
                        s.prefill(tr.ids[j:j + K])
                    s.reeval_tokens = opt.get("r", 64)
                    s._configure_core()
                    s._settle_prompt(tr.ids)
                else:
                    s.reeval_tokens = opt.get("r", 64)
                    # the pooled prefill under LRU, then the qk settle (as the ruler routine shares one prefill);
                    # reread: the sliding layers' rows kept while it reads, for the settle's re-read
                    s.policy = LRUPolicy()
                    if s.prefill_reread:
                        s.runtime.keep_swa_history(True)
                    s.prefill(tr.ids)
                    s.policy = QKPolicy()
                    s._settle_prompt(tr.ids)
                    s.runtime.keep_swa_history(False)
                pre = time.perf_counter() - t0
                kept = None
                if s is not full:
                    table = s.pager.chunk_table()
                    kept = all(bool(table["block"][c] >= 0) for x in tr.needles for c in passkey_chunks(s, tr.ids, x))
                s.save(snap)
                ans, _ = answer(s, tr.answer_tokens)
                pol = s.policy
                s.restore(snap)
                s.policy = pol
                lp = _logp_value(s, value_ids, s.logits())
                rec["modes"][mode] = {"answer": ans, "score": score(ans, tr.values), "logp": lp, "kept": kept,
                                      "prefill_s": pre}
                print(f"{hay} #{i} {mode:>10}: score {score(ans, tr.values):.2f} logp {lp:8.3f} kept {kept} "
                      f"{pre:6.1f}s  {ans[:40]!r}", flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
    os.remove(snap)
    os.rmdir(tmp)
    summarize(os.path.join(a.out, "trials.jsonl"))


def summarize(path: str) -> None:
    recs = [json.loads(x) for x in open(path) if x.strip()]
    modes = list(dict.fromkeys(m for r in recs for m in r["modes"]))
    print(f"\n{len(recs)} trials (TUNING split)")
    print("| mode | score | mean logp of the value | mean logp - full's | kept | prefill s (median) |")
    print("|---|---|---|---|---|---|")
    for m in modes:
        rs = [r for r in recs if m in r["modes"] and "full" in r["modes"]]
        if not rs:
            continue
        sc = statistics.mean(r["modes"][m]["score"] for r in rs)
        lp = statistics.mean(r["modes"][m]["logp"] for r in rs)
        d = statistics.mean(r["modes"][m]["logp"] - r["modes"]["full"]["logp"] for r in rs)
        ks = [r["modes"][m]["kept"] for r in rs if r["modes"][m]["kept"] is not None]
        pre = statistics.median(r["modes"][m]["prefill_s"] for r in rs)
        print(f"| {m} | {sc:.2f} ({len(rs)}) | {lp:.2f} | {d:+.2f} | {sum(ks)}/{len(ks) if ks else '-'} | {pre:.1f} |")


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 3 and sys.argv[1] == "--summary":
        summarize(sys.argv[2])
    else:
        main()
