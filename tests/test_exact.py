"""Exact mode: the full cache's output from a paged session (issue 19).

1. The attention op reading rows through a row table (chunks stored out of order, the exact mode's
   path) gives bit-identical results to the same rows read in place, for every kernel and KV type.
2. Runtime.eval(exact=True) on a pool far smaller than the context gives the full cache's logits bit
   for bit (prefill and decode), where the pooled eval does not.
3. Session(exact=True) greedy: the same tokens, final context and last logits as the full cache,
   with eviction in play, for lru and qk, whatever max_tokens cuts a round at.
4. Session(exact=True) sampling: the joint distribution of three sampled tokens matches the full
   cache's exact probabilities (chi-squared test over many seeded draws), while the drafts' own
   distribution differs from it (so the test has something to catch).
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

pytest.importorskip("gguf")
core = pytest.importorskip("kvflash._core")
import kvflash  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_attention_kernel import _rows  # noqa: E402
from tinygguf import write_tiny_model  # noqa: E402

C = 16          # chunk tokens: small pools (256) with room for 128-token pieces
POOL = 256
UBATCH = 128
PROMPT = 900    # ~3.5x the pool: most of the prompt is paged out


# --------------------------------------------------------------------------- 1. the op through a row table

@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("n,n_kv,table_rows", [(1, 97, 16), (5, 300, 64), (3, 256, 16)])
def test_row_table_reads_the_same_rows(kind, tiled, n, n_kv, table_rows):
    rng = np.random.default_rng(n * 1000 + n_kv)
    H, Hkv, D = 4, 2, 64
    k, _ = _rows(rng, kind, n_kv, Hkv * D)
    v, _ = _rows(rng, kind, n_kv, Hkv * D)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    visible = (rng.random((n, n_kv)) < 0.7).astype(np.uint8)
    visible[:, 0] = 1
    kw = dict(kv_type=kind, n_head_kv=Hkv, scale=0.125, n_split=3, n_threads=2, tiled=tiled)
    plain = core.pool_attention(q, k, v, visible, **kw)
    table = core.pool_attention(q, k, v, visible, table_rows=table_rows, **kw)
    assert np.array_equal(plain, table)


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("H,Hkv", [(9, 3), (4, 1), (8, 2)])
@pytest.mark.parametrize("window", [False, True])
def test_a_query_does_not_depend_on_its_batch(kind, tiled, H, Hkv, window):
    """Each query's output is the same alone or in a causal batch (what a verification pass needs to
    reproduce one-token steps): the rows of a batch are accumulated as a lone query's are -- also under
    a sliding window, whose lower edge moves with each query (rows the others see come first)."""
    rng = np.random.default_rng(H * 10 + Hkv)
    D, n_kv, n = 64, 768, 6
    k, _ = _rows(rng, kind, n_kv, Hkv * D)
    v, _ = _rows(rng, kind, n_kv, Hkv * D)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    p0 = 700
    j, i = np.arange(n_kv)[None, :], np.arange(n)[:, None]
    visible = (j <= p0 + i) & ((j > 150 + 7 * i) if window else True)
    visible = visible.astype(np.uint8)
    kw = dict(kv_type=kind, n_head_kv=Hkv, scale=0.125, n_split=3, n_threads=2, tiled=tiled)
    batch = core.pool_attention(q, k, v, visible, **kw)
    for i in range(n):
        alone = core.pool_attention(q[i:i + 1], k, v, visible[i:i + 1], **kw)
        assert np.array_equal(batch[i], alone[0]), i


def test_split_ranges_follow_powers_of_two():
    assert [tuple(core.split_for(n)) for n in (256, 512, 8192, 8448, 16384, 16640, 32768)] == [
        (1, 256), (2, 256), (32, 256), (17, 512), (32, 512), (17, 1024), (32, 1024)]


def test_row_table_rejects_a_negative_size():
    rng = np.random.default_rng(0)
    k, _ = _rows(rng, "q8_0", 8, 32)
    with pytest.raises(ValueError, match="table_rows"):
        core.pool_attention(np.zeros((1, 1, 32), np.float32), k, k, np.ones((1, 8), np.uint8), kv_type="q8_0",
                            n_head_kv=1, scale=1.0, table_rows=-1)


# --------------------------------------------------------------------------- tiny models

_MODELS: dict = {}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(arch) -> GGUF path of a 2-layer model (gemma3: 6 layers, 5 sliding, window 16; gemma3-12: 12
    layers, two global ones (5, 11), so the second's K/V depend on the first's attention; gemma3-8: 8 layers,
    the last two sliding)."""

    def get(arch, weights="f32"):
        key = (arch, weights)
        if key not in _MODELS:
            kw = dict(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=256, weight_type=weights, seed=11)
            if weights.endswith("_K"):   # K-quants: rows of 256
                kw.update(n_embd=256, n_head=8, n_ff=512)
            if arch.startswith("gemma3"):
                kw.update(n_layer=int(arch.split("-")[1]) if "-" in arch else 6, gemma_sliding_window=16)
            path = tmp_path_factory.mktemp("exact") / f"{arch}-{weights}.gguf"
            write_tiny_model(path, arch.split("-")[0], **kw)
            _MODELS[key] = str(path)
        return _MODELS[key]

    yield get
    _MODELS.clear()


