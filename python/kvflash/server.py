"""``kvflash serve``: an OpenAI-compatible HTTP server over kvflash Sessions (FastAPI + uvicorn,
the ``serve`` extra).

Slots: ``--parallel N`` Sessions over one loaded Model, each with its own pool and host store.  A
request takes the free slot whose cached tokens share the longest prefix with its prompt (or the one
it names with ``id_slot``), waiting while none is free: at most ``--max-queue`` requests wait, more
are refused (503 with Retry-After).  Each request has a deadline (``--timeout`` seconds from its
arrival): waiting, prefill and decode all end there (504).  The blocking work (prefill, decode,
snapshot files) runs in a worker thread per slot, and tokenizing, template rendering and JSON
parsing in a small pool of their own: the event loop only moves text.  A client that disconnects,
streaming or not, cancels its request: while it waits for a slot, between two prefill pieces
(Session.prefill's progress hook raises, the prompt is rolled back) or at the next token.  Slot
snapshots are ``Session.save`` files, confined to ``--slot-save-path`` (no symlinks), within a
quota of files and bytes.

Every request passes a guard first (``_Guard``): its ``Host`` must be one this server answers to
(loopback names, the bound address, ``--allowed-host``), so a DNS-rebinding page cannot read the
answers; a request with an ``Origin`` header is refused unless that origin is allowed
(``--cors-origin``, which also answers CORS preflights); the API key (``--api-key``, ``--api-key-file``
or ``KVFLASH_API_KEY``) is compared in constant time; a POST with a body must say
``Content-Type: application/json`` (a "simple" cross-site form or text/plain POST is refused, 415) and
stay under ``--max-body-bytes`` (413).

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (SSE when ``stream``), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus text), ``GET /slots``, ``POST /slots/{id}?action=save|restore|erase``.
Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status (5xx for
a full queue, a passed deadline or a server fault).

Tokens: a chat request's messages are rendered with the model's template and tokenized with
``Tokenizer.encode_chat``: the template's own markers become special tokens, special-token text inside a
message's content stays text.  A ``/v1/completions`` prompt string is tokenized as llama.cpp's server
does, special-token text parsed into special tokens (the raw prompt is the client's to write).
"""
# No `from __future__ import annotations`: FastAPI reads the route functions' annotations (Request) at run time.

import asyncio
import hmac
import ipaddress
import json
import os
import re
import socket
import stat
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain", "ip6-localhost"})
API_KEY_ENV = "KVFLASH_API_KEY"
ROLE_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


def is_loopback(host: str) -> bool:
    """True for localhost and the loopback addresses (127.0.0.0/8, ::1)."""
    h = host.strip("[]").lower()
    if h in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """What one request may ask of the server (the ``kvflash serve`` flags)."""
    max_body_bytes: int = 8 << 20     # --max-body-bytes: a request body larger than this is refused (413)
    n_predict: int = -1               # --n-predict: max_tokens at most this (-1: max_ctx); never above max_ctx
    max_queue: int = 16               # --max-queue: requests waiting for a slot; one more gets 503
    timeout_s: float = 600.0          # --timeout: seconds from a request's arrival to its end (0: none)
    slot_max_files: int = 64          # --slot-save-max-files: snapshots in --slot-save-path (0: no limit)
    slot_max_bytes: int = 8 << 30     # --slot-save-max-bytes: their bytes (0: no limit)
    retry_after_s: int = 2            # the Retry-After of a 503


@dataclass
class Access:
    """Who may talk to the server: API keys (compared in constant time), the Host names it answers to
    (None: any), and the cross-site origins it allows ("*": any)."""
    api_keys: tuple = ()
    allowed_hosts: Optional[frozenset] = LOOPBACK_NAMES
    cors_origins: frozenset = frozenset()


def host_name(header: str) -> str:
    """The name in a Host header, lowercase, without the port or IPv6 brackets ("[::1]:8080" -> "::1")."""
    h = header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else h
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def key_matches(given: str, keys: Sequence[str]) -> bool:
    """Whether given is one of keys, every key compared in constant time (no early exit)."""
    g = given.encode("utf-8", "surrogateescape")
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(g, k.encode("utf-8", "surrogateescape"))
    return ok


def _json_type(ct: str) -> bool:
    return ct.split(";", 1)[0].strip().lower() == "application/json"


