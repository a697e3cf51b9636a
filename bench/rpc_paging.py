"""Page events through a ggml RPC server on loopback against the same pool in local memory (issue 22).

    python bench/rpc_paging.py --layers 30 --n-embd-k 192 --kv-type q8_0 --chunk-tokens 64 --events 200 \
        --rounds 5 --json bench/results/rpc-paging/rpc.json

Starts `kvflash rpc-server` on 127.0.0.1 (one thread), builds two pagers of the same geometry (SmolLM2-135M's
by default: 30 paged layers, 3 KV heads of 64, q8_0), one with every layer's pool slice in local memory and
one with every slice on the server, fills both past the pool so chunks live in the host store, then times
--events page events (an evict, then a recall into the freed block: one page-out and one page-in) per round,
the two pagers alternating round by round.  Reports the bytes each event moves per device (the remote slices'
share crosses the wire twice: out and in) and the median time per event.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--n-embd-k", type=int, default=192)
    ap.add_argument("--kv-type", default="q8_0")
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from kvflash import Pager, _core
    port = free_port()
    ep = f"127.0.0.1:{port}"
    srv = subprocess.Popen([sys.executable, "-m", "kvflash", "rpc-server", "--port", str(port), "--threads", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(150):
            try:
                _core.rpc_device_memory(ep)
                break
            except RuntimeError:
                time.sleep(0.2)
        C = a.chunk_tokens
        max_ctx = 4 * a.pool
        pagers = {}
        for name, eps in (("local", None), ("rpc", [ep] * a.layers)):
            p = Pager(pool_tokens=a.pool, max_ctx=max_ctx, n_layers=a.layers, n_embd_k=a.n_embd_k, kv_type=a.kv_type,
                      chunk_tokens=C, layer_endpoints=eps)
            for pos0 in range(0, max_ctx, C):
                assert p.alloc_span(pos0, C) is not None
            pagers[name] = p
        chunk_bytes = pagers["local"].chunk_bytes
        rng = np.random.default_rng(0)
        times = {n: [] for n in pagers}
        for r in range(a.rounds):
            order = list(pagers) if r % 2 == 0 else list(reversed(list(pagers)))
            for name in order:
                p = pagers[name]
                t = p.chunk_table()
                host = [int(c) for c in np.flatnonzero(np.asarray(t["block"]) < 0) if t["materialised"][c]]
                picks = rng.choice(host, size=min(a.events, len(host)), replace=False)
                t0 = time.perf_counter()
                for c in picks:
                    assert p.recall(int(c))   # a page-in, after the LRU victim's page-out
                times[name].append((time.perf_counter() - t0) / len(picks))
        res = {"endpoint": ep, "layers": a.layers, "n_embd_k": a.n_embd_k, "kv_type": a.kv_type, "chunk_tokens": C,
               "pool": a.pool, "events_per_round": a.events, "rounds": a.rounds, "chunk_bytes": chunk_bytes,
               "wire_bytes_per_event": 2 * chunk_bytes,
               "ms_per_event": {n: [1e3 * x for x in v] for n, v in times.items()}}
        med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        print(f"page events (recall = page-out of an LRU victim + page-in), {a.layers} layers x {a.n_embd_k} {a.kv_type}, "
              f"chunk {C} tokens = {chunk_bytes / 1024:.1f} KiB, {a.events} events x {a.rounds} rounds, alternating\n")
        print("| pool slices | ms per event (median of rounds) | min-max | MB/s moved (out + in) | bytes on the wire per event |")
        print("|---|---:|---:|---:|---:|")
        for n, v in times.items():
            ms = [1e3 * x for x in v]
            print(f"| {n} | {med[n]:.3f} | {min(ms):.3f}-{max(ms):.3f} | {2 * chunk_bytes / (med[n] / 1e3) / 1e6:.0f} | "
                  f"{2 * chunk_bytes if n == 'rpc' else 0} |")
        print(f"\nrpc / local time per event: {med['rpc'] / med['local']:.1f}x")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        del pagers, p   # their remote buffers are freed while the server still answers
    finally:
        # (ggml's client aborts the process when a server it holds buffers on is gone: free them first)
        srv.kill()
        srv.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
