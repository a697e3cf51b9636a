"""kvflash.Session: a model, its paged KV pool, a tokenizer and a residency policy."""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple, Optional, Sequence, Union

import numpy as np

from . import _core
from .devices import resolve_device
from .models import DEFAULT_MODEL, resolve_model
from .policies import ChunkView, LRUPolicy, Policy, validate_scores
from .system import available_ram, usable_cores
from .tokenizer import StreamDecoder, Tokenizer

AUTO_CAP_TOKENS = 16384
DRAFTER_DIRS = ("drafter", "draft")


class PrefillProgress(NamedTuple):
    """Where a prefill stands (``Session.prefill(progress=...)``): tokens done of total, seconds since it
    started, chunks paged out to the host store so far, and whether this is the final report."""
    done: int
    total: int
    elapsed_s: float
    page_outs: int
    finished: bool

    @property
    def tok_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> Optional[float]:
        """Seconds left at the rate so far (None before any token is done)."""
        return (self.total - self.done) / self.tok_s if self.done and self.tok_s > 0 else None

    def line(self) -> str:
        """One line for a terminal: 'prefill 2048/8192 tokens (25%), 812 tok/s, ETA 8 s, 12 page-outs'."""
        pct = 100 * self.done // max(self.total, 1)
        eta = "" if self.finished or self.eta_s is None else f", ETA {self.eta_s:.0f} s"
        took = f" in {self.elapsed_s:.1f} s" if self.finished else ""
        return (f"prefill {self.done}/{self.total} tokens ({pct}%){took}, {self.tok_s:.0f} tok/s{eta}, "
                f"{self.page_outs} page-outs")


def kv_bytes_per_token(hp: dict, kv_type: str, n_paged_layers: int) -> float:
    """Bytes of K+V per token across the paged layers, for a KV type."""
    block_bytes, block_elems = _core.kv_type_size(kv_type)  # ggml's type traits
    per_elem = block_bytes / block_elems
    return 2 * hp["head_dim"] * hp["n_head_kv"] * per_elem * n_paged_layers


def auto_pool(hp: dict, kv_type: str, n_paged_layers: int, weight_bytes: int, max_ctx: int,
              expect_drafter: bool, *, free_bytes: Optional[int] = None,
              cap_tokens: int = AUTO_CAP_TOKENS, device: str = "cpu") -> tuple[int, str]:
    """Pool size for kvflash="auto" and the reason, as the banner prints it.

    CPU: a share of available RAM after the weights and a headroom (more when a
    drafter is expected), halved, capped, rounded to 256, floor at the minimum
    pool, never above max_ctx.
    CUDA (device "cuda:N"): the same rule over free device memory, which the caller
    passes as free_bytes = Model.device_memory()[0], queried after the weights were
    loaded (so they are not subtracted again); the headroom is for compute buffers
    and cuBLAS workspaces, plus the reserve when a drafter is expected.
    """
    floor = _core.min_pool_tokens()
    drafter_reserve = 768 << 20 if expect_drafter else 0
    if device.startswith("cuda"):
        if free_bytes is None:
            raise ValueError("auto_pool on CUDA needs free_bytes (free device memory after the weights)")
        free = free_bytes
        budget = max(0, free - (512 << 20) - drafter_reserve) // 2
        where = f"half of free {device} memory after weights and headroom, {free / 2**20:.0f} MiB free"
    else:
        free = available_ram() if free_bytes is None else free_bytes
        budget = max(0, free - weight_bytes - (1 << 30) - drafter_reserve) // 2
        where = "half of free RAM after weights and headroom"
    per_tok = kv_bytes_per_token(hp, kv_type, n_paged_layers)
    tokens = int(budget // per_tok) if per_tok > 0 else cap_tokens
    why = f"{budget / 2**20:.0f} MiB budget ({where})"
    if tokens > cap_tokens:
        tokens, why = cap_tokens, f"capped at {cap_tokens} ({why})"
    tokens = tokens // 256 * 256
    if tokens < floor:
        tokens, why = floor, f"floor {floor} ({why})"
    ctx_cap = (max_ctx + 255) // 256 * 256
    if tokens > ctx_cap:
        tokens, why = max(floor, ctx_cap), f"max_ctx {max_ctx} fits ({why})"
    return tokens, why


def find_drafter(model_path: Path) -> Optional[Path]:
    """A drafter GGUF next to the model, or in drafter/ or draft/ beside it."""
    here = model_path.parent
    for d in DRAFTER_DIRS:
        cand = sorted((here / d).glob("*.gguf")) if (here / d).is_dir() else []
        if cand:
            return cand[0]
    return None


SNAPSHOT_APP_VERSION = 2   # the layout of the session's own JSON inside a snapshot (its APPS section); 2: no paths


def _check_max_bytes(max_bytes):
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1):
        raise ValueError(f"max_bytes must be a positive integer (bytes) or None (no cap of yours), got {max_bytes!r}")


def _read_snapshot(path, runtime=None, max_bytes=None):
    """The core's Snapshot of path, checked against runtime (its geometry caps the file) and max_bytes."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"snapshot {p} does not exist")
    _check_max_bytes(max_bytes)
    return _core.Snapshot.read(p, runtime=runtime, max_bytes=max_bytes or 0)


def _peek_snapshot(path, runtime=None, max_bytes=None):
    """(header, app bytes, checked session state) of a snapshot, from small reads (Snapshot.peek; runtime's
    geometry and max_bytes cap the file's size)."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"snapshot {p} does not exist")
    _check_max_bytes(max_bytes)
    head, app_bytes = _core.Snapshot.peek(p, runtime=runtime, max_bytes=max_bytes or 0)
    return head, app_bytes, _snapshot_app(app_bytes, head, path)


def _is_int(v, lo=None, hi=None) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo) and (hi is None or v <= hi))


def _opt_int(lo=None, hi=None):
    return lambda v: v is None or _is_int(v, lo, hi)


def _int(lo=None, hi=None):
    return lambda v: _is_int(v, lo, hi)


def _one_of(*vals):
    return lambda v: isinstance(v, str) and v in vals


def _is_bool(v) -> bool:
    return isinstance(v, bool)