class _Guard:
    """ASGI middleware run before every route: Host, Origin (and CORS preflights), the API key,
    a POST's Content-Type and Content-Length.  Pure ASGI: it never wraps receive or send for a request
    it lets through, except to add the CORS headers of an allowed cross-site origin."""

    def __init__(self, app, access: Access, limits: Limits):
        self.app, self.access, self.limits = app, access, limits

    @staticmethod
    async def _refuse(send, e: ApiError, extra: Optional[dict] = None) -> None:
        body = json.dumps(e.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        for k, v in {**e.headers, **(extra or {})}.items():
            headers.append((k.lower().encode("latin-1"), str(v).encode("latin-1")))
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _origin_ok(self, origin: str, scope, host: Optional[str]) -> bool:
        o = origin.strip().rstrip("/").lower()
        allowed = self.access.cors_origins
        if "*" in allowed or o in allowed:
            return True
        # the server's own origin (a page it served, were there one): same scheme and Host
        return host is not None and o == f"{scope.get('scheme', 'http')}://{host.strip().lower()}"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        hs: dict = {}
        for k, v in scope.get("headers", []):
            hs.setdefault(k.decode("latin-1").lower(), []).append(v.decode("latin-1"))
        for name in ("host", "origin", "content-type", "content-length", "authorization"):
            if len(hs.get(name, ())) > 1:
                return await self._refuse(send, ApiError(400, f"more than one {name} header"))
        one = {k: v[0] for k, v in hs.items()}
        host = one.get("host")
        allowed = self.access.allowed_hosts
        if allowed is not None and host is not None and host_name(host) not in allowed:
            return await self._refuse(send, ApiError(
                403, f"Host {host_name(host)!r} is not a name this server answers to (it answers to "
                     f"{', '.join(sorted(allowed))}; add names with --allowed-host)", "permission_error",
                code="host_not_allowed"))
        origin = one.get("origin")
        method = scope.get("method", "GET")
        cors = {}
        if origin is not None:
            if not self._origin_ok(origin, scope, host):
                return await self._refuse(send, ApiError(
                    403, f"cross-site requests from {origin!r} are refused (allow an origin with --cors-origin)",
                    "permission_error", code="origin_not_allowed"))
            cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
            if method == "OPTIONS" and "access-control-request-method" in one:   # a CORS preflight
                headers = [(k.lower().encode(), v.encode()) for k, v in {
                    **cors, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": "Authorization, Content-Type",
                    "Access-Control-Max-Age": "600", "Content-Length": "0"}.items()]
                await send({"type": "http.response.start", "status": 204, "headers": headers})
                await send({"type": "http.response.body", "body": b""})
                return
        if self.access.api_keys and scope.get("path") != "/health":
            auth = one.get("authorization", "")
            given = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not key_matches(given, self.access.api_keys):
                return await self._refuse(send, ApiError(
                    401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error",
                    code="invalid_api_key"), cors)
        if method == "POST":
            ct = one.get("content-type")
            length = one.get("content-length")
            has_body = "transfer-encoding" in one or (length is not None and length.strip() not in ("", "0"))
            if (ct is not None or has_body) and not _json_type(ct or ""):
                return await self._refuse(send, ApiError(
                    415, f"POST bodies must be JSON with Content-Type: application/json (got "
                         f"{ct if ct is not None else 'no Content-Type'})", code="unsupported_media_type"), cors)
            if length is not None:
                try:
                    n = int(length)
                except ValueError:
                    return await self._refuse(send, ApiError(400, f"bad Content-Length {length!r}"), cors)
                if n > self.limits.max_body_bytes:
                    return await self._refuse(send, _too_large(n, self.limits), cors)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_cors(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) +
                               [(k.lower().encode(), v.encode()) for k, v in cors.items()])
            await send(message)
        return await self.app(scope, receive, send_cors)


def _too_large(n: Optional[int], limits: Limits) -> ApiError:
    what = f"{n} bytes" if n is not None else "more bytes"
    return ApiError(413, f"the request body has {what}; this server takes at most {limits.max_body_bytes} "
                         f"(--max-body-bytes)", code="request_too_large")


@dataclass
class Slot:
    id: int
    session: object
    busy: bool = False
    requests: int = 0
    generated: int = 0
    prompt_tokens: int = 0
    decode_s: float = 0.0
    cancelled: int = 0
    stats: dict = field(default_factory=dict)   # the pager's stats after the slot's last job (read while idle)

    def refresh(self) -> None:
        self.stats = dict(self.session.pager.stats, n_past=self.session.n_past)


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Slots:
    """The slots and who holds them; acquire() waits for a free one (the queue depth is the waiters),
    at most max_queue at a time."""

    def __init__(self, sessions, max_queue: Optional[int] = None, retry_after_s: int = 2):
        self.slots = [Slot(i, s) for i, s in enumerate(sessions)]
        for s in self.slots:
            s.refresh()
        self._cond: Optional[asyncio.Condition] = None
        self.waiting = 0
        self.max_queue, self.retry_after_s = max_queue, retry_after_s
        self.timeout_s: Optional[float] = None   # for the deadline's message
        self.refused = 0   # requests turned away with a full queue

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def acquire(self, ids, slot_id: Optional[int] = None, *, cancel: Optional[threading.Event] = None,
                      deadline: Optional[float] = None) -> Optional[Slot]:
        """A free slot, marked busy; None when cancel was set while waiting (the client went away).
        ApiError 503 when max_queue requests already wait, 504 when the deadline (time.monotonic())
        passes first."""
        def pick():
            free = [s for s in self.slots if not s.busy and (slot_id is None or s.id == slot_id)]
            if not free:
                return None
            best = max(free, key=lambda s: (_common(s.session.tokens, ids), -s.id))
            best.busy = True
            return best

        async with self.cond:
            best = pick()
            if best is not None:
                return best
            if self.max_queue is not None and self.waiting >= self.max_queue:
                self.refused += 1
                raise ApiError(503, f"the server is busy: {self.waiting} requests are waiting for a slot already "
                                    f"(--max-queue {self.max_queue}); retry later", "server_error",
                               code="queue_full", headers={"Retry-After": str(self.retry_after_s)})
            self.waiting += 1
            try:
                while True:
                    if cancel is not None and cancel.is_set():
                        return None
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise _deadline_error("while it waited for a free slot", self.timeout_s)
                    try:
                        await asyncio.wait_for(self.cond.wait(), 0.25 if left is None else min(0.25, left))
                    except asyncio.TimeoutError:
                        pass
                    best = pick()
                    if best is not None:
                        return best
            finally:
                self.waiting -= 1

    async def release(self, slot: Slot) -> None:
        async with self.cond:
            slot.refresh()
            slot.busy = False
            self.cond.notify_all()


