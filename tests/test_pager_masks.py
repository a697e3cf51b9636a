"""kvflash.Pager masks: token-exact, causal, windowed, padded, and after eviction and truncate.

Semantics under test are those documented in csrc/kvflash/pager.h.
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pagerutil import C, NEG, make, resident  # noqa: E402


# --------------------------------------------------------------------------- masks


def expected_mask(p, q_positions, n_kv=None, window=0):
    sp = p.slot_positions()
    n_kv = p.pool_tokens if n_kv is None else n_kv
    out = np.full((len(q_positions), n_kv), -np.inf, dtype=np.float16)
    for r, q in enumerate(q_positions):
        ok = (sp >= 0) & (sp <= q)
        if window > 0:
            ok &= sp > q - window
        out[r, : len(sp)][ok] = 0
    return out


def assert_mask_values(m):
    assert m.dtype == np.float16
    assert np.all((m == 0) | (m == NEG))
    assert not np.any(np.signbit(m) & (m == 0)), "zeros must be +0"


def test_mask_token_exact_head_chunk():
    p = make()
    p.alloc_span(0, 100)  # chunk 0 full, chunk 1 has 36 of 64 positions
    m = p.mask([99])
    assert m.shape == (1, 512)
    assert_mask_values(m)
    sp = p.slot_positions()
    visible = np.flatnonzero(m[0] == 0)
    assert sorted(sp[visible].tolist()) == list(range(100))
    b1 = p.chunk_table()["block"][1]
    # the 28 unwritten slots of the head chunk are masked
    assert np.all(m[0, b1 * C + 36:(b1 + 1) * C] == NEG)
    assert np.all(m[0, b1 * C: b1 * C + 36] == 0)


def test_mask_causal_window_padding_multi_row():
    p = make()
    p.alloc_span(0, 300)
    q = [0, 50, 63, 64, 200, 299, 1000]
    m = p.mask(np.array(q), n_kv=1024)
    assert m.shape == (len(q), 1024)
    assert_mask_values(m)
    assert np.array_equal(m, expected_mask(p, q, 1024))
    assert np.all(m[:, 512:] == NEG)  # padding
    sp = p.slot_positions()
    for r, qp in enumerate(q):
        assert int((m[r] == 0).sum()) == min(qp + 1, 300)
        assert np.all(sp[m[r, :512] == 0] <= qp)
    assert int((m[0] == 0).sum()) == 1  # never an empty row for a written query position
    # window: positions in (q - w, q]
    w = 10
    mw = p.mask([99, 5], window=w)
    assert_mask_values(mw)
    assert sorted(sp[mw[0] == 0].tolist()) == list(range(90, 100))
    assert sorted(sp[mw[1] == 0].tolist()) == list(range(0, 6))
    assert np.array_equal(mw, expected_mask(p, [99, 5], window=w))
    # empty query list
    assert p.mask(np.zeros(0, dtype=np.int64)).shape == (0, 512)


def test_mask_evicted_positions_masked():
    p = make()
    for c in range(14):
        p.alloc_span(c * C, C)
    t = p.chunk_table()
    gone = np.flatnonzero(t["materialised"] & (t["block"] < 0))
    assert len(gone) == 14 - 8
    m = p.mask([14 * C - 1])
    assert_mask_values(m)
    sp = p.slot_positions()
    vis = set(sp[m[0] == 0].tolist())
    for c in gone:
        assert not (set(range(c * C, (c + 1) * C)) & vis)
    assert len(vis) == 8 * C
    # evict one more explicitly
    victim = next(c for c in resident(p) if not p.chunk_table()["protected"][c])
    p.evict(victim)
    m2 = p.mask([14 * C - 1])
    assert int((m2[0] == 0).sum()) == 7 * C
    assert np.array_equal(m2, expected_mask(p, [14 * C - 1]))


def test_mask_after_truncate():
    p = make()
    p.alloc_span(0, 200)
    p.truncate(130)
    m = p.mask([199])
    assert sorted(p.slot_positions()[m[0] == 0].tolist()) == list(range(130))
