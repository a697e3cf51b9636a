#!/usr/bin/env python
"""Soak: a long decode with constant eviction, checked for leaks and for paging faults.

One Session (pool 512, qk policy by default) prefills a prompt, then decodes --steps
greedy tokens; whenever the context reaches --cycle tokens it is truncated back to the
prompt (Session.truncate), so the pool evicts and recalls for the whole run and the host
store is refilled every cycle.  Every --check steps: the pager's invariants
(Pager.check_invariants) and the process's RSS (VmRSS).  Every --hash-every steps (and
at each check) every resident sealed chunk is hashed (blake2b of its raw K and V rows in
every paged layer, read from the pool): the first hash of a chunk is its reference, and
every later one must equal it.  A chunk resident again after a page-out (it has a host
copy) is a recalled one: its bytes must be exactly what was paged out.  Truncation drops
the references of the chunks it cut, and of the one whose last kept token is read again.

RSS growth is measured from the end of warm-up (--warmup steps: every buffer, graph and
host region has been made once) to the end; the run passes when it is under --max-growth
percent, no invariant broke and no hash differed.  It measures memory and correctness, not
speed: wall time is reported only to say how long it ran.

Usage: python bench/soak.py [--model smollm2-135m] [--steps 20000] [--threads 1] [--out DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import sys
import time

import numpy as np


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def chunk_hash(pager, block: int, C: int) -> str:
    h = hashlib.blake2b(digest_size=16)
    for layer in range(pager.n_layers):
        for rows in (pager.k_rows(layer), pager.v_rows(layer)):
            h.update(rows[block * C:(block + 1) * C].tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--policy", default="qk")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (kept across cycles)")
    ap.add_argument("--cycle", type=int, default=3072, help="truncate back to the prompt at this many tokens")
    ap.add_argument("--check", type=int, default=1000, help="steps between invariant and RSS checks")
    ap.add_argument("--hash-every", type=int, default=50, help="steps between chunk-hash checks")
    ap.add_argument("--warmup", type=int, default=4000, help="steps before the RSS baseline")
    ap.add_argument("--max-growth", type=float, default=1.0, help="percent RSS growth allowed after warm-up")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--host", default="ram", choices=("ram", "file"))
    ap.add_argument("--out", help="directory for soak.json and soak.md")
    a = ap.parse_args(argv)

    import kvflash
    host_path = None
    if a.host == "file":
        import tempfile
        host_path = os.path.join(tempfile.mkdtemp(prefix="kvflash-soak-"), "store.bin")
    s = kvflash.Session(a.model, max_ctx=a.cycle + 256, kvflash=a.pool, policy=a.policy, threads=a.threads,
                        verbose=False, host=a.host, host_path=host_path)
    C = s.chunk_tokens
    rng = np.random.default_rng(0)
    vocab = min(s.tokenizer.n_vocab, s.hparams["n_vocab"])
    prompt = [int(t) for t in rng.integers(100, vocab, a.prompt)]
    s.prefill(prompt)

    refs: dict[int, str] = {}
    stats = dict(hash_checks=0, recalled_checks=0, hash_mismatches=0, invariant_checks=0, truncations=0)
    rows, t0, done = [], time.perf_counter(), 0
    baseline = None

    def hashes(step):
        table = s.pager.chunk_table()
        sealed = s.n_past // C
        for c in range(sealed):
            b = int(table["block"][c])
            if b < 0:
                continue
            hsh = chunk_hash(s.pager, b, C)
            if c not in refs:
                refs[c] = hsh
                continue
            stats["hash_checks"] += 1
            stats["recalled_checks"] += int(table["host"][c] >= 0)
            if refs[c] != hsh:
                stats["hash_mismatches"] += 1
                print(f"step {step}: chunk {c} bytes differ from its first reading", file=sys.stderr)

    def check(step):
        nonlocal baseline
        s.pager.check_invariants()
        stats["invariant_checks"] += 1
        hashes(step)
        r = rss_bytes()
        if step >= a.warmup and baseline is None:
            baseline = r
        p = s.pager.stats
        rows.append(dict(step=step, n_past=s.n_past, rss_mib=r / 2**20, page_outs=p["page_outs"],
                         page_ins=p["page_ins"], host_mib=p["host_bytes"] / 2**20,
                         host_reserved_mib=p["host_reserved_bytes"] / 2**20, rescores=s.stats["rescores"]))
        print(f"step {step:6d}  n_past {s.n_past:5d}  rss {r / 2**20:8.1f} MiB  page_outs {p['page_outs']:7d}  "
              f"page_ins {p['page_ins']:7d}  host {p['host_bytes'] / 2**20:6.1f} MiB  hash checks "
              f"{stats['hash_checks']} (recalled {stats['recalled_checks']})", file=sys.stderr, flush=True)

    check(0)
    while done < a.steps:
        room = a.cycle - s.n_past
        if room <= 0:
            s.truncate(a.prompt)
            for c in [c for c in refs if c >= (a.prompt - 1) // C]:  # the last kept token is read again
                del refs[c]
            stats["truncations"] += 1
            continue
        n = min(room, a.hash_every - done % a.hash_every, a.check - done % a.check, a.steps - done)
        for _ in s.generate(max_tokens=n, ignore_eos=True):
            pass
        got = s.n_past - (a.cycle - room)
        if got <= 0:
            raise RuntimeError(f"generate stopped without a token ({s.finish_reason})")
        done += got
        if done % a.check == 0 or done >= a.steps:
            check(done)
        elif done % a.hash_every == 0:
            hashes(done)
    wall = time.perf_counter() - t0

    end = rows[-1]["rss_mib"] * 2**20
    growth = 100.0 * (end - baseline) / baseline if baseline else float("nan")
    ok = growth < a.max_growth and stats["hash_mismatches"] == 0
    result = dict(command="python " + " ".join(shlex.quote(x) for x in sys.argv), model=a.model, steps=done,
                  pool=a.pool, policy=a.policy, prompt=a.prompt, cycle=a.cycle, threads=a.threads, host=a.host,
                  warmup=a.warmup, rss_baseline_mib=baseline / 2**20 if baseline else None, rss_end_mib=end / 2**20,
                  rss_max_after_warmup_mib=max(r["rss_mib"] for r in rows if r["step"] >= a.warmup),
                  rss_growth_pct=growth, max_growth_pct=a.max_growth, wall_s=wall, ok=ok,
                  machine=dict(platform=platform.platform(), python=platform.python_version(),
                               cpus=len(os.sched_getaffinity(0)), kvflash=kvflash.__version__),
                  final=dict(s.pager.stats), **stats, rows=rows)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1, default=str))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "soak.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.join(a.out, "soak.md"), "w") as f:
            f.write(_markdown(result))
    return 0 if ok else 1


def _markdown(r) -> str:
    lines = [f"# Soak: {r['steps']} decode steps, pool {r['pool']}, {r['policy']}, {r['model']}", "",
             f"Command: `{r['command']}`", "",
             f"Machine: {r['machine']['platform']}, Python {r['machine']['python']}, {r['machine']['cpus']} usable "
             f"CPU(s), kvflash {r['machine']['kvflash']}, {r['threads']} thread(s); wall {r['wall_s']:.0f} s "
             f"(not a speed measurement).", "",
             f"- RSS after warm-up ({r['warmup']} steps): {r['rss_baseline_mib']:.1f} MiB; at the end "
             f"{r['rss_end_mib']:.1f} MiB; max after warm-up {r['rss_max_after_warmup_mib']:.1f} MiB: "
             f"**growth {r['rss_growth_pct']:+.3f}%** (limit {r['max_growth_pct']}%)",
             f"- pager invariants checked {r['invariant_checks']} times: all held",
             f"- chunk hashes compared: {r['hash_checks']} (of chunks recalled after a page-out: "
             f"{r['recalled_checks']}); mismatches: **{r['hash_mismatches']}**",
             f"- context cycled {r['truncations']} times ({r['prompt']} → {r['cycle']} tokens); page-outs "
             f"{r['final']['page_outs']}, page-ins {r['final']['page_ins']}, clean skips {r['final']['clean_skips']}",
             f"- verdict: **{'pass' if r['ok'] else 'FAIL'}**", "",
             "| step | n_past | RSS MiB | page-outs | page-ins | host MiB | host reserved MiB | rescores |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append(f"| {x['step']} | {x['n_past']} | {x['rss_mib']:.1f} | {x['page_outs']} | {x['page_ins']} | "
                     f"{x['host_mib']:.2f} | {x['host_reserved_mib']:.2f} | {x['rescores']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
