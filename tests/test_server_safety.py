"""kvflash serve exposed to careless clients and other sites' pages (issue 36): every probe gets its
status.  Cross-site (415 for a non-JSON POST, 403 for a foreign Host or Origin, CORS for allowed origins),
request limits (413, 400 over the max_tokens cap, 503 with Retry-After when the queue is full, 504 past
the deadline), cancellation that reaches the prefill, API keys (constant time, from a file or the
environment), TLS, and the slot files' quota and symlinks.  Servers run as child processes on loopback."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("kvflash._core")
pytest.importorskip("gguf")
import httpx  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tinygguf import write_tiny_model  # noqa: E402

from kvflash.bench.routines.serve import ServerProcess  # noqa: E402


def _server(model, *args, **kw):
    return ServerProcess(model, ["--max-ctx", "2048", "--kvflash", "512", "--kvflash-policy", "lru", "-t", "1",
                                 *args], timeout=120, **kw)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = tmp_path_factory.mktemp("safety") / "small.gguf"
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    write_tiny_model(p, "llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, weight_type="f32",
                     seed=3, weight_scale=2.0, extra={"tokenizer.chat_template": template})
    return str(p)


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """Wide enough that a few thousand prompt tokens take seconds on one thread."""
    p = tmp_path_factory.mktemp("safety-slow") / "wide.gguf"
    write_tiny_model(p, "llama", n_layer=4, n_embd=512, n_head=8, n_head_kv=4, head_dim=64, n_ff=2048,
                     weight_type="f32", seed=5, ctx_len=16384)
    return str(p)


@pytest.fixture(scope="module")
def slots_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def server(model, slots_dir):
    srv = _server(model, "--parallel", "2", "--slot-save-path", str(slots_dir), "--n-predict", "64",
                  "--max-body-bytes", "65536", "--cors-origin", "https://app.example")
    yield srv
    srv.stop()


def _err(r, status, code=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["message"] and e["type"]
    if code is not None:
        assert e["code"] == code, e
    return e


def _ok(srv):
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def _ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 250, n)]


# ---------------------------------------------------------------- cross-site

def test_a_text_plain_post_is_refused_and_writes_nothing(server, slots_dir):
    """The issue's probe: a JSON body sent as text/plain (a cross-site "simple" request, no preflight)
    to the slot save endpoint was accepted and wrote a file.  Now: 415, nothing written; the same
    for the completion endpoints and form posts."""
    before = sorted(os.listdir(slots_dir))
    body = json.dumps({"filename": "probe.kvsnap"})
    for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"content-type": ct} if ct else {}
        r = httpx.post(server.base + "/slots/0?action=save", content=body, headers=headers)
        e = _err(r, 415, "unsupported_media_type")
        assert "application/json" in e["message"]
        r = httpx.post(server.base + "/v1/completions", content=json.dumps({"prompt": "x"}), headers=headers)
        _err(r, 415)
        r = httpx.post(server.base + "/v1/chat/completions", headers=headers,
                       content=json.dumps({"messages": [{"role": "user", "content": "x"}]}))
        _err(r, 415)
    assert sorted(os.listdir(slots_dir)) == before
    # JSON with a charset is JSON
    r = httpx.post(server.base + "/v1/completions", content=json.dumps({"prompt": "x", "max_tokens": 1}),
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text
    # a POST with no body at all needs no Content-Type (erase takes none)
    assert httpx.post(server.base + "/slots/1?action=erase").status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.nip.io", "192.0.2.10"])
def test_a_foreign_host_header_is_refused(server, host):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example."""
    for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/completions")):
        r = httpx.request(method, server.base + path, headers={"host": host}, json={"prompt": "x"})
        e = _err(r, 403, "host_not_allowed")
        assert "--allowed-host" in e["message"]


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "LOCALHOST"])
def test_loopback_host_names_are_served(server, host):
    r = httpx.get(server.base + "/v1/models", headers={"host": f"{host}:{server.port}"})
    assert r.status_code == 200, r.text


