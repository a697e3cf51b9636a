"""A bounded loopback load test of `kvflash serve`: good and bad requests mixed, for a fixed time."""
from __future__ import annotations

import json
import threading
import time
from typing import Optional

import numpy as np

from ..common import BenchConfig, Progress, haystack_text, summarize
from ..report import Result
from ._shared import BASE_COLS, _base
from .serve import ServerProcess, _pct

# what each kind of request is, and the status it must get
GOOD = ("completion", "completion stream", "chat", "chat stream")
BAD = {
    "non-JSON body (text/plain)": 415,
    "malformed JSON": 400,
    "oversized body": 413,
    "max_tokens over the cap": 400,
    "unknown model": 404,
    "foreign Host header": 403,
    "foreign Origin header": 403,
}
# one request in this many is a bad one, of the kinds above in turn
BAD_EVERY = 3


def _rss_kib(pid: int) -> Optional[tuple]:
    """(VmRSS, VmHWM) of a process in KiB, from /proc (None when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            d = {ln.split(":")[0]: ln.split()[1] for ln in f if ln.startswith(("VmRSS", "VmHWM"))}
        return int(d["VmRSS"]), int(d["VmHWM"])
    except (OSError, KeyError, ValueError, IndexError):
        return None


class _Sampler(threading.Thread):
    """The server's RSS every interval seconds, with the time of each sample."""

    def __init__(self, pid: int, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.interval, self.samples, self.hwm = pid, interval, [], None
        self.stop_ev = threading.Event()

    def run(self):
        t0 = time.perf_counter()
        while not self.stop_ev.is_set():
            r = _rss_kib(self.pid)
            if r is not None:
                self.samples.append((time.perf_counter() - t0, r[0]))
                self.hwm = r[1]
            self.stop_ev.wait(self.interval)


def _good(client, base: str, kind: str, text: str, max_tokens: int) -> dict:
    """One good request; its status, time to first text (streams) and latency, and whether it completed:
    200, finish_reason set, max_tokens tokens (ignore_eos), and a stream closed by [DONE]."""
    chat = kind.startswith("chat")
    stream = kind.endswith("stream")
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    body = {"max_tokens": max_tokens, "temperature": 0.7, "ignore_eos": True, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first = usage = reason = None
    done = False
    if not stream:
        r = client.post(url, json=body, timeout=300)
        t1 = time.perf_counter()
        ok = r.status_code == 200
        if ok:
            d = r.json()
            usage, reason = d["usage"], d["choices"][0]["finish_reason"]
            done = True
        return {"status": r.status_code, "ttft_s": None, "latency_s": t1 - t0,
                "ok": ok and done and reason is not None and usage["completion_tokens"] == max_tokens,
                "detail": None if ok else r.text[:200]}
    with client.stream("POST", url, json=body, timeout=300) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "ttft_s": None, "latency_s": time.perf_counter() - t0, "ok": False,
                    "detail": r.read().decode(errors="replace")[:200]}
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                return {"status": 200, "ttft_s": None, "latency_s": time.perf_counter() - t0, "ok": False,
                        "detail": ev["error"].get("message")}
            ch = ev["choices"][0]
            piece = ch.get("text") or (ch.get("delta") or {}).get("content")
            if piece and first is None:
                first = time.perf_counter()
            reason = ch.get("finish_reason") or reason
            usage = ev.get("usage") or usage
    t1 = time.perf_counter()
    ok = done and reason is not None and usage is not None and usage["completion_tokens"] == max_tokens
    return {"status": 200, "ttft_s": None if first is None else first - t0, "latency_s": t1 - t0, "ok": ok,
            "detail": None if ok else f"stream: done={done} reason={reason} usage={usage}"}


def _bad(client, base: str, kind: str, cap: int, body_cap: int, port: int) -> dict:
    """One bad request of a kind; ok when it gets the kind's status with an OpenAI-shaped error body."""
    url = base + "/v1/completions"
    t0 = time.perf_counter()
    good = {"prompt": "Hello", "max_tokens": 2}
    if kind == "non-JSON body (text/plain)":
        r = client.post(url, content=json.dumps(good), headers={"content-type": "text/plain"})
    elif kind == "malformed JSON":
        r = client.post(url, content=b'{"prompt": "Hello", "max_tokens": ', headers={"content-type": "application/json"})
    elif kind == "oversized body":
        r = client.post(url, json={"prompt": "x" * (body_cap + 1024), "max_tokens": 2})
    elif kind == "max_tokens over the cap":
        r = client.post(url, json={"prompt": "Hello", "max_tokens": cap + 1})
    elif kind == "unknown model":
        r = client.post(url, json=dict(good, model="gpt-4o"))
    elif kind == "foreign Host header":
        r = client.post(url, json=good, headers={"host": f"rebound.example:{port}"})
    elif kind == "foreign Origin header":
        r = client.post(url, json=good, headers={"origin": "https://evil.example"})
    else:
        raise ValueError(kind)
    want = BAD[kind]
    try:
        err = r.json().get("error") or {}
        shaped = bool(err.get("message")) and bool(err.get("type"))
    except ValueError:
        shaped = False
    return {"status": r.status_code, "ttft_s": None, "latency_s": time.perf_counter() - t0,
            "ok": r.status_code == want and shaped, "detail": None if r.status_code == want else r.text[:200]}


def run_load(cfg: BenchConfig) -> Result:
    """--clients concurrent clients on loopback for --seconds against one `kvflash serve` child process
    (--parallel slots, small pool), each sending requests in turn: two good ones (completions and chat,
    streamed or not, prompts of about --client-prompt tokens, --client-tokens tokens with ignore_eos),
    then a bad one (non-JSON, malformed JSON, an oversized body, max_tokens over the cap, an unknown
    model, a foreign Host, a foreign Origin, in turn).  Every good request must complete, every bad one
    get its 4xx in OpenAI's error shape; the server's RSS is sampled every 0.5 s (after a warm-up:
    start, end, max); time to first token p50/p95 over the good streams."""
    try:
        import httpx
    except ImportError as e:
        raise RuntimeError(f"the load routine needs the serve extra: pip install 'kvflash[serve]' ({e})") from None
    from kvflash.models import resolve_model
    from kvflash.system import usable_cores
    pool = cfg.pools[0]
    policy = cfg.policy or "lru"
    max_ctx = max(cfg.contexts)
    threads = cfg.threads or usable_cores()
    cap = cfg.client_tokens * 4   # --n-predict: the good requests ask for a quarter of it
    body_cap = 64 << 10
    model = str(resolve_model(cfg.model))
    args = ["--max-ctx", str(max_ctx), "--kvflash", str(pool), "--kvflash-policy", policy,
            "--kv-type", cfg.kv_type, "-t", str(threads), "--seed", str(cfg.seed), "--parallel", str(cfg.parallel),
            "--n-predict", str(cap), "--max-body-bytes", str(body_cap), "--max-queue", str(4 * cfg.clients),
            "--timeout", "300", "--kvflash-chunk-tokens", str(cfg.chunk_tokens or 64)]   # the bench's geometry
    words = haystack_text().split()
    n_words = max(8, int(cfg.client_prompt * 0.7))   # about client_prompt tokens of English
    base = _base(cfg)
    base["threads"] = threads
    res = Result("load", f"kvflash serve under load: {cfg.clients} clients on loopback for {cfg.load_seconds} s, "
                         f"good and bad requests mixed, --parallel {cfg.parallel}, pool {pool}",
                 BASE_COLS + [("what", "requests"), ("want", "expected"), ("n", "sent"), ("as_expected", "as expected"),
                              ("wrong", "otherwise"), ("ttft_p50", "TTFT p50 s"), ("ttft_p95", "TTFT p95 s"),
                              ("latency_p50", "latency p50 s"), ("latency_p95", "latency p95 s"),
                              ("rss", "server RSS MiB start / end / max")])
    with Progress(cfg.load_seconds, "load", cfg.quiet) as pb:
        srv = ServerProcess(model, args)
        sampler = None
        try:
            with httpx.Client() as c:   # warm-up: each good kind once, before the RSS baseline
                for k in GOOD:
                    x = _good(c, srv.base, k, " ".join(words[:n_words]), cfg.client_tokens)
                    if not x["ok"]:
                        raise RuntimeError(f"warm-up {k} failed: {x['status']} {x['detail']}")
            rss0 = _rss_kib(srv.proc.pid)
            sampler = _Sampler(srv.proc.pid)
            sampler.start()
            records: list = []
            lock = threading.Lock()
            t_end = time.perf_counter() + cfg.load_seconds
            bad_kinds = list(BAD)

            def client_loop(ci: int):
                rng = np.random.default_rng(cfg.seed + ci)
                i = 0
                with httpx.Client() as cl:
                    while time.perf_counter() < t_end:
                        if i % BAD_EVERY == BAD_EVERY - 1:
                            kind = bad_kinds[(ci + i // BAD_EVERY) % len(bad_kinds)]
                            call = lambda: _bad(cl, srv.base, kind, cap, body_cap, srv.port)   # noqa: E731
                        else:
                            kind = GOOD[(ci + i) % len(GOOD)]
                            off = int(rng.integers(0, max(1, len(words) - n_words)))
                            text = f"Client {ci} request {i}. " + " ".join(words[off:off + n_words])
                            call = lambda: _good(cl, srv.base, kind, text, cfg.client_tokens)   # noqa: E731
                        t_sent = time.perf_counter()
                        try:
                            x = call()
                        except httpx.HTTPError as e:
                            x = {"status": None, "ttft_s": None, "latency_s": time.perf_counter() - t_sent,
                                 "ok": False, "detail": f"{type(e).__name__}: {e}"}
                        with lock:
                            records.append({"client": ci, "i": i, "kind": kind, "t": t_sent - (t_end - cfg.load_seconds),
                                            **x})
                        i += 1

            th = [threading.Thread(target=client_loop, args=(ci,), daemon=True) for ci in range(cfg.clients)]
            t0 = time.perf_counter()
            for t in th:
                t.start()
            shown = 0
            while any(t.is_alive() for t in th):
                time.sleep(1.0)
                el = min(cfg.load_seconds, int(time.perf_counter() - t0))
                if el > shown:
                    with lock:
                        n, bad = len(records), sum(not r["ok"] for r in records)
                    pb.advance(el - shown, note=f"{n} requests, {bad} not as expected")
                    shown = el
            wall = time.perf_counter() - t0
            for t in th:
                t.join()
            with httpx.Client() as c:
                health = c.get(srv.base + "/health").json()
            sampler.stop_ev.set()
            sampler.join()
            rss1 = _rss_kib(srv.proc.pid)
        finally:
            if sampler is not None:
                sampler.stop_ev.set()
            srv.stop()
    res.raw = records
    mib = lambda k: None if k is None else k / 1024   # noqa: E731
    rss_max = max(v for _, v in sampler.samples) if sampler.samples else None
    rss_txt = f"{mib(rss0[0]):.1f} / {mib(rss1[0]):.1f} / {mib(rss_max):.1f}" if rss0 and rss1 and rss_max else None
    good = [r for r in records if r["kind"] in GOOD]
    for k in list(GOOD) + list(BAD):
        rr = [r for r in records if r["kind"] == k]
        if not rr:
            continue
        ttft = [r["ttft_s"] for r in rr if r["ok"] and r["ttft_s"] is not None]
        lat = [r["latency_s"] for r in rr if r["ok"]]
        res.rows.append({**base, "what": k, "want": "200, completed" if k in GOOD else str(BAD[k]), "n": len(rr),
                         "as_expected": sum(r["ok"] for r in rr), "wrong": sum(not r["ok"] for r in rr),
                         "ttft_p50": _pct(ttft, 50), "ttft_p95": _pct(ttft, 95),
                         "latency_p50": _pct(lat, 50), "latency_p95": _pct(lat, 95)})
    ttft = [r["ttft_s"] for r in good if r["ok"] and r["ttft_s"] is not None]
    lat = [r["latency_s"] for r in good if r["ok"]]
    res.rows.append({**base, "what": "all good requests", "want": "200, completed", "n": len(good),
                     "as_expected": sum(r["ok"] for r in good), "wrong": sum(not r["ok"] for r in good),
                     "ttft_p50": _pct(ttft, 50), "ttft_p95": _pct(ttft, 95), "latency_p50": _pct(lat, 50),
                     "latency_p95": _pct(lat, 95), "rss": rss_txt})
    bad = [r for r in records if r["kind"] in BAD]
    res.rows.append({**base, "what": "all bad requests", "want": "their 4xx", "n": len(bad),
                     "as_expected": sum(r["ok"] for r in bad), "wrong": sum(not r["ok"] for r in bad)})
    wrong = sorted({f"{r['kind']}: {r['status']} {r['detail']}" for r in records if not r["ok"]})
    n_good_ok = sum(r["ok"] for r in good)
    # RSS over the run: the first and last quarter's medians (a leak grows between them)
    s = sampler.samples
    q = max(1, len(s) // 4)
    first_q, last_q = summarize(v for _, v in s[:q]), summarize(v for _, v in s[-q:])
    growth = (last_q["median"] / first_q["median"] - 1) if s and first_q["median"] else None
    res.notes += [
        f"{len(records)} requests in {wall:.0f} s ({len(records) / wall:.1f}/s) from {cfg.clients} clients: "
        f"{n_good_ok} of {len(good)} good requests completed, {sum(r['ok'] for r in bad)} of {len(bad)} bad ones got "
        f"their 4xx" + (f"; not as expected: {'; '.join(wrong[:5])}" if wrong else "; nothing else"),
        f"server RSS (VmRSS of the `kvflash serve` process, sampled every 0.5 s after the warm-up): start "
        f"{mib(rss0[0]):.1f} MiB, end {mib(rss1[0]):.1f} MiB, max {mib(rss_max):.1f} MiB (VmHWM {mib(sampler.hwm):.1f}); "
        f"median of the last quarter's samples vs the first quarter's: {100 * growth:+.2f}%"
        if rss0 and rss1 and rss_max and growth is not None else "server RSS: not readable here",
        f"TTFT: request sent to the first text event of a good stream ({len(ttft)} streams), the wait for a free "
        f"slot included; latency: request to its last byte, every good request",
        f"good requests: completions and chat, streamed or not, in turn; each prompt about {cfg.client_prompt} tokens "
        f"of English (its own slice of the bench's haystack, behind a per-request header), {cfg.client_tokens} tokens "
        f"with ignore_eos, temperature 0.7; one request in {BAD_EVERY} is a bad one, the seven kinds in turn",
        f"after the run /health said {health}",
        "the server: kvflash serve " + " ".join(args),
    ]
    return res
