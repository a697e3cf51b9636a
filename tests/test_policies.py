"""Residency policies: the scorers' math against numpy, planted chunks, per-session state."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import kvflash
from kvflash import _core
from kvflash.policies import ChunkView, validate_scores
from kvflash.scoring import DrafterPolicy, QKPolicy, per_chunk_mean, smooth, spread_max

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinygguf import write_small_llama, write_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_small_llama(tmp_path_factory.mktemp("pol") / "tiny.gguf", seed=3)


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.int32)


def test_smoothing_and_chunk_means():
    x = np.zeros(10, dtype=np.float32)
    x[5] = 3.0
    np.testing.assert_allclose(smooth(x, 3)[4:7], [1, 1, 1])
    np.testing.assert_allclose(per_chunk_mean(np.arange(6, dtype=np.float32), 4, 2), [1.5, 4.5])


class PlantedPolicy:
    """Keeps one planted chunk: the test fails if the session does not act on scores."""
    name = "planted"

    def __init__(self, chunk):
        self.chunk = chunk
        self.calls = 0
        self.resets = 0

    def score(self, view: ChunkView):
        self.calls += 1
        assert view.n_chunks == -(-view.n_past // view.chunk_tokens)
        s = np.zeros(view.n_chunks, dtype=np.float32)
        s[self.chunk] = 10.0
        return s

    def reset(self):
        self.resets += 1


def test_python_policy_keeps_planted_chunk(tiny):
    pol = PlantedPolicy(chunk=2)
    s = kvflash.Session(tiny, max_ctx=4096, kvflash=512, policy=pol, tau=16, threads=1, verbose=False)
    s.prefill(_tokens(64 * 12, 2).tolist())          # outgrows the pool: rescored at the end of prefill
    assert pol.calls == 1
    assert s.pager.chunk_table()["block"][2] >= 0      # the planted chunk was recalled
    # ...and the prompt's last 64 tokens were evaluated again against the new residents
    assert s.runtime.timings["tokens"] == 64 * 12 + 64
    assert s.n_past == 64 * 12
    lru = kvflash.Session(tiny, max_ctx=4096, kvflash=512, policy="lru", threads=1, verbose=False)
    lru.prefill(_tokens(64 * 12, 2).tolist())
    assert lru.pager.chunk_table()["block"][2] < 0     # recency alone would have dropped it
    assert lru.last_scores is None                     # lru never scores
    want = np.zeros(12, dtype=np.float32)
    want[2] = 10.0
    np.testing.assert_array_equal(s.last_scores, want)  # what the policy returned, kept for inspection
    list(s.generate(max_tokens=40, ignore_eos=True))   # decode rescoring every max(tau, n/45) tokens
    assert pol.calls >= 3
    assert s.stats["rescores"] == pol.calls
    assert s.pager.chunk_table()["block"][2] >= 0
    s.reset()
    assert pol.resets == 1 and s.pager.scores() is None and s.n_past == 0 and s.last_scores is None


def test_bad_policy_objects(tiny):
    with pytest.raises(ValueError, match="score"):
        kvflash.Session(tiny, kvflash=512, policy=object(), verbose=False)

    class Bad:
        name = "bad"

        def score(self, view):
            return np.ones(3)

    s = kvflash.Session(tiny, max_ctx=4096, kvflash=512, policy=Bad(), threads=1, verbose=False)
    with pytest.raises(ValueError, match="expected"):
        s.prefill(_tokens(64 * 12).tolist())
    with pytest.raises(ValueError, match="NaN"):
        validate_scores([np.nan, 1.0], 2, "x")


def test_drafter_feeds_only_new_tokens_and_resets(tiny):
    s = kvflash.Session(tiny, max_ctx=4096, kvflash=512, policy="drafter", drafter=tiny, tau=16, threads=1,
                        verbose=False)
    assert isinstance(s.policy, DrafterPolicy) and "fall" not in s.banner
    s.prefill(_tokens(64 * 12, 4).tolist())
    fed = s.policy.fed_tokens_total
    assert fed == 64 * 12                              # the whole history once
    list(s.generate(max_tokens=40, ignore_eos=True))
    assert s.stats["rescores"] >= 2
    assert s.policy.fed_tokens_total < fed + 60         # then only what was added since
    assert not s.policy.bridged
    s.reset()
    assert s.policy._fed == [] and s.pager.scores() is None


def test_drafter_fallback_and_explicit_failure(tiny, tmp_path):
    s = kvflash.Session(tiny, max_ctx=1024, kvflash=512, policy="drafter", threads=1, verbose=False)
    assert isinstance(s.policy, QKPolicy) and "falling back to qk" in s.banner and "policy=qk" in s.banner
    assert s.stats["policy"] == "qk (fallback)"
    with pytest.raises((ValueError, FileNotFoundError)):
        kvflash.Session(tiny, max_ctx=1024, kvflash=512, policy="drafter", drafter=str(tmp_path / "nope.gguf"),
                        verbose=False)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    s = kvflash.Session(tiny, max_ctx=4096, kvflash=512, policy="drafter", drafter=str(bad), threads=1,
                        verbose=False)
    with pytest.raises(ValueError, match="failed to load"):
        s.prefill(_tokens(64 * 12).tolist())           # loaded lazily, at the first rescore: an error, not a fallback


def test_drafter_probe_next_to_model(tiny, tmp_path):
    import shutil
    d = tmp_path / "m"
    (d / "drafter").mkdir(parents=True)
    shutil.copy(tiny, d / "target.gguf")
    shutil.copy(tiny, d / "drafter" / "small.gguf")
    s = kvflash.Session(str(d / "target.gguf"), max_ctx=1024, kvflash=512, policy="drafter", threads=1,
                        verbose=False)
    assert isinstance(s.policy, DrafterPolicy) and s.policy.path.endswith("small.gguf")
    assert "policy=drafter" in s.banner


def test_the_default_policy_is_qk_even_beside_a_drafter(tiny, tmp_path):
    """qk is the default of Session, the CLI and the server (it ranked needles better than the drafter on the
    reporting corpus, bridged and same-vocabulary): a drafter next to the model is used when asked for by name
    only."""
    import argparse
    import shutil

    from kvflash import cli
    d = tmp_path / "m"
    (d / "drafter").mkdir(parents=True)
    shutil.copy(tiny, d / "target.gguf")
    shutil.copy(tiny, d / "drafter" / "small.gguf")
    s = kvflash.Session(str(d / "target.gguf"), max_ctx=1024, kvflash=512, threads=1, verbose=False)
    assert type(s.policy) is QKPolicy and "policy=qk" in s.banner and "fallback" not in s.stats["policy"]
    p = argparse.ArgumentParser()
    cli._session_args(p)
    a = p.parse_args(["-m", str(d / "target.gguf"), "-t", "1", "--max-ctx", "1024", "--kvflash", "512",
                      "--no-progress"])
    assert a.kvflash_policy == "qk"
    assert type(cli._make_session(a).policy) is QKPolicy
    a = p.parse_args(["-m", str(d / "target.gguf"), "-t", "1", "--max-ctx", "1024", "--kvflash", "512",
                      "--no-progress", "--kvflash-policy", "drafter"])
    assert isinstance(cli._make_session(a).policy, DrafterPolicy)


def test_scoring_runtime_evaluates_only_its_first_layers(tmp_path):
    path = str(tmp_path / "four.gguf")
    write_tiny_model(path, "llama", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
                     weight_type="f32", seed=11)
    m = _core.Model(path, 1)
    toks = _tokens(200, 3)
    full = _core.Runtime(m, max_ctx=1024, pool_tokens=0, kv_type="f16", capture_queries=8)
    full.eval(toks)
    for k in (1, 2, 3):
        rt = _core.Runtime(m, max_ctx=1024, pool_tokens=0, kv_type="f16", capture_queries=8, eval_layers=k)
        assert rt.eval_layers == k
        out = rt.eval(toks)
        assert not out.any()                                   # no head: no logits
        q = rt.captured_queries()
        assert q.shape[0] == k and rt.pager.n_layers == k      # only the evaluated layers are cached
        np.testing.assert_array_equal(q, full.captured_queries()[:k])
        for l in range(k):
            np.testing.assert_array_equal(rt.pager.k_rows(l)[:200], full.pager.k_rows(l)[:200])
            np.testing.assert_array_equal(rt.pager.v_rows(l)[:200], full.pager.v_rows(l)[:200])
        assert rt.attention_scores().shape == (200,)
        with pytest.raises(ValueError, match="scoring runtime"):
            rt.eval_sample(toks[:1])
    with pytest.raises(ValueError, match="eval_layers"):
        _core.Runtime(m, max_ctx=1024, eval_layers=5)


def test_drafter_layers_default_and_errors(tiny, tmp_path):
    s = kvflash.Session(tiny, max_ctx=2048, kvflash=512, policy="drafter", drafter=tiny, tau=16, threads=1,
                        verbose=False)
    s.prefill(_tokens(64 * 12, 6).tolist())
    assert s.policy.eval_layers == 0                # a quarter, at least 8: all of 2 layers
    assert s.policy.layers_used == 2
    other = tmp_path / "other.gguf"
    write_tiny_model(str(other), "llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
                     weight_type="f32", seed=4)
    s = kvflash.Session(tiny, max_ctx=2048, kvflash=512, policy=DrafterPolicy(str(other), threads=1), threads=1,
                        verbose=False)
    s.prefill(_tokens(64 * 12, 6).tolist())
    assert s.policy.eval_layers == 0
    s = kvflash.Session(tiny, max_ctx=2048, kvflash=512, policy=DrafterPolicy(tiny, layers=1), threads=1,
                        verbose=False)
    s.prefill(_tokens(64 * 12, 6).tolist())
    assert s.policy.eval_layers == 1 and s.policy.layers_used == 1
    with pytest.raises(ValueError, match="layers"):
        DrafterPolicy(tiny, layers=0)
    s = kvflash.Session(tiny, max_ctx=2048, kvflash=512, policy=DrafterPolicy(tiny, layers=3), threads=1,
                        verbose=False)
    with pytest.raises(ValueError, match="has 2 layers"):
        s.prefill(_tokens(64 * 12, 6).tolist())


def test_paged_drafter_keeps_every_key_and_scores_like_a_full_cache(tmp_path):
    # A one-layer drafter: its keys and queries depend only on the tokens, so its paged cache
    # (forward over a 512-token pool, the rest in host memory) must score what a full cache does.
    one = str(tmp_path / "one.gguf")
    write_tiny_model(one, "llama", n_layer=1, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
                     weight_type="f32", seed=9)
    target = write_small_llama(tmp_path / "target.gguf", seed=5)
    toks = _tokens(64 * 30 + 9, 21).tolist()
    got = {}
    for pool in (512, None):
        pol = DrafterPolicy(one, threads=1, pool=pool)
        s = kvflash.Session(target, max_ctx=4096, kvflash=512, policy=pol, tau=16, threads=1, verbose=False)
        s.prefill(toks)
        assert pol._rt.pool_tokens == (512 if pool else 4096)
        if pool:
            assert pol._rt.pager.stats["host_chunks"] >= 20      # the drafter's own history paged out, kept
        got[pool] = pol.score(s.chunk_view())
    assert got[512].shape == (-(-len(toks) // 64),)
    np.testing.assert_allclose(got[512], got[None], rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="drafter pool"):
        DrafterPolicy(one, pool=-1)
    assert DrafterPolicy(one, pool=0).pool is None               # 0: a full cache


def test_drafter_chunk_aggregates(tiny):
    pol = DrafterPolicy(tiny, aggregate="max", spread=0)
    tok = np.array([0, 0, 9, 0, 1, 1, 1, 1, 2], dtype=np.float32)
    chunk_of = np.arange(9) // 4
    np.testing.assert_allclose(pol._per_chunk(tok, chunk_of, 3), [9, 1, 2])      # a peak is not diluted
    pol = DrafterPolicy(tiny, aggregate="mean", smooth_width=1, spread=0)
    np.testing.assert_allclose(pol._per_chunk(tok, chunk_of, 3), [2.25, 1, 2])
    with pytest.raises(ValueError, match="aggregate"):
        DrafterPolicy(tiny, aggregate="sum")


def test_drafter_chunk_peaks_below_zero_keep_their_order(tiny):
    # With contrast most token scores are negative; a chunk's peak must still rank it (no floor at 0).
    pol = DrafterPolicy(tiny, aggregate="max", spread=0)
    tok = np.array([-5, -1, -3, -2, -9, -7, -0.5, -4], dtype=np.float32)
    chunk_of = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    got = pol._per_chunk(tok, chunk_of, 5)   # chunk 4: no drafter token starts in it
    np.testing.assert_allclose(got[:4], [-1, -2, -7, -0.5])
    assert got[4] < got[:4].min()
    assert list(np.argsort(-got)) == [3, 0, 1, 2, 4]


def test_history_attention_groups(tiny):
    m = _core.Model(tiny, 1)
    rt = _core.Runtime(m, max_ctx=2048, pool_tokens=512, kv_type="f16", capture_queries=4)
    n = 64 * 10 + 17
    rt.eval(_tokens(n, 13))
    per_chunk = rt.history_attention(per_chunk=True)
    grouped = rt.history_attention(groups=np.arange(n) // 64)
    np.testing.assert_allclose(grouped, per_chunk, rtol=1e-6)
    g = np.full(n, -1)
    g[64:128] = 0                                   # one group; the rest counted nowhere
    np.testing.assert_allclose(rt.history_attention(groups=g), per_chunk[1:2], rtol=1e-6)
    with pytest.raises(ValueError, match="groups"):
        rt.history_attention(groups=np.zeros(3))
    pol = DrafterPolicy(tiny, aggregate="mass")
    assert pol.aggregate == "mass"


def test_drafter_cut_reaches_a_full_attention_layer(tmp_path):
    # Gemma-3 style: five sliding-window layers, then a global one.  Only global layers are
    # paged and scored, so a cut must reach the first of them.
    gem = str(tmp_path / "gem.gguf")
    write_tiny_model(gem, "gemma3", n_layer=12, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, seed=2)
    m = _core.Model(gem, 1)
    assert min(m.global_layers) == 5
    s = kvflash.Session(gem, max_ctx=2048, kvflash=512, policy=DrafterPolicy(gem, threads=1), threads=1,
                        verbose=False)
    s.prefill(_tokens(64 * 12, 8).tolist())
    assert s.policy.layers_used == 8 and s.policy._rt.pager.n_layers == 1
    s = kvflash.Session(gem, max_ctx=2048, kvflash=512, policy=DrafterPolicy(gem, layers=4, threads=1), threads=1,
                        verbose=False)
    with pytest.raises(ValueError, match="first full-attention layer"):
        s.prefill(_tokens(64 * 12, 8).tolist())


def test_drafter_contrast_subtracts_the_earlier_queries_scores(tiny):
    # contrast=N: tail scores minus the scores of the queries that ended N tokens earlier, per token,
    # then spread (peak of the 4 tokens either side) and the peak per chunk.  The expectation is built
    # from a plain runtime of the same geometry fed the same tokens, and numpy: no policy internals.
    toks = _tokens(64 * 9 + 5, 33).tolist()
    s = kvflash.Session(tiny, max_ctx=4096, kvflash=512, policy="lru", threads=1, verbose=False)
    s.prefill(toks)
    view = s.chunk_view()
    pol = DrafterPolicy(tiny, threads=1, n_queries=8, contrast=40)
    assert pol.spread == 4 and pol.aggregate == "max"
    got = pol.score(view)
    rt = _core.Runtime(_core.Model(tiny, 1), max_ctx=4096, pool_tokens=1024, kv_type="q8_0", capture_queries=8)
    rt.eval(np.asarray(toks[:-40], dtype=np.int32))
    base = rt.history_attention(n_threads=1).astype(np.float64)      # the queries ending 40 tokens earlier
    rt.eval(np.asarray(toks[-40:], dtype=np.int32))
    x = rt.history_attention(n_threads=1).astype(np.float64)         # the tail's
    assert len(base) == len(toks) - 40 and len(x) == len(toks)
    x[: len(base)] -= base
    assert (x < 0).any()
    spread = np.array([x[max(0, i - 4): i + 5].max() for i in range(len(x))])
    want = np.array([spread[c * 64: (c + 1) * 64].max() for c in range(view.n_chunks)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_drafter_spread_reaches_across_a_chunk_edge(tiny):
    # the tail attends to "passkey" at the end of chunk 0; the digits sit at the start of chunk 1
    x = np.zeros(40)
    x[9], x[35] = 5.0, 1.0
    np.testing.assert_allclose(spread_max(x, 2)[7:12], [5, 5, 5, 5, 5])
    assert spread_max(x, 2)[6] == 0 and spread_max(x, 2)[12] == 0
    np.testing.assert_array_equal(spread_max(x, 0), x)
    chunk_of = np.arange(40) // 10                     # chunks of 10 tokens: the peak is chunk 0's last token
    plain = DrafterPolicy(tiny, spread=0)._per_chunk(x, chunk_of, 4)
    spread = DrafterPolicy(tiny, spread=2)._per_chunk(x, chunk_of, 4)
    assert np.argsort(-plain)[1] == 3                  # without spread chunk 1 (the digits) ranks below chunk 3
    np.testing.assert_allclose(spread, [5, 5, 0, 1])   # with it, chunk 1 shares chunk 0's peak
    neg = np.array([-3.0, -1.0, -2.0])                 # contrast makes scores negative: spread keeps them
    np.testing.assert_allclose(spread_max(neg, 1), [-1, -1, -1])


def test_a_cut_of_the_history_reaches_the_drafters_cache(tiny):
    # Session.truncate cuts the drafter's own cache with the session's (the policy's rewind is the core's
    # rewind hook); its next feed then reads only what is new past the cut.
    s = kvflash.Session(tiny, max_ctx=4096, kvflash=512, policy="drafter", drafter=tiny, tau=16, threads=1,
                        verbose=False)
    s.prefill(_tokens(64 * 12, 4).tolist())
    assert len(s.policy._fed) == 64 * 12
    s.truncate(300)
    assert len(s.policy._fed) <= 300 and s.policy._fed == s.tokens[: len(s.policy._fed)]
