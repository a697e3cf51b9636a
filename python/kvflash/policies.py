"""Residency policies: which chunks deserve the pool's slots, behind one protocol and one registry.

The protocol
------------
A policy is any object with ``name`` (a non-empty str) and ``score(view) -> ndarray | None``.
At each rescore the session hands ``score`` a :class:`ChunkView` -- a read-only view of the
chunk table and the token history, with handles to the core's scorers -- and the policy
returns one float per chunk (higher = keep), and the pager repages the pool to the
top-scoring set, or ``None`` to leave the pager's own recency order in charge.  A policy
never sees the session or its runtime: the core only receives scores, so a policy written
in Python is as first-class as a built-in.

Optional members (:class:`BasePolicy` has them all, with these defaults):

- ``requirements``: a :class:`Requirements` (read when the policy is installed): how many
  queries the runtime must capture for it, whether it reads chunk summaries, whether it
  scores at all, whether the core scores it natively (:class:`QkScorer`: qk and its
  variants, no call into Python), and the memory it takes beside the session (auto pool
  sizing leaves it free).  Default: ``Requirements()``, scored through ``score(view)``.
- ``reset()``: the session forgot its context (``Session.reset``, a snapshot restored).
- ``rewind(n_tokens)``: the session's history was cut back to its first n_tokens, for a
  policy that keeps state per token (the drafter's own cache).
- ``spec() -> dict | None``: the settings that make the policy again, saved in a snapshot
  under its registered name (None: not saved; ``Session.load`` then needs ``policy=``).

The registry
------------
:func:`register_policy` maps a name to a factory and the schema of its saved settings;
``Session(policy="name")`` builds it, and ``Session.load`` builds it again from a snapshot's
settings.  The built-ins ("lru" here; "qk", "qk-bound", "qk-mean" and "drafter" in
:mod:`kvflash.scoring`) are registered the same way.

Example::

    class KeepEarly:
        name = "keep-early"
        def score(self, view):
            return -np.arange(view.n_chunks, dtype=np.float32)   # earlier = better

    kvflash.Session("smollm2-135m", kvflash=512, policy=KeepEarly())
    register_policy("keep-early", KeepEarly)                     # now by name too, snapshots included
    kvflash.Session("smollm2-135m", kvflash=512, policy="keep-early")
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Optional, Protocol, Union, runtime_checkable

import numpy as np

from . import _core
from ._checks import is_int


def qk_layers(layers, n_paged: int) -> int:
    """The paged layers qk scoring reads for a ``layers`` setting ("auto", a count, None: all) on a runtime with
    n_paged of them (the core's 0 = all)."""
    if layers is None:
        return 0
    if layers == "auto":
        return _core.qk_auto_layers(n_paged)
    return min(layers, n_paged)


@dataclass(frozen=True)
class QkScorer:
    """The core's qk scorer (``QkScoring``, csrc/kvflash/scoring.h: qk and its variants) and its settings: a policy
    whose requirements name one is scored in the core at each rescore, and the session never calls its score()."""
    n_queries: int
    mode: str = "keys"
    aggregate: str = "peak"
    smooth_width: int = 5
    contrast: int = 0
    spread: int = 0
    carry: int = 0
    layers: Union[str, int, None] = "auto"
    windows: int = 1

    def core_args(self, n_paged: int) -> dict:
        """The settings as the core's ``Runtime.configure(qk=...)`` and ``qk_policy_scores`` take them."""
        return dict(mode=self.mode, aggregate=self.aggregate, n_queries=self.n_queries, smooth_width=self.smooth_width,
                    contrast=self.contrast, spread=self.spread, n_layers=qk_layers(self.layers, n_paged),
                    carry=self.carry, windows=self.windows)


@dataclass(frozen=True)
class Requirements:
    """What a policy needs from the session that serves it (read when the policy is installed)."""
    scores: bool = True            # False: installs no scores, the pager's recency order rules; score() never called
    n_capture: int = 1             # the last queries the runtime keeps captured (view.history_attention's queries)
    chunk_summaries: bool = False  # the runtime keeps per-chunk key summaries (view.qk_scores)
    native: Optional[QkScorer] = None   # scored in the core with these settings, not through score()
    extra_bytes: int = 0           # memory the policy takes beside the session's (auto pool sizing leaves it free)

    def __post_init__(self):
        if not isinstance(self.scores, bool) or not isinstance(self.chunk_summaries, bool):
            raise ValueError("Requirements.scores and chunk_summaries must be True or False")
        if not is_int(self.n_capture, 1, 4096):
            raise ValueError(f"Requirements.n_capture must be an integer in [1, 4096], got {self.n_capture!r}")
        if self.native is not None and not isinstance(self.native, QkScorer):
            raise ValueError(f"Requirements.native must be a QkScorer or None, got {self.native!r}")
        nat = self.native
        if nat is not None and _core.qk_peak_capture(nat.n_queries, nat.contrast, nat.windows) > self.n_capture:
            raise ValueError("Requirements.native reads more queries (n_queries + contrast, or n_queries * windows) "
                             "than n_capture keeps")
        if not is_int(self.extra_bytes, 0):
            raise ValueError(f"Requirements.extra_bytes must be a non-negative integer, got {self.extra_bytes!r}")


@dataclass(frozen=True)
class Target:
    """The session a view comes from, as a policy that runs a model of its own needs to know it (the drafter
    shares these weights when it is the same file, and bridges to this tokenizer when its own differs)."""
    model_path: str
    model: Any          # the target's loaded kvflash._core.Model (weights only: no cache, no session)
    tokenizer: Any      # its kvflash.tokenizer.Tokenizer
    threads: int
    max_ctx: int


class ScorerHandles(NamedTuple):
    """What a view may ask of the session's core: each reads, none changes the cache (built by the session)."""
    history_attention: Callable     # (**kw) -> per-token (or per-group / per-chunk) attention of captured queries
    qk_peak_scores: Callable        # (n_chunks, **kw) -> the core's peak chunk scores
    qk_scores: Callable             # (mode) -> chunk summaries' scores ("bound" / "mean")
    qk_policy_scores: Callable      # (n_chunks, qk settings) -> the core's qk scorer's chunk scores
    captured_queries: Callable      # () -> float32 [n_paged_layers, n_captured, ...]
    n_captured: Callable            # () -> int
    n_paged_layers: int
    token_bytes: Callable           # (tokens) -> (bytes, end offset of each token), special tokens skipped
    target: Target

    @classmethod
    def of(cls, runtime, tokenizer, target: Target) -> "ScorerHandles":
        rt = runtime
        return cls(history_attention=lambda **kw: rt.history_attention(**kw),
                   qk_peak_scores=lambda n_chunks, **kw: rt.qk_peak_scores(n_chunks, **kw),
                   qk_scores=lambda mode: rt.qk_scores(mode),
                   qk_policy_scores=lambda n_chunks, qk: rt.qk_policy_scores(n_chunks, qk),
                   captured_queries=lambda: rt.captured_queries(),
                   n_captured=lambda: rt.n_captured,
                   n_paged_layers=int(rt.n_paged_layers),
                   token_bytes=lambda tokens: tokenizer.bytes_of(tokens, skip_special=True),
                   target=target)


def _read_only(a, dtype) -> np.ndarray:
    v = np.asarray(a, dtype=dtype).view()   # a view: the caller's array stays theirs, this one cannot write
    v.setflags(write=False)
    return v


@dataclass(frozen=True)
class ChunkView:
    """What a policy sees at a rescore: arrays indexed by chunk (length n_chunks) and the token history, all
    read-only, and the scorer handles (``handles``: the session's core, read-only; None in a view built by
    hand, whose scorer methods then raise).  ``dataclasses.replace(view, ...)`` makes a variant."""

    n_chunks: int            # chunks materialised so far (ceil(n_past / chunk_tokens))
    chunk_tokens: int
    n_past: int
    tokens: np.ndarray       # int32 [n_past]: the session's token history
    resident: np.ndarray     # bool: holds a pool block now
    protected: np.ndarray    # bool: sink or tail window (always kept)
    pool_chunks: int         # how many chunks the pool holds
    on_host: Optional[np.ndarray] = None   # bool: has a copy in the host store (None: all False)
    handles: Optional[ScorerHandles] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        for k, dt in (("tokens", np.int32), ("resident", bool), ("protected", bool)):
            object.__setattr__(self, k, _read_only(getattr(self, k), dt))
        on_host = np.zeros(self.n_chunks, dtype=bool) if self.on_host is None else self.on_host
        object.__setattr__(self, "on_host", _read_only(on_host, bool))
        if self.handles is not None and not isinstance(self.handles, ScorerHandles):
            raise TypeError("ChunkView.handles must be a ScorerHandles (or None)")

    def _h(self) -> ScorerHandles:
        if self.handles is None:
            raise ValueError("this ChunkView has no scorer handles (it was built by hand): take one from "
                             "Session.chunk_view(), or dataclasses.replace() one")
        return self.handles

    # -- scorer handles: the core's attention over the whole history, read-only
    def history_attention(self, **kw) -> np.ndarray:
        """The captured queries' attention over every key of the history (``Runtime.history_attention``'s
        arguments: n_threads, per_chunk, groups, q_first, q_count, n_layers)."""
        return self._h().history_attention(**kw)

    def qk_peak_scores(self, n_chunks: Optional[int] = None, **kw) -> np.ndarray:
        """The core's peak chunk scores (n_queries, contrast, spread, n_layers, carry, windows)."""
        return self._h().qk_peak_scores(self.n_chunks if n_chunks is None else n_chunks, **kw)

    def qk_scores(self, mode: str) -> np.ndarray:
        """Chunk summaries scored against the last query ("bound" / "mean"; needs Requirements.chunk_summaries)."""
        return self._h().qk_scores(mode)

    def qk_policy_scores(self, qk: dict, n_chunks: Optional[int] = None) -> np.ndarray:
        """The core's qk scorer with these settings (QkScorer.core_args): what a session scores a qk policy with."""
        return self._h().qk_policy_scores(self.n_chunks if n_chunks is None else n_chunks, qk)

    def captured_queries(self) -> np.ndarray:
        return self._h().captured_queries()

    @property
    def n_captured(self) -> int:
        return self._h().n_captured()

    @property
    def n_paged_layers(self) -> int:
        return self._h().n_paged_layers

    def token_bytes(self) -> tuple[bytes, np.ndarray]:
        """The history's bytes (special tokens skipped) and each token's end offset in them."""
        return self._h().token_bytes(self.tokens[: self.n_past])

    @property
    def target(self) -> Target:
        return self._h().target


@runtime_checkable
class Policy(Protocol):
    """The one required part of the protocol; the optional members are BasePolicy's."""
    name: str

    def score(self, view: ChunkView) -> Optional[np.ndarray]:
        ...


class BasePolicy:
    """A policy's optional members with their defaults (subclassing is optional: duck typing works)."""
    name: str = ""
    requirements: Requirements = Requirements()

    def score(self, view: ChunkView) -> Optional[np.ndarray]:
        raise NotImplementedError(f"{type(self).__name__} has no score(view)")

    def reset(self) -> None:
        pass

    def rewind(self, n_tokens: int) -> None:
        pass

    def spec(self) -> Optional[dict]:
        return None


class LRUPolicy(BasePolicy):
    """Recency only: the pager evicts the least recently used chunk.  Installs no scores."""

    name = "lru"
    requirements = Requirements(scores=False)

    def score(self, view: ChunkView) -> Optional[np.ndarray]:
        return None

    def spec(self) -> dict:
        return {}


def validate_scores(scores, n_chunks: int, policy_name: str) -> np.ndarray:
    """Scores from a (possibly user-written) policy, checked before they reach the core."""
    arr = np.asarray(scores, dtype=np.float32)
    if arr.ndim != 1 or arr.shape[0] != n_chunks:
        raise ValueError(f"policy {policy_name!r} returned scores of shape {arr.shape}; "
                         f"expected ({n_chunks},), one per chunk")
    if np.isnan(arr).any():
        raise ValueError(f"policy {policy_name!r} returned NaN scores")
    return arr


# ---------------------------------------------------------------------- the protocol as the session uses it

class Bound(NamedTuple):
    """A policy's protocol, read once when it is installed (``bind``): the session asks only this."""
    policy: Any
    requirements: Requirements
    score: Callable
    reset: Callable
    rewind: Optional[Callable]   # None: the policy keeps no history of its own (the core calls nothing on a cut)
    spec: Callable


_LEGACY = ("n_capture", "needs_chunk_summaries")


def bind(policy) -> Bound:
    """The protocol of a policy object, checked (ValueError naming what is missing or wrong)."""
    score = getattr(policy, "score", None)
    if not callable(score) or getattr(type(policy), "score", None) is BasePolicy.score:
        raise ValueError(f"policy object {policy!r} has no score(view) method")
    name = getattr(policy, "name", None)
    if not name or not isinstance(name, str):
        raise ValueError("policy object needs a name attribute (a non-empty str)")
    req = getattr(policy, "requirements", None)
    if req is None:
        old = [k for k in _LEGACY if hasattr(policy, k)]
        if old:
            raise ValueError(f"policy {name!r} sets {', '.join(old)}: declare requirements = "
                             f"kvflash.policies.Requirements(n_capture=..., chunk_summaries=...) instead")
        req = Requirements()
    if not isinstance(req, Requirements):
        raise ValueError(f"policy {name!r}: requirements must be a kvflash.policies.Requirements, got {req!r}")
    members = {}
    for k in ("reset", "rewind", "spec"):
        m = getattr(policy, k, None)
        if m is not None and not callable(m):
            raise ValueError(f"policy {name!r}: {k} must be a method")
        members[k] = m
    return Bound(policy, req, score, members["reset"] or (lambda: None), members["rewind"],
                 members["spec"] or (lambda: None))


# ---------------------------------------------------------------------- the registry

class PolicyUnavailable(ValueError):
    """What a policy needs is not there (a drafter model): raised as is, never as a malformed snapshot."""


@dataclass
class PolicyContext:
    """What a factory may use to build a policy: the session's model, the caller's drafter=, threads, and the
    snapshot being loaded (None when the session is being made).  A factory that falls back to another policy
    says why in ``note`` (the banner shows it)."""
    model_path: Path
    drafter: Any = None
    threads: Optional[int] = None
    snapshot: Optional[str] = None
    note: str = ""

    def drafter_path(self) -> Optional[Path]:
        """The second model: the caller's drafter= (a path or a model name), else a GGUF in drafter/ or draft/
        beside the model, else None.  PolicyUnavailable when the caller's cannot be found."""
        from ._pool import find_drafter
        from .models import resolve_model
        if self.drafter is None:
            return find_drafter(self.model_path)
        try:
            where = resolve_model(self.drafter)
        except ValueError as e:
            raise PolicyUnavailable(str(e)) from e
        if not os.path.exists(where):
            raise PolicyUnavailable(f"drafter {where} does not exist")
        return where


@dataclass(frozen=True)
class PolicyEntry:
    name: str
    factory: Callable
    settings: Optional[Mapping[str, Callable[[Any], bool]]]   # field -> check of a saved value; None: no settings
    key: str           # the field of a snapshot's policy object that holds the settings
    context: bool      # the factory takes the PolicyContext first

    def build(self, ctx: PolicyContext, settings: Optional[dict] = None):
        kw = dict(settings or {})
        return self.factory(ctx, **kw) if self.context else self.factory(**kw)


_REGISTRY: dict[str, PolicyEntry] = {}
_RESERVED_KEYS = ("name", "custom")


def register_policy(name: str, factory: Callable, *, settings: Optional[Mapping[str, Callable]] = None,
                    key: str = "settings", context: bool = False, replace: bool = False) -> None:
    """Make ``Session(policy=name)`` build ``factory()`` (``factory(ctx)`` with ``context=True``: a
    :class:`PolicyContext`), and a snapshot taken with it load by name.

    ``settings``: the fields of the policy's ``spec()`` mapped to a check of each saved value (a callable
    returning True when the value is acceptable); the snapshot saves them under ``key`` and the loader builds
    ``factory(**settings)`` after checking every one.  Without ``settings`` the policy is saved by name alone.
    ``replace=True`` replaces an earlier registration of the name (else that is a ValueError)."""
    if not isinstance(name, str) or not 0 < len(name) <= 200:
        raise ValueError(f"policy name must be a non-empty str of at most 200 characters, got {name!r}")
    if not callable(factory):
        raise ValueError(f"register_policy({name!r}): factory must be callable, got {factory!r}")
    if settings is not None:
        if not isinstance(settings, Mapping) or not all(isinstance(k, str) and callable(v)
                                                        for k, v in settings.items()):
            raise ValueError(f"register_policy({name!r}): settings must map field names to checks (callables)")
        settings = dict(settings)
    if not isinstance(key, str) or not key or key in _RESERVED_KEYS:
        raise ValueError(f"register_policy({name!r}): key must be a str other than {_RESERVED_KEYS}, got {key!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"a policy named {name!r} is registered already (pass replace=True to replace it)")
    _REGISTRY[name] = PolicyEntry(name, factory, settings, key, bool(context))


def unregister_policy(name: str) -> None:
    """Forget a registered name (KeyError when it is not registered)."""
    del _REGISTRY[name]


def registered_policies() -> list[str]:
    return sorted(_REGISTRY)


def policy_entry(name: str) -> Optional[PolicyEntry]:
    return _REGISTRY.get(name)


def make_policy(policy, ctx: PolicyContext) -> Bound:
    """A policy by registered name (built by its factory) or a policy object, bound (checked)."""
    if isinstance(policy, str):
        entry = _REGISTRY.get(policy)
        if entry is None:
            raise ValueError(f"unknown policy {policy!r}: use one of {', '.join(map(repr, registered_policies()))} "
                             f"or an object with score(view)")
        policy = entry.build(ctx)
    return bind(policy)


def policy_spec(bound: Bound) -> dict:
    """The policy as a snapshot saves it: {"name": n} (registered, no settings), {"name": n, key: settings}, or
    {"name": n, "custom": True} (not registered, or no spec(): the loader must pass policy=)."""
    name = bound.policy.name
    entry = _REGISTRY.get(name)
    settings = bound.spec()
    if entry is None or (entry.settings is not None and settings is None):
        return {"name": name, "custom": True}
    if entry.settings is None:
        if settings:
            raise ValueError(f"policy {name!r}: spec() gave settings {settings!r}, but {name!r} was registered "
                             f"without a settings schema")
        return {"name": name}
    if not isinstance(settings, dict) or set(settings) != set(entry.settings):
        raise ValueError(f"policy {name!r}: spec() must give exactly the registered settings "
                         f"{sorted(entry.settings)}, got {settings!r}")
    bad = [k for k, ok in entry.settings.items() if not ok(settings[k])]
    if bad:
        raise ValueError(f"policy {name!r}: spec()'s {bad[0]} = {settings[bad[0]]!r} fails its registered check")
    return {"name": name, entry.key: dict(settings)}


def policy_from_spec(spec: dict, ctx: PolicyContext):
    """The policy a snapshot's (checked: kvflash._snapshot) policy object names, built by its registered factory.
    A factory's ValueError is the snapshot's fault (SnapshotError), except PolicyUnavailable."""
    name, where = spec["name"], f"snapshot {ctx.snapshot}"
    entry = _REGISTRY.get(name)
    if spec.get("custom") or entry is None:
        raise ValueError(f"{where} was taken with the custom policy {name!r}: pass policy= (an object named "
                         f"{name!r}) to Session.load")
    try:
        return entry.build(ctx, spec.get(entry.key) if entry.settings is not None else None)
    except PolicyUnavailable:
        raise
    except ValueError as e:   # (a TypeError is the factory's own: it does not take its registered settings)
        raise _core.SnapshotError(f"{where}: its session state is malformed: the policy's settings: {e}") from None


register_policy("lru", LRUPolicy)