_I32 = 2**31 - 1
# Every field of the session's JSON (save() writes exactly these), with the values load/restore accept.
_APP_CONFIG = {
    "max_ctx": _int(1, _core.MAX_CONTEXT), "kvflash": _opt_int(1, _core.MAX_CONTEXT), "tau": _int(1, _I32),
    "kv_type": _one_of("f16", "q8_0", "q4_0"), "chunk_tokens": _int(1, 4096), "sink_chunks": _int(0, _I32),
    "tail_window_chunks": _int(0, _I32), "ubatch": _int(1, _I32), "reeval_tokens": _int(1, _I32),
    "seed": _opt_int(0, 2**64 - 1), "allow_long_ctx": _is_bool, "exact": _is_bool,
    "exact_draft": lambda v: v is None or _is_int(v, 0, MAX_DRAFT), "exact_prefill": _is_bool,
}
_APP_QK = {"mode": lambda v: isinstance(v, str) and len(v) <= 64, "n_queries": _int(1, 256),
           "smooth_width": _int(0, 4096), "aggregate": lambda v: v is None or isinstance(v, str) and len(v) <= 64,
           "contrast": _opt_int(0, _I32), "spread": _opt_int(0, _I32),
           "layers": lambda v: v is None or v == "auto" or _is_int(v, 1, _I32), "carry": _opt_int(0, _I32)}
_APP_DRAFTER = {"n_queries": _int(1, 4096), "smooth_width": _int(0, 4096), "kv_type": _one_of("f16", "q8_0", "q4_0"),
                "layers": _opt_int(1, _I32), "pool": _opt_int(0, _core.MAX_CONTEXT),
                "aggregate": _one_of("max", "mean", "mass"), "contrast": _opt_int(0, _I32),
                "spread": _opt_int(0, _I32)}
_APP_STATE = {"since_rescore": _int(0, 2**63 - 1), "rescores": _int(0, 2**63 - 1),
              "last_scores": lambda v: v is None or isinstance(v, list)}


