"""Layers on RPC servers against one process: decode speed and the bytes on the wire (issue 22).

    python bench/rpc_split.py --model smollm2-135m --servers 2 --threads 2 --pool 512 --prompt-tokens 1024 \
        --steps 32 --rounds 7 --json bench/results/rpc-split/rpc.json

Starts --servers `kvflash rpc-server` processes on 127.0.0.1 (--threads each) and splits the model's layers
evenly over them (the embedding and the output head stay in this process), as `Session(rpc=[...])` does.

Speed: decode of --steps greedy tokens after a --prompt-tokens prompt (longer than the pool, so chunks are
paged out through the servers' pool slices), per mode, the modes interleaved round by round: `local` (one
process, ggml's attention: the identity test's reference), `local-again` (the same, an A/A control), `rpc`
(the split) and `local-pool` (one process with kvflash's own CPU attention kernel, the default path).  The
median per-step time of each round, then the median over rounds; ratios are taken per round.

Traffic: a second set of servers, each behind a byte-counting TCP relay (a child process), and the same
split: bytes client->server and server->client for the prompt, per decode step, per qk rescore (the core's
qk_peak_scores with the qk policy's defaults: it reads the resident chunks' keys of the scored layers
from the servers) and per page event (a recall: one page-out and one page-in of the remote slices).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
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


def _relay(listen_port: int, target_port: int, up, down, ready) -> None:
    """Forward 127.0.0.1:listen_port to 127.0.0.1:target_port, counting bytes each way."""
    import threading
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", listen_port))
    ls.listen(8)
    ready.set()

    def pump(a, b, ctr):
        while True:
            try:
                d = a.recv(1 << 20)
            except OSError:
                d = b""
            if not d:
                break
            with ctr.get_lock():
                ctr.value += len(d)
            b.sendall(d)
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    while True:
        c, _ = ls.accept()
        try:
            s = socket.create_connection(("127.0.0.1", target_port))
        except OSError:   # the server is not up yet: the client sees a closed connection and retries
            c.close()
            continue
        for x in (c, s):
            x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=pump, args=(c, s, up), daemon=True).start()
        threading.Thread(target=pump, args=(s, c, down), daemon=True).start()


def start_server(threads: int):
    from kvflash import _core
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvflash", "rpc-server", "--port", str(port), "--threads",
                             str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


def wait_up(ep: str) -> None:
    from kvflash import _core
    for _ in range(150):
        try:
            _core.rpc_device_memory(ep)
            return
        except RuntimeError:
            time.sleep(0.2)
    raise SystemExit(f"rpc-server at {ep} did not come up")


def decode(rt, prompt, steps):
    """Prompt (timed as a whole), then greedy steps timed one by one: (prefill s, [step s])."""
    rt.reset()
    t0 = time.perf_counter()
    lg = rt.eval(prompt)
    pre = time.perf_counter() - t0
    ts = []
    for _ in range(steps):
        tok = np.array([int(np.argmax(lg))], dtype=np.int32)
        t0 = time.perf_counter()
        lg = rt.eval(tok)
        ts.append(time.perf_counter() - t0)
    return pre, ts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="threads of this process and of each server")
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import kvflash
    from kvflash import _core
    path = str(kvflash.resolve_model(a.model))
    procs, relays = [], []
    try:
        direct, counted, ctrs = [], [], []
        for _ in range(a.servers):
            p, port = start_server(a.threads)
            procs.append(p)
            direct.append(f"127.0.0.1:{port}")
            p2, port2 = start_server(a.threads)
            procs.append(p2)
            up, down, ready = mp.Value("q", 0), mp.Value("q", 0), mp.Event()
            lp = free_port()
            r = mp.Process(target=_relay, args=(lp, port2, up, down, ready), daemon=True)
            r.start()
            relays.append(r)
            ready.wait(30)
            counted.append(f"127.0.0.1:{lp}")
            ctrs.append((up, down))
        for ep in direct + counted:
            wait_up(ep)
        local = _core.Model(path, n_threads=a.threads)
        remote = _core.Model(path, n_threads=a.threads, rpc=direct)
        hp = local.hparams
        prompt = np.random.default_rng(0).integers(100, min(hp["n_vocab"], 20000), a.prompt_tokens).astype(np.int32)
        max_ctx = (a.prompt_tokens + a.steps + 64 + 255) // 256 * 256
        kw = dict(max_ctx=max_ctx, pool_tokens=a.pool, capture_queries=40)
        rts = {"local": _core.Runtime(local, attn="ggml", **kw), "local-again": _core.Runtime(local, attn="ggml", **kw),
               "rpc": _core.Runtime(remote, **kw), "local-pool": _core.Runtime(local, attn="pool", **kw)}
        step_ms = {m: [] for m in rts}
        prefill_s = {m: [] for m in rts}
        tokens = {}
        for r in range(a.rounds):
            order = list(rts) if r % 2 == 0 else list(reversed(list(rts)))
            for m in order:
                pre, ts = decode(rts[m], prompt, a.steps)
                prefill_s[m].append(pre)
                step_ms[m].append(1e3 * statistics.median(ts))
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{m} {step_ms[m][-1]:.2f} ms" for m in rts), flush=True)
        med = {m: statistics.median(v) for m, v in step_ms.items()}
        ratio = lambda x, y: [p / q for p, q in zip(step_ms[x], step_ms[y])]   # noqa: E731
        # -- traffic through the counting relays
        counted_model = _core.Model(path, n_threads=a.threads, rpc=counted)
        rt = _core.Runtime(counted_model, **kw)

        def total():
            return sum(u.value for u, _ in ctrs), sum(d.value for _, d in ctrs)

        t0 = total()
        lg = rt.eval(prompt)
        t1 = total()
        for _ in range(4):   # warm: graphs built and allocated
            lg = rt.eval(np.array([int(np.argmax(lg))], dtype=np.int32))
        t2 = total()
        per_step = []
        for _ in range(a.steps):
            b0 = total()
            lg = rt.eval(np.array([int(np.argmax(lg))], dtype=np.int32))
            b1 = total()
            per_step.append((b1[0] - b0[0], b1[1] - b0[1]))
        t3 = total()
        n_chunks = (rt.n_past + 63) // 64
        scores = rt.qk_peak_scores(n_chunks, n_queries=8, contrast=32, spread=4,
                                   n_layers=_core.qk_auto_layers(rt.n_paged_layers), carry=16)
        t4 = total()
        tab = rt.pager.chunk_table()
        host = [c for c in range(n_chunks) if tab["block"][c] < 0 and tab["materialised"][c]][:8]
        for c in host:
            assert rt.pager.recall(c)
        t5 = total()
        remote_share = sum(rt.pager.layer_chunk_bytes) if hasattr(rt.pager, "layer_chunk_bytes") else None
        d = lambda x, y, n=1: ((y[0] - x[0]) / n, (y[1] - x[1]) / n)   # noqa: E731
        traffic = {"prefill": d(t0, t1), "per_decode_step": d(t2, t3, a.steps),
                   "per_decode_step_median": (statistics.median(u for u, _ in per_step),
                                              statistics.median(x for _, x in per_step)),
                   "decode_steps": per_step, "per_rescore": d(t3, t4),
                   "per_page_event": d(t4, t5, max(1, len(host))), "page_events": len(host)}
        res = {"model": os.path.basename(path), "servers": a.servers, "threads": a.threads, "pool": a.pool,
               "prompt_tokens": a.prompt_tokens, "steps": a.steps, "rounds": a.rounds,
               "split": [dict(r) for r in remote.remote_layers], "step_ms": step_ms, "prefill_s": prefill_s,
               "median_step_ms": med, "rpc_over_local": ratio("rpc", "local"),
               "aa_local_again_over_local": ratio("local-again", "local"), "traffic_bytes": traffic,
               "chunk_bytes_all_layers": rt.pager.chunk_bytes, "qk_layers": _core.qk_auto_layers(rt.n_paged_layers),
               "scores_finite": bool(np.isfinite(scores).all())}
        print(f"\n{os.path.basename(path)}, layers split {[(r['first'], r['last']) for r in remote.remote_layers]} over "
              f"{a.servers} loopback servers ({a.threads} threads each; client {a.threads}), pool {a.pool}, prompt "
              f"{a.prompt_tokens} tokens, {a.steps} decode steps x {a.rounds} rounds, interleaved\n")
        print("| mode | ms per decode step (median of round medians) | tok/s | min-max | prefill s (median) |")
        print("|---|---:|---:|---:|---:|")
        for m, v in step_ms.items():
            print(f"| {m} | {med[m]:.2f} | {1e3 / med[m]:.1f} | {min(v):.2f}-{max(v):.2f} | "
                  f"{statistics.median(prefill_s[m]):.2f} |")
        rr, aa = ratio("rpc", "local"), ratio("local-again", "local")
        print(f"\nrpc / local step time: {statistics.median(rr):.2f}x (per round {min(rr):.2f}-{max(rr):.2f}); "
              f"A/A local-again / local: {statistics.median(aa):.2f}x ({min(aa):.2f}-{max(aa):.2f})")
        print("\n| traffic (all servers) | client -> servers | servers -> client |\n|---|---:|---:|")
        for k in ("prefill", "per_decode_step", "per_decode_step_median", "per_rescore", "per_page_event"):
            u, dn = traffic[k]
            print(f"| {k} | {u / 1024:.1f} KiB | {dn / 1024:.1f} KiB |")
        print(f"\n(page events: {len(host)} recalls; one chunk of every paged layer is "
              f"{rt.pager.chunk_bytes / 1024:.1f} KiB; qk scoring reads {res['qk_layers']} layer(s))")
        if a.json:
            os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        del rt, rts, counted_model, remote   # remote buffers freed while the servers answer
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for r in relays:
            r.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