def _ids(n, seed=1, vocab=256):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_exact_eval_is_the_full_cache(tiny, arch):
    m = core.Model(tiny(arch), n_threads=2)
    full = core.Runtime(m, max_ctx=2048, pool_tokens=0, chunk_tokens=C, ubatch=UBATCH)
    paged = core.Runtime(m, max_ctx=2048, pool_tokens=POOL, chunk_tokens=C, ubatch=UBATCH)
    pooled = core.Runtime(m, max_ctx=2048, pool_tokens=POOL, chunk_tokens=C, ubatch=UBATCH)
    ids = _ids(PROMPT)
    want = full.eval(ids)
    got = paged.eval(ids, exact=True)
    approx = pooled.eval(ids)
    assert paged.pager.stats["host_chunks"] > 40          # most of the prompt lives in the host store
    assert np.array_equal(got, want)
    assert np.abs(approx - want).max() > 1e-4             # the pool alone does not give it
    for t in _ids(6, seed=2):                              # decode, one token at a time
        want = full.eval(np.asarray([t], np.int32))
        assert np.array_equal(paged.eval(np.asarray([t], np.int32), exact=True), want)
    # a batch on top (a verification pass's shape) against the full cache's batch
    more = _ids(9, seed=3)
    assert np.array_equal(paged.eval(more, all_logits=True, exact=True), full.eval(more, all_logits=True))


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma3-8"])
@pytest.mark.parametrize("attn", ["pool", "ggml"])
@pytest.mark.parametrize("pool", [0, POOL])
def test_a_prompt_reads_only_its_last_querys_attention(tiny, arch, attn, pool):
    """A prompt whose last logits alone are read has only its last query attend in the model's last layer
    with the pool kernel (the other rows' outputs reach nothing; ggml's path keeps every query): those
    logits are the all-logits batch's last row bit for bit, and every row's K/V are written as before, so
    the next tokens' logits are the same bit for bit, in the full cache and over a pool that pages
    (gemma3-8: the last layer is a sliding one)."""
    m = core.Model(tiny(arch), n_threads=2)
    kw = dict(max_ctx=2048, pool_tokens=pool, chunk_tokens=C, ubatch=UBATCH, attn=attn)
    a, b = core.Runtime(m, **kw), core.Runtime(m, **kw)
    ids = _ids(PROMPT if pool else 300, seed=21)
    last, every = a.eval(ids), b.eval(ids, all_logits=True)
    assert every.shape == (len(ids), last.shape[-1])
    assert np.array_equal(last, every[-1])
    if pool:
        assert a.pager.stats["host_chunks"] > 40
    for t in _ids(3, seed=22):
        one = np.asarray([t], np.int32)
        assert np.array_equal(a.eval(one), b.eval(one))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kv_type", ["q8_0", "f16"])