def _snapshot_app(app_bytes: bytes, head: dict, path) -> dict:
    """The session's JSON from a snapshot's APPS section, every field Session.load and restore use held to its
    type and range and to the core's header (SnapshotError naming the first that is not).  Nothing in it
    names a file: the model and a drafter are the caller's to give."""
    where = f"snapshot {os.fspath(path)}"

    def bad(why):
        return _core.SnapshotError(f"{where}: its session state is malformed: {why}")

    try:
        app = json.loads(app_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _core.SnapshotError(f"{where} holds no kvflash Session state (it was not written by Session.save)") \
            from None
    if not isinstance(app, dict) or "kvflash_session" not in app:
        raise _core.SnapshotError(f"{where} holds no kvflash Session state (it was not written by Session.save)")
    if app["kvflash_session"] != SNAPSHOT_APP_VERSION:
        raise _core.SnapshotError(f"{where} holds Session state of layout {app['kvflash_session']!r}; this kvflash "
                                  f"reads layout {SNAPSHOT_APP_VERSION}")

    def fields(d, spec, what):
        if not isinstance(d, dict):
            raise bad(f"{what} is not an object")
        if set(d) != set(spec):
            extra, missing = sorted(set(d) - set(spec)), sorted(set(spec) - set(d))
            raise bad(f"{what} has " + ("unknown field(s) " + ", ".join(map(repr, extra)) if extra else
                                        "no field(s) " + ", ".join(map(repr, missing))))
        for k, ok in spec.items():
            if not ok(d[k]):
                raise bad(f"{what}.{k} = {d[k]!r} is out of range or of the wrong type")

    fields(app, {"kvflash_session": lambda v: True, "config": lambda v: True, "policy": lambda v: True,
                 "state": lambda v: True}, "the session state")
    fields(app["config"], _APP_CONFIG, "config")
    cfg, st, pol = app["config"], app["state"], app["policy"]
    fields(st, _APP_STATE, "state")
    n_chunks = -(-head["max_ctx"] // head["chunk_tokens"])
    ls = st["last_scores"]
    if ls is not None and (len(ls) > n_chunks or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                         and x == x for x in ls)):
        raise bad(f"state.last_scores is not a list of at most {n_chunks} numbers")
    if not isinstance(pol, dict) or not isinstance(pol.get("name"), str) or not 0 < len(pol["name"]) <= 200:
        raise bad("policy has no name")
    if pol["name"] == "lru":
        fields(pol, {"name": lambda v: True}, "policy")
    elif "qk" in pol:
        fields(pol, {"name": lambda v: True, "qk": lambda v: True}, "policy")
        fields(pol["qk"], _APP_QK, "policy.qk")
    elif "drafter" in pol:
        fields(pol, {"name": lambda v: v == "drafter", "drafter": lambda v: True}, "policy")
        fields(pol["drafter"], _APP_DRAFTER, "policy.drafter")
    else:
        fields(pol, {"name": lambda v: True, "custom": lambda v: v is True}, "policy")
    # What builds the session must be what the core's header says the cache is.
    for k, hk in (("max_ctx", "max_ctx"), ("kv_type", "kv_type"), ("chunk_tokens", "chunk_tokens"),
                  ("sink_chunks", "sink_chunks"), ("tail_window_chunks", "tail_window_chunks")):
        if cfg[k] != head[hk]:
            raise bad(f"config.{k} = {cfg[k]!r} but the cache's header has {head[hk]!r}")
    if (cfg["kvflash"] is None) != bool(head["full_cache"]) or (
            cfg["kvflash"] is not None and cfg["kvflash"] != head["pool_tokens"]):
        raise bad(f"config.kvflash = {cfg['kvflash']!r} but the cache's header has a "
                  + ("full cache" if head["full_cache"] else f"pool of {head['pool_tokens']} tokens"))
    return app


MAX_DRAFT = _core.MAX_DRAFT   # drafts per exact-mode round, at most (the core's kMaxDraft)


def _rpc_args(rpc, tensor_split):
    """rpc= and tensor_split= as the core takes them: ([endpoint, ...], [weight, ...]), checked."""
    if rpc is None:
        rpc = []
    elif isinstance(rpc, str):
        rpc = [e for e in rpc.split(",") if e]
    else:
        rpc = list(rpc)
    if not all(isinstance(e, str) for e in rpc):
        raise ValueError(f"rpc must be 'host:port' strings (or one comma-separated string), got {rpc!r}")
    for e in rpc:
        _core.check_rpc_endpoint(e)
    if tensor_split is None:
        split = []
    else:
        if isinstance(tensor_split, str):
            tensor_split = [x for x in tensor_split.split(",") if x]
        try:
            split = [float(x) for x in tensor_split]
        except (TypeError, ValueError):
            raise ValueError(f"tensor_split must be numbers (one weight per rpc endpoint, and optionally one more for "
                             f"this process), got {tensor_split!r}") from None
        if not rpc:
            raise ValueError("tensor_split needs rpc endpoints to split the layers over")
    return rpc, split


def _spec_stats(r: dict, decode_s: float) -> dict:
    """Exact mode's figures from the core's counters (``Runtime.spec_stats``; the draft length is chosen there)."""
    return {
        "exact_rounds": r["rounds"],
        "exact_drafted": r["drafted"],
        "exact_kept": r["kept"],
        "acceptance_rate": r["kept"] / r["drafted"] if r["drafted"] else 0.0,
        "mean_kept_per_round": r["kept"] / r["rounds"] if r["rounds"] else 0.0,
        "verify_share": (r["verify_ms"] / 1e3) / decode_s if decode_s > 0 else 0.0,
    }


def _policy_spec(policy) -> dict:
    """A policy's name and settings, enough to make it again (custom objects: the name only)."""
    from . import scoring
    if isinstance(policy, LRUPolicy):
        return {"name": "lru"}
    if isinstance(policy, scoring.QKPolicy):
        return {"name": policy.name, "qk": dict(mode=policy.mode, n_queries=policy.n_queries,
                                                smooth_width=policy.smooth_width, aggregate=policy.aggregate,
                                                contrast=policy.contrast, spread=policy.spread,
                                                layers=policy.layers, carry=policy.carry)}
    if isinstance(policy, scoring.DrafterPolicy):
        # no path: a snapshot names no files (the drafter is the loader's to give)
        return {"name": "drafter", "drafter": dict(n_queries=policy.n_queries,
                                                   smooth_width=policy.smooth_width, kv_type=policy.kv_type,
                                                   layers=policy.layers, pool=policy.pool,
                                                   aggregate=policy.aggregate, contrast=policy.contrast,
                                                   spread=policy.spread)}
    return {"name": policy.name, "custom": True}


def _policy_from_spec(spec: dict, drafter, model_path: Path, path):
    """The policy a snapshot's (checked) spec names.  A drafter is the caller's drafter=, or one found next to
    the caller's model as Session finds it; never a file the snapshot names."""
    from . import scoring
    name = spec["name"]
    if name == "lru":
        return LRUPolicy()
    if "qk" not in spec and "drafter" not in spec:
        raise ValueError(f"snapshot {os.fspath(path)} was taken with the custom policy {name!r}: pass policy= (an "
                         f"object named {name!r}) to Session.load")
    if "drafter" in spec:
        where = resolve_model(drafter) if drafter is not None else find_drafter(model_path)
        if where is None:
            raise ValueError(f"snapshot {os.fspath(path)} was taken with the drafter policy and no drafter is next to "
                             f"{model_path}: pass drafter= (the drafter model) to Session.load (a snapshot names no "
                             f"files)")
        if not os.path.exists(where):
            raise ValueError(f"drafter {where} does not exist")
    try:
        if "qk" in spec:
            return scoring.QKPolicy(**spec["qk"])
        return scoring.DrafterPolicy(where, **spec["drafter"])
    except ValueError as e:
        raise _core.SnapshotError(f"snapshot {os.fspath(path)}: its session state is malformed: the policy's "
                                  f"settings: {e}") from None


class Session:
    """One conversation's state over a GGUF model, with the KV cache in a paged pool.

    >>> s = kvflash.Session("smollm2-135m", max_ctx=8192, kvflash=1024, policy="lru")
    >>> print("".join(s.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}])))
    """

    def __init__(self, model: Union[str, os.PathLike, "_core.Model"] = DEFAULT_MODEL, *, max_ctx: Optional[int] = None,
                 kvflash: Union[str, int, None] = "auto", policy: Union[str, Policy] = "drafter",
                 drafter: Union[str, os.PathLike, None] = None, tau: int = 64, kv_type: str = "q8_0",
                 threads: Optional[int] = None, seed: Optional[int] = None, chunk_tokens: int = 64,
                 sink_chunks: int = 1, tail_window_chunks: int = 4, host: str = "ram",
                 host_path: Union[str, os.PathLike, None] = None, allow_long_ctx: bool = False,
                 ubatch: int = 512, reeval_tokens: int = 64, verbose: bool = True, device: str = "auto",
                 max_host_bytes: Optional[int] = None, prefill_piece: Optional[int] = None,
                 exact: bool = False, exact_draft: Optional[int] = None, exact_prefill: bool = False,
                 rpc: Optional[Sequence[str]] = None, tensor_split: Optional[Sequence[float]] = None):
        if kv_type not in ("f16", "q8_0", "q4_0"):
            raise ValueError(f"kv_type must be 'f16', 'q8_0' or 'q4_0', got {kv_type!r}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        if max_host_bytes is not None and (not isinstance(max_host_bytes, int) or isinstance(max_host_bytes, bool)
                                           or max_host_bytes < 1):
            raise ValueError(f"max_host_bytes must be a positive integer (bytes) or None (no cap), got {max_host_bytes!r}")
        if not isinstance(exact, bool):
            raise ValueError(f"exact must be True or False, got {exact!r}")
        if not isinstance(exact_prefill, bool):
            raise ValueError(f"exact_prefill must be True or False, got {exact_prefill!r}")
        if exact_draft is not None and (not isinstance(exact_draft, int) or isinstance(exact_draft, bool)
                                        or not 0 <= exact_draft <= MAX_DRAFT):
            raise ValueError(f"exact_draft must be None (adaptive) or an integer in [0, {MAX_DRAFT}] (drafts per "
                             f"round), got {exact_draft!r}")
        if not isinstance(tau, int) or tau < 1:
            raise ValueError(f"tau must be a positive integer (decoded tokens between rescores), got {tau!r}")
        if kvflash is not None and kvflash != "auto" and (not isinstance(kvflash, int) or isinstance(kvflash, bool)):
            raise ValueError(f"kvflash must be 'auto', an integer pool size in tokens, or None, got {kvflash!r}")
        rpc, tensor_split = _rpc_args(rpc, tensor_split)
        if rpc and (exact or exact_prefill):
            raise ValueError("exact=True and exact_prefill=True read the host store in place with kvflash's CPU "
                             "kernel in one process; they cannot run with layers on RPC servers (rpc=...)")
        if isinstance(model, _core.Model):
            if rpc:
                raise ValueError("rpc= places a model's layers when it is loaded; this Model is already loaded: pass "
                                 "rpc and tensor_split to kvflash._core.Model (or give Session a path)")
            # Sessions may share one loaded Model (the server's slots): its compute is serialized
            # per model, each session keeps its own pool and host store.
            self.model_path = Path(model.path)
            self.threads = threads or model.n_threads
            self.model = model
        else:
            device = resolve_device(device)
            self.model_path = resolve_model(model)
            self.threads = threads or usable_cores()
            self.model = _core.Model(str(self.model_path), self.threads, device=device, rpc=rpc,
                                     tensor_split=tensor_split)
        self.device = self.model.device
        self.remote_layers = list(self.model.remote_layers)
        if exact and not str(self.device).startswith("cpu"):
            raise ValueError(f"exact=True verifies on the CPU backend (its attention reads the host store in place); "
                             f"the model is on {self.device}: use device='cpu'")
        if exact_prefill and not str(self.device).startswith("cpu"):
            raise ValueError(f"exact_prefill=True reads the host store in place on the CPU backend; the model is on "
                             f"{self.device}: use device='cpu'")
        hp = self.model.hparams
        self.hparams = hp
        if max_ctx is None:
            max_ctx = int(hp["n_ctx_train"])
        if not isinstance(max_ctx, int) or isinstance(max_ctx, bool) or max_ctx < 1:
            raise ValueError(f"max_ctx must be a positive integer, got {max_ctx!r}")
        _core.check_max_ctx(max_ctx)  # the core's one size guard, before anything is sized from max_ctx
        if max_ctx > hp["n_ctx_train"] and not allow_long_ctx:
            raise ValueError(f"max_ctx {max_ctx} is above the {hp['n_ctx_train']} tokens this model was trained "
                             f"for; lower it, or pass allow_long_ctx=True to run past the trained context")
        self.max_ctx = max_ctx
        self.tokenizer = Tokenizer.from_gguf(self.model_path)
        if self.tokenizer.n_vocab > hp["n_vocab"]:
            # Encoding could give ids the model has no embedding for: prefill refuses
            # those by id; say so once here, where the file's mismatch is visible.
            warnings.warn(f"the tokenizer has {self.tokenizer.n_vocab} tokens, the model {hp['n_vocab']}: "
                          f"text that encodes to the extra tokens is refused by prefill", stacklevel=2)
        self.tau = tau
        self.kv_type = kv_type
        if not isinstance(reeval_tokens, int) or reeval_tokens < 1:
            raise ValueError(f"reeval_tokens must be a positive integer, got {reeval_tokens!r}")
        self.reeval_tokens = reeval_tokens

        # Policy, with the drafter resolved (or the fallback decided) before sizing the pool.
        self._policy_note = ""
        self.policy = self._make_policy(policy, drafter)

        pool = self._pool_tokens(kvflash, kv_type, chunk_tokens, sink_chunks, tail_window_chunks)
        # prefill_piece: the tokens a prompt's eval takes at a time once the pool is full (None: one chunk).
        # It changes how a prompt is cut, not what a snapshot holds, so it is not part of _config.
        if prefill_piece is not None:
            room = pool - (sink_chunks + tail_window_chunks + 1) * chunk_tokens
            if (not isinstance(prefill_piece, int) or isinstance(prefill_piece, bool) or prefill_piece < 1
                    or prefill_piece % chunk_tokens):
                raise ValueError(f"prefill_piece must be a positive multiple of chunk_tokens ({chunk_tokens}), "
                                 f"got {prefill_piece!r}")
            if pool > 0 and prefill_piece > room:
                raise ValueError(f"prefill_piece {prefill_piece} does not fit the pool's evictable room of {room} "
                                 f"tokens (pool minus sink, tail window and the open chunk)")
        # the queries the policy scores with (qk: n_queries + contrast), captured by the runtime
        self._n_capture = int(getattr(self.policy, "n_capture", getattr(self.policy, "n_queries", 1)))
        self.runtime = _core.Runtime(self.model, max_ctx=max_ctx, pool_tokens=pool, kv_type=kv_type,
                                     chunk_tokens=chunk_tokens, sink_chunks=sink_chunks,
                                     tail_window_chunks=tail_window_chunks, ubatch=ubatch, host=host,
                                     host_path=None if host_path is None else str(host_path),
                                     seed=0 if seed is None else int(seed), max_host_bytes=max_host_bytes or 0,
                                     chunk_summaries=bool(getattr(self.policy, "needs_chunk_summaries", False)),
                                     capture_queries=self._n_capture, prefill_piece=prefill_piece or 0)
        if self.tokenizer.n_vocab < hp["n_vocab"]:
            # Padded embedding rows (ids the tokenizer has no text for): never sample them,
            # or the stream would meet an id it cannot decode.
            self.runtime.sample_vocab = self.tokenizer.n_vocab
        self.seed = seed
        # What Session.load needs to build a session a snapshot fits (the rest is in the snapshot's header).
        self._config = dict(max_ctx=max_ctx, kvflash=pool if pool > 0 else None, tau=tau, kv_type=kv_type,
                            chunk_tokens=chunk_tokens, sink_chunks=sink_chunks, tail_window_chunks=tail_window_chunks,
                            ubatch=ubatch, reeval_tokens=reeval_tokens, seed=seed, allow_long_ctx=allow_long_ctx,
                            exact=exact, exact_draft=exact_draft, exact_prefill=exact_prefill)
        self.pager = self.runtime.pager
        self.chunk_tokens = chunk_tokens
        self.kvflash = pool > 0
        # Exact mode (speculative verification): the full cache's tokens from the paged session.  With
        # the full cache itself there is nothing to verify: every eval is already exact.
        self.exact = exact and self.kvflash
        self.exact_draft = exact_draft
        # Exact prefill: prompts are evaluated as the full cache evaluates them (every position attended,
        # paged-out rows read from the host store), so every chunk's K/V are the full cache's; decode then
        # reads the pool as usual.  Implied by exact mode; nothing to do for the full cache.
        self.exact_prefill = (exact_prefill or exact) and self.kvflash
        # The schedule, the scorer and exact mode live in the core session (csrc/kvflash/session.h).
        self._configure_core()
        self._prefill_s = 0.0
        self._decode_s = 0.0
        self._decoded = 0
        # One caller at a time (the runtime's own guard covers its native state; this one
        # covers the Python state around it), and at most one open generate() iterator.
        self._lock = threading.RLock()
        self._open_gen: Optional[weakref.ref] = None
        self.finish_reason: Optional[str] = None  # why the last generate() ended (see generate)
        if verbose:
            print(self.banner, file=sys.stderr)

    # ------------------------------------------------------------------ setup
    def _pool_tokens(self, kvflash, kv_type, chunk_tokens, sink_chunks, tail_window_chunks) -> int:
        """The pool size for kvflash= (0: the full cache); sets auto_reason for "auto"."""
        hp, max_ctx = self.hparams, self.max_ctx
        n_paged = len(self.model.global_layers)
        self.auto_reason = ""
        if kvflash is None:
            return 0
        if kvflash == "auto":
            on_cuda = self.device.startswith("cuda")
            pool, self.auto_reason = auto_pool(hp, kv_type, n_paged, self.model.weight_bytes, max_ctx,
                                               expect_drafter=self.policy.name == "drafter", device=self.device,
                                               free_bytes=self.model.device_memory()[0] if on_cuda else None)
            if pool >= (max_ctx + 255) // 256 * 256:
                pool = 0  # the whole context fits: the full cache is the same thing, minus the paging
            return pool
        floor = _core.min_pool_tokens(chunk_tokens, sink_chunks, tail_window_chunks)
        if kvflash < floor:
            raise ValueError(f"kvflash pool of {kvflash} tokens is below the minimum {floor} "
                             f"((sink + tail + 2) chunks of {chunk_tokens}, rounded up to 256)")
        return kvflash

    def _make_policy(self, policy, drafter) -> Policy:
        if isinstance(policy, str):
            if policy == "lru":
                return LRUPolicy()
            if policy in ("drafter", "qk", "qk-bound", "qk-mean"):
                from . import scoring  # the scored policies live beside their scorers
                if policy.startswith("qk"):
                    return scoring.QKPolicy("keys" if policy == "qk" else policy[3:])
                path = None
                if drafter is not None:
                    path = resolve_model(drafter)
                else:
                    path = find_drafter(self.model_path)
                if path is None:   # the reference falls back to LRU, which keeps no needle past its window
                    self._policy_note = " (no drafter found next to the model: falling back to qk)"
                    return scoring.QKPolicy()
                return scoring.DrafterPolicy(path, threads=self.threads)
            raise ValueError(f"unknown policy {policy!r}: use 'drafter', 'lru', 'qk' ('qk-bound', 'qk-mean') or an object with "
                             f"score(view)")
        if not callable(getattr(policy, "score", None)):
            raise ValueError(f"policy object {policy!r} has no score(view) method")
        if not getattr(policy, "name", None):
            raise ValueError("policy object needs a name attribute")
        return policy

    @property
    def policy(self) -> Policy:
        """The policy that scores the chunks; assigning another one reconfigures the core's scorer."""
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self._policy = policy
        if getattr(self, "runtime", None) is not None:
            self._configure_core()

    def _configure_core(self) -> None:
        rt = self.runtime
        rt.set_scorer(None)
        rt.configure(**self._core_scorer(), tau=self.tau, reeval_tokens=self.reeval_tokens, exact=self.exact,
                     exact_draft=-1 if self.exact_draft is None else self.exact_draft,
                     exact_prefill=self.exact_prefill)
        rewind = getattr(self.policy, "rewind", None)
        # a policy with a history of its own (the drafter's cache) hears of cuts
        rt.set_rewind_hook(rewind if callable(rewind) else None)

    def _core_scorer(self) -> dict:
        """How the core scores chunks for this policy: lru scores nothing; qk's peak scoring runs in the
        core; every other policy (the drafter, qk's other aggregates, user objects) through the callback."""
        from . import scoring
        if isinstance(self.policy, LRUPolicy):
            return dict(scorer="none")
        p = self.policy
        if type(p) is scoring.QKPolicy and p.mode == "keys" and p.aggregate == "peak":
            return dict(scorer="peak", qk=dict(n_queries=p.n_queries, contrast=p.contrast, spread=p.spread,
                                               n_layers=p.n_layers(self.runtime.n_paged_layers), carry=p.carry))
        self.runtime.set_scorer(self._policy_scores)
        return dict(scorer="external")

    @property
    def banner(self) -> str:
        mode = (" [exact: drafts over the pool, verified over the whole context]" if self.exact
                else " [exact prefill: prompts attend the whole context]" if self.exact_prefill
                else "" if self.kvflash else " [full cache]")
        line = (f"[kvflash] resident pool {self.runtime.pool_tokens} tokens (logical max_ctx {self.max_ctx}), tau={self.tau}, "
                f"policy={self.policy.name}{self._policy_note}{mode}")
        if self.auto_reason:
            line += f"\n[kvflash] auto pool: {self.auto_reason}"
        for r in self.remote_layers:
            line += (f"\n[kvflash] layers {r['first']}-{r['last'] - 1} on the RPC server {r['endpoint']} "
                     f"({r['weight_bytes'] / 2**20:.0f} MiB of weights there, their pool slice too)")
        return line

    # ------------------------------------------------------------------ one caller at a time
    def _open_iterator(self):
        g = self._open_gen() if self._open_gen is not None else None
        if g is None or inspect.getgeneratorstate(g) == inspect.GEN_CLOSED:
            self._open_gen = None
            return None
        return g

    @contextlib.contextmanager
    def _using(self, what: str, *, from_iterator=None):
        """Hold the session for one call: RuntimeError if another thread holds it, or if a
        generate() iterator other than from_iterator is still open (its next step would
        continue from a history this call changed)."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"this Session is in use by another thread or iterator: {what} refused; give each "
                               f"thread its own Session")
        try:
            g = self._open_iterator()
            if g is not None and g is not from_iterator:
                raise RuntimeError(f"this Session is in use by another thread or iterator: {what} refused while a "
                                   f"generate() iterator is open; exhaust it or call its close() first")
            yield
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ text
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"tokenize expects str, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if i < 0 or i >= self.tokenizer.n_vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside [0, {self.tokenizer.n_vocab})")
        return self.tokenizer.decode(ids)

    @property
    def tokens(self) -> list[int]:
        """The token history held in the cache."""
        return self.runtime.tokens.tolist()

    @property
    def n_past(self) -> int:
        return self.runtime.n_past

    @property
    def _last_logits(self) -> Optional[np.ndarray]:
        """The logits after the last evaluated token (None before any), as the core session keeps them."""
        return self.runtime.last_logits() if self.runtime.has_logits else None

    # ------------------------------------------------------------------ evaluation
    def _check_text_ids(self, ids: list[int]) -> list[int]:
        """Ids the tokenizer gave for a text, refused (ValueError) when the model has no embedding for some."""
        V = self.hparams["n_vocab"]
        bad = sorted({i for i in ids if i >= V})
        if bad:
            raise ValueError(f"the text encodes to token ids {bad[:5]} the model has no embedding for: this GGUF's "
                             f"tokenizer has {self.tokenizer.n_vocab} tokens, its model {V}; nothing was evaluated")
        return ids

    def _as_ids(self, text_or_ids, *, first: bool) -> list[int]:
        if isinstance(text_or_ids, str):
            return self._check_text_ids(self.tokenize(text_or_ids, add_special=first, parse_special=True))
        try:
            ids = [int(t) for t in text_or_ids]
        except TypeError:
            raise TypeError("expected a string or a sequence of token ids") from None
        bad = [i for i in ids if i < 0 or i >= self.hparams["n_vocab"]]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside [0, {self.hparams['n_vocab']})")
        return ids

    def prefill(self, text_or_ids: Union[str, Sequence[int]], *,
                progress: Optional[Callable[["PrefillProgress"], None]] = None) -> int:
        """Append a prompt to the context; returns the number of tokens added.

        ``progress``: called with a :class:`PrefillProgress` (tokens done of total, tok/s, ETA,
        page-outs) after each piece the core evaluates -- whole ubatches while the prompt fits the
        pool, 64-token pieces once it pages -- and once more when the prompt is in.  What it raises
        ends the prefill as a failure does (nothing of the prompt is kept).

        All or nothing: when anything fails on the way (the eval, the policy's rescore,
        the re-read of the prompt's tail) or Ctrl-C interrupts it, the context is put
        back as it was before the call and the exception propagates, so a retry does not
        duplicate the prompt.  (When the context cannot be rewound -- gemma3's
        sliding-window ring no longer holds that far back -- the session is reset.)
        """
        if progress is not None and not callable(progress):
            raise TypeError("progress must be a callable taking a PrefillProgress, or None")
        with self._using("prefill"):
            ids = self._as_ids(text_or_ids, first=self.runtime.n_past == 0)
            if not ids:
                return 0
            self._check_fits(len(ids), self.runtime.n_past)
            self._eval_prompt(ids, progress)
            return len(ids)

    def _check_fits(self, n: int, n_past: int) -> None:
        if n_past + n > self.max_ctx:
            raise ValueError(f"prompt of {n} tokens on top of {n_past} in context exceeds "
                             f"max_ctx {self.max_ctx}; raise max_ctx or shorten the prompt")

    def _eval_prompt(self, ids: list[int], progress, continue_to: Optional[bool] = None):
        """A prompt through the core, timed, with progress: appended (runtime.prefill), or with continue_to set
        the context made ids (runtime.continue_to, fresh_logits=continue_to); then the tokens reused."""
        t0 = time.perf_counter()
        outs0 = self.pager.stats["page_outs"]
        hook = None
        if progress is not None:
            def hook(done, total, page_outs):
                progress(PrefillProgress(done, total, time.perf_counter() - t0, page_outs - outs0, False))
        try:
            arr = np.asarray(ids, dtype=np.int32)
            if continue_to is None:
                self.runtime.prefill(arr, progress=hook)
                out = 0
            else:
                out = self.runtime.continue_to(arr, progress=hook, fresh_logits=continue_to)
        finally:
            self._prefill_s += time.perf_counter() - t0
        if progress is not None:
            n = len(ids) - out
            progress(PrefillProgress(n, n, time.perf_counter() - t0, self.pager.stats["page_outs"] - outs0, True))
        return out

    def _settle_prompt(self, ids: list[int]) -> None:
        """After a prompt's eval outside prefill (the bench's ruler routine calls this on a restored prefill
        to share one prefill across policies): the settling rescore prefill runs."""
        self.runtime.settle_prompt(np.asarray(ids, dtype=np.int32))

    @property
    def _rescore_s(self) -> float:
        return self.runtime.rescore_ms / 1e3

    def _scored(self) -> bool:
        return self.kvflash and not isinstance(self.policy, LRUPolicy)

    def logits(self) -> np.ndarray:
        """Logits after the last evaluated token (float32 [n_vocab])."""
        if not self.runtime.has_logits:
            raise ValueError("no token evaluated yet: prefill a prompt first")
        return self.runtime.last_logits()

    def chunk_view(self) -> ChunkView:
        """What a policy sees now: the chunk table, the token history and this session."""
        n = -(-self.runtime.n_past // self.chunk_tokens)
        table = self.pager.chunk_table()
        return ChunkView(n_chunks=n, chunk_tokens=self.chunk_tokens, n_past=self.runtime.n_past,
                         tokens=self.runtime.tokens, resident=table["block"][:n] >= 0,
                         protected=table["protected"][:n], pool_chunks=self.pager.n_blocks, session=self)

    def _policy_scores(self, n: int):
        """The core's external scorer: the Python policy's scores for n chunks, checked (None: nothing moves)."""
        scores = self.policy.score(self.chunk_view())
        return None if scores is None else validate_scores(scores, n, self.policy.name)

    @property
    def last_scores(self) -> Optional[np.ndarray]:
        """The chunk scores of the last rescore (a copy), or None."""
        return self.runtime.last_scores

    def rescore(self) -> int:
        """Ask the policy for chunk scores now and repage the pool; returns chunks moved."""
        with self._using("rescore", from_iterator=self._open_iterator()):
            return self.runtime.rescore()

    def generate(self, prompt: Union[str, Sequence[int], None] = None, *, max_tokens: int = 256,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 stop: Union[str, Sequence[str], None] = None, ignore_eos: bool = False,
                 seed: Optional[int] = None, progress: Optional[Callable] = None) -> Iterator[str]:
        """Stream text pieces, continuing from whatever is already in the session.

        One iterator at a time: while one is open (neither exhausted nor closed), another
        generate(), prefill(), chat() or reset() raises RuntimeError.  When it ends,
        ``finish_reason`` says why: "eos" (an end-of-turn token), "stop" (a stop string),
        "length" (max_tokens), "max_ctx" (the context is full), "closed" (the caller
        closed it early) or "error" (it raised).  The token history and the native
        cache agree however it ends, Ctrl-C included.
        """
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
        if not (temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        if not (0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if not (0 <= min_p < 1):
            raise ValueError(f"min_p must be in [0, 1), got {min_p!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of them")
        with self._using("generate"):
            if prompt is not None:
                self.prefill(prompt, progress=progress)
            if not self.runtime.has_logits:
                raise ValueError("nothing to continue from: pass a prompt or prefill() first")
            gen = self._generate(max_tokens, temperature, top_k, top_p, min_p, stops, ignore_eos, seed)
            self._open_gen = weakref.ref(gen)
            self.finish_reason = None
            return gen

    def _generate(self, max_tokens, temperature, top_k, top_p, min_p, stops, ignore_eos, seed):
        rt = self.runtime
        me = self._open_iterator()
        sampling = (temperature, top_k, top_p, min_p)
        eot = set() if ignore_eos else set(self.tokenizer.eot_ids)
        stop_ids = sorted(eot)
        dec = StreamDecoder(self.tokenizer, strip_leading_space=False)
        held = ""  # text withheld while it could still be the start of a stop string
        t0 = time.perf_counter()
        n_start = rt.n_past
        reason = None
        try:
            with self._using("generate", from_iterator=me):
                if seed is not None:
                    rt.seed(int(seed))
                tok = rt.sample_last(*sampling)
            for i in range(max_tokens):
                if tok in eot:
                    reason = "eos"
                    break
                if rt.n_past >= self.max_ctx:
                    reason = "max_ctx"
                    break
                with self._using("generate", from_iterator=me):
                    nxt = rt.advance(int(tok), *sampling, budget=max_tokens - i, stop_ids=stop_ids)
                piece = dec.push(tok)
                tok = nxt
                if not stops:
                    if piece:
                        yield piece
                    continue
                held += piece
                cut = min((held.find(s) for s in stops if s in held), default=-1)
                if cut >= 0:
                    reason = "stop"
                    if held[:cut]:
                        yield held[:cut]
                    held = ""
                    return
                keep = max((len(s) - 1 for s in stops), default=0)
                # emit all but a tail that could begin a stop string
                safe = len(held)
                for k in range(min(keep, len(held)), 0, -1):
                    if any(s.startswith(held[-k:]) for s in stops):
                        safe = len(held) - k
                        break
                if safe:
                    yield held[:safe]
                    held = held[safe:]
            else:
                reason = "length"
            tail = dec.flush() if hasattr(dec, "flush") else ""
            if held + tail:
                yield held + tail
        except GeneratorExit:
            reason = "closed"
            raise
        except BaseException:
            reason = "error"
            raise
        finally:
            if self.exact:   # drafts the loop did not take leave the cache
                with self._using("generate", from_iterator=me):
                    rt.settle()
            produced = rt.n_past - n_start
            self._decode_s += time.perf_counter() - t0
            self._decoded += max(produced, 0)
            self.finish_reason = reason
            if self._open_gen is not None and self._open_gen() is me:
                self._open_gen = None

    def chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
             progress: Optional[Callable] = None, **kw) -> Iterator[str]:
        """Render messages with the model's chat template and stream the reply.

        The rendered conversation reuses the longest common prefix already in the
        cache, so a multi-turn chat only evaluates what is new (``progress``: as prefill's,
        for that new part).  Only the template's own markers become special tokens: special-token
        text inside a message's content is tokenized as ordinary text (``Tokenizer.encode_chat``).
        """
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        with self._using("chat"):
            # the template's markers are special tokens; the messages' content is text (Tokenizer.encode_chat)
            ids = self.tokenizer.encode_chat(list(messages), add_generation_prompt=add_generation_prompt)
            self.continue_to(ids, progress=progress)
            return self.generate(None, **kw)

    def continue_to(self, ids: Sequence[int], *, progress: Optional[Callable] = None, fresh_logits: bool = True) -> int:
        """Make the context ``ids``: the longest common prefix with what the cache holds is kept (at
        least the last token is read again, for fresh logits), the rest cut, the new part prefilled
        as ``prefill`` does (all or nothing from the cut).  Returns the tokens reused.
        ``fresh_logits=False``: when the context is ``ids`` already and its logits are kept (a restored
        snapshot), nothing is read again and decoding continues exactly as it would have."""
        with self._using("continue_to"):
            self._check_text_ids(list(ids))   # before the cached reply is cut away for it
            ids = self._as_ids(ids, first=True)
            if not ids:
                raise ValueError("continue_to: no tokens")
            self._check_fits(len(ids), 0)
            return self._eval_prompt(ids, progress, continue_to=bool(fresh_logits))

    def truncate(self, n_tokens: int) -> None:
        """Rewind the context to its first n_tokens (0: reset).  The last kept tokens are read
        again, so generate() continues from fresh logits and a scored policy's capture window
        (qk: its last n_queries + contrast queries, which go with the forgotten tokens) is
        whole again, as in a session that only ever held these tokens.  ValueError when
        gemma3's sliding-window ring no longer reaches that far back (reset and prefill instead)."""
        with self._using("truncate"):
            n = self.runtime.n_past
            if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or not 0 <= n_tokens <= n:
                raise ValueError(f"truncate: n_tokens must be an integer in [0, {n}], got {n_tokens!r}")
            self.runtime.rewind(n_tokens)

    def _bos_text(self) -> str:
        bos = self.tokenizer.bos_id
        return self.tokenizer.token_text(bos) if bos is not None else "\0"

    def reset(self) -> None:
        """Forget the context and every piece of policy state (scores never leak across sessions)."""
        with self._using("reset"):
            self._reset()

    def _reset(self) -> None:
        self.runtime.reset()
        if hasattr(self.policy, "reset"):
            self.policy.reset()


    # ------------------------------------------------------------------ snapshots
    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the whole session to a snapshot file: the chunk table, the pool's rows, the host
        store's chunks, gemma3's sliding-window ring, the captured queries, the token history,
        the last logits, the sampler's generator and the policy's settings.

        Atomic: a temporary file beside ``path``, fsynced, then renamed over it; when the write
        fails (RuntimeError naming the OS error) ``path`` is as it was.  Refused (RuntimeError)
        while a generate() iterator is open.  The drafter policy's own cache is not saved:
        it is rebuilt by re-feeding the history at the first rescore after a load.
        """
        with self._using("save"):
            # No paths: the model and a drafter are whoever loads it's to give (the header names the model's
            # fingerprint).
            app = {"kvflash_session": SNAPSHOT_APP_VERSION, "config": self._config,
                   "policy": _policy_spec(self.policy),
                   "state": {"since_rescore": self.runtime.since_rescore, "rescores": self.runtime.rescores,
                             "last_scores": None if self.last_scores is None else [float(x) for x in self.last_scores]}}
            self.runtime.save_snapshot(os.fspath(path), self.runtime.tokens, self._last_logits,
                                       json.dumps(app).encode())

    def restore(self, path: Union[str, os.PathLike], *, max_bytes: Optional[int] = None) -> None:
        """Replace this session's context with a snapshot's (``save``).

        The snapshot must fit: the same model file (by fingerprint), KV type, chunk geometry,
        pool size, max_ctx and policy; anything else is refused with a ValueError naming what
        differs (``kvflash.SnapshotError``), as is a truncated or corrupted file, one larger
        than a snapshot of this session's geometry can be (or than ``max_bytes``), one of
        another format version, and one whose session state is malformed; the session is
        left exactly as it was.  The file's header is checked against this session before
        the file is read whole.  This session's own schedule settings (tau, reeval_tokens)
        apply from here on.
        """
        with self._using("restore"):
            # the header and the session state first (small reads), the file held to this session's geometry
            self._check_policy(_peek_snapshot(path, self.runtime, max_bytes)[2])
            snap = _read_snapshot(path, self.runtime, max_bytes)
            self._restore(snap, _snapshot_app(snap.app, snap.header, path))

    @classmethod
    def load(cls, path: Union[str, os.PathLike], model: Union[str, os.PathLike, "_core.Model"], *,
             policy: Union[str, Policy, None] = None, drafter: Union[str, os.PathLike, None] = None,
             threads: Optional[int] = None, device: str = "auto", host: str = "ram",
             host_path: Union[str, os.PathLike, None] = None, max_host_bytes: Optional[int] = None,
             allow_long_ctx: bool = False, max_bytes: Optional[int] = None, verbose: bool = False) -> "Session":
        """A new Session over ``model`` (a path or a model name) holding a snapshot's context.

        The geometry (max_ctx, pool, KV type, chunks, ubatch, tau) and the policy's settings come
        from the snapshot, each checked for its type and range and against the cache's header
        before anything is built, and the model file's fingerprint is compared first; what does
        not change the state (threads, device, host backing, the host cap) is chosen here.  A
        snapshot names no files: a drafter policy's drafter is ``drafter`` (or one found next to
        ``model``, as Session finds it).  ``allow_long_ctx``: the caller's, as in Session (a file
        cannot lift the model's trained context).  ``policy``: needed when the snapshot's policy
        was a custom object (it must have the snapshot's policy name).  Refusals as in ``restore``.
        """
        # The header and the session state alone (small reads), checked before anything is built.
        head, _, app = _peek_snapshot(path, None, max_bytes)
        model_path = Path(model.path) if isinstance(model, _core.Model) else resolve_model(model)
        fp = _core.model_fingerprint(str(model_path))
        size = os.path.getsize(model_path)
        if (fp, size) != (head["fingerprint"], head["model_bytes"]):
            raise _core.SnapshotError(f"snapshot does not fit this session: it was taken with another model file "
                                      f"(fingerprint {head['fingerprint']:016x}, {head['model_bytes']} bytes; "
                                      f"{model_path} is {fp:016x}, {size} bytes)")
        cfg = dict(app["config"], allow_long_ctx=bool(allow_long_ctx))
        if policy is None:
            policy = _policy_from_spec(app["policy"], drafter, model_path, path)
        s = cls(model if isinstance(model, _core.Model) else model_path, policy=policy, drafter=drafter,
                threads=threads, device=device, host=host, host_path=host_path, max_host_bytes=max_host_bytes,
                verbose=verbose, **cfg)
        snap = _read_snapshot(path, s.runtime, max_bytes)   # the same file, read whole and checked again
        s._restore(snap, _snapshot_app(snap.app, snap.header, path))
        return s

    def _check_policy(self, app: dict) -> None:
        want = app["policy"]["name"]
        if want != self.policy.name:
            raise _core.SnapshotError(f"snapshot does not fit this session: the policy differs (the file has "
                                      f"{want!r}, this session {self.policy.name!r})")

    def _restore(self, snap, app: dict) -> None:
        self._check_policy(app)
        st = app["state"]
        last_scores = None if st["last_scores"] is None else np.asarray(st["last_scores"], dtype=np.float32)
        since, rescores = int(st["since_rescore"]), int(st["rescores"])
        snap.apply(self.runtime)   # checks everything, then replaces the native state, history and logits
        self.runtime.restore_state(since, rescores, last_scores)
        self.finish_reason = None
        if hasattr(self.policy, "reset"):
            self.policy.reset()    # the drafter re-feeds the history at its next rescore

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> dict:
        p = self.pager.stats
        mib = 2**20
        resident = self.runtime.pool_bytes + self.runtime.swa_bytes
        mat = max(1, p["materialised_chunks"])
        return {
            "mode": "kvflash" if self.kvflash else "full",
            "policy": self.policy.name + (" (fallback)" if self._policy_note else ""),
            "n_past": self.runtime.n_past,
            "max_ctx": self.max_ctx,
            "pool_tokens": self.runtime.pool_tokens,
            "resident_kv_mib": resident / mib,
            "host_kv_mib": p["host_bytes"] / mib,
            "host_cap_mib": p["max_host_bytes"] / mib if p["max_host_bytes"] else None,
            "residency_pct": 100.0 * min(p["resident_chunks"], mat) / mat,
            "page_outs": p["page_outs"],
            "page_ins": p["page_ins"],
            "clean_skips": p["clean_skips"],
            "bytes_out": p["bytes_out"],
            "bytes_in": p["bytes_in"],
            "rescores": self.runtime.rescores,
            "rescore_ms": 1e3 * self._rescore_s,
            "prefill_s": self._prefill_s,
            "decode_tok_s": self._decoded / self._decode_s if self._decode_s > 0 else 0.0,
            "threads": self.threads,
            "kv_type": self.kv_type,
            **(_spec_stats(self.runtime.spec_stats, self._decode_s) if self.exact else {}),
            **({"rpc": [dict(r) for r in self.remote_layers]} if self.remote_layers else {}),
        }
