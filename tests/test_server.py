"""kvflash serve (issue 17): real clients (the openai package and plain httpx) against a server the
test starts on a free loopback port.  The test extra pulls in the serve extra, so a missing server
dependency fails here instead of skipping (CI must run these)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("kvflash._core")
pytest.importorskip("gguf")
import fastapi  # noqa: E402,F401  (the server's own stack: installed by the test extra)
import httpx  # noqa: E402
import openai  # noqa: E402
import prometheus_client  # noqa: E402,F401
import uvicorn  # noqa: E402,F401

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tinygguf import write_tiny_chat_model  # noqa: E402

from kvflash.bench.routines.serve import ServerProcess  # noqa: E402


class Server(ServerProcess):
    """kvflash serve on a free loopback port (the bench's launcher), with the tests' session flags."""

    def __init__(self, model, *args):
        super().__init__(model, ["--max-ctx", "2048", "--kvflash", "512", "--kvflash-policy", "lru", "-t", "1", *args],
                         timeout=120)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = tmp_path_factory.mktemp("serve") / "small.gguf"
    write_tiny_chat_model(p, seed=3, weight_scale=2.0)
    return str(p)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = Server(model, "--parallel", "2", "--slot-save-path", str(tmp_path_factory.mktemp("slots")))
    yield srv
    srv.stop()


def _ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 250, n)]


def test_completion_streaming_and_not_agree(server):
    r = httpx.post(server.base + "/v1/completions", json={"model": "small", "prompt": "hello there", "max_tokens": 20,
                                                          "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "text_completion" and d["choices"][0]["finish_reason"] == "length"
    assert d["usage"]["completion_tokens"] == 20 and d["usage"]["prompt_tokens"] > 0
    assert d["usage"]["total_tokens"] == d["usage"]["prompt_tokens"] + 20
    assert d["id_slot"] == 0
    c = server.client()
    pieces, reasons = [], []
    # on the other, fresh slot: the same computation as the first request's, so the same greedy text
    for ch in c.completions.create(model="small", prompt="hello there", max_tokens=20, temperature=0, stream=True,
                                   extra_body={"id_slot": 1}):
        pieces.append(ch.choices[0].text)
        reasons.append(ch.choices[0].finish_reason)
    assert "".join(pieces) == d["choices"][0]["text"]
    assert reasons[-1] == "length"


def test_chat_with_the_openai_client(server):
    c = server.client()
    r = c.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                  temperature=0)
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.usage.completion_tokens <= 12 and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=12, temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert [m.id for m in c.models.list().data] == ["small"]


@pytest.mark.parametrize("body, status, match", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": [5] * 3000}, 400, "context"),
    ({"prompt": 7}, 400, "prompt must be"),
    ({"prompt": [99999]}, 400, "outside"),
    ({"prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, match):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.base + "/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert match in err["message"] and err["type"]
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


def test_the_name_it_was_started_with_is_a_model_id(server, model):
    """The path (or registry name) given to `kvflash serve` is accepted as the request's model, beside the file's
    stem; any other id is a 404 that lists the names that work."""
    for name in (model, "small", "small.gguf"):
        r = httpx.post(server.base + "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 200, (name, r.text)
    r = httpx.post(server.base + "/v1/completions", json={"model": "gpt-4o", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404
    msg = r.json()["error"]["message"]
    assert "'gpt-4o' does not exist" in msg and "'small'" in msg and repr(model) in msg


@pytest.mark.model
def test_serve_by_registry_name_answers_to_that_name():
    """`kvflash serve smollm2-135m`: the openai client asking for model="smollm2-135m" is served, and
    /v1/models lists that name."""
    import kvflash
    kvflash.resolve_model("smollm2-135m")   # fetched before the server's start-up clock runs
    srv = ServerProcess("smollm2-135m", ["--max-ctx", "1024", "--kvflash", "512", "--kvflash-policy", "lru",
                                         "-t", "2"], timeout=300)
    try:
        c = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["smollm2-135m"]
        r = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=4, temperature=0)
        assert r.choices[0].message.content is not None
        r = c.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Hi", max_tokens=2)   # the stem too
        assert r.choices[0].text is not None
    finally:
        srv.stop()


def test_ignore_eos_reaches_generate():
    """llama.cpp's ignore_eos extension: a boolean, handed to Session.generate (the bench's fixed-length
    streams rely on it); off by default."""
    from kvflash.server import _sampling
    assert _sampling({"ignore_eos": True}, 16)["ignore_eos"] is True
    assert _sampling({}, 16)["ignore_eos"] is False


def test_eight_concurrent_streaming_clients_on_two_slots(server):
    c = server.client()
    out, errors = {}, []

    def one(i):
        try:
            out[i] = "".join(ch.choices[0].text for ch in c.completions.create(
                model="small", prompt=f"client {i} says", max_tokens=24, temperature=0.7, seed=i, stream=True))
        except Exception as e:   # collected, the test fails below
            errors.append(e)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors and len(out) == 8
    m = httpx.get(server.base + "/metrics").text
    assert "kvflash_queue_depth" in m and 'kvflash_slot_n_past{slot="1"}' in m


def test_a_disconnect_mid_stream_frees_the_slot(server):
    with httpx.stream("POST", server.base + "/v1/completions",
                      json={"prompt": "a long one", "max_tokens": 1500, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    deadline = time.time() + 30
    while any(s["is_processing"] for s in httpx.get(server.base + "/slots").json()):
        assert time.time() < deadline, "the cancelled generation still holds its slot"
        time.sleep(0.1)
    st = httpx.get(server.base + "/slots").json()
    assert max(s["n_past"] for s in st) < 1500   # it stopped well before max_tokens
    assert httpx.post(server.base + "/v1/completions", json={"prompt": "next", "max_tokens": 3}).status_code == 200


def test_slot_filenames_cannot_escape_the_save_path(server):
    for name in ("../x", "/etc/passwd", ".hidden", "a/b", ""):
        r = httpx.post(server.base + "/slots/0?action=save", json={"filename": name})
        assert r.status_code == 400, (name, r.text)
    assert httpx.post(server.base + "/slots/9?action=save", json={"filename": "a"}).status_code == 404
    assert httpx.post(server.base + "/slots/0?action=restore", json={"filename": "missing"}).status_code == 404


def test_slot_save_restart_restore_continues_exactly(model, tmp_path):
    prompt = _ids(1200, 1)   # above the 512-token pool: eviction is in play
    req = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "id_slot": 0}
    a = Server(model, "--slot-save-path", str(tmp_path))
    try:
        want = httpx.post(a.base + "/v1/completions", json=req, timeout=120).json()["choices"][0]["text"]
        assert httpx.post(a.base + "/slots/0?action=erase").status_code == 200
        r = httpx.post(a.base + "/v1/completions", json=dict(req, max_tokens=0), timeout=120)
        assert r.status_code == 200, r.text
        assert httpx.get(a.base + "/slots").json()[0]["host_chunks"] > 0
        r = httpx.post(a.base + "/slots/0?action=save", json={"filename": "s.kvsnap"})
        assert r.status_code == 200 and r.json()["n_saved"] == 1200, r.text
    finally:
        a.stop()
    b = Server(model, "--slot-save-path", str(tmp_path))
    try:
        r = httpx.post(b.base + "/slots/0?action=restore", json={"filename": "s.kvsnap"})
        assert r.status_code == 200 and r.json()["n_restored"] == 1200, r.text
        got = httpx.post(b.base + "/v1/completions", json=req, timeout=120).json()["choices"][0]["text"]
        assert got == want
    finally:
        b.stop()


def test_api_key_and_loopback(model, tmp_path):
    s = Server(model, "--api-key", "sekrit")
    try:
        assert httpx.get(s.base + "/health").status_code == 200
        r = httpx.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert s.client(api_key="sekrit").completions.create(model="small", prompt="x", max_tokens=1).choices
    finally:
        s.stop()
    r = subprocess.run([sys.executable, "-m", "kvflash", "serve", model, "--host", "0.0.0.0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "needs --api-key" in r.stderr + r.stdout
