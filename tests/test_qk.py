"""The qk policy and the scoring kernels it reads: chunk summaries, attention over the pool and over the
whole history (paged-out keys included), the core's chunk peaks, and qk's peak scoring; each against numpy."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import kvflash
from kvflash import _core
from kvflash.scoring import QKPolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_policies import _tokens, tiny  # noqa: E402,F401 (the same tiny model and tokens as the policy tests)
from tinygguf import write_tiny_model  # noqa: E402


def test_qk_scores_match_numpy(tiny):
    m = _core.Model(tiny, 1)
    rt = _core.Runtime(m, max_ctx=2048, pool_tokens=1024, kv_type="f16", chunk_summaries=True)
    rt.eval(_tokens(64 * 6 + 10))
    q = rt.captured_queries()                       # [L, 1, H, D]
    L, _, H, D = q.shape
    Hkv, G = 2, H // 2
    n_chunks = 7
    for mode in ("bound", "mean"):
        got = rt.qk_scores(mode)
        assert got.shape == (n_chunks,)
        assert np.isinf(got[6])                     # the unsealed head chunk has no summary
        for c in range(6):
            per_layer = []
            for l in range(L):
                keys = rt.chunk_keys(c, l).reshape(64, Hkv, D)
                best = -np.inf
                for h in range(H):
                    qh = q[l, 0, h].astype(np.float64)
                    kg = keys[:, h // G, :].astype(np.float64)
                    if mode == "bound":
                        s = np.maximum(qh * kg.min(0), qh * kg.max(0)).sum()
                        assert s >= (kg @ qh).max() - 1e-4      # an upper bound of every q.k in the chunk
                    else:
                        mean = kg.mean(0)
                        s = qh @ (mean / np.linalg.norm(mean))
                    best = max(best, s)
                per_layer.append(best)
            assert got[c] == pytest.approx(np.mean(per_layer), rel=1e-4, abs=1e-4)


def test_qk_scores_need_summaries(tiny):
    rt = _core.Runtime(_core.Model(tiny, 1), max_ctx=1024, pool_tokens=512)
    rt.eval(_tokens(100))
    with pytest.raises(ValueError, match="summaries"):
        rt.qk_scores("bound")
    with pytest.raises(ValueError, match="mode"):
        _core.Runtime(_core.Model(tiny, 1), max_ctx=1024, chunk_summaries=True).qk_scores("nope")


def test_attention_scores_match_numpy(tiny):
    m = _core.Model(tiny, 1)
    rt = _core.Runtime(m, max_ctx=1024, pool_tokens=0, kv_type="f16", capture_queries=8)
    n = 150
    rt.eval(_tokens(n, 1))
    got = rt.attention_scores()
    q = rt.captured_queries()                       # [L, 8, H, D]
    L, nq, H, D = q.shape
    assert nq == 8
    want = np.zeros(n)
    scale = 1.0 / np.sqrt(D)
    for l in range(L):
        keys = np.stack([rt.pager.k_rows(l)[s].view(np.float16).astype(np.float64)
                         for s in range(n)]).reshape(n, 2, D)
        for h in range(H):
            avg = np.zeros(n)
            for i in range(nq):
                qpos = n - nq + i
                lg = keys[: qpos + 1, h // 2, :] @ q[l, i, h].astype(np.float64) * scale
                p = np.exp(lg - lg.max())
                avg[: qpos + 1] += p / p.sum() / nq
            want = np.maximum(want, avg)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_qk_policy_in_session(tiny):
    s = kvflash.Session(tiny, max_ctx=4096, kvflash=512, policy="qk", tau=16, threads=1, verbose=False)
    assert isinstance(s.policy, QKPolicy)
    s.prefill(_tokens(64 * 12, 5).tolist())
    assert s.stats["rescores"] == 1
    list(s.generate(max_tokens=20, ignore_eos=True))
    s.pager.check_invariants()


def test_history_attention_sees_paged_out_keys(tmp_path):
    # One layer: its keys and queries depend only on the tokens, so a pooled runtime that
    # paged most of the history out must score exactly what a full cache scores.
    path = str(tmp_path / "one.gguf")
    write_tiny_model(path, "llama", n_layer=1, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
                     weight_type="f32", seed=9)
    m = _core.Model(path, 1)
    toks = _tokens(64 * 14 + 20, 7)
    full = _core.Runtime(m, max_ctx=2048, pool_tokens=0, kv_type="q8_0", capture_queries=8)
    pooled = _core.Runtime(m, max_ctx=2048, pool_tokens=512, kv_type="q8_0", capture_queries=8, seed=4)
    for rt in (full, pooled):
        rt.eval(toks[:-5])
        for t in toks[-5:]:                       # decode steps: the capture window spans evals
            rt.eval(np.asarray([t], dtype=np.int32))
    assert pooled.pager.stats["host_chunks"] > 0
    assert pooled.captured_queries().shape[1] == 8
    np.testing.assert_allclose(pooled.captured_queries(), full.captured_queries(), rtol=1e-5, atol=1e-6)
    want = full.attention_scores()
    got = pooled.history_attention()
    assert got.shape == want.shape == (len(toks),)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
    # the pool-only scores cannot see the paged-out positions
    unseen = pooled.attention_scores() == 0
    assert unseen.sum() >= 64 * 6 and (got[unseen] > 0).mean() > 0.9
    # truncate trims the capture window with the cache
    pooled.truncate(len(toks) - 3)
    assert pooled.captured_queries().shape[1] == 5
    with pytest.raises(ValueError, match="captured"):
        _core.Runtime(m, max_ctx=1024, pool_tokens=0).history_attention()
    # a subset of the captured queries scores what a runtime capturing only those would
    few = _core.Runtime(m, max_ctx=2048, pool_tokens=0, kv_type="q8_0", capture_queries=3)
    few.eval(toks[:-4])                            # its queries: positions n-7..n-5 = full's captured 1..3
    assert few.n_captured == 3
    sub = full.history_attention(q_first=1, q_count=3)
    np.testing.assert_allclose(sub[:-4], few.history_attention(), rtol=1e-4, atol=1e-7)
    assert not sub[-4:].any()                      # later keys are invisible to those queries
    assert not np.allclose(full.history_attention(q_first=1, q_count=3), full.history_attention())
    np.testing.assert_array_equal(full.history_attention(q_first=5), full.history_attention(q_first=5, q_count=3))
    for first, count in ((8, 1), (-1, 2), (6, 3), (0, 0)):
        with pytest.raises(ValueError, match="captured"):
            full.history_attention(q_first=first, q_count=count)


def test_qk_modes_and_errors():
    assert QKPolicy().name == "qk" and QKPolicy().n_queries == 8 and not QKPolicy().needs_chunk_summaries
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="layers"):
            QKPolicy(layers=bad)
    with pytest.raises(ValueError, match="mode 'keys'"):
        QKPolicy("bound", layers=2)
    assert QKPolicy("bound").needs_chunk_summaries and QKPolicy("mean").name == "qk-mean"
    with pytest.raises(ValueError, match="qk mode"):
        QKPolicy("nope")
    with pytest.raises(ValueError, match="n_queries"):
        QKPolicy(n_queries=0)


def test_history_attention_per_chunk_matches_numpy(tiny):
    m = _core.Model(tiny, 1)
    rt = _core.Runtime(m, max_ctx=2048, pool_tokens=512, kv_type="f16", capture_queries=4)
    n = 64 * 10 + 17
    rt.eval(_tokens(n, 12))
    assert rt.pager.stats["host_chunks"] > 0
    full = _core.Runtime(m, max_ctx=2048, pool_tokens=0, kv_type="f16", capture_queries=4)
    full.eval(_tokens(n, 12))
    # the pooled runtime's own keys: layer 0 matches the full cache exactly (it sees only tokens)
    got = rt.history_attention(per_chunk=True)
    assert got.shape == (11,)
    q = rt.captured_queries()                       # [L, 4, H, D]
    L, nq, H, D = q.shape
    want = np.zeros(11)
    keys0 = np.stack([full.pager.k_rows(0)[s].view(np.float16).astype(np.float64) for s in range(n)]).reshape(n, 2, D)
    for h in range(H):
        avg = np.zeros(n)
        for i in range(nq):
            qpos = n - nq + i
            lg = keys0[: qpos + 1, h // 2, :] @ q[0, i, h].astype(np.float64) / np.sqrt(D)
            p = np.exp(lg - lg.max())
            avg[: qpos + 1] += p / p.sum() / nq
        per_chunk = np.add.reduceat(avg, np.arange(0, n, 64))
        want = np.maximum(want, per_chunk)
    # layer 1 can only raise the max: the per-chunk score bounds layer 0's from above
    assert (got >= want - 1e-5).all()
    one = _core.Runtime(m, max_ctx=2048, pool_tokens=512, kv_type="f16", capture_queries=4, eval_layers=1)
    one.eval(_tokens(n, 12))
    np.testing.assert_allclose(one.history_attention(per_chunk=True), want, rtol=1e-4, atol=1e-6)
    # n_layers=1: the two-layer runtime's score over its first paged layer only is layer 0's, from numpy
    np.testing.assert_allclose(rt.history_attention(per_chunk=True, n_layers=1), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(rt.history_attention(per_chunk=True, n_layers=L + 5), got)  # past L: all
    with pytest.raises(ValueError, match="n_layers"):
        rt.history_attention(n_layers=-1)


def test_qk_peak_contrast_spread_scores_from_the_targets_own_queries(tiny):
    # qk with aggregate="peak": the session captures n_queries + contrast queries.  Without paging, the
    # expectation is a second runtime fed the same tokens in two parts (the baseline's queries end
    # `contrast` tokens early), and numpy.  With paging (pool 512 < 9 chunks, paged-out keys read from the
    # host store), the paged session's own captured queries: the newest 8 minus the oldest 8, then numpy.
    toks = _tokens(64 * 9 + 5, 34).tolist()

    def want_from(x, base):
        x = x.astype(np.float64)
        x[: len(base)] -= base
        spread = np.array([x[max(0, i - 3): i + 4].max() for i in range(len(x))])
        lower = x - np.abs(x) * 1e-6                      # carry: the 10 tokens before, a hair lower
        carried = np.array([lower[max(0, i - 10): i - 3].max() if i - 3 > 0 else -np.inf for i in range(len(x))])
        tok = np.maximum(spread, carried)
        return np.array([tok[c * 64: (c + 1) * 64].max() for c in range(-(-len(toks) // 64))])

    pol = QKPolicy(aggregate="peak", n_queries=8, contrast=24, spread=3, carry=10, windows=1)
    assert pol.n_capture == 32
    whole = kvflash.Session(tiny, max_ctx=4096, kvflash=4096, policy=pol, threads=1, verbose=False)
    whole.prefill(toks)
    rt = _core.Runtime(_core.Model(tiny, 1), max_ctx=4096, pool_tokens=4096, kv_type="q8_0", capture_queries=8)
    rt.eval(np.asarray(toks[:-24], dtype=np.int32))
    base = rt.history_attention(n_threads=1).astype(np.float64)
    rt.eval(np.asarray(toks[-24:], dtype=np.int32))
    np.testing.assert_allclose(pol.score(whole.chunk_view()), want_from(rt.history_attention(n_threads=1), base),
                               rtol=1e-5, atol=1e-8)

    s = kvflash.Session(tiny, max_ctx=4096, kvflash=512, policy=pol, threads=1, verbose=False)
    s.prefill(toks)
    assert s.pager.stats["host_chunks"] > 0 and s.runtime.n_captured == 32
    r = s.runtime
    want = want_from(r.history_attention(q_first=24, q_count=8), r.history_attention(q_first=0, q_count=8))
    np.testing.assert_allclose(pol.score(s.chunk_view()), want, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="peak"):
        QKPolicy(aggregate="chunk", contrast=8)   # contrast works on token scores only
    with pytest.raises(ValueError, match="non-negative"):
        QKPolicy(aggregate="peak", spread=-1)


def test_qk_windows_rank_a_chunk_by_its_best_window(tiny):
    # windows=3: the last 24 captured queries score as three windows of 8, each minus the one baseline (the 8
    # ending 24 tokens before the latest); a chunk's score is -(its best rank in any window) + (1 - mean rank /
    # n_chunks) / 2
    toks = _tokens(64 * 9 + 5, 35).tolist()
    pol = QKPolicy(n_queries=8, contrast=24, spread=3, carry=10, windows=3)
    assert pol.n_capture == 32 and pol.spec()["windows"] == 3
    assert QKPolicy(n_queries=8, contrast=8, windows=4).n_capture == 32   # the windows reach further back
    s = kvflash.Session(tiny, max_ctx=4096, kvflash=512, policy=pol, threads=1, verbose=False)
    s.prefill(toks)
    r, v = s.runtime, s.chunk_view()
    assert s.pager.stats["host_chunks"] > 0 and r.n_captured == 32
    n_chunks = v.n_chunks
    chunk_of = (np.arange(len(toks)) // 64).astype(np.int32)
    base = r.history_attention(q_first=0, q_count=8).astype(np.float64)
    ranks, peaks = [], []
    for w in range(3):
        x = r.history_attention(q_first=32 - 8 * (w + 1), q_count=8).astype(np.float64) - base
        sc = _core.chunk_peaks(x, chunk_of, n_chunks, 3, 10)
        order = np.argsort(-sc, kind="stable")
        rank = np.empty(n_chunks, dtype=np.int64)
        rank[order] = np.arange(n_chunks)
        ranks.append(rank)
        peaks.append(sc)
    ranks = np.array(ranks)
    want = -ranks.min(axis=0) + 0.5 * (1 - ranks.mean(axis=0) / n_chunks)
    got = pol.score(v)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.argsort(-got, kind="stable")[0] in set(np.where(ranks.min(axis=0) == 0)[0])
    kw = dict(contrast=24, spread=3, carry=10, n_layers=v.n_paged_layers)
    np.testing.assert_allclose(r.qk_peak_scores(n_chunks, windows=3, **kw), got, rtol=1e-6)
    # one window: the single-window peak score, the latest window's
    np.testing.assert_allclose(QKPolicy(n_queries=8, contrast=24, spread=3, carry=10, windows=1).score(v), peaks[0],
                               rtol=1e-6)
    # more windows than the captured queries hold: those that fit (four of 8 in 32)
    assert not np.array_equal(r.qk_peak_scores(n_chunks, windows=5, **kw), got)
    np.testing.assert_array_equal(r.qk_peak_scores(n_chunks, windows=5, **kw), r.qk_peak_scores(n_chunks, windows=4,
                                                                                                 **kw))
    for bad in (0, 17, True, 2.0):
        with pytest.raises(ValueError, match="windows"):
            QKPolicy(windows=bad)
    with pytest.raises(ValueError, match="peak"):
        QKPolicy(aggregate="chunk", windows=2)
    with pytest.raises(ValueError, match="windows"):
        r.qk_peak_scores(n_chunks, windows=0)


def test_chunk_peaks_in_the_core():
    # the one token-to-chunk aggregation (qk's peak scores and the drafter's chunks go through it)
    x = np.array([0.0, 3.0, -1.0, -2.0, 7.0, -4.0, -5.0])
    chunk_of = np.array([0, 0, 1, 1, -1, 2, 2])        # token 4 belongs to no chunk
    np.testing.assert_allclose(_core.chunk_peaks(x, chunk_of, 4, 0), [3, -1, -4, -5])   # chunk 3 empty: lowest-1
    np.testing.assert_allclose(_core.chunk_peaks(x, chunk_of, 3, 1), [3, 7, 7])         # token 4 still spreads
    np.testing.assert_allclose(_core.chunk_peaks(np.zeros(0), np.zeros(0), 2), [0, 0])
    with pytest.raises(ValueError, match="n_chunks"):
        _core.chunk_peaks(x, chunk_of, 2)
    with pytest.raises(ValueError, match="one length"):
        _core.chunk_peaks(x, chunk_of[:3], 3)
    with pytest.raises(ValueError, match="spread"):
        _core.chunk_peaks(x, chunk_of, 3, -1)


def test_chunk_peaks_carry_ranks_the_value_chunk_right_behind_its_key():
    # a key peak at token 5, the last of chunk 1 (chunks of 3 tokens); chunk 3 holds a rival of 4.0
    x = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.1, 0.1, 0.1, 4.0, 0.0, 0.0])
    chunk_of = np.repeat(np.arange(4), 3)
    np.testing.assert_allclose(_core.chunk_peaks(x, chunk_of, 4, 0), [0, 5, 0.1, 4], rtol=1e-6)
    got = _core.chunk_peaks(x, chunk_of, 4, 0, carry=2)   # tokens 6 and 7 take 5.0, a hair lower
    assert got[1] == np.float32(5.0) and 4.0 < got[2] < 5.0 and got[2] > 5.0 * (1 - 1e-5), got
    assert list(np.argsort(-got, kind="stable")) == [1, 2, 3, 0]   # the value chunk second, the rival third
    assert got[3] == np.float32(4.0) and got[0] == 0.0            # carry looks back only
    # carry works on top of spread and only reaches further back than spread does
    np.testing.assert_allclose(_core.chunk_peaks(x, chunk_of, 4, 1, carry=1), _core.chunk_peaks(x, chunk_of, 4, 1))
    neg = -np.arange(1.0, 7.0)                                    # all negative: carried stays just below
    c = _core.chunk_peaks(neg, np.repeat(np.arange(2), 3), 2, 0, carry=3)
    assert c[0] == np.float32(-1.0) and -1.0 > c[1] > -1.0001, c
    with pytest.raises(ValueError, match="carry"):
        _core.chunk_peaks(x, chunk_of, 4, 0, carry=-1)
    with pytest.raises(ValueError, match="non-negative"):
        QKPolicy(carry=-2)
    with pytest.raises(ValueError, match="peak"):
        QKPolicy(aggregate="chunk", carry=8)


def test_qk_defaults_are_peak_scoring_over_early_layers():
    p = QKPolicy()
    assert (p.aggregate, p.n_queries, p.contrast, p.spread, p.carry, p.windows, p.layers, p.n_capture) == (
        "peak", 8, 64, 8, 16, 3, "auto", 72)
    assert [p.n_layers(n) for n in (3, 8, 30, 64)] == [3, 8, 8, 16]
    assert QKPolicy(layers=None).n_layers(30) == 0 and QKPolicy(layers=12).n_layers(6) == 6
    c = QKPolicy(aggregate="chunk")
    assert (c.contrast, c.spread, c.windows, c.n_capture) == (0, 0, 1, 8)
    assert QKPolicy("bound").aggregate == "chunk" and QKPolicy("bound").contrast == 0


def _prefill_rescore_session(tiny, every: int, **kw):
    # 32 blocks of 32 tokens: sink 1, tail window 4 and the head's chunk leave 26 to choose
    return kvflash.Session(tiny, max_ctx=4096, kvflash=1024, chunk_tokens=32, policy="qk", tau=16, threads=1,
                           verbose=False, prefill_rescore=every, **kw)


def test_prefill_rescore_scores_between_pooled_pieces(tiny):
    """prefill_rescore=1: after each pooled piece but the last (once the prompt outgrew the pool) the chunks
    are scored and the best paged in, the chunks of the recent half of the evictable blocks kept, exactly as
    a rescore keeping them between the same pieces read one by one does."""
    ids = _tokens(64 * 24, 7).tolist()
    a = _prefill_rescore_session(tiny, 1)
    a.prefill(ids)
    # by hand: 1024 batched (the pool's size), a 32-token piece, then a rescore before each next piece
    b = _prefill_rescore_session(tiny, 0)
    recent = ((32 - 1 - 4 - 1) // 2 + 4 + 1) * 32
    b.runtime.eval(np.asarray(ids[:1056], dtype=np.int32))
    for lo in range(1056, len(ids), 32):
        b.runtime.rescore(keep_recent=recent)
        b.runtime.eval(np.asarray(ids[lo:lo + 32], dtype=np.int32))
    b._settle_prompt(ids)
    assert np.array_equal(a.pager.chunk_table()["block"], b.pager.chunk_table()["block"])
    assert np.array_equal(a.logits(), b.logits())
    assert a.stats["rescores"] == b.stats["rescores"] == 16   # 15 between the 16 pieces, the settling one
    # without it only the settling rescore runs, and the pieces attend other chunks
    c = _prefill_rescore_session(tiny, 0)
    c.prefill(ids)
    assert c.stats["rescores"] == 1
    assert a.pager.stats["page_ins"] > c.pager.stats["page_ins"]
    assert not np.array_equal(a.logits(), c.logits())
    # every second piece
    d = _prefill_rescore_session(tiny, 2)
    d.prefill(ids)
    assert d.stats["rescores"] == 8
    for s in (a, b, c, d):
        s.pager.check_invariants()
    with pytest.raises(ValueError, match="keep_recent"):
        a.runtime.rescore(keep_recent=-1)


def test_prefill_rescore_is_checked_and_skipped_where_it_cannot_apply(tiny):
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="prefill_rescore"):
            _prefill_rescore_session(tiny, bad)
    ids = _tokens(64 * 24, 8).tolist()
    # exact prefill attends every position: nothing to choose between pieces
    e = _prefill_rescore_session(tiny, 1, exact_prefill=True)
    e.prefill(ids)
    assert e.stats["rescores"] == 1
    # lru scores nothing
    s = kvflash.Session(tiny, max_ctx=4096, kvflash=1024, chunk_tokens=32, policy="lru", threads=1, verbose=False,
                        prefill_rescore=1)
    s.prefill(ids)
    assert s.stats["rescores"] == 0