def test_batch_logits_are_one_token_steps(tiny, arch, kv_type):
    """The full cache gives a token the same logits in a batch as in a one-token step, bit for bit, across
    a 256-slot edge too and through gemma3's sliding-window ring (whose lower edge differs per query):
    the ground exact mode's greedy identity stands on."""
    m = core.Model(tiny(arch), n_threads=2)
    a = core.Runtime(m, max_ctx=1024, pool_tokens=0, chunk_tokens=C, kv_type=kv_type)
    b = core.Runtime(m, max_ctx=1024, pool_tokens=0, chunk_tokens=C, kv_type=kv_type)
    ids = _ids(253, seed=12)
    a.eval(ids)
    b.eval(ids)
    more = _ids(7, seed=13)
    batch = a.eval(more, all_logits=True)
    steps = np.stack([b.eval(more[i:i + 1]) for i in range(len(more))])
    assert np.array_equal(batch, steps)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_one_row_products_are_one_token_steps(tiny, arch):
    """ggml's batched products for a repacked q4_K weight (the 4-row gemm) round differently from its
    one-row product (gemv), so a batch's logits are not one-token steps' -- which is what the full cache
    decodes.  one_row_products=True gives each token of the batch the one-row arithmetic: the same
    logits bit for bit, on the full cache and through exact mode's row tables alike."""
    m = core.Model(tiny(arch, "q4_K"), n_threads=2)
    rts = [core.Runtime(m, max_ctx=1024, pool_tokens=0, chunk_tokens=C, ubatch=UBATCH) for _ in range(3)]
    paged = core.Runtime(m, max_ctx=1024, pool_tokens=POOL, chunk_tokens=C, ubatch=UBATCH)
    ids = _ids(500, seed=21)
    for rt in rts:
        rt.eval(ids)
    paged.eval(ids, exact=True)
    more = _ids(9, seed=22)
    steps = np.stack([rts[0].eval(more[i:i + 1]) for i in range(len(more))])
    batch = rts[1].eval(more, all_logits=True)
    one_row = rts[2].eval(more, all_logits=True, one_row_products=True)
    verified = paged.eval(more, all_logits=True, exact=True, one_row_products=True)
    assert not np.array_equal(batch, steps)   # the model is batch-variant: the test has something to catch
    assert np.array_equal(one_row, steps)
    assert np.array_equal(verified, steps)
    assert paged.pager.stats["host_chunks"] > 0


def test_one_row_products_on_one_token_is_the_plain_step(tiny):
    """For one token the flag changes nothing (the plain one-token graph)."""
    m = core.Model(tiny("llama", "q4_K"), n_threads=1)
    rt = core.Runtime(m, max_ctx=256, pool_tokens=0, chunk_tokens=C)
    rt.eval(_ids(40))
    tok = _ids(1, seed=9)
    a = rt.eval(tok, one_row_products=True)
    rt.truncate(rt.n_past - 1)
    assert np.array_equal(a, rt.eval(tok))


def test_exact_eval_refuses_ggml_attention(tiny):
    m = core.Model(tiny("llama"), n_threads=1)
    rt = core.Runtime(m, max_ctx=1024, pool_tokens=POOL, chunk_tokens=C, attn="ggml")
    with pytest.raises(ValueError, match="attn='ggml'"):
        rt.eval(_ids(4), exact=True)
    assert rt.n_past == 0


# --------------------------------------------------------------------------- 3. greedy sessions

def _same_logits(got, want):
    """Logits of a verification batch against the full cache's one-token step: the attention op is
    batch-invariant (test_batch_logits_are_one_token_steps) and the verification's matrix products take
    one-row arithmetic (test_one_row_products_are_one_token_steps), so they are equal bit for bit."""
    assert np.array_equal(got, want)


def _session(path, exact, policy="lru", **kw):
    return kvflash.Session(path, max_ctx=2048, kvflash=POOL if exact is not None else None, chunk_tokens=C,
                           ubatch=UBATCH, policy=policy, threads=2, verbose=False, exact=bool(exact), tau=16, **kw)