class DeadlineExceeded(Exception):
    """A request passed its deadline (--timeout)."""


class _Cancelled(Exception):
    """The client went away: the prefill stops between two pieces."""


def _deadline_error(where: str, timeout_s: Optional[float] = None) -> ApiError:
    of = f" of {timeout_s:g} s" if timeout_s else ""
    return ApiError(504, f"the request passed its deadline{of} (--timeout) {where}", "timeout_error",
                    code="deadline_exceeded")


# ---------------------------------------------------------------- request checks

def _number(body: dict, name: str, default, lo=None, hi=None, *, integer=False, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f" in {'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else (f" >= {lo}" if lo is not None else "")
        raise ApiError(400, f"{name} must be {'an integer' if integer else 'a number'}{rng}, got {v!r}", param=name)
    return v


def _sampling(body: dict, default_max: int, cap: Optional[int] = None, cap_why: str = "") -> dict:
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
            raise ApiError(400, "stop must be a non-empty string or a list of up to 16 of them", param="stop")
        stop = stops
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ApiError(400, f"seed must be a non-negative integer, got {seed!r}", param="seed")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, f"ignore_eos must be true or false, got {ignore_eos!r}", param="ignore_eos")
    if cap is not None:
        default_max = min(default_max, cap)
    max_tokens = _number(body, "max_tokens", default_max, 0, integer=True)
    if cap is not None and max_tokens > cap:
        raise ApiError(400, f"max_tokens {max_tokens} is above this server's cap of {cap} tokens{cap_why}",
                       param="max_tokens", code="max_tokens_exceeded")
    return dict(max_tokens=max_tokens,
                temperature=float(_number(body, "temperature", 1.0, 0, 2)),
                top_p=float(_number(body, "top_p", 1.0, 0, 1, lo_open=True)),
                top_k=_number(body, "top_k", 0, 0, integer=True),
                min_p=float(_number(body, "min_p", 0.0, 0, 0.999)),
                stop=stop, seed=seed, ignore_eos=ignore_eos)


def _finish(reason: Optional[str]) -> str:
    return "length" if reason in ("length", "max_ctx") else "stop"


# ---------------------------------------------------------------- the work, in a thread

def _work(slot: Slot, ids: list, sp: dict, put, cancel: threading.Event, deadline: Optional[float] = None) -> None:
    """One request on its slot: prefill, then decode, each piece sent with put().  It stops when cancel is set
    (the client went away) or the deadline (time.monotonic()) passes: between two prefill pieces, or at the
    next token."""
    s = slot.session

    def check(p=None):
        if cancel.is_set():
            raise _Cancelled()
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlineExceeded("during the prompt's prefill")

    n_prompt = s.n_past
    try:
        check()
        s.continue_to(ids, progress=check, fresh_logits=False)   # a restored slot continues from its logits
        n_prompt = s.n_past
        t0 = time.perf_counter()
        gen = s.generate(None, **sp)
        late = False
        try:
            for piece in gen:
                if cancel.is_set():
                    break
                if deadline is not None and time.monotonic() > deadline:
                    late = True
                    break
                put(("text", piece))
        finally:
            gen.close()
        n_out = s.n_past - n_prompt
        slot.generated += n_out
        slot.prompt_tokens += len(ids)
        slot.decode_s += time.perf_counter() - t0
        if late:
            put(("error", DeadlineExceeded(f"after {n_out} generated tokens")))
            return
        put(("done", {"reason": "cancelled" if cancel.is_set() else s.finish_reason,
                      "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out,
                                "total_tokens": len(ids) + n_out}}))
    except _Cancelled:   # the prefill stopped between two pieces and took its tokens back
        slot.cancelled += 1
        put(("done", {"reason": "cancelled", "usage": {"prompt_tokens": len(ids), "completion_tokens": 0,
                                                       "total_tokens": len(ids)}}))
    except Exception as e:   # reported to the client; the slot stays usable (the session rewinds itself)
        put(("error", e))


