"""Residency policies: which chunks deserve the pool's slots.

A policy is any object with ``name`` and ``score(view) -> ndarray | None``
(optionally ``reset()``, and ``rewind(n_tokens)``: the session's history was cut
back to its first n_tokens, for a policy that keeps state per token).  At each rescore the session hands it a
:class:`ChunkView`; a policy returns one float per chunk (higher = keep) and the
pager repages the pool to the top-scoring set, or returns ``None`` to leave the
pager's own recency order in charge.  The core never sees a policy: it only
receives scores, so a policy written in Python is as first-class as a built-in.

Example::

    class KeepEarly:
        name = "keep-early"
        def score(self, view):
            return -np.arange(view.n_chunks, dtype=np.float32)   # earlier = better

    kvflash.Session("smollm2-135m", kvflash=512, policy=KeepEarly())
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import numpy as np


@dataclass
class ChunkView:
    """What a policy sees at a rescore (arrays indexed by chunk, length n_chunks)."""

    n_chunks: int            # chunks materialised so far (ceil(n_past / chunk_tokens))
    chunk_tokens: int
    n_past: int
    tokens: np.ndarray       # int32 [n_past]: the session's token history
    resident: np.ndarray     # bool: holds a pool block now
    protected: np.ndarray    # bool: sink or tail window (always kept)
    pool_chunks: int         # how many chunks the pool holds
    session: object          # the Session, for policies that need more (e.g. the model)


@runtime_checkable
class Policy(Protocol):
    name: str

    def score(self, view: ChunkView) -> Optional[np.ndarray]:
        ...


class LRUPolicy:
    """Recency only: the pager evicts the least recently used chunk.  Installs no scores."""

    name = "lru"

    def score(self, view: ChunkView) -> Optional[np.ndarray]:
        return None

    def reset(self) -> None:
        pass


def validate_scores(scores, n_chunks: int, policy_name: str) -> np.ndarray:
    """Scores from a (possibly user-written) policy, checked before they reach the core."""
    arr = np.asarray(scores, dtype=np.float32)
    if arr.ndim != 1 or arr.shape[0] != n_chunks:
        raise ValueError(f"policy {policy_name!r} returned scores of shape {arr.shape}; "
                         f"expected ({n_chunks},), one per chunk")
    if np.isnan(arr).any():
        raise ValueError(f"policy {policy_name!r} returned NaN scores")
    return arr
