"""kvflash.Session: a model, its paged KV pool, a tokenizer and a residency policy.

The session's logic is the core's (``_core.Runtime`` holds a ``kvflash::Session``); this class brings the
arguments (checked: ``_checks``), the pool size (``_pool``), text (templates, stop strings, streaming decode),
the policy (``policies``: the protocol and the registry) and snapshots (``_snapshot``: the session's JSON)."""
from __future__ import annotations

import contextlib
import json
import inspect
import os
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from . import _core, _snapshot
from . import scoring  # noqa: F401  (registers the built-in scored policies)
from ._checks import (check_exact_device, check_generate_args, check_max_ctx, check_prefill_piece,
                      check_session_args, is_int, rpc_args)
from ._pool import pool_tokens
from ._stats import PrefillProgress, session_stats
from .devices import resolve_device
from .models import DEFAULT_MODEL, resolve_model
from .policies import (ChunkView, Policy, PolicyContext, ScorerHandles, Target, bind, make_policy, policy_from_spec,
                       policy_spec, validate_scores)
from .system import usable_cores
from .tokenizer import StreamDecoder, Tokenizer

__all__ = ["Session", "PrefillProgress"]


class Session:
    """One conversation's state over a GGUF model, with the KV cache in a paged pool.

    >>> s = kvflash.Session("smollm2-135m", max_ctx=8192, kvflash=1024, policy="lru")
    >>> print("".join(s.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}])))
    """

    def __init__(self, model: Union[str, os.PathLike, "_core.Model"] = DEFAULT_MODEL, *, max_ctx: Optional[int] = None,
                 kvflash: Union[str, int, None] = "auto", policy: Union[str, Policy] = "qk",
                 drafter: Union[str, os.PathLike, None] = None, tau: int = 64, kv_type: str = "q8_0",
                 threads: Optional[int] = None, seed: Optional[int] = None, chunk_tokens: Union[int, str] = 64,
                 sink_chunks: int = 1, tail_window_chunks: int = 4, host: str = "ram",
                 host_path: Union[str, os.PathLike, None] = None, allow_long_ctx: bool = False,
                 ubatch: int = 512, reeval_tokens: int = 64, prefill_rescore: int = 0, prefill_reread: bool = False,
                 verbose: bool = True,
                 device: str = "auto",
                 max_host_bytes: Optional[int] = None, prefill_piece: Optional[int] = None,
                 exact: bool = False, exact_draft: Optional[int] = None, exact_prefill: Union[bool, str] = False,
                 exact_prefill_until: Optional[int] = None,
                 rpc: Optional[Sequence[str]] = None, tensor_split: Optional[Sequence[float]] = None):
        check_session_args(kv_type=kv_type, threads=threads, max_host_bytes=max_host_bytes, exact=exact,
                           exact_prefill=exact_prefill, exact_prefill_until=exact_prefill_until,
                           exact_draft=exact_draft, tau=tau, kvflash=kvflash,
                           reeval_tokens=reeval_tokens, prefill_rescore=prefill_rescore, prefill_reread=prefill_reread)
        rpc, tensor_split = rpc_args(rpc, tensor_split)
        if rpc and (exact or exact_prefill is True or prefill_reread):
            raise ValueError("exact=True, exact_prefill=True and prefill_reread=True read the host store in place with "
                             "kvflash's CPU kernel in one process; they cannot run with layers on RPC servers (rpc=...)")
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
        check_exact_device(self.device, exact, exact_prefill, prefill_reread)
        hp = self.model.hparams
        self.hparams = hp
        if max_ctx is None:
            max_ctx = int(hp["n_ctx_train"])
        check_max_ctx(max_ctx, hp["n_ctx_train"], allow_long_ctx)
        self.max_ctx = max_ctx
        self.tokenizer = Tokenizer.from_gguf(self.model_path)
        if self.tokenizer.n_vocab > hp["n_vocab"]:
            # Encoding could give ids the model has no embedding for: prefill refuses
            # those by id; say so once here, where the file's mismatch is visible.
            warnings.warn(f"the tokenizer has {self.tokenizer.n_vocab} tokens, the model {hp['n_vocab']}: "
                          f"text that encodes to the extra tokens is refused by prefill", stacklevel=2)
        self.tau = tau
        self.kv_type = kv_type
        self.reeval_tokens = reeval_tokens
        self.prefill_rescore = prefill_rescore
        # A scored session's prompt that outgrew the pool: its settle reads the chosen chunks the pooled pieces
        # wrote again in place over the whole context (Runtime.reread), before the tail's re-read.
        self.prefill_reread = prefill_reread

        # The policy (the drafter resolved, or the fallback decided) before sizing the pool: what it declares
        # it needs (Requirements) sizes the pool's neighbours and the runtime's capture window.
        ctx = PolicyContext(self.model_path, drafter=drafter, threads=self.threads)
        self._bound = make_policy(policy, ctx)
        self._policy, self._policy_note = self._bound.policy, ctx.note
        req = self._bound.requirements
        # chunk_tokens='auto' (the CLI's and the server's default): the core's rule for the pool this resolves to
        # (the largest of 64, 32, 16 leaving >= 24 chunks free of the sink and the tail window), the pool's floor
        # checked at the smallest of them; prompts still read 64-token pieces (kvflash::auto_chunk_geometry).
        auto_chunk = chunk_tokens == "auto"
        if not auto_chunk and not is_int(chunk_tokens, 1):
            raise ValueError(f"chunk_tokens must be a positive integer or 'auto', got {chunk_tokens!r}")
        pool, self.auto_reason = pool_tokens(self.model, kvflash, kv_type=kv_type, max_ctx=max_ctx,
                                             chunk_tokens=16 if auto_chunk else chunk_tokens, sink_chunks=sink_chunks,
                                             tail_window_chunks=tail_window_chunks, extra_bytes=req.extra_bytes)
        if auto_chunk:
            chunk_tokens, piece = _core.auto_chunk_geometry(pool, sink_chunks, tail_window_chunks)
            if prefill_piece is None and piece:
                prefill_piece = piece
        # prefill_piece changes how a prompt is cut, not what a snapshot holds, so a snapshot does not record it.
        check_prefill_piece(prefill_piece, pool, chunk_tokens, sink_chunks, tail_window_chunks)
        # the runtime's capture window and summaries are fixed here: a policy swapped in later must fit them
        self._n_capture, self._summaries = req.n_capture, req.chunk_summaries
        self.runtime = _core.Runtime(self.model, max_ctx=max_ctx, pool_tokens=pool, kv_type=kv_type,
                                     chunk_tokens=chunk_tokens, sink_chunks=sink_chunks,
                                     tail_window_chunks=tail_window_chunks, ubatch=ubatch, host=host,
                                     host_path=None if host_path is None else str(host_path),
                                     seed=0 if seed is None else int(seed), max_host_bytes=max_host_bytes or 0,
                                     chunk_summaries=self._summaries, capture_queries=self._n_capture,
                                     prefill_piece=prefill_piece or 0)
        if self.tokenizer.n_vocab < hp["n_vocab"]:
            # Padded embedding rows (ids the tokenizer has no text for): never sample them,
            # or the stream would meet an id it cannot decode.
            self.runtime.sample_vocab = self.tokenizer.n_vocab
        self.seed = seed
        # recorded in a snapshot (the rest of what Session.load builds from is the core's: session_file.h)
        self._allow_long_ctx = allow_long_ctx
        self.pager = self.runtime.pager
        self.chunk_tokens = chunk_tokens
        self.kvflash = pool > 0
        # Exact mode (speculative verification): the full cache's tokens from the paged session.  With
        # the full cache itself there is nothing to verify: every eval is already exact.
        self.exact = exact and self.kvflash
        self.exact_draft = exact_draft
        # Exact prefill: prompts are evaluated as the full cache evaluates them (every position attended,
        # paged-out rows read from the host store), so every chunk's K/V are the full cache's; decode then
        # reads the pool as usual.  Implied by exact mode; nothing to do for the full cache.  'auto': on
        # where the core measures it cheap (few paged layers, the CPU backend), up to the position it gives
        # (Model.auto_exact_prefill_until; pieces from there are pooled); off elsewhere.
        self.exact_prefill_until = 0 if exact else exact_prefill_until or 0
        if exact_prefill == "auto" and not exact:
            if exact_prefill_until is None:
                self.exact_prefill_until = int(self.model.auto_exact_prefill_until)
            exact_prefill = int(self.model.auto_exact_prefill_until) > 0
        self.exact_prefill = bool(exact_prefill or exact) and self.kvflash
        # What a policy's view may ask of the core (read-only), and who it serves.
        self._handles = ScorerHandles.of(self.runtime, self.tokenizer,
                                         Target(str(self.model_path), self.model, self.tokenizer, self.threads,
                                                max_ctx))
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

    # ------------------------------------------------------------------ the policy
    @property
    def policy(self) -> Policy:
        """The policy that scores the chunks; assigning another one reconfigures the core's scorer.  It must
        fit the runtime made for the first: no more captured queries, and chunk summaries only when the first
        had them (ValueError otherwise)."""
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        bound = bind(policy)
        req = bound.requirements
        if req.n_capture > self._n_capture:
            raise ValueError(f"policy {policy.name!r} reads the last {req.n_capture} queries; this session's "
                             f"runtime captures {self._n_capture} (make the session with a policy that reads "
                             f"at least as many)")
        if req.chunk_summaries and not self._summaries:
            raise ValueError(f"policy {policy.name!r} reads chunk summaries; this session's runtime keeps none "
                             f"(make the session with a policy that reads them)")
        with self._using("setting the policy", from_iterator=self._open_iterator()):
            self._policy, self._bound, self._policy_note = policy, bound, ""
            self._configure_core()

    def _configure_core(self) -> None:
        """How the core scores chunks for this policy: one that scores nothing installs no scores, a native
        one is scored in the core, every other through the callback (policy.score(view))."""
        rt, req = self.runtime, self._bound.requirements
        rt.set_scorer(None)
        if not req.scores:
            scorer = dict(scorer="none")
        elif req.native is not None:
            scorer = dict(scorer="qk", qk=req.native.core_args(rt.n_paged_layers))
        else:
            rt.set_scorer(self._policy_scores)
            scorer = dict(scorer="external")
        rt.configure(**scorer, tau=self.tau, reeval_tokens=self.reeval_tokens, prefill_rescore=self.prefill_rescore,
                     prefill_reread=self.prefill_reread,
                     exact=self.exact,
                     exact_draft=-1 if self.exact_draft is None else self.exact_draft,
                     exact_prefill=self.exact_prefill, exact_prefill_until=self.exact_prefill_until,
                     allow_long_ctx=self._allow_long_ctx,
                     seed_given=self.seed is not None)
        # how the core names the policy (a restore compares names); its settings are taken at save()
        rt.set_policy_spec("" if self._core_named() else json.dumps({"name": self._policy.name, "custom": True}))
        # a policy with a history of its own (the drafter's cache) hears of cuts
        rt.set_rewind_hook(self._bound.rewind)

    def _core_named(self) -> bool:
        """The core writes this policy's spec itself: lru, or a qk policy it scores natively."""
        req = self._bound.requirements
        return (not req.scores and self._policy.name == "lru") or req.native is not None

    def chunk_view(self) -> ChunkView:
        """What a policy sees now: the chunk table, the token history (read-only) and the scorer handles."""
        rt = self.runtime
        n = -(-rt.n_past // self.chunk_tokens)
        table = self.pager.chunk_table()
        return ChunkView(n_chunks=n, chunk_tokens=self.chunk_tokens, n_past=rt.n_past, tokens=rt.tokens,
                         resident=table["block"][:n] >= 0, protected=table["protected"][:n],
                         on_host=table["host"][:n] >= 0, pool_chunks=self.pager.n_blocks, handles=self._handles)

    def _policy_scores(self, n: int):
        """The core's external scorer: the Python policy's scores for n chunks, checked (None: nothing moves)."""
        scores = self._bound.score(self.chunk_view())
        return None if scores is None else validate_scores(scores, n, self.policy.name)

    @property
    def banner(self) -> str:
        mode = (" [exact: drafts over the pool, verified over the whole context]" if self.exact
                else f" [exact prefill: prompts attend the whole context up to position {self.exact_prefill_until}]"
                if self.exact_prefill and self.exact_prefill_until
                else " [exact prefill: prompts attend the whole context]" if self.exact_prefill
                else "" if self.kvflash else " [full cache]")
        pool = (f"{self.runtime.pool_tokens} tokens in {self.chunk_tokens}-token chunks" if self.kvflash
                else f"{self.runtime.pool_tokens} tokens")
        line = (f"[kvflash] resident pool {pool} (logical max_ctx {self.max_ctx}), tau={self.tau}, "
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

    def logits(self) -> np.ndarray:
        """Logits after the last evaluated token (float32 [n_vocab])."""
        if not self.runtime.has_logits:
            raise ValueError("no token evaluated yet: prefill a prompt first")
        return self.runtime.last_logits()

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
        stops = check_generate_args(max_tokens, temperature, top_p, min_p, stop)
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
            tail = dec.flush()
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
        self._bound.reset()

    # ------------------------------------------------------------------ snapshots
    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the whole session to a snapshot file: the chunk table, the pool's rows, the host
        store's chunks, gemma3's sliding-window ring, the recurrent layers' state and its host
        checkpoints (qwen35), the captured queries, the token history, the last logits, the
        sampler's generator and the policy's settings.

        Atomic: a temporary file beside ``path``, fsynced, then renamed over it; when the write
        fails (RuntimeError naming the OS error) ``path`` is as it was.  Refused (RuntimeError)
        while a generate() iterator is open.  The drafter policy's own cache is not saved:
        it is rebuilt by re-feeding the history at the first rescore after a load.
        """
        with self._using("save"):
            if not self._core_named():   # the policy's settings as they are now (ValueError: its spec breaks its schema)
                self.runtime.set_policy_spec(json.dumps(policy_spec(self._bound)))
            self.runtime.save(os.fspath(path))   # the core writes the session's JSON too (session_file.h)

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
            # the core: the header and the session state first (small reads), the file held to this session's
            # geometry and policy, then the file read whole, checked again and applied (session_file.h)
            self.runtime.restore(_snapshot.existing(path), max_bytes=_snapshot.max_bytes_arg(max_bytes),
                                 where=f"snapshot {os.fspath(path)}")
            self._restored()

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
        head, app = _snapshot.peek(path, max_bytes)
        model_path = Path(model.path) if isinstance(model, _core.Model) else resolve_model(model)
        fp = _core.model_fingerprint(str(model_path))
        size = os.path.getsize(model_path)
        if (fp, size) != (head["fingerprint"], head["model_bytes"]):
            raise _core.SnapshotError(f"snapshot does not fit this session: it was taken with another model file "
                                      f"(fingerprint {head['fingerprint']:016x}, {head['model_bytes']} bytes; "
                                      f"{model_path} is {fp:016x}, {size} bytes)")
        cfg = dict(app["config"], allow_long_ctx=bool(allow_long_ctx))
        if policy is None:
            # by its registered name and saved settings; a drafter is the caller's drafter=, or one found next to
            # the caller's model as Session finds it, never a file the snapshot names
            ctx = PolicyContext(model_path, drafter=drafter, threads=threads, snapshot=os.fspath(path))
            policy = policy_from_spec(app["policy"], ctx)
        s = cls(model if isinstance(model, _core.Model) else model_path, policy=policy, drafter=drafter,
                threads=threads, device=device, host=host, host_path=host_path, max_host_bytes=max_host_bytes,
                verbose=verbose, **cfg)
        # the same file, read whole and checked again by the core
        s.runtime.restore(_snapshot.existing(path), max_bytes=_snapshot.max_bytes_arg(max_bytes),
                          where=f"snapshot {os.fspath(path)}")
        s._restored()
        return s

    def _restored(self) -> None:
        self.finish_reason = None
        self._bound.reset()    # the drafter re-feeds the history at its next rescore

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> dict:
        return session_stats(self)