# ---------------------------------------------------------------- the app

async def _watch_disconnect(request, cancel: threading.Event) -> None:
    """Set cancel once the client has gone (polled: uvicorn reports a closed connection to receive())."""
    try:
        while not cancel.is_set():
            if await request.is_disconnected():
                cancel.set()
                return
            await asyncio.sleep(0.1)
    except asyncio.CancelledError:
        pass


def _slot_files(save_dir: Path) -> list:
    """(name, bytes) of the snapshots in the slot directory: regular files whose names a request may use
    (a dot-file is a save in progress), symlinks left out."""
    out = []
    with os.scandir(save_dir) as it:
        for e in it:
            if e.name.startswith(".") or e.is_symlink():
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((e.name, st.st_size))
    return out


def create_app(sessions, *, model_name: str, api_key: Optional[str] = None,
               slot_save_path: Optional[os.PathLike] = None, default_max_tokens: int = 256,
               aliases: Sequence[str] = (), limits: Optional[Limits] = None, access: Optional[Access] = None):
    """The FastAPI app over these sessions (one slot each; they may share one Model).

    ``model_name`` is the id /v1/models lists; a request's ``model`` may also be any of ``aliases`` (the name
    or path the server was started with), the file's path, name or stem.  Any other id is refused (404) with
    the list of names that work: one model is served, and a client that asks for another should hear so.
    ``limits``: the request bounds (``Limits``); ``access``: keys, Host names and origins (``Access``; by
    default loopback names only, no cross-site origin, ``api_key`` if given)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from prometheus_client import CollectorRegistry, generate_latest, CONTENT_TYPE_LATEST
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    limits = limits or Limits()
    if access is None:
        access = Access(api_keys=(api_key,) if api_key else ())
    elif api_key and api_key not in access.api_keys:
        access = Access(api_keys=(*access.api_keys, api_key), allowed_hosts=access.allowed_hosts,
                        cors_origins=access.cors_origins)
    slots = Slots(sessions, max_queue=limits.max_queue if limits.max_queue >= 0 else None,
                  retry_after_s=limits.retry_after_s)
    slots.timeout_s = limits.timeout_s or None
    tasks: set = set()
    first = slots.slots[0].session
    max_ctx = first.max_ctx
    cap = min(limits.n_predict, max_ctx) if limits.n_predict and limits.n_predict > 0 else max_ctx
    cap_why = (f" (--n-predict {limits.n_predict})" if 0 < limits.n_predict < max_ctx else
               f" (the context, max_ctx {max_ctx})")
    save_dir = Path(slot_save_path).resolve() if slot_save_path is not None else None
    # slot work: one thread per slot (a job holds its slot), plus one for the slot actions' file checks;
    # text work (JSON, tokenizing, templates): two threads, so a huge prompt never holds up the event loop
    work_pool = ThreadPoolExecutor(max_workers=len(sessions) + 1, thread_name_prefix="kvflash-slot")
    text_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvflash-text")
    save_lock = asyncio.Lock()
    app = FastAPI(title="kvflash", docs_url=None, redoc_url=None, openapi_url=None)
    names = [model_name, *aliases, str(first.model_path), first.model_path.name, first.model_path.stem]
    names = list(dict.fromkeys(n for n in names if n))   # in that order, once each

    def _off_loop(fn, *a, **kw):
        return asyncio.get_running_loop().run_in_executor(text_pool, lambda: fn(*a, **kw))

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

    @app.exception_handler(RequestValidationError)
    async def _bad_params(request, e):
        return JSONResponse(ApiError(400, f"bad request parameters: {e.errors()}").body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    def _parse(raw: bytes) -> dict:
        try:
            body = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    async def _body(request) -> dict:
        chunks, n = [], 0
        async for c in request.stream():   # counted as it comes: a chunked body has no Content-Length
            n += len(c)
            if n > limits.max_body_bytes:
                raise _too_large(None, limits)
            chunks.append(c)
        raw = b"".join(chunks)
        body = await _off_loop(_parse, raw) if len(raw) > 65536 else _parse(raw)
        m = body.get("model")
        if m is not None and m not in names:
            raise ApiError(404, f"the model {m!r} does not exist: this server serves one model, "
                                f"named {', '.join(map(repr, names))}", code="model_not_found", param="model")
        return body

    def _deadline() -> Optional[float]:
        return time.monotonic() + limits.timeout_s if limits.timeout_s and limits.timeout_s > 0 else None

    def _slot_id(body) -> Optional[int]:
        v = body.get("id_slot")
        if v is None or v == -1:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < len(slots.slots):
            raise ApiError(400, f"id_slot must be in [0, {len(slots.slots)}) or -1, got {v!r}", param="id_slot")
        return v

    def _check_fits(ids, sp):
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(ids) >= max_ctx:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is {max_ctx} "
                                f"(max_ctx)", code="context_length_exceeded", param="prompt")
        bad = [i for i in ids if i < 0 or i >= first.hparams["n_vocab"]]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} outside [0, {first.hparams['n_vocab']})", param="prompt")

    def _failure(e: Exception) -> ApiError:
        if isinstance(e, DeadlineExceeded):
            return _deadline_error(str(e), limits.timeout_s)
        if isinstance(e, ValueError):
            return ApiError(400, str(e))
        return ApiError(500, f"{type(e).__name__}: {e}", "server_error")

    async def _run(request, ids, sp, slot_id, make_chunk, make_full, stream: bool, include_usage: bool,
                   deadline: Optional[float]):
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        watch = loop.create_task(_watch_disconnect(request, cancel))
        try:
            if deadline is not None and time.monotonic() > deadline:
                raise _deadline_error("while its prompt was tokenized", limits.timeout_s)
            slot = await slots.acquire(ids, slot_id, cancel=cancel, deadline=deadline)
        except BaseException:
            watch.cancel()
            raise
        if slot is None:   # the client went away while it waited: nobody reads this
            watch.cancel()
            return Response(status_code=499)
        slot.requests += 1
        q: asyncio.Queue = asyncio.Queue()

        def put(item):
            loop.call_soon_threadsafe(q.put_nowait, item)

        fut = loop.run_in_executor(work_pool, _work, slot, ids, sp, put, cancel, deadline)

        async def finish():
            try:
                await fut
            finally:
                watch.cancel()
                await slots.release(slot)

        rid = f"kvf-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if not stream:
            texts = []
            try:
                while True:
                    kind, val = await q.get()
                    if kind == "text":
                        texts.append(val)
                    elif kind == "error":
                        raise _failure(val)
                    else:
                        break
            finally:
                cancel.set()
                await finish()
            return JSONResponse(make_full(rid, created, slot.id, "".join(texts), _finish(val["reason"]), val["usage"]))

        # The slot goes back when the worker ends, whether or not the stream is ever read (a
        # client gone before its first byte); a stream that ends early cancels the worker.
        done = loop.create_task(finish())
        tasks.add(done)   # a strong reference until it ends
        done.add_done_callback(tasks.discard)

        async def events():
            try:
                while True:
                    kind, val = await q.get()
                    if kind == "text":
                        yield f"data: {json.dumps(make_chunk(rid, created, val, None))}\n\n"
                    elif kind == "error":
                        yield f"data: {json.dumps(_failure(val).body())}\n\n"
                        break
                    else:
                        last = make_chunk(rid, created, "", _finish(val["reason"]))
                        if include_usage:
                            last["usage"] = val["usage"]
                        yield f"data: {json.dumps(last)}\n\n"
                        yield "data: [DONE]\n\n"
                        break
            finally:
                cancel.set()   # a client that went away: the worker stops at its next token or prefill piece

        return StreamingResponse(events(), media_type="text/event-stream")

    def _stream_flags(body):
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, f"stream must be true or false, got {stream!r}", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options")
        return stream, bool(opts.get("include_usage"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        deadline = _deadline()
        body = await _body(request)
        sp = _sampling(body, 16, cap, cap_why)
        stream, include_usage = _stream_flags(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            # llama.cpp's server: special-token text in a raw prompt is parsed into special tokens
            ids = await _off_loop(first.tokenize, prompt, add_special=True, parse_special=True)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        _check_fits(ids, sp)

        def chunk(rid, created, text, reason):
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

        def full(rid, created, slot_id, text, reason, usage):
            d = chunk(rid, created, text, reason)
            d["usage"] = usage
            d["id_slot"] = slot_id
            return d

        return await _run(request, ids, sp, _slot_id(body), chunk, full, stream, include_usage, deadline)

    def _chat_ids(msgs) -> list:
        try:
            return first.tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in msgs],
                                               add_generation_prompt=True)
        except Exception as e:   # the template refused the conversation
            raise ApiError(400, f"the chat template cannot render these messages: {e}", param="messages") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        deadline = _deadline()
        body = await _body(request)
        sp = _sampling(body, default_max_tokens, cap, cap_why)
        stream, include_usage = _stream_flags(body)
        msgs = body.get("messages")
        if (not isinstance(msgs, list) or not msgs or
                not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in msgs)):
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects with string content",
                           param="messages")
        bad = [m["role"] for m in msgs if not ROLE_RE.fullmatch(m["role"])]
        if bad:
            raise ApiError(400, f"a message's role must be a plain name (letters, digits, '_', '-'), got "
                                f"{bad[0][:80]!r}", param="messages")
        ids = await _off_loop(_chat_ids, msgs)
        _check_fits(ids, sp)

        def chunk(rid, created, text, reason):
            delta = {"content": text} if text else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        def full(rid, created, slot_id, text, reason, usage):
            return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                 "finish_reason": reason}], "usage": usage, "id_slot": slot_id}

        return await _run(request, ids, sp, _slot_id(body), chunk, full, stream, include_usage, deadline)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvflash",
                                            "meta": {"n_ctx": max_ctx, "pool_tokens": first.runtime.pool_tokens,
                                                     "slots": len(slots.slots), "n_predict": cap}}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "slots_idle": sum(not s.busy for s in slots.slots),
                "slots_processing": sum(s.busy for s in slots.slots)}

    @app.get("/slots")
    async def list_slots():
        return [{"id": s.id, "is_processing": s.busy, "n_ctx": s.session.max_ctx,
                 "pool_tokens": s.session.runtime.pool_tokens, "n_past": s.stats.get("n_past", 0),
                 "host_chunks": s.stats.get("host_chunks", 0), "resident_chunks": s.stats.get("resident_chunks", 0),
                 "policy": s.session.policy.name} for s in slots.slots]

    def _snapshot_path(body) -> Path:
        if save_dir is None:
            raise ApiError(400, "slot save/restore is off: start the server with --slot-save-path DIR",
                           code="not_supported")
        name = body.get("filename")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}", name) or ".." in name:
            raise ApiError(400, "filename must be a plain file name (letters, digits, '.', '_', '-'; no path)",
                           param="filename")
        p = save_dir / name
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return p
        except OSError as e:
            raise ApiError(400, f"{name}: {e.strerror}", param="filename") from None
        if stat.S_ISLNK(st.st_mode):   # never followed: it could point anywhere
            raise ApiError(400, f"{name} is a symbolic link in the slot save path; slot files must be regular files",
                           param="filename", code="not_a_regular_file")
        if not stat.S_ISREG(st.st_mode):
            raise ApiError(400, f"{name} is not a regular file", param="filename", code="not_a_regular_file")
        return p

    def _save_within_quota(s, path: Path) -> int:
        """Session.save into a hidden temporary file, then renamed over path if the directory stays within
        the quota; otherwise removed (ApiError 409), nothing else changed.  Returns the file's bytes."""
        files = [(n, b) for n, b in _slot_files(save_dir) if n != path.name]
        if limits.slot_max_files and len(files) + 1 > limits.slot_max_files:
            raise ApiError(409, f"the slot save path holds {len(files)} snapshots; this server keeps at most "
                                f"{limits.slot_max_files} (--slot-save-max-files): erase or overwrite one",
                           code="slot_quota_exceeded")
        used = sum(b for _, b in files)
        if limits.slot_max_bytes and used >= limits.slot_max_bytes:
            raise ApiError(409, f"the slot save path holds {used} bytes of snapshots; this server keeps at most "
                                f"{limits.slot_max_bytes} (--slot-save-max-bytes)", code="slot_quota_exceeded")
        tmp = save_dir / f".kvflash-save-{uuid.uuid4().hex}"
        try:
            s.save(tmp)
            size = os.lstat(tmp).st_size
            if limits.slot_max_bytes and used + size > limits.slot_max_bytes:
                raise ApiError(409, f"this snapshot has {size} bytes; with the {used} already in the slot save "
                                    f"path that passes its quota of {limits.slot_max_bytes} (--slot-save-max-bytes); "
                                    f"nothing was written", code="slot_quota_exceeded")
            os.replace(tmp, path)   # replaces a name, never follows one
            return size
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: int, request: Request, action: str = ""):
        if not 0 <= slot_id < len(slots.slots):
            raise ApiError(404, f"no slot {slot_id}: this server has {len(slots.slots)}", code="slot_not_found")
        if action not in ("save", "restore", "erase"):
            raise ApiError(400, f"action must be save, restore or erase, got {action!r}", param="action")
        body = await _body(request) if action != "erase" else {}
        path = _snapshot_path(body) if action != "erase" else None
        if action == "restore" and not path.exists():
            raise ApiError(404, f"no snapshot {path.name} in the slot save path", code="file_not_found")
        slot = await slots.acquire([], slot_id, deadline=_deadline())
        try:
            s = slot.session
            t0 = time.perf_counter()
            loop = asyncio.get_running_loop()
            if action == "erase":
                n = s.n_past
                await loop.run_in_executor(work_pool, s.reset)
                return {"id_slot": slot_id, "n_erased": n}
            if action == "save":
                async with save_lock:   # one save at a time: the quota is checked against the others' files
                    size = await loop.run_in_executor(work_pool, _save_within_quota, s, path)
                return {"id_slot": slot_id, "filename": path.name, "n_saved": s.n_past,
                        "n_written": size, "timings": {"save_ms": 1e3 * (time.perf_counter() - t0)}}
            path = _snapshot_path(body)   # checked again, now that the slot is ours
            try:
                await loop.run_in_executor(work_pool, s.restore, path)
            except ValueError as e:
                raise ApiError(400, str(e), code="snapshot_refused") from None
            except FileNotFoundError:
                raise ApiError(404, f"no snapshot {path.name} in the slot save path", code="file_not_found") from None
            return {"id_slot": slot_id, "filename": path.name, "n_restored": s.n_past,
                    "n_read": path.stat().st_size, "timings": {"restore_ms": 1e3 * (time.perf_counter() - t0)}}
        finally:
            await slots.release(slot)

    class _Collector:
        def collect(self):
            per = {
                "n_past": ("kvflash_slot_n_past", "tokens in the slot's context"),
                "resident_chunks": ("kvflash_slot_resident_chunks", "chunks holding a pool block"),
                "host_chunks": ("kvflash_slot_host_chunks", "chunks held only in the host store"),
                "host_bytes": ("kvflash_slot_host_bytes", "bytes in the host store"),
            }
            for key, (name, doc) in per.items():
                g = GaugeMetricFamily(name, doc, labels=["slot"])
                for s in slots.slots:
                    g.add_metric([str(s.id)], float(s.stats.get(key, 0)))
                yield g
            for key, (name, doc) in {"page_outs": ("kvflash_slot_page_outs", "chunks paged out"),
                                     "page_ins": ("kvflash_slot_page_ins", "chunks paged in")}.items():
                c = CounterMetricFamily(name, doc, labels=["slot"])
                for s in slots.slots:
                    c.add_metric([str(s.id)], float(s.stats.get(key, 0)))
                yield c
            c = CounterMetricFamily("kvflash_tokens_generated", "tokens generated", labels=["slot"])
            r = CounterMetricFamily("kvflash_requests", "requests served", labels=["slot"])
            g = GaugeMetricFamily("kvflash_decode_tokens_per_second", "generated tokens over decode time",
                                  labels=["slot"])
            for s in slots.slots:
                c.add_metric([str(s.id)], float(s.generated))
                r.add_metric([str(s.id)], float(s.requests))
                g.add_metric([str(s.id)], s.generated / s.decode_s if s.decode_s > 0 else 0.0)
            yield c
            yield r
            yield g
            yield GaugeMetricFamily("kvflash_queue_depth", "requests waiting for a slot", value=float(slots.waiting))
            yield CounterMetricFamily("kvflash_requests_refused_queue_full", "requests refused: the queue was full",
                                      value=float(slots.refused))
            c = CounterMetricFamily("kvflash_requests_cancelled_in_prefill", "prefills stopped by a client that "
                                    "went away", labels=["slot"])
            for s in slots.slots:
                c.add_metric([str(s.id)], float(s.cancelled))
            yield c
            yield GaugeMetricFamily("kvflash_slots_processing", "slots busy",
                                    value=float(sum(s.busy for s in slots.slots)))

    registry = CollectorRegistry()
    registry.register(_Collector())

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(_Guard, access=access, limits=limits)
    app.state.slots = slots
    app.state.limits = limits
    app.state.access = access
    return app


