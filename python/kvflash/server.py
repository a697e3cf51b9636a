"""``kvflash serve``: an OpenAI-compatible HTTP server over kvflash Sessions (FastAPI + uvicorn,
the ``serve`` extra).

Slots: ``--parallel N`` Sessions over one loaded Model, each with its own pool and host store.  A
request takes the free slot whose cached tokens share the longest prefix with its prompt (or the one
it names with ``id_slot``), waiting while none is free.  The blocking work (prefill, decode, snapshot
files) runs in a worker thread; the event loop only moves text.  A client that disconnects from a
stream cancels its generation at the next token.  Slot snapshots are ``Session.save`` files, confined
to ``--slot-save-path``.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (SSE when ``stream``), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus text), ``GET /slots``, ``POST /slots/{id}?action=save|restore|erase``.
Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status.
"""
# No `from __future__ import annotations`: FastAPI reads the route functions' annotations (Request) at run time.

import asyncio
import json
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Slot:
    id: int
    session: object
    busy: bool = False
    requests: int = 0
    generated: int = 0
    prompt_tokens: int = 0
    decode_s: float = 0.0
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
    """The slots and who holds them; acquire() waits for a free one (the queue depth is the waiters)."""

    def __init__(self, sessions):
        self.slots = [Slot(i, s) for i, s in enumerate(sessions)]
        for s in self.slots:
            s.refresh()
        self._cond: Optional[asyncio.Condition] = None
        self.waiting = 0

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def acquire(self, ids, slot_id: Optional[int] = None) -> Slot:
        async with self.cond:
            self.waiting += 1
            try:
                while True:
                    free = [s for s in self.slots if not s.busy and (slot_id is None or s.id == slot_id)]
                    if free:
                        best = max(free, key=lambda s: (_common(s.session.tokens, ids), -s.id))
                        best.busy = True
                        return best
                    await self.cond.wait()
            finally:
                self.waiting -= 1

    async def release(self, slot: Slot) -> None:
        async with self.cond:
            slot.refresh()
            slot.busy = False
            self.cond.notify_all()


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


def _sampling(body: dict, default_max: int) -> dict:
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
    return dict(max_tokens=_number(body, "max_tokens", default_max, 0, integer=True),
                temperature=float(_number(body, "temperature", 1.0, 0, 2)),
                top_p=float(_number(body, "top_p", 1.0, 0, 1, lo_open=True)),
                top_k=_number(body, "top_k", 0, 0, integer=True),
                min_p=float(_number(body, "min_p", 0.0, 0, 0.999)),
                stop=stop, seed=seed, ignore_eos=ignore_eos)


def _finish(reason: Optional[str]) -> str:
    return "length" if reason in ("length", "max_ctx") else "stop"


# ---------------------------------------------------------------- the work, in a thread

def _prepare(s, ids: list) -> None:
    """Bring the session's context to ids, reusing the longest cached prefix."""
    toks = s.tokens
    common = _common(toks, ids)
    if common == len(ids) == len(toks) and s._last_logits is not None:
        return   # the context is the prompt already: continue from its logits (a restored slot, exactly)
    if common == len(ids):
        common -= 1   # evaluate the last prompt token again, for its logits
    if common < len(toks):
        if common <= 0:
            s.reset()
            common = 0
        else:
            try:
                s.truncate(common)
            except ValueError:   # gemma3's ring cannot rewind that far
                s.reset()
                common = 0
    if common < len(ids):
        s.prefill(ids[common:])


def _work(slot: Slot, ids: list, sp: dict, put, cancel: threading.Event) -> None:
    s = slot.session
    try:
        _prepare(s, ids)
        n_prompt = s.n_past
        t0 = time.perf_counter()
        gen = s.generate(None, **sp)
        try:
            for piece in gen:
                if cancel.is_set():
                    break
                put(("text", piece))
        finally:
            gen.close()
        n_out = s.n_past - n_prompt
        slot.generated += n_out
        slot.prompt_tokens += len(ids)
        slot.decode_s += time.perf_counter() - t0
        put(("done", {"reason": "cancelled" if cancel.is_set() else s.finish_reason,
                      "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out,
                                "total_tokens": len(ids) + n_out}}))
    except Exception as e:   # reported to the client; the slot stays usable (the session rewinds itself)
        put(("error", e))