def test_allowed_host_flag(model):
    srv = _server(model, "--allowed-host", "kvflash.internal")
    try:
        assert httpx.get(srv.base + "/health", headers={"host": "kvflash.internal:80"}).status_code == 200
        _err(httpx.get(srv.base + "/health", headers={"host": "other.internal"}), 403)
    finally:
        srv.stop()


def test_foreign_origins_are_refused_allowed_ones_get_cors(server):
    body = {"prompt": "x", "max_tokens": 1}
    for origin in ("https://evil.example", "null", "http://localhost:3000", "https://app.example.evil"):
        r = httpx.post(server.base + "/v1/completions", json=body, headers={"origin": origin})
        e = _err(r, 403, "origin_not_allowed")
        assert "--cors-origin" in e["message"]
        # no body, no Content-Type: still refused (a cross-site erase)
        _err(httpx.post(server.base + "/slots/0?action=erase", headers={"origin": origin}), 403)
        _err(httpx.options(server.base + "/v1/completions", headers={
            "origin": origin, "access-control-request-method": "POST"}), 403)
    ok = "https://app.example"
    r = httpx.post(server.base + "/v1/completions", json=body, headers={"origin": ok})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ok
    r = httpx.options(server.base + "/v1/chat/completions", headers={
        "origin": ok, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == ok
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "content-type" in r.headers["access-control-allow-headers"].lower()
    # a refusal to an allowed origin still carries the CORS header, so the page can read the error
    r = httpx.post(server.base + "/v1/completions", content=b"x", headers={"origin": ok, "content-type": "text/plain"})
    assert r.status_code == 415 and r.headers["access-control-allow-origin"] == ok


def test_no_cross_site_origin_is_allowed_by_default(model):
    srv = _server(model)
    try:
        r = httpx.post(srv.base + "/v1/completions", json={"prompt": "x"}, headers={"origin": "https://app.example"})
        _err(r, 403, "origin_not_allowed")
        _ok(srv)   # no Origin header (curl, SDKs): served
    finally:
        srv.stop()


# ---------------------------------------------------------------- request limits

def test_a_body_over_the_cap_is_413(server):
    big = {"prompt": "x" * 70000, "max_tokens": 1}
    e = _err(httpx.post(server.base + "/v1/completions", json=big), 413, "request_too_large")
    assert "65536" in e["message"] and "--max-body-bytes" in e["message"]

    def chunks():   # no Content-Length: counted as it arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]
    r = httpx.post(server.base + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    _err(r, 413, "request_too_large")
    _ok(server)


def test_max_tokens_over_the_cap_is_400(server, model):
    e = _err(httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 65}), 400,
             "max_tokens_exceeded")
    assert "64" in e["message"] and "--n-predict" in e["message"]
    e = _err(httpx.post(server.base + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000000000}), 400, "max_tokens_exceeded")
    assert e["param"] == "max_tokens"
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 64, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64
    # omitted: the endpoint's default, within the cap (chat's 256 becomes 64)
    r = httpx.post(server.base + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64
    assert httpx.get(server.base + "/v1/models").json()["data"][0]["meta"]["n_predict"] == 64


def test_without_n_predict_the_cap_is_max_ctx(model):
    """The issue's probe: max_tokens 1e9 held a slot until max_ctx.  Without --n-predict the cap is max_ctx."""
    srv = _server(model)
    try:
        e = _err(httpx.post(srv.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1000000000}), 400,
                 "max_tokens_exceeded")
        assert "2048" in e["message"] and "max_ctx" in e["message"]
    finally:
        srv.stop()