def _run(s, prompt, n, **kw):
    text = "".join(s.generate(prompt.tolist() if prompt is not None else None, max_tokens=n, ignore_eos=True, **kw))
    return text, list(s.tokens)


@pytest.mark.parametrize("arch,policy,weights", [("llama", "lru", "f32"), ("llama", "qk", "f32"), ("gemma3", "lru", "f32"),
                                                 ("llama", "qk", "q4_K"), ("gemma3", "qk", "q4_K")])
def test_greedy_tokens_are_the_full_cache(tiny, arch, policy, weights):
    """q4_K: repacked weights whose batched products differ from one-row ones (as Gemma-3's Q4_K_M)."""
    path = tiny(arch, weights)
    prompt = _ids(PROMPT, seed=4)
    full = _session(path, None)
    ex = _session(path, True, policy=policy)
    pooled = _session(path, False, policy=policy)
    _, want = _run(full, prompt, 64)
    _, got = _run(ex, prompt, 64)
    _, approx = _run(pooled, prompt, 64)
    assert got == want
    _same_logits(ex.logits(), full.logits())
    assert ex.runtime.n_past == full.runtime.n_past == len(want)
    # every K/V row the rounds kept is the full cache's: one more token over the whole context agrees
    probe = _ids(1, seed=77)
    _same_logits(ex.runtime.eval(probe, exact=True), full.runtime.eval(probe))
    st = ex.stats
    assert st["exact_rounds"] > 0 and st["exact_drafted"] > 0
    assert 0 <= st["acceptance_rate"] <= 1 and 0 < st["verify_share"] < 1
    assert ex.pager.stats["host_chunks"] > 0
    # eviction is in play: the pooled session's logits along the way are not the full cache's
    assert approx != want or not np.array_equal(pooled.logits(), full.logits())


def test_greedy_rounds_cut_by_max_tokens_and_continue(tiny):
    """Rounds cut short by max_tokens leave the cache, the history and the logits where the
    full cache has them; generation continues from there, and a fixed draft length works too."""
    path = tiny("llama")
    prompt = _ids(PROMPT, seed=5)
    full = _session(path, None)
    ex = _session(path, True, exact_draft=6)
    _run(full, prompt, 1)
    _run(ex, prompt, 1)
    for n in (3, 5, 2, 11, 7):
        _, want = _run(full, None, n)
        _, got = _run(ex, None, n)
        assert got == want
        assert ex.runtime.n_past == len(got)
        _same_logits(ex.logits(), full.logits())
    assert ex.stats["exact_drafted"] > 0


def test_exact_session_arguments(tiny):
    path = tiny("llama")
    with pytest.raises(ValueError, match="exact must be"):
        kvflash.Session(path, exact="yes", verbose=False)
    with pytest.raises(ValueError, match="exact_draft"):
        _session(path, True, exact_draft=99)
    s = kvflash.Session(path, max_ctx=1024, kvflash=None, exact=True, threads=1, verbose=False)
    assert not s.exact          # the full cache is exact already: nothing to verify
    rt = _session(path, True).runtime
    rt.eval(_ids(40))
    with pytest.raises(IndexError, match="max_ctx"):
        rt.spec_round(1, 3000)
    with pytest.raises(ValueError, match="k must be"):
        rt.spec_round(1, -1)
    assert rt.n_past == 40


# --------------------------------------------------------------------------- 4. sampling

def _dist(logits, temperature, top_k):
    """What the sampler draws from (temperature, then top-k; top_p 1, min_p 0): {id: p}."""
    z = np.asarray(logits, np.float64) / temperature
    top = np.argsort(-z, kind="stable")[:top_k]
    w = np.exp(z[top] - z[top].max())
    return dict(zip(top.tolist(), (w / w.sum()).tolist()))