def read_api_keys(args, environ=None) -> tuple:
    """The API keys from --api-key, --api-key-file (one per line; blank lines and '#' comments skipped) and the
    KVFLASH_API_KEY environment variable, in that order, each once."""
    environ = os.environ if environ is None else environ
    keys = []
    if getattr(args, "api_key", None):
        keys.append(args.api_key)
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"kvflash serve: --api-key-file {path}: {getattr(e, 'strerror', None) or e}") from None
        got = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not got:
            raise SystemExit(f"kvflash serve: --api-key-file {path} holds no key")
        keys += got
    if environ.get(API_KEY_ENV, "").strip():
        keys.append(environ[API_KEY_ENV].strip())
    return tuple(dict.fromkeys(k for k in keys if k))


def _allowed_hosts(args) -> Optional[frozenset]:
    """The Host names to answer to: loopback, the bound address (a wildcard bind: this machine's name and
    addresses), --allowed-host ('*': any)."""
    extra = list(getattr(args, "allowed_host", None) or [])
    if "*" in extra:
        return None
    hosts = set(LOOPBACK_NAMES) | {host_name(h) for h in extra}
    if args.host in ("0.0.0.0", "::", ""):
        names = {socket.gethostname(), socket.getfqdn()}
        for n in list(names):
            try:
                names |= {ai[4][0] for ai in socket.getaddrinfo(n, None)}
            except OSError:
                pass
        hosts |= {n.lower() for n in names if n}
    else:
        hosts.add(args.host.strip("[]").lower())
    return frozenset(hosts)


