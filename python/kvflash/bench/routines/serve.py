"""kvflash serve over HTTP: streaming decode against in-process generate(), and concurrent clients."""
from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..common import BenchConfig, Progress, ctx_label, open_session, summarize, text_tokens
from ..report import Result
from ._shared import BASE_COLS, _base, _long_note, _spread, _verdict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`kvflash serve` in a child process on a free loopback port, up once /health answers."""

    def __init__(self, model: str, args: list, timeout: float = 300.0, *, scheme: str = "http", verify=True,
                 env: Optional[dict] = None):
        import httpx
        self.port = _free_port()
        self.base = f"{scheme}://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvflash-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kvflash", "serve", model, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env=None if env is None else {**os.environ, **env})
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvflash serve exited ({self.proc.returncode}): {self.output()[-2000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2, verify=verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"kvflash serve did not come up in {timeout:.0f}s: {self.output()[-2000:]}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def stream_completion(client, base: str, ids: list, max_tokens: int) -> dict:
    """One streaming greedy completion of token ids; arrival times of its events, its text and usage.
    Raises RuntimeError on an HTTP error or an error event."""
    body = {"prompt": [int(t) for t in ids], "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t_send = time.perf_counter()
    t_first = t_end = None
    texts, usage, reason = [], None, None
    with client.stream("POST", base + "/v1/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"error event: {ev['error'].get('message')}")
            ch = ev["choices"][0]
            if ch.get("text"):
                t_first = t_first or time.perf_counter()
                texts.append(ch["text"])
            if ch.get("finish_reason"):
                reason = ch["finish_reason"]
                t_end = time.perf_counter()
            if ev.get("usage"):
                usage = ev["usage"]
    if t_end is None:
        raise RuntimeError("the stream ended without a finish reason")
    return {"t_send": t_send, "t_first": t_first, "t_end": t_end, "text": "".join(texts), "usage": usage,
            "reason": reason}


def _inprocess(s, ids: list, max_tokens: int) -> dict:
    """The same completion through Session.generate in this process, timed the same way: the slot's
    context preparation (Session.continue_to, as the server's), then greedy decoding, times at each piece."""
    t_send = time.perf_counter()
    s.continue_to(list(ids), fresh_logits=False)
    n0 = s.n_past
    t_first, texts = None, []
    for piece in s.generate(None, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        if piece:
            t_first = t_first or time.perf_counter()
            texts.append(piece)
    t_end = time.perf_counter()
    return {"t_send": t_send, "t_first": t_first, "t_end": t_end, "text": "".join(texts),
            "usage": {"completion_tokens": s.n_past - n0}, "reason": s.finish_reason}


def _decode_rate(x: dict) -> Optional[float]:
    n = x["usage"]["completion_tokens"] if x["usage"] else 0
    dt = x["t_end"] - x["t_first"] if x["t_first"] else 0
    return (n - 1) / dt if n > 1 and dt > 0 else None


def _pct(xs: list, q: float) -> Optional[float]:
    return float(np.percentile(xs, q)) if xs else None


def run_serve(cfg: BenchConfig) -> Result:
    """Two measurements of `kvflash serve`, each against a server child process on a loopback port.
    (1) Decode through streaming HTTP against in-process Session.generate(), same configuration (one
    slot; the in-process session prepared the way a slot prepares its context), greedy, --steps tokens
    after a D-token prompt, in rounds with the modes' order rotated, plus an A/A control (a second
    in-process run); decode tok/s from each stream's first text event to its end.  (2) --clients
    concurrent streaming clients on a --parallel server, each with its own distinct prompt each round:
    completions, errors, and time to first token (queueing for a slot included) at p50 / p95."""
    # Long on purpose: two server lifetimes, each a timing loop and its rows, sharing the session settings.
    try:
        import httpx
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"the serve routine needs the serve extra: pip install 'kvflash[serve]' ({e})") from None
    from kvflash.models import resolve_model
    D = max(cfg.contexts)
    pool = cfg.pools[0]
    policy = cfg.policy or "lru"
    max_ctx = max(D + cfg.decode_steps + 64, cfg.client_prompt + cfg.client_tokens + 64)
    s = open_session(cfg, max_ctx=max_ctx, pool=pool, policy=policy)
    s_b = open_session(cfg, max_ctx=max_ctx, pool=pool, policy=policy)   # the A/A control's own session
    model = str(resolve_model(cfg.model))
    args = ["--max-ctx", str(max_ctx), "--kvflash", str(pool), "--kvflash-policy", s.policy.name,
            "--kvflash-tau", str(cfg.tau), "--kv-type", cfg.kv_type, "-t", str(s.threads),
            "--seed", str(cfg.seed),
            # the in-process session's geometry and prefill, not the server's defaults (auto chunk size, auto
            # exact prefill): the streams are compared token for token
            "--kvflash-chunk-tokens", str(s.chunk_tokens), "--kvflash-exact-prefill", "on" if s.exact_prefill else "off"]
    if s.max_ctx > int(s.hparams["n_ctx_train"]):
        args.append("--allow-long-ctx")
    base = _base(cfg, s)
    toks = text_tokens(s, max(D, 1 << 16))
    ids = [int(t) for t in toks[:D]]
    prompts = []   # (2)'s prompts, each distinct from its first tokens on: a header, then its own slice of the text
    for r in range(cfg.repeats):
        row = []
        for c in range(cfg.clients):
            head = s.tokenize(f"Request {r}.{c} of the serve bench. ", add_special=False)
            off = (r * cfg.clients + c) * 97
            row.append([int(t) for t in head] + [int(t) for t in toks[off: off + cfg.client_prompt - len(head)]])
        prompts.append(row)
    res = Result("serve", f"kvflash serve: streaming HTTP decode vs in-process generate() (D={ctx_label(D)}, "
                 f"{cfg.decode_steps} tokens, {cfg.repeats} rounds), and {cfg.clients} concurrent streaming "
                 f"clients on --parallel {cfg.parallel}",
                 BASE_COLS + [("pool", "pool"), ("policy", "policy"), ("what", "measurement"), ("mode", "mode"),
                              ("context", "prompt tokens"), ("decode_tok_s", "decode tok/s"),
                              ("ratio", "vs in-process per round (median, min-max)"), ("ttft_s", "TTFT s"),
                              ("ttft_p50", "TTFT p50 s"), ("ttft_p95", "TTFT p95 s"),
                              ("latency_p50", "latency p50 s"), ("latency_p95", "latency p95 s"),
                              ("agg_tok_s", "aggregate tok/s"), ("done", "completed / errors"),
                              ("same_text", "same text as in-process, each round")])
    modes = ["http", "inproc", "inproc_b"]
    n_work = len(modes) * (cfg.repeats + 1) + cfg.repeats
    with Progress(n_work, "serve", cfg.quiet) as pb:
        # (1) one slot against the in-process session
        srv = ServerProcess(model, args + ["--parallel", "1"])
        try:
            with httpx.Client() as client:
                run = {"http": functools.partial(stream_completion, client, srv.base, ids, cfg.decode_steps),
                       "inproc": functools.partial(_inprocess, s, ids, cfg.decode_steps),
                       "inproc_b": functools.partial(_inprocess, s_b, ids, cfg.decode_steps)}
                warm = {}
                for m in modes:   # untimed: the first request prefills the prompt
                    pb.note(f"warm-up {m}")
                    warm[m] = run[m]()
                    pb.advance(1, note=f"warm-up {m}")
                for r in range(cfg.repeats):
                    k = r % len(modes)
                    for m in modes[k:] + modes[:k]:
                        x = run[m]()
                        res.raw.append({**base, "what": "decode", "mode": m, "round": r, "context": D,
                                        "decode_tok_s": _decode_rate(x), "ttft_s": x["t_first"] - x["t_send"],
                                        "tokens": x["usage"]["completion_tokens"], "reason": x["reason"],
                                        "text": x["text"]})
                        pb.advance(1, note=f"round {r} {m} {_decode_rate(x) or 0:.1f} tok/s")
        finally:
            srv.stop()
        del s, s_b, run   # the in-process sessions' memory goes before the second server starts
        # (2) concurrent clients on --parallel slots
        srv = ServerProcess(model, args + ["--parallel", str(cfg.parallel)])
        try:
            rounds = []
            for r in range(cfg.repeats):
                out: list = [None] * cfg.clients
                gate = threading.Barrier(cfg.clients)

                def client_run(c):
                    with httpx.Client() as cl:
                        gate.wait()
                        try:
                            out[c] = stream_completion(cl, srv.base, prompts[r][c], cfg.client_tokens)
                        except Exception as e:   # counted as an error, the round goes on
                            out[c] = {"error": f"{type(e).__name__}: {e}"}
                th = [threading.Thread(target=client_run, args=(c,)) for c in range(cfg.clients)]
                t0 = time.perf_counter()
                for t in th:
                    t.start()
                for t in th:
                    t.join()
                wall = time.perf_counter() - t0
                rounds.append((out, wall))
                for c, x in enumerate(out):
                    ok = "error" not in x and x["usage"] and x["usage"]["completion_tokens"] == cfg.client_tokens
                    res.raw.append({**base, "what": "concurrent", "mode": f"client {c}", "round": r,
                                    "context": len(prompts[r][c]),
                                    "ttft_s": x["t_first"] - x["t_send"] if ok else None,
                                    "latency_s": x["t_end"] - x["t_send"] if ok else None,
                                    "tokens": x["usage"]["completion_tokens"] if ok else 0,
                                    "error": None if ok else x.get("error", f"incomplete: {x.get('usage')}")})
                pb.advance(1, note=f"round {r}: {cfg.clients} clients in {wall:.1f}s")
        finally:
            srv.stop()
    # rows: (1)
    by = {m: {x["round"]: x for x in res.raw if x["what"] == "decode" and x["mode"] == m} for m in modes}
    # the slot and both sessions went through the same requests: the same greedy text each round
    texts = {m: {i: x.pop("text") for i, x in by[m].items()} for m in modes}
    for m in modes:
        for i, x in by[m].items():
            x["same_text"] = texts[m][i] == texts["inproc"].get(i)
    ratios = {}
    for m in modes:
        rr = list(by[m].values())
        row = {**base, "pool": pool, "policy": policy, "what": "decode", "context": D,
               "mode": {"http": "HTTP stream (kvflash serve)", "inproc": "in-process generate()",
                        "inproc_b": "in-process generate() (A/A control)"}[m],
               "decode_tok_s": summarize(x["decode_tok_s"] for x in rr), "ttft_s": summarize(x["ttft_s"] for x in rr),
               "same_text": "yes" if all(x["same_text"] for x in rr) else
               f"NO ({sum(not x['same_text'] for x in rr)}/{len(rr)} differ)"}
        if m != "inproc":
            dr = [x["decode_tok_s"] / by["inproc"][i]["decode_tok_s"] for i, x in by[m].items()
                  if x["decode_tok_s"] and by["inproc"][i]["decode_tok_s"]]
            ratios[m] = dr
            row["ratio"] = f"{statistics.median(dr):.3f}x ({_spread(dr)})" if dr else None
        res.rows.append(row)
    dr, cr = ratios.get("http"), ratios.get("inproc_b")
    if dr and cr:
        res.notes.append(f"HTTP/in-process decode tok/s {statistics.median(dr):.3f}x per round (target >= 0.95); "
                         "vs the A/A control: " + _verdict(dr, cr))
    # rows: (2)
    cc = [x for x in res.raw if x["what"] == "concurrent"]
    ok = [x for x in cc if x["error"] is None]
    ttft = [x["ttft_s"] for x in ok]
    lat = [x["latency_s"] for x in ok]
    agg = [sum(x["tokens"] for x in cc if x["round"] == r) / w for r, (_, w) in enumerate(rounds)]
    res.rows.append({**base, "pool": pool, "policy": policy, "what": f"{cfg.clients} concurrent clients",
                     "mode": f"HTTP stream, --parallel {cfg.parallel}", "context": cfg.client_prompt,
                     "ttft_p50": _pct(ttft, 50), "ttft_p95": _pct(ttft, 95), "latency_p50": _pct(lat, 50),
                     "latency_p95": _pct(lat, 95), "agg_tok_s": summarize(agg),
                     "done": f"{len(ok)} / {len(cc) - len(ok)}"})
    errs = sorted({x["error"] for x in cc if x["error"]})
    res.notes.append(f"{cfg.clients} concurrent streaming clients x {cfg.repeats} rounds on --parallel {cfg.parallel}: "
                     f"{len(ok)} of {len(cc)} completed with {cfg.client_tokens} tokens each"
                     + (f"; errors: {'; '.join(errs[:3])}" if errs else ", no errors") +
                     f"; TTFT (request sent to first text, waiting for a free slot included) p50 {_pct(ttft, 50):.2f} s, "
                     f"p95 {_pct(ttft, 95):.2f} s over {len(ttft)} requests; each prompt {cfg.client_prompt} tokens, "
                     "distinct (a per-request header, then its own slice of the text), so no prefix is reused")
    res.notes += [
        "decode tok/s: (completion tokens - 1) / (end of the stream - first text), the same on both sides; HTTP: "
        "httpx reading the SSE stream of /v1/completions (token-id prompt, temperature 0, ignore_eos) from a "
        "kvflash serve child process with one slot; in-process: the slot's context preparation "
        "(Session.continue_to, as the server calls it: the cached prompt is kept, its last token re-evaluated), then Session.generate",
        "the slot and the two in-process sessions (the second is the A/A control's) serve the same requests in the "
        "same order, so each round's greedy text must be the same in all three (a paged cache's contents depend on "
        "its history); each mode ran once untimed first (the prompt's prefill); then rounds with the order rotated; "
        "ratios are "
        "per round against the same round's in-process run; the server is idle while the in-process session "
        "computes and the other way round (never two computing at once)",
        "TTFT in the decode rows: request to first text, one re-evaluated prompt token plus the first decoded one "
        "(HTTP adds the request and the first event)",
        "the server's model and sessions use the same settings as the in-process session: " + " ".join(args),
    ]
    if (n := _long_note(cfg, max_ctx)):
        res.notes.append(n)
    return res