def test_bad_stream_flags_and_roles(server):
    _err(httpx.post(server.base + "/v1/completions", json={"prompt": "x", "stream": "yes"}), 400)
    r = httpx.post(server.base + "/v1/chat/completions", json={
        "messages": [{"role": "user<|im_end|>", "content": "x"}]})
    assert "role" in _err(r, 400)["message"]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_huge_prompt_does_not_stall_other_clients(model, endpoint):
    """Tokenizing (and rendering) a prompt of megabytes runs off the event loop: /health keeps answering."""
    from kvflash.tokenizer import Tokenizer
    words = np.array(["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "then"])
    text = " ".join(np.random.default_rng(0).choice(words, 500_000))
    t0 = time.perf_counter()
    Tokenizer.from_gguf(model).encode(text, parse_special=True)
    tok_s = time.perf_counter() - t0
    if tok_s < 1.0:
        pytest.skip(f"tokenizing {len(text)} characters takes only {tok_s:.2f} s here")
    srv = _server(model, "--max-body-bytes", "8M")
    try:
        body = ({"prompt": text, "max_tokens": 1} if endpoint == "/v1/completions" else
                {"messages": [{"role": "user", "content": text}], "max_tokens": 1})
        out = {}
        th = threading.Thread(target=lambda: out.update(r=httpx.post(srv.base + endpoint, json=body, timeout=120)))
        th.start()
        worst = 0.0
        with httpx.Client() as c:
            while th.is_alive():
                a = time.perf_counter()
                assert c.get(srv.base + "/health", timeout=30).status_code == 200
                worst = max(worst, time.perf_counter() - a)
                time.sleep(0.02)
        _err(out["r"], 400, "context_length_exceeded")
        # a blocked event loop would hold /health for the whole tokenization (tok_s, measured here); half of
        # it, not a wall-clock constant, so a loaded machine slows both sides alike
        assert worst < tok_s / 2, (worst, tok_s)
    finally:
        srv.stop()


def _hold(srv, prompt_len=6000, seed=0):
    """Start a request that holds a slot for a while (a long prefill), streaming; returns (thread, events)."""
    events = []

    def run():
        try:
            with httpx.stream("POST", srv.base + "/v1/completions", timeout=300, json={
                    "prompt": _ids(prompt_len, seed), "max_tokens": 4, "stream": True}) as r:
                events.append(("status", r.status_code))
                for line in r.iter_lines():
                    events.append(("line", line))
        except httpx.HTTPError as e:
            events.append(("error", e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, events


def _wait(cond, timeout, what):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, what
        time.sleep(0.05)
    return time.time() - t0


def _busy(srv):
    return [s["is_processing"] for s in httpx.get(srv.base + "/slots").json()]


def _metric(srv, name):
    total = 0.0
    for line in httpx.get(srv.base + "/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def slow_server(slow_model):
    srv = ServerProcess(slow_model, ["--max-ctx", "16384", "--kvflash", "512", "--kvflash-policy", "lru", "-t", "1",
                                     "--parallel", "1", "--max-queue", "1"], timeout=120)
    yield srv
    srv.stop()


def _prefill_rate(srv):
    """Prompt tokens per second of this server's slot (a 512-token prompt, then its usage)."""
    t0 = time.perf_counter()
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": _ids(512, 99), "max_tokens": 1}, timeout=300)
    assert r.status_code == 200, r.text
    return 512 / (time.perf_counter() - t0)


def test_a_full_queue_is_503_with_retry_after(slow_server):
    srv = slow_server
    t, ev = _hold(srv, 6000, seed=1)
    _wait(lambda: any(_busy(srv)), 30, "the first request never took the slot")
    waiter = threading.Thread(target=lambda: httpx.post(srv.base + "/v1/completions", timeout=300, json={
        "prompt": "second", "max_tokens": 1}), daemon=True)
    waiter.start()
    _wait(lambda: _metric(srv, "kvflash_queue_depth") >= 1, 30, "the second request never queued")
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "third", "max_tokens": 1}, timeout=30)
    e = _err(r, 503, "queue_full")
    assert int(r.headers["retry-after"]) >= 1 and "--max-queue 1" in e["message"]
    assert _metric(srv, "kvflash_requests_refused_queue_full") >= 1
    # slot actions queue the same way
    _err(httpx.post(srv.base + "/slots/0?action=erase"), 503, "queue_full")
    t.join(300)
    waiter.join(300)
    _wait(lambda: not any(_busy(srv)), 60, "the slot never came back")


def test_uvicorns_connection_limit(slow_model):
    """--limit-concurrency: past it uvicorn answers 503 itself, before any route runs."""
    srv = ServerProcess(slow_model, ["--max-ctx", "8192", "--kvflash", "512", "--kvflash-policy", "lru", "-t", "1",
                                     "--parallel", "1", "--limit-concurrency", "4"], timeout=120)
    try:
        t, ev = _hold(srv, 6000, seed=11)
        _wait(lambda: any(_busy(srv)), 30, "the first request never took the slot")
        waiter = threading.Thread(target=lambda: httpx.post(srv.base + "/v1/completions", timeout=300, json={
            "prompt": "second", "max_tokens": 1}), daemon=True)
        waiter.start()
        _wait(lambda: _metric(srv, "kvflash_queue_depth") >= 1, 30, "the second request never queued")
        with httpx.Client() as a, httpx.Client() as b:   # two more open connections: the fourth is refused
            assert a.get(srv.base + "/health").status_code == 200
            assert b.get(srv.base + "/health").status_code == 503
        t.join(300)
        waiter.join(300)
        assert ("status", 200) in ev
        _ok(srv)
    finally:
        srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnect_during_a_long_prefill_frees_the_slot(slow_server, stream):
    """A client that goes away while its prompt is prefilled: the prefill stops at its next piece (the
    progress hook raises, the prompt is rolled back) and the slot serves the next request long before
    the abandoned prefill could have ended."""
    srv = slow_server
    _wait(lambda: not any(_busy(srv)), 300, "the slot is still busy from an earlier test")
    rate = _prefill_rate(srv)
    n = max(4000, min(16000, int(rate * 8)))   # about 8 s of prefill, as far as the context allows
    full_s = n / rate   # a lower bound on the whole prefill: attention only gets dearer with context
    if full_s < 4:
        pytest.skip(f"the prefill is too fast here ({rate:.0f} tok/s) for a {n}-token prompt to take seconds")
    print(f"prefill {rate:.0f} tok/s: {n} tokens would take >= {full_s:.1f} s")
    cancelled0 = _metric(srv, "kvflash_requests_cancelled_in_prefill")
    body = {"prompt": _ids(n, 7 + stream), "max_tokens": 8, "stream": stream}
    t0 = time.time()
    if stream:
        with httpx.stream("POST", srv.base + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            time.sleep(1.0)   # the headers are out; the prefill runs; then the client closes
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.base + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    _wait(lambda: not any(_busy(srv)), full_s / 2, "the abandoned prefill still holds its slot")
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "next", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    took = time.time() - t0
    print(f"disconnected, slot free and the next request served {took:.1f} s after the long one was sent")
    assert took < full_s * 0.75, (took, full_s)
    assert _metric(srv, "kvflash_requests_cancelled_in_prefill") == cancelled0 + 1
    # the prompt was rolled back, not kept half-done: the slot holds the last request's context only
    assert httpx.get(srv.base + "/slots").json()[0]["n_past"] < 100


def test_a_request_past_its_deadline_ends_with_504(slow_model):
    srv = ServerProcess(slow_model, ["--max-ctx", "8192", "--kvflash", "512", "--kvflash-policy", "lru", "-t", "1",
                                     "--timeout", "1.5"], timeout=120)
    try:
        t0 = time.time()
        r = httpx.post(srv.base + "/v1/completions", json={"prompt": _ids(7000, 3), "max_tokens": 4}, timeout=120)
        e = _err(r, 504, "deadline_exceeded")
        assert "1.5 s" in e["message"] and "prefill" in e["message"]
        assert time.time() - t0 < 30
        with httpx.stream("POST", srv.base + "/v1/completions", timeout=120, json={
                "prompt": _ids(7000, 4), "max_tokens": 4, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
        last = json.loads(lines[-1][5:])
        assert last["error"]["code"] == "deadline_exceeded"
        # a request that fits its deadline is served
        _wait(lambda: not any(_busy(srv)), 30, "the slot never came back")
        _ok(srv)
    finally:
        srv.stop()


# ---------------------------------------------------------------- API keys

def test_api_keys_are_compared_in_constant_time(monkeypatch):
    from kvflash import server as srv_mod
    calls = []
    real = srv_mod.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)
    monkeypatch.setattr(srv_mod.hmac, "compare_digest", spy)
    assert srv_mod.key_matches("k2", ["k1", "k2", "k3"])
    assert len(calls) == 3   # every key compared, no early exit on the match
    calls.clear()
    assert not srv_mod.key_matches("k", ["k1", "k2"]) and len(calls) == 2
    assert not srv_mod.key_matches("", ["k1"])
    # the guard goes through key_matches: no plain comparison left in the server
    import inspect
    src = inspect.getsource(srv_mod._Guard.__call__)
    assert "key_matches(" in src and "!= f\"Bearer" not in src


def test_api_key_from_a_file_or_the_environment(model, tmp_path):
    from kvflash.server import read_api_keys
    f = tmp_path / "keys"
    f.write_text("# the team's keys\nfile-key-1\n\n  file-key-2  \n")
    args = SimpleNamespace(api_key=None, api_key_file=str(f))
    assert read_api_keys(args, environ={}) == ("file-key-1", "file-key-2")
    assert read_api_keys(SimpleNamespace(api_key="cli", api_key_file=None),
                         environ={"KVFLASH_API_KEY": "env"}) == ("cli", "env")
    srv = _server(model, "--api-key-file", str(f), env={"KVFLASH_API_KEY": "env-key"})
    try:
        assert httpx.get(srv.base + "/health").status_code == 200
        for key, status in (("file-key-1", 200), ("file-key-2", 200), ("env-key", 200), ("file-key", 401),
                            ("file-key-1x", 401), (None, 401)):
            headers = {} if key is None else {"authorization": f"Bearer {key}"}
            r = httpx.post(srv.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
            assert r.status_code == status, (key, r.text)
        assert "file-key" not in " ".join(open(f"/proc/{srv.proc.pid}/cmdline").read().split("\0"))
    finally:
        srv.stop()
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing\n")
    r = subprocess.run([sys.executable, "-m", "kvflash", "serve", model, "--api-key-file", str(empty)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "holds no key" in r.stderr + r.stdout


def test_non_loopback_still_needs_a_key(model):
    env = {k: v for k, v in os.environ.items() if k != "KVFLASH_API_KEY"}
    for host in ("0.0.0.0", "::", "192.0.2.1"):
        r = subprocess.run([sys.executable, "-m", "kvflash", "serve", model, "--host", host], capture_output=True,
                           text=True, timeout=60, env=env)
        assert r.returncode != 0 and "needs --api-key" in r.stderr + r.stdout, host


# ---------------------------------------------------------------- TLS

def _self_signed(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate with")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    r = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {r.stderr[-300:]}")
    return key, cert


def test_tls(model, tmp_path):
    import ssl
    key, cert = _self_signed(tmp_path)
    ctx = ssl.create_default_context(cafile=str(cert))
    srv = _server(model, "--ssl-key-file", str(key), "--ssl-cert-file", str(cert), scheme="https", verify=ctx)
    try:
        assert srv.base.startswith("https://")
        r = httpx.post(srv.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, verify=ctx,
                       timeout=60)
        assert r.status_code == 200, r.text
        with pytest.raises(httpx.HTTPError):   # plain HTTP to the TLS port is not served
            httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5).raise_for_status()
        with pytest.raises(httpx.ConnectError):   # an unknown certificate is refused by a verifying client
            httpx.get(srv.base + "/health", timeout=5)
    finally:
        srv.stop()
    r = subprocess.run([sys.executable, "-m", "kvflash", "serve", model, "--ssl-key-file", str(key)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "both --ssl-key-file and --ssl-cert-file" in r.stderr + r.stdout


# ---------------------------------------------------------------- slot files

def test_slot_quota_on_files_and_bytes(model, tmp_path):
    d = tmp_path / "slots"
    d.mkdir()
    srv = _server(model, "--slot-save-path", str(d), "--slot-save-max-files", "2")
    try:
        httpx.post(srv.base + "/v1/completions", json={"prompt": _ids(300), "max_tokens": 1}, timeout=60)
        for name in ("a", "b"):
            r = httpx.post(srv.base + "/slots/0?action=save", json={"filename": name})
            assert r.status_code == 200, r.text
        size = os.path.getsize(d / "a")
        e = _err(httpx.post(srv.base + "/slots/0?action=save", json={"filename": "c"}), 409, "slot_quota_exceeded")
        assert "--slot-save-max-files" in e["message"]
        assert sorted(os.listdir(d)) == ["a", "b"]   # nothing else, no temporary file left
        assert httpx.post(srv.base + "/slots/0?action=save", json={"filename": "a"}).status_code == 200   # overwrite
    finally:
        srv.stop()
    srv = _server(model, "--slot-save-path", str(d), "--slot-save-max-bytes", str(int(size * 2.5)))
    try:
        httpx.post(srv.base + "/v1/completions", json={"prompt": _ids(300), "max_tokens": 1}, timeout=60)
        before = {n: os.path.getsize(d / n) for n in os.listdir(d)}
        e = _err(httpx.post(srv.base + "/slots/0?action=save", json={"filename": "c"}), 409, "slot_quota_exceeded")
        assert "--slot-save-max-bytes" in e["message"] and "nothing was written" in e["message"]
        assert {n: os.path.getsize(d / n) for n in os.listdir(d)} == before
        r = httpx.post(srv.base + "/slots/0?action=save", json={"filename": "b"})   # replacing b fits
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_symlinks_in_the_slot_dir_are_not_followed(server, slots_dir, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    (slots_dir / "evil").symlink_to(outside)
    (slots_dir / "evil-dir").symlink_to(tmp_path, target_is_directory=True)
    try:
        httpx.post(server.base + "/v1/completions", json={"prompt": "some context", "max_tokens": 1}, timeout=60)
        for action in ("save", "restore"):
            r = httpx.post(server.base + f"/slots/0?action={action}", json={"filename": "evil"})
            e = _err(r, 400, "not_a_regular_file")
            assert "symbolic link" in e["message"]
            _err(httpx.post(server.base + f"/slots/0?action={action}", json={"filename": "evil-dir"}), 400)
        assert outside.read_text() == "precious" and os.path.islink(slots_dir / "evil")
        assert sorted(os.listdir(tmp_path)) == ["outside.txt"]
        # erase touches no file: it forgets the slot's context
        r = httpx.post(server.base + "/slots/0?action=erase")
        assert r.status_code == 200 and outside.read_text() == "precious"
        # a save next to the links still works, and the links are not counted as snapshots
        r = httpx.post(server.base + "/slots/0?action=save", json={"filename": "real"})
        assert r.status_code == 200, r.text
        assert os.path.isfile(slots_dir / "real") and not os.path.islink(slots_dir / "real")
    finally:
        os.unlink(slots_dir / "evil")
        os.unlink(slots_dir / "evil-dir")


def test_guard_units():
    from kvflash.server import host_name, is_loopback
    assert host_name("[::1]:8080") == "::1" and host_name("LocalHost:80") == "localhost"
    assert host_name("localhost.") == "localhost" and host_name("127.0.0.1") == "127.0.0.1"
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.1") and not is_loopback("example.com")


def test_bad_requests_never_take_the_server_down(server):
    """A batch of malformed requests at once, then a good one."""
    bad = [dict(content=b"\xff\xfe", headers={"content-type": "application/json"}),
           dict(content=b"[1,2", headers={"content-type": "application/json"}),
           dict(content=b"{}", headers={"content-type": "application/json", "content-length": "abc"}),
           dict(json={"prompt": [1, 2], "max_tokens": -1}),
           dict(json={"messages": "hi"}),
           dict(json={"prompt": "x", "model": "nope"})]
    for kw in bad:
        try:
            r = httpx.post(server.base + "/v1/completions", timeout=30, **kw)
            assert 400 <= r.status_code < 500, r.text
        except httpx.HTTPError:   # a malformed header may close the connection instead
            pass
    _ok(server)