# ---------------------------------------------------------------- the app

def create_app(sessions, *, model_name: str, api_key: Optional[str] = None,
               slot_save_path: Optional[os.PathLike] = None, default_max_tokens: int = 256,
               aliases: Sequence[str] = ()):
    """The FastAPI app over these sessions (one slot each; they may share one Model).

    ``model_name`` is the id /v1/models lists; a request's ``model`` may also be any of ``aliases`` (the name
    or path the server was started with), the file's path, name or stem.  Any other id is refused (404) with
    the list of names that work: one model is served, and a client that asks for another should hear so."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CollectorRegistry, generate_latest, CONTENT_TYPE_LATEST
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    slots = Slots(sessions)
    tasks: set = set()
    first = slots.slots[0].session
    save_dir = Path(slot_save_path).resolve() if slot_save_path is not None else None
    app = FastAPI(title="kvflash", docs_url=None, redoc_url=None, openapi_url=None)
    names = [model_name, *aliases, str(first.model_path), first.model_path.name, first.model_path.stem]
    names = list(dict.fromkeys(n for n in names if n))   # in that order, once each

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_params(request, e):
        return JSONResponse(ApiError(400, f"bad request parameters: {e.errors()}").body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    @app.middleware("http")
    async def _auth(request, call_next):
        if api_key is not None and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                e = ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error",
                             code="invalid_api_key")
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    async def _body(request) -> dict:
        try:
            body = json.loads(await request.body() or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        m = body.get("model")
        if m is not None and m not in names:
            raise ApiError(404, f"the model {m!r} does not exist: this server serves one model, "
                                f"named {', '.join(map(repr, names))}", code="model_not_found", param="model")
        return body

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
        if len(ids) >= first.max_ctx:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is {first.max_ctx} "
                                f"(max_ctx)", code="context_length_exceeded", param="prompt")
        bad = [i for i in ids if i < 0 or i >= first.hparams["n_vocab"]]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} outside [0, {first.hparams['n_vocab']})", param="prompt")

    async def _run(request, ids, sp, slot_id, make_chunk, make_full, stream: bool, include_usage: bool):
        slot = await slots.acquire(ids, slot_id)
        slot.requests += 1
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def put(item):
            loop.call_soon_threadsafe(q.put_nowait, item)

        fut = loop.run_in_executor(None, _work, slot, ids, sp, put, cancel)

        async def finish():
            try:
                await fut
            finally:
                await slots.release(slot)

        def failure(e: Exception) -> ApiError:
            if isinstance(e, ValueError):
                return ApiError(400, str(e))
            return ApiError(500, f"{type(e).__name__}: {e}", "server_error")

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
                        raise failure(val)
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
                        yield f"data: {json.dumps(failure(val).body())}\n\n"
                        break
                    else:
                        last = make_chunk(rid, created, "", _finish(val["reason"]))
                        if include_usage:
                            last["usage"] = val["usage"]
                        yield f"data: {json.dumps(last)}\n\n"
                        yield "data: [DONE]\n\n"
                        break
            finally:
                cancel.set()   # a client that went away: the worker stops at its next token

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        sp = _sampling(body, 16)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = first.tokenize(prompt, add_special=True, parse_special=True)
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

        return await _run(request, ids, sp, _slot_id(body), chunk, full, bool(body.get("stream")),
                          bool((body.get("stream_options") or {}).get("include_usage")))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request)
        sp = _sampling(body, default_max_tokens)
        msgs = body.get("messages")
        if (not isinstance(msgs, list) or not msgs or
                not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in msgs)):
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects with string content",
                           param="messages")
        try:   # the template's markers are special tokens; the messages' content is text
            ids = first.tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in msgs],
                                              add_generation_prompt=True)
        except Exception as e:   # the template refused the conversation
            raise ApiError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        _check_fits(ids, sp)

        def chunk(rid, created, text, reason):
            delta = {"content": text} if text else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        def full(rid, created, slot_id, text, reason, usage):
            return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                 "finish_reason": reason}], "usage": usage, "id_slot": slot_id}

        return await _run(request, ids, sp, _slot_id(body), chunk, full, bool(body.get("stream")),
                          bool((body.get("stream_options") or {}).get("include_usage")))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvflash",
                                            "meta": {"n_ctx": first.max_ctx, "pool_tokens": first.runtime.pool_tokens,
                                                     "slots": len(slots.slots)}}]}

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
        p = (save_dir / name).resolve()
        if p.parent != save_dir:
            raise ApiError(400, "filename escapes --slot-save-path", param="filename")
        return p

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
        slot = await slots.acquire([], slot_id)
        try:
            s = slot.session
            t0 = time.perf_counter()
            loop = asyncio.get_running_loop()
            if action == "erase":
                n = s.n_past
                await loop.run_in_executor(None, s.reset)
                return {"id_slot": slot_id, "n_erased": n}
            if action == "save":
                await loop.run_in_executor(None, s.save, path)
                return {"id_slot": slot_id, "filename": path.name, "n_saved": s.n_past,
                        "n_written": path.stat().st_size, "timings": {"save_ms": 1e3 * (time.perf_counter() - t0)}}
            try:
                await loop.run_in_executor(None, s.restore, path)
            except ValueError as e:
                raise ApiError(400, str(e), code="snapshot_refused") from None
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
            yield GaugeMetricFamily("kvflash_slots_processing", "slots busy",
                                    value=float(sum(s.busy for s in slots.slots)))

    registry = CollectorRegistry()
    registry.register(_Collector())

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    app.state.slots = slots
    return app


def serve(args) -> int:
    """``kvflash serve`` (argparse namespace from cli.py)."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise SystemExit(f"kvflash serve needs the serve extra: pip install 'kvflash[serve]' ({e})") from None
    from . import _core
    from .cli import _pool_arg
    from .models import resolve_model
    from .session import Session
    if args.host not in LOOPBACK and not args.api_key:
        raise SystemExit(f"kvflash serve: binding {args.host} (not loopback) needs --api-key")
    if args.parallel < 1:
        raise SystemExit("kvflash serve: --parallel must be >= 1")
    if args.slot_save_path is not None and not os.path.isdir(args.slot_save_path):
        raise SystemExit(f"kvflash serve: --slot-save-path {args.slot_save_path} is not a directory")
    path = resolve_model(args.model)
    from .system import usable_cores
    from .devices import resolve_device
    from .session import _rpc_args
    rpc, split = _rpc_args(getattr(args, "rpc", None), getattr(args, "tensor_split", None))
    model = _core.Model(str(path), args.threads or usable_cores(), device=resolve_device(args.device), rpc=rpc,
                        tensor_split=split)
    sessions = [Session(model, max_ctx=args.max_ctx, kvflash=_pool_arg(args.kvflash), policy=args.kvflash_policy,
                        drafter=args.prefill_drafter, tau=args.kvflash_tau, kv_type=args.kv_type, seed=args.seed,
                        allow_long_ctx=args.allow_long_ctx, exact=getattr(args, "kvflash_exact", False),
                        exact_prefill=getattr(args, "kvflash_exact_prefill", False),
                        verbose=i == 0) for i in range(args.parallel)]
    # the id it lists: --alias, else the registry name it was started with, else the file's stem; the name or
    # path it was started with is always accepted
    is_name = os.sep not in args.model and not args.model.endswith(".gguf")
    app = create_app(sessions, model_name=args.alias or (args.model if is_name else path.stem), api_key=args.api_key,
                     slot_save_path=args.slot_save_path, aliases=[args.model])
    print(f"[kvflash] serving {path.name} on http://{args.host}:{args.port} ({args.parallel} slot"
          f"{'s' if args.parallel > 1 else ''}, OpenAI-compatible /v1)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