def _chi2_sf(x, df):
    """P(chi2_df > x), Wilson-Hilferty."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampling_follows_the_full_cache_distribution(tiny):
    path = tiny("llama")
    T, K, N = 1.5, 3, 1500
    prompt = _ids(700, seed=6)
    full = _session(path, None)
    full.prefill(prompt.tolist())
    n0 = full.runtime.n_past
    # exact joint probabilities of three tokens from the full cache
    joint = {}
    p1 = _dist(full.logits(), T, K)
    rt = full.runtime
    for a, pa in p1.items():
        la = rt.eval(np.asarray([a], np.int32))
        for b, pb in _dist(la, T, K).items():
            lb = rt.eval(np.asarray([b], np.int32))
            for c, pc in _dist(lb, T, K).items():
                joint[(a, b, c)] = pa * pb * pc
            rt.truncate(n0 + 1)
        rt.truncate(n0)
    # the drafts' distribution (the pool alone) differs from the full cache's
    pooled = _session(path, False)
    pooled.prefill(prompt.tolist())
    q1 = _dist(pooled.logits(), T, K)
    tv = 0.5 * sum(abs(p1.get(t, 0) - q1.get(t, 0)) for t in set(p1) | set(q1))
    assert tv > 0.02, f"the pool's distribution is too close to the full cache's to test anything (TV {tv:.4f})"

    ex = _session(path, True, exact_draft=2)
    ex.prefill(prompt.tolist())
    counts: dict = {}
    for i in range(N):
        _run(ex, None, 3, temperature=T, top_k=K, seed=1000 + i)
        key = tuple(ex.tokens[n0:n0 + 3])
        counts[key] = counts.get(key, 0) + 1
        ex.truncate(n0)
    assert set(counts) <= set(joint), "a sampled sequence the full cache gives probability 0"
    # chi-squared over the cells, the rare ones pooled so every expected count is >= 5
    cells = sorted(joint, key=lambda c: -joint[c])
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for c in cells:
        e = joint[c] * N
        if e >= 5:
            obs.append(counts.get(c, 0))
            exp.append(e)
        else:
            rest_o += counts.get(c, 0)
            rest_e += e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    x = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    assert df >= 5
    assert _chi2_sf(x, df) > 1e-3, f"chi2 {x:.1f} on {df} df"
    st = ex.stats
    assert st["exact_kept"] < st["exact_drafted"]   # drafts were rejected along the way


def test_exact_session_snapshot_round_trip(tiny, tmp_path):
    """An exact session saved mid-generation and loaded elsewhere continues with the same tokens,
    in exact mode; a snapshot written without the exact settings still loads."""
    path = tiny("llama")
    ex = _session(path, True, policy="qk")
    _run(ex, _ids(PROMPT, seed=8), 10)
    snap = tmp_path / "ex.kvf"
    ex.save(snap)
    back = kvflash.Session.load(snap, path, threads=2)
    assert back.exact and back.runtime.n_past == ex.runtime.n_past
    _, a = _run(ex, None, 12)
    _, b = _run(back, None, 12)
    assert a == b


def test_full_cache_keeps_identity_placement_through_truncation(tiny):
    """The full cache's blocks stay block = chunk after truncations (its attention walks rows in position
    order every time, which is what exact mode reproduces), so repeating a prompt repeats its logits."""
    m = core.Model(tiny("llama"), n_threads=2)
    rt = core.Runtime(m, max_ctx=2048, pool_tokens=0, chunk_tokens=C, ubatch=UBATCH)
    ids = _ids(600, seed=9)
    rt.eval(ids[:400])
    first = rt.eval(ids[400:])
    for cut in (390, 137, 399):
        rt.truncate(cut)
        rt.eval(ids[cut:400])
        again = rt.eval(ids[400:])
        blocks = rt.pager.chunk_table()["block"][: -(-600 // C)]
        assert list(blocks) == list(range(len(blocks)))
        assert np.array_equal(again, first)


# --------------------------------------------------------------------------- 5. exact prefill, pooled decode

@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_exact_prefill_gives_every_chunk_the_full_caches_rows(tiny, arch):
    """Session(exact_prefill=True): the prompt is evaluated as the full cache evaluates it, so the logits
    after it and every chunk's K/V rows (resident or in the host store) are the full cache's; decode then
    reads the pool (and parts from the full cache), unlike exact mode."""
    path = tiny(arch)
    prompt = _ids(PROMPT, seed=31).tolist()
    full = _session(path, None)
    ep = _session(path, False, policy="qk", exact_prefill=True)
    pooled = _session(path, False, policy="qk")
    for s in (full, ep, pooled):
        s.prefill(prompt)
    assert ep.exact_prefill and not ep.exact and "exact prefill" in ep.banner
    assert ep.pager.stats["host_chunks"] > 0
    _same_logits(ep.logits(), full.logits())
    assert not np.array_equal(pooled.logits(), full.logits())
    fp, pp = full.runtime.pager, ep.runtime.pager
    for c in range(PROMPT // C):   # bring each chunk in and compare its rows with the full cache's
        if pp.chunk_table()["block"][c] < 0:
            assert pp.recall(c)
        for il in range(pp.n_layers):
            for rows in ((pp.k_rows(il), fp.k_rows(il)), (pp.v_rows(il), fp.v_rows(il))):
                for pos in range(c * C, (c + 1) * C):
                    assert bytes(rows[0][pp.slot_of(pos)]) == bytes(rows[1][fp.slot_of(pos)]), (c, il, pos)
    out = "".join(ep.generate(None, max_tokens=8, ignore_eos=True))
    assert isinstance(out, str) and ep.runtime.n_past == PROMPT + 8


def test_exact_prefill_arguments_and_snapshot(tiny, tmp_path):
    path = tiny("llama")
    with pytest.raises(ValueError, match="exact_prefill must be True, False or 'auto'"):
        _session(path, False, exact_prefill=1)
    for bad in (-1, 1.5, "16K"):
        with pytest.raises(ValueError, match="exact_prefill_until must be None or an integer"):
            _session(path, False, exact_prefill=True, exact_prefill_until=bad)
    s = _session(path, False, policy="qk", exact_prefill=True)
    s.prefill(_ids(300, seed=8).tolist())
    f = tmp_path / "s.kvfs"
    s.save(str(f))
    t = kvflash.Session.load(str(f), path, verbose=False)
    assert t.exact_prefill and np.array_equal(t.logits(), s.logits())
    assert _session(path, None, exact_prefill=True).exact_prefill is False   # the full cache: nothing to do


@pytest.mark.parametrize("arch", ["llama", "gemma3-12"])
def test_exact_prefill_until_caps_the_exact_read(tiny, arch):
    """exact_prefill_until=N: the prompt's pieces before position N are read exactly (those chunks hold the
    full cache's rows, bit for bit), the pieces from N over the pool (later chunks differ: their paged
    layers after the first attended part of the context), and the prompt is settled as a pooled one."""
    path = tiny(arch)
    prompt = _ids(PROMPT, seed=31).tolist()
    N = 4 * UBATCH   # where the full cache's prefill cuts a piece too: the exact pieces are its pieces
    full = _session(path, None)
    cap = _session(path, False, policy="qk", exact_prefill=True, exact_prefill_until=N)
    whole = _session(path, False, policy="qk", exact_prefill=True)
    for s in (full, cap, whole):
        s.prefill(prompt)
    assert cap.exact_prefill and cap.exact_prefill_until == N and f"up to position {N}" in cap.banner
    assert whole.exact_prefill_until == 0
    bad = _differing_chunks(cap.runtime.pager, full.runtime.pager, PROMPT // C)
    assert bad and min(bad) >= N // C, bad
    assert not _differing_chunks(whole.runtime.pager, full.runtime.pager, PROMPT // C)
    assert not np.array_equal(cap.logits(), full.logits())
    _same_logits(whole.logits(), full.logits())
    # exact mode reads everything exactly whatever the cap
    assert _session(path, True, exact_prefill_until=N).exact_prefill_until == 0


def test_exact_prefill_auto_follows_the_models_paged_layers(tiny, tmp_path):
    """'auto' turns exact prefill on, capped at the core's position: 16384 where the model's paged layers are
    at most a quarter of its layers (gemma3-12: 2 of 12), 4096 where every layer is paged (llama); a snapshot
    keeps the cap; an explicit cap wins."""
    g = _session(tiny("gemma3-12"), False, policy="qk", exact_prefill="auto")
    assert g.model.auto_exact_prefill_until == 16384
    assert g.exact_prefill and g.exact_prefill_until == 16384 and "up to position 16384" in g.banner
    llama = _session(tiny("llama"), False, policy="qk", exact_prefill="auto")
    assert llama.model.auto_exact_prefill_until == 4096
    assert llama.exact_prefill and llama.exact_prefill_until == 4096 and "up to position 4096" in llama.banner
    assert _session(tiny("gemma3-12"), False, exact_prefill="auto", exact_prefill_until=256).exact_prefill_until == 256
    g.prefill(_ids(300, seed=8).tolist())
    f = tmp_path / "g.kvfs"
    g.save(str(f))
    back = kvflash.Session.load(str(f), tiny("gemma3-12"), verbose=False)
    assert back.exact_prefill and back.exact_prefill_until == 16384 and np.array_equal(back.logits(), g.logits())


# --------------------------------------------------------------------------- 6. a past span read again in place

def _differing_chunks(pp, fp, n_chunks):
    """Chunks whose rows (any paged layer, K or V) differ between two runtimes' pagers; brings each into
    both pools (recalls: evictions page out what was rewritten)."""
    bad = []
    for c in range(n_chunks):
        for p in (pp, fp):
            if p.chunk_table()["block"][c] < 0:
                assert p.recall(c)
        if any(bytes(a[pp.slot_of(pos)]) != bytes(b[fp.slot_of(pos)])
               for il in range(pp.n_layers) for a, b in ((pp.k_rows(il), fp.k_rows(il)), (pp.v_rows(il), fp.v_rows(il)))
               for pos in range(c * C, (c + 1) * C)):
            bad.append(c)
    return bad


@pytest.mark.parametrize("arch", ["llama", "gemma3-12"])
def test_reread_in_order_turns_a_pooled_prefill_into_the_full_caches(tiny, arch):
    """Runtime.reread: a pooled prefill (most of the prompt out of the pool while it was read) whose every span
    is read again in place, in order and in the full cache's pieces, holds the full cache's K/V bit for bit:
    each re-read attends every earlier position (the pool's rows and the host store's, those already
    repaired) as the full cache did.  gemma3-12: the sliding layers' windows come from the history kept
    while the prompt was read (their rows depend on the first global layer's attention, so they change too),
    and the decode ring is updated: an exact decode step after it is the full cache's.  Rewritten chunks are
    dirty: evicted later, they are paged out again (a stale host copy would fail the comparison)."""
    m = core.Model(tiny(arch), n_threads=2)
    ids = _ids(PROMPT, seed=31)
    full = core.Runtime(m, max_ctx=2048, pool_tokens=0, chunk_tokens=C, ubatch=UBATCH)
    rt = core.Runtime(m, max_ctx=2048, pool_tokens=POOL, chunk_tokens=C, ubatch=UBATCH)
    rt.keep_swa_history(True)
    full.eval(ids)
    rt.eval(ids)
    assert 0 < rt.pooled_from <= POOL and full.pooled_from == -1
    fp, pp = full.pager, rt.pager
    assert len(_differing_chunks(pp, fp, PROMPT // C)) > PROMPT // C // 2   # the pooled read is approximate
    for j in range(0, PROMPT, UBATCH):
        n = min(UBATCH, PROMPT - j)
        for c in range(j // C, -(-(j + n) // C)):
            if pp.chunk_table()["block"][c] < 0:
                assert pp.recall(c)
        rt.reread(j, n)
    assert rt.n_past == PROMPT
    outs = pp.stats["page_outs"]
    assert _differing_chunks(pp, fp, PROMPT // C) == []
    assert pp.stats["page_outs"] > outs   # the rewritten chunks went out again when the walk evicted them
    pp.check_invariants()
    t = np.array([7], np.int32)
    _same_logits(rt.eval(t, exact=True), full.eval(t))


def test_reread_refuses_what_it_cannot_read(tiny):
    """A span outside the history, a chunk not resident, a sliding window without its history: ValueError
    saying what to do, and nothing changed."""
    ids = _ids(PROMPT, seed=32)
    rt = core.Runtime(core.Model(tiny("llama"), n_threads=2), max_ctx=2048, pool_tokens=POOL, chunk_tokens=C,
                      ubatch=UBATCH)
    rt.eval(ids)
    gone = int(np.flatnonzero(rt.pager.chunk_table()["block"][: PROMPT // C] < 0)[0])
    before = rt.pager.chunk_table()["block"].copy()
    with pytest.raises(ValueError, match=f"chunk {gone} is not resident"):
        rt.reread(gone * C, C)
    for pos0, n in ((PROMPT - 8, 16), (-1, 4), (0, 0)):
        with pytest.raises(ValueError, match="inside the history"):
            rt.reread(pos0, n)
    assert np.array_equal(rt.pager.chunk_table()["block"], before) and rt.n_past == PROMPT
    g = core.Runtime(core.Model(tiny("gemma3-12"), n_threads=2), max_ctx=2048, pool_tokens=POOL, chunk_tokens=C,
                     ubatch=UBATCH)
    g.eval(ids)
    with pytest.raises(ValueError, match="keep_swa_history"):
        g.reread(PROMPT - 2 * C, C)
    g.keep_swa_history(True)   # from now on (seeded with the ring's last 256 positions): the sink chunk is older
    with pytest.raises(ValueError, match="sliding history holds"):
        g.reread(0, C)
    g.reread(PROMPT - 2 * C, C)   # the ring's positions are in it


@pytest.mark.parametrize("arch", ["llama", "gemma3-12"])
def test_prefill_reread_rewrites_the_chosen_chunks(tiny, arch):
    """Session(prefill_reread=True): the settle's rescore chooses the residents as before; the chosen chunks the
    pooled pieces wrote (from pooled_from to the tail the settle re-reads anyway) get new rows, every other
    chunk keeps the pooled prefill's, and the tail re-read after it attends the new rows (other logits).
    With exact prefill it changes nothing."""
    path = tiny(arch)
    prompt = _ids(PROMPT, seed=33).tolist()
    plain = _session(path, False, policy="qk")
    rr = _session(path, False, policy="qk", prefill_reread=True)
    for s in (plain, rr):
        s.prefill(prompt)
    blocks = rr.pager.chunk_table()["block"][: PROMPT // C]
    assert np.array_equal(blocks, plain.pager.chunk_table()["block"][: PROMPT // C])   # the same residents
    first, last = rr.runtime.pooled_from // C, (PROMPT - rr.reeval_tokens) // C
    chosen = [c for c in range(first, last) if blocks[c] >= 0]
    assert len(chosen) >= 3, chosen
    assert not np.array_equal(rr.logits(), plain.logits())
    differ = _differing_chunks(rr.runtime.pager, plain.runtime.pager, PROMPT // C)
    tail = set(range(last, -(-PROMPT // C)))   # the settle's tail re-read: after the re-read, so new rows too
    assert set(differ) - tail == set(chosen), (differ, chosen)
    assert rr.stats["reread_tokens"] == len(chosen) * C and rr.stats["reread_ms"] > 0
    assert plain.stats["reread_tokens"] == 0
    # exact prefill's K/V are already exact: nothing to read again
    ep = _session(path, False, policy="qk", exact_prefill=True)
    epr = _session(path, False, policy="qk", exact_prefill=True, prefill_reread=True)
    for s in (ep, epr):
        s.prefill(prompt)
    assert np.array_equal(ep.logits(), epr.logits())
    with pytest.raises(ValueError, match="prefill_reread must be True or False"):
        _session(path, False, prefill_reread=1)

