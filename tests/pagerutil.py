"""Helpers shared by the Pager tests."""
from __future__ import annotations

import numpy as np

import kvflash

C = 64  # chunk tokens used throughout
NEG = np.float16(-np.inf)  # a masked slot


def make(pool=512, max_ctx=64 * 24, **kw):
    return kvflash.Pager(pool_tokens=pool, max_ctx=max_ctx, **kw)


def resident(p):
    return set(np.flatnonzero(p.chunk_table()["block"] >= 0).tolist())


def on_host(p):
    t = p.chunk_table()
    return set(np.flatnonzero((t["block"] < 0) & (t["host"] >= 0)).tolist())
