"""Oracle residency for one needle trial: does the model answer when we choose the resident chunks?

Prefills one needle prompt (the bench's trial i) through a pooled session under LRU, then for each
requested set of chunks: repages the pool to keep them (plus the sink and tail window), re-reads the
prompt's last 64 tokens against those residents, and answers greedily.  This separates "the policy
picked the wrong chunks" from "the model cannot answer from this little context".

    python bench/needle_oracle.py --context 4096 --pool 512 --trial 0 --keep "6;5,6;6,7;"
    (each ';'-separated entry is one comma list of chunks; the empty entry keeps nothing extra)
"""
from __future__ import annotations

import argparse

import numpy as np

import kvflash
from kvflash.bench.needle import NeedleBuilder, score


class Keep:
    name = "oracle"

    def __init__(self, chunks):
        self.chunks = chunks

    def score(self, view):
        x = np.arange(view.n_chunks, dtype=np.float32) / 1e3   # otherwise: the most recent
        x[list(self.chunks)] = 10.0
        return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--trial", type=int, default=0)
    ap.add_argument("--keep", default="", help="';'-separated chunk lists, e.g. '6;5,6'")
    ap.add_argument("--split", default="tuning", help="needle split (tuning, tuning-indirect, reporting)")
    ap.add_argument("--haystack", default="prose", help="haystack (prose; ledger for the reporting split)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    s = kvflash.Session(a.model, max_ctx=a.context, kvflash=a.pool, policy="lru", threads=a.threads,
                        verbose=False, seed=1234)
    # the needle routine's prompt for this trial (it reserves answer_tokens + 1 = 13 tokens)
    tr = NeedleBuilder(s, 1234, split=a.split, haystack=a.haystack).trial(a.trial, a.context - 13, [10, 50, 90])
    ids = tr.ids
    data, ends = s.tokenizer.bytes_of(ids, skip_special=True)
    at = int(np.searchsorted(ends, data.find(tr.value.encode()), side="right"))
    print(f"trial {a.trial}: depth {tr.depth}%, {len(ids)} tokens, passkey {tr.value} at token {at} "
          f"(chunk {at // 64})")
    s.prefill(ids)
    for entry in a.keep.split(";"):
        keep = [int(c) for c in entry.split(",") if c.strip()]
        s.policy = Keep(keep)
        s.rescore()
        k = 64
        s.runtime.truncate(len(ids) - k)
        s.runtime.eval_sample(np.asarray(ids[-k:], dtype=np.int32))   # the tail read again; the core keeps its logits
        ans = "".join(s.generate(None, max_tokens=12, temperature=0.0, stop=["\n"]))
        res = np.where(s.pager.chunk_table()["block"] >= 0)[0].tolist()
        print(f"keep {keep or '-'}: resident {res} -> {ans!r} {'ok' if score(ans, tr.value) else 'miss'}")
        s.runtime.truncate(len(ids))   # the history follows the cache


if __name__ == "__main__":
    main()