def serve(args) -> int:
    """``kvflash serve`` (argparse namespace from cli.py)."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise SystemExit(f"kvflash serve needs the serve extra: pip install 'kvflash[serve]' ({e})") from None
    from . import _core
    from ._args import exact_prefill_arg
    from ._args import pool_arg as _pool_arg
    from .models import resolve_model
    from .session import Session
    # long prompts are tokenized with the GIL released (Tokenizer.encode): in this thread, not rayon's pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    keys = read_api_keys(args)
    if not is_loopback(args.host) and not keys:
        raise SystemExit(f"kvflash serve: binding {args.host} (not loopback) needs --api-key (or --api-key-file, "
                         f"or {API_KEY_ENV} in the environment)")
    if args.parallel < 1:
        raise SystemExit("kvflash serve: --parallel must be >= 1")
    if args.slot_save_path is not None and not os.path.isdir(args.slot_save_path):
        raise SystemExit(f"kvflash serve: --slot-save-path {args.slot_save_path} is not a directory")
    ssl_key, ssl_cert = getattr(args, "ssl_key_file", None), getattr(args, "ssl_cert_file", None)
    if (ssl_key is None) != (ssl_cert is None):
        raise SystemExit("kvflash serve: TLS needs both --ssl-key-file and --ssl-cert-file")
    for flag, f in (("--ssl-key-file", ssl_key), ("--ssl-cert-file", ssl_cert)):
        if f is not None and not os.path.isfile(f):
            raise SystemExit(f"kvflash serve: {flag} {f} is not a file")
    limits = Limits(max_body_bytes=args.max_body_bytes, n_predict=args.n_predict, max_queue=args.max_queue,
                    timeout_s=args.timeout, slot_max_files=args.slot_save_max_files,
                    slot_max_bytes=args.slot_save_max_bytes)
    for name, v in (("--max-body-bytes", limits.max_body_bytes), ("--max-queue", limits.max_queue),
                    ("--timeout", limits.timeout_s), ("--slot-save-max-files", limits.slot_max_files),
                    ("--slot-save-max-bytes", limits.slot_max_bytes)):
        if v < 0:
            raise SystemExit(f"kvflash serve: {name} must be >= 0, got {v}")
    if limits.max_body_bytes == 0:
        raise SystemExit("kvflash serve: --max-body-bytes must be > 0")
    if args.n_predict == 0 or args.n_predict < -1:
        raise SystemExit(f"kvflash serve: --n-predict must be -1 (max_ctx) or > 0, got {args.n_predict}")
    access = Access(api_keys=keys, allowed_hosts=_allowed_hosts(args),
                    cors_origins=frozenset(o.strip().rstrip("/").lower() for o in (args.cors_origin or [])))
    path = resolve_model(args.model)
    from .system import usable_cores
    from .devices import resolve_device
    from ._checks import rpc_args
    rpc, split = rpc_args(getattr(args, "rpc", None), getattr(args, "tensor_split", None))
    model = _core.Model(str(path), args.threads or usable_cores(), device=resolve_device(args.device), rpc=rpc,
                        tensor_split=split)
    sessions = [Session(model, max_ctx=args.max_ctx, kvflash=_pool_arg(args.kvflash), policy=args.kvflash_policy,
                        drafter=args.prefill_drafter, tau=args.kvflash_tau, kv_type=args.kv_type, seed=args.seed,
                        allow_long_ctx=args.allow_long_ctx, exact=getattr(args, "kvflash_exact", False),
                        exact_prefill=exact_prefill_arg(getattr(args, "kvflash_exact_prefill", "auto")),
                        prefill_rescore=getattr(args, "kvflash_prefill_rescore", 0),
                        prefill_reread=getattr(args, "kvflash_prefill_reread", False),
                        chunk_tokens=getattr(args, "kvflash_chunk_tokens", "auto"),
                        verbose=i == 0) for i in range(args.parallel)]
    # the id it lists: --alias, else the registry name it was started with, else the file's stem; the name or
    # path it was started with is always accepted
    is_name = os.sep not in args.model and not args.model.endswith(".gguf")
    app = create_app(sessions, model_name=args.alias or (args.model if is_name else path.stem),
                     slot_save_path=args.slot_save_path, aliases=[args.model], limits=limits, access=access)
    concurrency = args.limit_concurrency or args.parallel + limits.max_queue + 32
    max_ctx = sessions[0].max_ctx
    cap = min(limits.n_predict, max_ctx) if limits.n_predict > 0 else max_ctx
    scheme = "https" if ssl_cert else "http"
    print(f"[kvflash] serving {path.name} on {scheme}://{args.host}:{args.port} ({args.parallel} slot"
          f"{'s' if args.parallel > 1 else ''}, OpenAI-compatible /v1; max_tokens <= {cap}, queue "
          f"{limits.max_queue}, timeout {limits.timeout_s:g} s, {concurrency} connections"
          f"{', API key required' if keys else ''})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", limit_concurrency=concurrency,
                ssl_keyfile=ssl_key, ssl_certfile=ssl_cert)
    return 0
