"""kvflash.Pager argument checking: every bad construction or call raises a clear
Python exception, and out-of-range positions never crash the interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvflash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pagerutil import NEG, make  # noqa: E402


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kw,exc,match", [
    (dict(pool_tokens=256, max_ctx=4096), ValueError, r"minimum 512"),
    (dict(pool_tokens=448, max_ctx=4096), ValueError, r"minimum 512"),
    (dict(pool_tokens=530, max_ctx=4096), ValueError, r"whole number of 64-token chunks"),
    (dict(pool_tokens=0, max_ctx=4096), ValueError, r"positive.*512"),
    (dict(pool_tokens=-64, max_ctx=4096), ValueError, r"positive"),
    (dict(pool_tokens=512, max_ctx=0), ValueError, r"max_ctx must be > 0"),
    (dict(pool_tokens=512, max_ctx=-5), ValueError, r"max_ctx must be > 0"),
    (dict(pool_tokens=512, max_ctx=4096, kv_type="q5_k"), ValueError, r"unknown KV type 'q5_k'"),
    (dict(pool_tokens=512, max_ctx=4096, host="file"), ValueError, r"host_path"),
    (dict(pool_tokens=512, max_ctx=4096, host="disk"), ValueError, r"host must be 'ram' or 'file'"),
    (dict(pool_tokens=512, max_ctx=4096, n_layers=0), ValueError, r"n_layers must be >= 1"),
    (dict(pool_tokens=512, max_ctx=4096, n_layers=2, layer_ids=[1]), ValueError, r"layer_ids has 1 entries"),
    (dict(pool_tokens=512, max_ctx=4096, n_embd_k=48, kv_type="q4_0"), ValueError, r"block size 32"),
    (dict(pool_tokens=512, max_ctx=4096, n_embd_k=0), ValueError, r"non-positive row width"),
    (dict(pool_tokens=512, max_ctx=4096, chunk_tokens=0), ValueError, r"chunk_tokens"),
    (dict(pool_tokens=512, max_ctx=4096, chunk_tokens=48), ValueError, r"divide 256"),
    (dict(pool_tokens=512, max_ctx=4096, sink_chunks=-1), ValueError, r"sink_chunks"),
    (dict(pool_tokens=512, max_ctx=4096, tail_window_chunks=-1), ValueError, r"tail_window_chunks"),
    (dict(pool_tokens=512, max_ctx=4096, sink_chunks=4, tail_window_chunks=4), ValueError, r"minimum 768"),
])
def test_bad_construction(kw, exc, match):
    with pytest.raises(exc, match=match):
        kvflash.Pager(**kw)


def test_file_backing_unwritable_path(tmp_path):
    with pytest.raises(RuntimeError, match="cannot create"):
        make(host="file", host_path=str(tmp_path / "no" / "such" / "dir" / "s.bin"))


def test_pool_rounding_and_min_pool():
    assert kvflash.min_pool_tokens() == 512
    assert kvflash.min_pool_tokens(64, 4, 4) == 768
    assert make(pool=576).pool_tokens == 768
    assert make(pool=576).n_blocks == 12


@pytest.fixture
def p():
    pg = make(pool=512, max_ctx=64 * 24)
    pg.alloc_span(0, 200)
    return pg


@pytest.mark.parametrize("call,exc,match", [
    (lambda p: p.alloc_span(-1, 1), IndexError, r"outside \[0, max_ctx=1536\)"),
    (lambda p: p.alloc_span(64 * 24, 1), IndexError, r"outside \[0, max_ctx=1536\)"),
    (lambda p: p.alloc_span(64 * 24 - 1, 2), IndexError, r"outside \[0, max_ctx=1536\)"),
    (lambda p: p.alloc_span(0, 0), ValueError, r"n must be >= 1"),
    (lambda p: p.alloc_span(0, -3), ValueError, r"n must be >= 1"),
    (lambda p: p.slot_for(-1), IndexError, r"outside \[0, max_ctx=1536\)"),
    (lambda p: p.slot_for(1536), IndexError, r"outside \[0, max_ctx=1536\)"),
    (lambda p: p.evict(24), IndexError, r"chunk 24 outside \[0, 24\)"),
    (lambda p: p.evict(-1), IndexError, r"chunk -1 outside"),
    (lambda p: p.recall(24), IndexError, r"outside"),
    (lambda p: p.recall(-7), IndexError, r"outside"),
    (lambda p: p.evict(10), ValueError, r"not resident"),
    (lambda p: p.evict(0), ValueError, r"protected"),
    (lambda p: p.recall(2), ValueError, r"already resident"),
    (lambda p: p.recall(10), ValueError, r"not on the host"),
    (lambda p: p.set_scores(np.zeros((2, 3), np.float32)), ValueError, r"1-D"),
    (lambda p: p.set_scores(np.zeros(25, np.float32)), ValueError, r"25 entries; the pager has 24 chunks"),
    (lambda p: p.set_scores(np.array([0, 1, np.nan], np.float32)), ValueError, r"NaN at chunk 2"),
    (lambda p: p.set_scores(np.array(["a", "b"])), ValueError, r"array of numbers"),
    (lambda p: p.reselect(np.zeros((24, 1), np.float32)), ValueError, r"1-D"),
    (lambda p: p.reselect(np.zeros(100, np.float32)), ValueError, r"100 entries"),
    (lambda p: p.reselect(np.array([np.nan])), ValueError, r"NaN"),
    (lambda p: p.mask([-1]), ValueError, r"q_positions must be >= 0"),
    (lambda p: p.mask([5, -2]), ValueError, r"q_positions must be >= 0"),
    (lambda p: p.mask([5], n_kv=511), ValueError, r"n_kv must be >= pool_tokens \(512\)"),
    (lambda p: p.mask([[5]]), ValueError, r"1-D"),
    (lambda p: p.mask([5], window=-1), ValueError, r"window must be >= 0"),
    (lambda p: p.k_rows(1), IndexError, r"layer 1 outside \[0, 1\)"),
    (lambda p: p.k_rows(-1), IndexError, r"layer -1 outside"),
    (lambda p: p.v_rows(5), IndexError, r"layer 5 outside"),
    (lambda p: p.truncate(-1), IndexError, r"n_past -1 outside"),
    (lambda p: p.truncate(1537), IndexError, r"n_past 1537 outside"),
])
def test_bad_calls(p, call, exc, match):
    before = (p.stats, p.chunk_table()["block"].copy(), p.slot_positions().copy(), p.scores())
    with pytest.raises(exc, match=match):
        call(p)
    # errors change nothing
    s, blk, sp, sc = before
    assert p.stats == s
    assert np.array_equal(p.chunk_table()["block"], blk)
    assert np.array_equal(p.slot_positions(), sp)
    assert (p.scores() is None) == (sc is None)
    p.check_invariants()


def test_scores_accepted_as_plain_list(p):
    # Any sequence of numbers converts; a non-numeric one is a ValueError, not a crash.
    p.set_scores([1.0, 2.0])
    assert p.scores()[0] == 1.0 and p.scores()[1] == 2.0
    with pytest.raises((ValueError, TypeError)):
        p.set_scores(["a", "b"])


def test_failed_set_scores_keeps_old_scores(p):
    sc = np.arange(24, dtype=np.float32)
    p.set_scores(sc)
    with pytest.raises(ValueError, match="NaN"):
        p.set_scores(np.array([1, np.nan], np.float32))
    assert np.array_equal(p.scores(), sc)


def _run_isolated(code):
    """Run code in a child interpreter: a crash there cannot take pytest down."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("pos0,n", [(2**63 - 1, 1), (2**63 - 64, 64)])
def test_alloc_span_overflowing_positions_rejected(pos0, n):
    rc, out = _run_isolated(f"""
        import kvflash
        p = kvflash.Pager(pool_tokens=512, max_ctx=1536)
        try:
            p.alloc_span({pos0}, {n})
        except IndexError as e:
            print("IndexError", e)
        p.check_invariants()
        del p
    """)
    assert rc == 0 and "IndexError" in out, out


def test_huge_positions_elsewhere_do_not_crash(p):
    with pytest.raises(IndexError):
        p.slot_for(2**63 - 1)
    with pytest.raises(IndexError):
        p.truncate(2**63 - 1)
    assert p.slot_of(2**63 - 1) == -1
    assert p.slot_of(-5) == -1
    m = p.mask(np.array([2**63 - 1]), window=5)
    assert np.all(m == NEG)
    with pytest.raises((OverflowError, TypeError)):
        p.evict(2**70)
