"""Scored residency policies: drafter-scored and drafter-free (qk).

Both follow the policy protocol of :mod:`kvflash.policies` (``name``, ``score(view)``,
``requirements``, ``reset()``, ``rewind()``, ``spec()``) and are registered by name through
:func:`kvflash.policies.register_policy`, as a user's policy is; the heavy lifting (key
summaries, attention probabilities) happens in the native runtime, once per rescore, through
the view's scorer handles.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np

from . import _core
from ._checks import KV_TYPES, int_in, one_of, opt_int
from ._pool import DRAFTER_RESERVE_BYTES
from .policies import (BasePolicy, ChunkView, QkScorer, PolicyContext, PolicyUnavailable, Requirements, Target,
                       qk_layers, register_policy)


class QKPolicy(BasePolicy):
    """Drafter-free: score chunks with the target model's own queries and keys.

    ``mode="keys"`` (policy ``"qk"``): at a rescore the queries of the last
    ``n_queries`` tokens (post-RoPE, captured by the runtime across evals) attend
    over every key of the history -- resident rows from the pool, paged-out rows
    from the host store, where they are kept bit-exact -- with a softmax per
    layer, head and query.  One pass over the keys per rescore, no second model,
    no re-feeding.  How those probabilities become chunk scores is ``aggregate``:

    - ``"peak"`` (the default, scored in the core: ``_core.Runtime.qk_peak_scores``):
      per token the attention the last ``n_queries`` pay it (mean over the queries,
      max over heads and the first ``layers`` paged layers), minus what the
      ``n_queries`` ending ``contrast`` tokens earlier pay it (what any query
      attends to -- sinks, common words -- cancels; 0: off), each token taking the
      peak of the ``spread`` tokens either side, and a chunk its peak token.
      ``carry=N`` (default 16; 0: off) also gives each token, a hair lower, the
      score of the N tokens before it: the value of a fact follows its key, so the
      chunk after a key that sits near a chunk edge ranks right behind the key's
      (a passkey split by a chunk edge, or its key at the end of one chunk and its
      digits in the next).  ``windows=W`` scores the last W * n_queries queries as W
      windows of n_queries (the latest first), each minus the one baseline, and ranks
      a chunk by its best rank in any window (ties: the better mean rank): a prompt
      that ends in format tokens (a chat log's next "[16:32] name: ") still scores
      with its question's queries a window earlier.  The runtime then captures
      n_queries + contrast queries (n_queries * windows if that is more).
      The core scores it itself (``requirements.native``) unless a subclass overrides score().
      ``layers="auto"`` reads a quarter of the paged layers but at least 8 (all when there are fewer):
      later layers' spikes drown the retrieval signal of the early ones.
      Defaults (8 queries, contrast 64, spread 8, carry 16, 3 windows, auto layers) chosen on
      the tuning splits (bench/drafter_rank.py --policy qk, bench/qk_contrast.py; bench/results README).
    - ``"chunk"``: per layer and head the attention mass a chunk's positions
      receive, max over heads and layers (``aggregate="chunk", layers=None`` is
      the qk before 63110a5, over every paged layer).
    - ``"token"``: tokens scored first (max over heads and layers), smoothed and
      averaged per chunk.

    The summary modes score a per-chunk summary computed when the chunk seals (it
    is still resident then), per paged layer and KV head, against the last query
    alone: ``"bound"`` the element-wise min/max keys, scoring
    sum_d max(q_d * min_d, q_d * max_d) (an upper bound of q . k in the chunk);
    ``"mean"`` the L2-normalised mean key.  Max over query heads, mean over layers.
    They read no history, but rank needles poorly on SmolLM2 (bench/results/tuning/needle).
    """

    MODES = ("keys", "bound", "mean")

    def __init__(self, mode: str = "keys", *, n_queries: Optional[int] = None, smooth_width: int = 5,
                 aggregate: Optional[str] = None, contrast: Optional[int] = None, spread: Optional[int] = None,
                 layers="auto", carry: Optional[int] = None, windows: Optional[int] = None):
        if mode not in self.MODES:
            raise ValueError(f"qk mode must be one of {', '.join(self.MODES)}; got {mode!r}")
        defaults = _core.QK_PEAK_DEFAULTS   # the core's PeakScoring (scoring.h): one place for the numbers
        if n_queries is None:
            n_queries = defaults["n_queries"]
        if not isinstance(n_queries, int) or isinstance(n_queries, bool) or not 1 <= n_queries <= 256:
            raise ValueError(f"n_queries must be an integer in [1, 256], got {n_queries!r}")
        if aggregate is None:
            aggregate = "peak" if mode == "keys" else "chunk"
        if aggregate not in ("chunk", "token", "peak"):
            raise ValueError(f"qk aggregate must be 'chunk', 'token' or 'peak', got {aggregate!r}")
        peak = aggregate == "peak" and mode == "keys"
        resolved = {}
        for what, v in (("contrast", contrast), ("spread", spread), ("carry", carry)):
            if v is None:
                v = defaults[what] if peak else 0
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"qk {what} must be a non-negative token count (0: off), got {v!r}")
            if v and not peak:
                raise ValueError(f"qk {what} works on token scores: use aggregate='peak' (mode 'keys') with it")
            resolved[what] = v
        if windows is None:
            windows = defaults["windows"] if peak else 1
        if not isinstance(windows, int) or isinstance(windows, bool) or not 1 <= windows <= 16:
            raise ValueError(f"qk windows must be an integer in [1, 16], got {windows!r}")
        if windows > 1 and not peak:
            raise ValueError("qk windows works on token scores: use aggregate='peak' (mode 'keys') with it")
        if layers is not None and layers != "auto" and (
                not isinstance(layers, int) or isinstance(layers, bool) or layers < 1):
            raise ValueError(f"qk layers must be 'auto', a positive layer count or None (every paged layer), "
                             f"got {layers!r}")
        if mode != "keys" and layers not in ("auto", None):
            raise ValueError("qk layers works on the history attention: use mode 'keys' with it")
        self.mode = mode
        self.layers = layers if mode == "keys" else None
        self.aggregate = aggregate
        self.contrast, self.spread, self.carry = resolved["contrast"], resolved["spread"], resolved["carry"]
        self.windows = windows
        self.name = "qk" if mode == "keys" else f"qk-{mode}"
        self.needs_chunk_summaries = mode != "keys"
        self.n_queries = n_queries if mode == "keys" else 1
        # queries the session's runtime must keep: the baseline's and the latest, or every window's if more
        self.n_capture = _core.qk_peak_capture(self.n_queries, self.contrast, self.windows)
        self.smooth_width = smooth_width

    def n_layers(self, n_paged: int) -> int:
        """The paged layers scored, for a runtime with n_paged of them (the core's 0 = all)."""
        return qk_layers(self.layers, n_paged)

    def _scorer(self) -> QkScorer:
        return QkScorer(n_queries=self.n_queries, mode=self.mode, aggregate=self.aggregate,
                        smooth_width=self.smooth_width, contrast=self.contrast, spread=self.spread, carry=self.carry,
                        layers=self.layers, windows=self.windows)

    @property
    def requirements(self) -> Requirements:
        # every mode and aggregate is the core's (QkScoring); a subclass with a score() of its own is called instead
        native = self._scorer() if type(self).score is QKPolicy.score else None
        return Requirements(n_capture=self.n_capture, chunk_summaries=self.needs_chunk_summaries, native=native)

    def score(self, view: ChunkView) -> Optional[np.ndarray]:
        """What the core scores the chunks with at a rescore (the same call: scoring.h qk_scores)."""
        return view.qk_policy_scores(self._scorer().core_args(view.n_paged_layers))

    def spec(self) -> dict:
        return dict(mode=self.mode, n_queries=self.n_queries, smooth_width=self.smooth_width,
                    aggregate=self.aggregate, contrast=self.contrast, spread=self.spread, layers=self.layers,
                    carry=self.carry, windows=self.windows)

    # reset: captured queries and summaries live in the runtime and are cleared by its reset


# Token scores to chunk scores: the core's (scoring.h), the one implementation the qk scorer, the drafter and the
# C API use; these are its Python faces.

def smooth(x: np.ndarray, width: int) -> np.ndarray:
    """Centered moving average (width 1 = identity)."""
    if width <= 1 or x.size == 0:
        return x
    return _core.moving_average(np.asarray(x, dtype=np.float64), width).astype(np.float32)


def spread_max(x: np.ndarray, reach: int) -> np.ndarray:
    """Each entry becomes the max of itself and its ``reach`` neighbours on either side (0 = identity)."""
    if reach <= 0 or x.size == 0:
        return x
    return _core.spread_max(np.asarray(x, dtype=np.float64), reach).astype(x.dtype, copy=False)


def tokens_to_chunks(tok_scores: np.ndarray, chunk_of: np.ndarray, n_chunks: int, *, aggregate: str = "max",
                     spread: int = 0, smooth_width: int = 5) -> np.ndarray:
    """Token scores to chunk scores (``chunk_of``: the chunk of each token): each token first takes the peak
    of the ``spread`` tokens on either side, then a chunk scores its peak token (``aggregate="max"``) or
    the mean of its smoothed tokens (``"mean"``)."""
    n = min(len(tok_scores), len(chunk_of))
    x, idx = np.asarray(tok_scores[:n], dtype=np.float64), np.asarray(chunk_of[:n], dtype=np.int32)
    if aggregate == "max":
        return _core.chunk_peaks(x, idx, n_chunks, spread)
    return _core.chunk_means(x, idx, n_chunks, spread, smooth_width)


def per_chunk_mean(tok_scores: np.ndarray, chunk_tokens: int, n_chunks: int) -> np.ndarray:
    """Each chunk's mean token score (chunk c: tokens [c * chunk_tokens, (c + 1) * chunk_tokens))."""
    n = min(tok_scores.size, n_chunks * chunk_tokens)
    chunk_of = (np.arange(n) // chunk_tokens).astype(np.int32)
    return _core.chunk_means(np.asarray(tok_scores[:n], dtype=np.float64), chunk_of, n_chunks, 0, 0)


class DrafterPolicy(BasePolicy):
    """A second (smaller) model scores every chunk by the attention the tail pays it.

    The drafter keeps its own cache of the whole history and is fed only the
    tokens added since its last rescore (the reference re-reads the whole
    history every time).  At a rescore it evaluates the new tokens, captures the
    queries of the last ``n_queries`` tokens, and takes per history token the
    attention those queries pay it (softmax per head and layer over every key of
    the history, mean over the queries, max over heads and layers).  A chunk
    scores the peak of its tokens (``aggregate="max"``, the default: a passkey is
    a few tokens of its chunk) or, the reference's way, their mean after a
    ``smooth_width``-token moving average (``aggregate="mean"``).  When the
    drafter's vocabulary differs from the target's, the history is detokenized,
    re-tokenized for the drafter, and the scores are mapped back to target chunks
    by byte spans (the cross-tokenizer bridge).  The drafter is loaded lazily, at
    the first rescore.

    ``layers`` cuts the drafter to its first N layers (a scoring runtime: K/V and
    queries of those layers only, no FFN after the last, no head).  Every decoded
    token is fed to the drafter once, so its forward cost per token is the
    policy's price.  ``layers=None`` evaluates a quarter of the drafter's layers
    (rounded up) but at least 8 (or all, when it has fewer), and always through
    its first full-attention layer (the sliding-window layers score nothing).

    ``contrast=N`` (default 32; 0 turns it off) subtracts, per history token, the
    attention paid by the queries that ended N drafter tokens earlier from the
    tail's: what any query attends to (sinks, generally salient words) cancels,
    what the tail itself asks for stays.  It costs one more pass over the history
    per rescore.  ``spread=R`` (default 4; 0 turns it off) gives each token the
    peak score of the R tokens on either side of it before the per-chunk
    aggregation: a fact is read from the words around the one the queries look at
    ("... the passkey is" attends to "passkey", the answer is the digits after
    it), and that span may cross a chunk edge.  These defaults were chosen on the
    bench's tuning prompts (8K, Gemma-3 target, SmolLM2 drafter: passkey chunk kept
    in 16/16 there, 9/16 with 8 queries and neither); on held-out prompts see
    bench/results/*-reporting.

    ``pool`` pages the drafter's own cache the way the target's is paged: every
    key and value of the history is kept (bit-exact, the cold chunks in host
    memory), its forward attends over a ``pool``-token window (attention sink plus
    the most recent tokens), and the scoring queries attend over every key of the
    history, resident or paged out.  ``pool=None`` (or 0) gives the drafter a full
    cache: its forward then attends over the whole history, which costs what a
    full-cache decode costs per fed token, in memory that grows with the context.

    It loads from the view's ``target`` (the session's model, tokenizer, threads and max_ctx)
    and, bridged, reads the history's bytes through ``view.token_bytes()``; auto pool sizing
    leaves ``requirements.extra_bytes`` free for it.
    """

    name = "drafter"

    def __init__(self, path, *, threads: Optional[int] = None, n_queries: int = 16, smooth_width: int = 5,
                 kv_type: str = "q8_0", layers: Optional[int] = None, pool: Optional[int] = 1024,
                 aggregate: str = "max", contrast: Optional[int] = None, spread: Optional[int] = None):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise ValueError(f"drafter {self.path} does not exist")
        self.threads = threads
        self.n_queries = n_queries
        self.smooth_width = smooth_width
        self.kv_type = kv_type
        if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 1):
            raise ValueError(f"drafter layers must be a positive integer or None, got {layers!r}")
        self.layers = layers
        if pool is not None and (not isinstance(pool, int) or isinstance(pool, bool) or pool < 0):
            raise ValueError(f"drafter pool must be a non-negative token count or None (full cache), got {pool!r}")
        self.pool = pool or None
        self.aggregate = aggregate
        if not isinstance(n_queries, int) or isinstance(n_queries, bool):
            raise ValueError(f"drafter n_queries must be an integer in [1, 4096], got {n_queries!r}")
        for what, v in (("contrast", contrast), ("spread", spread), ("smooth_width", smooth_width)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"drafter {what} must be a non-negative token count (0: off), got {v!r}")
        # the core checks the rest and resolves contrast and spread (DrafterSettings, csrc/kvflash/drafter.h)
        s = _core.drafter_settings(n_queries=n_queries, smooth_width=smooth_width, kv_type=kv_type, layers=layers,
                                   pool=self.pool, aggregate=aggregate, contrast=contrast, spread=spread)
        self.contrast, self.spread = s["contrast"], s["spread"]
        self._drafter = None        # the core's drafter scorer (_core.Drafter), made at the first score
        self._tok = None

    @property
    def requirements(self) -> Requirements:
        # the target's capture window stays n_queries, as before the protocol (a snapshot's header holds it)
        return Requirements(n_capture=self.n_queries, extra_bytes=DRAFTER_RESERVE_BYTES)

    def spec(self) -> dict:
        # no path: a snapshot names no files (the drafter is the loader's to give)
        return dict(n_queries=self.n_queries, smooth_width=self.smooth_width, kv_type=self.kv_type,
                    layers=self.layers, pool=self.pool, aggregate=self.aggregate, contrast=self.contrast,
                    spread=self.spread)

    # -- lazy setup: the core's drafter scorer (csrc/kvflash/drafter.h) does the work ----------------------
    def load(self, target: Target) -> None:
        """Load the drafter for a session now (``view.target``; otherwise done at the first rescore)."""
        if self._drafter is None:
            self._load(target)

    def _load(self, target: Target) -> None:
        from .tokenizer import Tokenizer
        same = os.path.realpath(self.path) == os.path.realpath(str(target.model_path))
        try:
            if same:   # same weights: share them
                model, self._tok = target.model, target.tokenizer
            else:
                # on the target's device (a GPU's drafter scores beside it; "cpu" where the target is)
                model = _core.Model(self.path, self.threads or target.threads,
                                    device=getattr(target.model, "device", "cpu"))
                self._tok = Tokenizer.from_gguf(self.path)
        except Exception as e:  # an explicit drafter that fails to load is an error
            raise ValueError(f"drafter {self.path} failed to load: {e}") from e
        d = _core.Drafter(model, target.max_ctx, self.threads or target.threads, n_queries=self.n_queries,
                          smooth_width=self.smooth_width, kv_type=self.kv_type, layers=self.layers, pool=self.pool,
                          aggregate=self.aggregate, contrast=self.contrast, spread=self.spread,
                          target_vocab=target.tokenizer, drafter_vocab=self._tok)
        d.load()   # its layer count checked now, against the drafter's layers (ValueError)
        self._drafter = d

    @property
    def bridged(self) -> bool:
        """The drafter's vocabulary is not the target's: scores go through the byte-span bridge."""
        return self._drafter is not None and self._drafter.bridged

    @property
    def fed_tokens_total(self) -> int:
        """Tokens the drafter evaluated over its lifetime."""
        return 0 if self._drafter is None else self._drafter.fed_tokens_total

    @property
    def layers_used(self) -> Optional[int]:
        """Layers the loaded drafter evaluates (None before it is loaded)."""
        return None if self._drafter is None else self._drafter.layers_used

    @property
    def eval_layers(self) -> int:
        """What the loaded drafter runtime evaluates (0: all its layers)."""
        return 0 if self._drafter is None else self._drafter.eval_layers

    @property
    def _rt(self):
        """The drafter's own runtime (a view of its scoring session), None before it is loaded."""
        return None if self._drafter is None else self._drafter.runtime()

    @property
    def _fed(self) -> list[int]:
        """The tokens the drafter's cache holds (its core session's history)."""
        rt = self._rt
        return [] if rt is None else rt.tokens.tolist()

    def set_interrupt(self, fn: Optional[Callable[[], bool]]) -> None:
        """fn() is asked between the pieces of the drafter's evals (Ctrl-C always is); True stops the eval as a
        Ctrl-C does.  The drafter must be loaded (load())."""
        if self._drafter is None:
            raise ValueError("set_interrupt: the drafter is not loaded yet (load(view.target) first)")
        self._drafter.set_interrupt(fn)

    def rewind(self, n_tokens: int) -> None:
        """The session's history was cut back to its first n_tokens (a failed or interrupted prefill,
        ``Session.truncate``, a chat turn that diverged): forget what the drafter was fed past them.
        A bridged drafter's tokens are its own, so it finds the common prefix at its next feed instead."""
        if self._drafter is not None:
            self._drafter.rewind(n_tokens)

    def _per_chunk(self, tok_scores: np.ndarray, chunk_of: np.ndarray, n_chunks: int) -> np.ndarray:
        """Token scores to chunk scores with this policy's aggregate, spread and smoothing (the core's, as its
        drafter scorer takes them)."""
        return tokens_to_chunks(tok_scores, chunk_of, n_chunks, aggregate=self.aggregate, spread=self.spread,
                                smooth_width=self.smooth_width)

    def score(self, view: ChunkView) -> Optional[np.ndarray]:
        if self._drafter is None:
            self._load(view.target)
        return self._drafter.score(view.tokens[: view.n_past], view.n_chunks, view.chunk_tokens)

    def reset(self) -> None:
        if self._drafter is not None:
            self._drafter.reset()


# ---------------------------------------------------------------------- registered as a user's policy would be

_QK_SETTINGS = {"mode": lambda v: isinstance(v, str) and len(v) <= 64, "n_queries": int_in(1, 256),
                "smooth_width": int_in(0, 4096),
                "aggregate": lambda v: v is None or isinstance(v, str) and len(v) <= 64,
                "contrast": opt_int(0, 2**31 - 1), "spread": opt_int(0, 2**31 - 1),
                "layers": lambda v: v is None or v == "auto" or int_in(1, 2**31 - 1)(v),
                "carry": opt_int(0, 2**31 - 1), "windows": int_in(1, 16)}
_DRAFTER_SETTINGS = {"n_queries": int_in(1, 4096), "smooth_width": int_in(0, 4096), "kv_type": one_of(*KV_TYPES),
                     "layers": opt_int(1, 2**31 - 1), "pool": opt_int(0, _core.MAX_CONTEXT),
                     "aggregate": one_of("max", "mean", "mass"), "contrast": opt_int(0, 2**31 - 1),
                     "spread": opt_int(0, 2**31 - 1)}


def _qk(mode: str):
    def make(**settings) -> QKPolicy:
        # a snapshot's settings name their mode; one from before API version 15 has no windows: it scored one
        old = {"windows": 1} if settings and "windows" not in settings else {}
        return QKPolicy(**{"mode": mode, **old, **settings})
    return make


def _drafter(ctx: PolicyContext, **settings):
    """The drafter next to the model (or the caller's drafter=); making a session without one falls back to qk,
    loading a snapshot taken with one asks for it."""
    where = ctx.drafter_path()
    if where is None:
        if ctx.snapshot is not None:
            raise PolicyUnavailable(f"snapshot {ctx.snapshot} was taken with the drafter policy and no drafter is "
                                    f"next to {ctx.model_path}: pass drafter= (the drafter model) to Session.load "
                                    f"(a snapshot names no files)")
        # the reference falls back to LRU, which keeps no needle past its window
        ctx.note = " (no drafter found next to the model: falling back to qk)"
        return QKPolicy()
    return DrafterPolicy(where, **{"threads": ctx.threads, **settings})


for _mode, _name in (("keys", "qk"), ("bound", "qk-bound"), ("mean", "qk-mean")):
    register_policy(_name, _qk(_mode), settings=_QK_SETTINGS, key="qk")
register_policy("drafter", _drafter, settings=_DRAFTER_SETTINGS, key="drafter", context=True)
