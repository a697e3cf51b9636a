"""What the family test files (test_hybrid, test_gptoss, test_laguna, test_gemma4) share: token ids, a runtime and
a session over a tiny GGUF, f16 KV, and logits batched or one token at a time; the comparisons with llama.cpp
and the conformance checks a test file calls on its model."""
from __future__ import annotations

import numpy as np
import pytest

import kvflash
import kvflash._core as core
import llama_ref


def ids(n: int, seed: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def runtime(path, **kw):
    """A runtime over its own model: max_ctx 2048, f16 KV, ubatch 512 unless kw says otherwise."""
    kw = dict(dict(max_ctx=2048, kv_type="f16", ubatch=512), **kw)
    return core.Runtime(core.Model(str(path), n_threads=2), **kw)


def session(path, pool=None, **kw):
    """A session with 16-token chunks (a pool of 256 pages a few hundred tokens), lru, f16 KV."""
    kw = dict(dict(max_ctx=4096, kvflash=pool, chunk_tokens=16, ubatch=128, threads=2, verbose=False,
                   kv_type="f16", policy="lru"), **kw)
    return kvflash.Session(str(path), **kw)


def eval_logits(rt, toks, batched: bool) -> np.ndarray:
    """Every token's logits [n, vocab]: one batch, or one eval per token."""
    return rt.eval(toks, all_logits=True) if batched else np.stack([rt.eval(toks[i:i + 1]) for i in range(len(toks))])


# The comparisons with llama.cpp (a test file marks them peer): 300 tokens (seed 1), f16 KV on both sides; label
# names the model in the printed line.
def logits_match_llama_cpp(path, vocab: int, attn: str, batched: bool, label: str, ne_tol: float = 2e-3,
                           argmax_min: float = 0.97) -> None:
    """Against llama.cpp without flash attention: normalised error <= ne_tol over the whole [tokens, vocab]
    array, the argmax of >= argmax_min of the rows the same."""
    toks = ids(300, 1, vocab)
    # one thread for llama.cpp's 300 one-token decodes: its thread pool spins between them, and on one core
    # (a pinned run) two of its threads take minutes where one takes a second
    ref = llama_ref.logits(path, toks, batched=batched, threads=2 if batched else 1)
    got = eval_logits(runtime(path, attn=attn), toks, batched)
    assert got.shape == ref.shape
    ne = llama_ref.normalized_error(got, ref)
    agree = float((got.argmax(1) == ref.argmax(1)).mean())
    print(f"{label} attn={attn} batched={batched} vs llama.cpp: normalised error {ne:.3g}, argmax agreement {agree:.4f}")
    assert ne <= ne_tol, (label, attn, batched, ne)
    assert agree >= argmax_min, (label, attn, batched, agree)


def batched_logits_match_llama_cpp_flash_attention(path, vocab: int, attn: str, label: str, tol: float) -> None:
    """Batched against llama.cpp with flash attention (ggml's tiled all-f32 kernel for a batch): normalised error
    <= tol and every argmax the same."""
    toks = ids(300, 1, vocab)
    ref = llama_ref.logits(path, toks, batched=True, flash_attn=True)
    got = runtime(path, attn=attn).eval(toks, all_logits=True)
    ne = llama_ref.normalized_error(got, ref)
    print(f"{label} attn={attn} batched vs llama.cpp flash attention: normalised error {ne:.3g}")
    assert ne <= tol, (label, attn, ne)
    assert (got.argmax(1) == ref.argmax(1)).all()


def ggml_path_one_token_matches_llama_cpp(path, vocab: int, label: str, tol: float) -> None:
    """kvflash's ggml_flash_attn_ext path one token at a time against llama.cpp's flash attention one token at a
    time, one thread each: normalised error <= tol."""
    toks = ids(300, 1, vocab)
    ref = llama_ref.logits(path, toks, batched=False, flash_attn=True, threads=1)
    rt = core.Runtime(core.Model(str(path), n_threads=1), max_ctx=2048, kv_type="f16", ubatch=512, attn="ggml")
    got = eval_logits(rt, toks, False)
    ne = llama_ref.normalized_error(got, ref)
    print(f"{label} attn=ggml one-token vs llama.cpp flash attention one-token: normalised error {ne:.3g}")
    assert ne <= tol, (label, ne)


def attention_paths_agree(path, vocab: int, tol: float) -> None:
    """ggml_flash_attn_ext against the pool kernel, batched over 300 tokens (seed 2): they differ (summation
    order), by a normalised error of at most tol."""
    toks = ids(300, 2, vocab)
    pool = runtime(path, attn="pool").eval(toks, all_logits=True)
    ggml = runtime(path, attn="ggml").eval(toks, all_logits=True)
    ne = llama_ref.normalized_error(ggml, pool)
    assert 0 < ne <= tol, (str(path), ne)


def captured_queries_and_scorers(path, vocab: int, q_shape: tuple, n_paged: int | None = None) -> None:
    """A 256-slot pool under 600 tokens capturing 8 queries: the paged layers' queries are captured (q_shape:
    [paged layers, 8, heads, head dim]); the scorers read them over the pool and the host store (one group: all
    the history's keys take the whole mass)."""
    rt = runtime(path, pool_tokens=256, chunk_tokens=16, ubatch=128, capture_queries=8)
    rt.eval(ids(600, 3, vocab))
    assert rt.pager.stats["host_chunks"] > 0
    if n_paged is not None:
        assert rt.n_paged_layers == n_paged
    q = rt.captured_queries()
    assert q.shape == q_shape and np.isfinite(q).all()
    mass = rt.history_attention(n_threads=2, groups=np.zeros(rt.n_past, np.int32))
    assert abs(float(mass[0]) - 1.0) < 1e-5
    res = rt.attention_scores()
    assert np.isfinite(res).all() and 0 < res.max() <= 1.0


# The conformance checks a family with sliding layers shares (gpt-oss, laguna): a test file calls them on its model.
def exact_greedy_is_the_full_cache(path, vocab: int, policy: str) -> None:
    """Exact mode over a 256-token pool under a 900-token prompt: the full cache's greedy text, tokens and logits."""
    prompt = ids(900, 9, vocab).tolist()
    full = session(path)
    ex = session(path, 256, exact=True, tau=16, policy=policy)
    a = "".join(full.generate(prompt, max_tokens=40, ignore_eos=True))
    b = "".join(ex.generate(prompt, max_tokens=40, ignore_eos=True))
    assert a == b and ex.tokens == full.tokens
    assert np.array_equal(ex.logits(), full.logits())
    assert ex.pager.stats["host_chunks"] > 0 and ex.stats["exact_rounds"] > 0


def pool_smaller_than_the_prompt_runs(path, vocab: int, n_paged: int) -> None:
    """A 256-token pool under a 1200-token prompt with qk: it decodes, chunks move, the sliding layers keep a ring."""
    s = session(path, 256, policy="qk")
    out = "".join(s.generate(ids(1200, 10, vocab).tolist(), max_tokens=30, ignore_eos=True))
    assert len(s.tokens) == 1230 and out
    st = s.pager.stats
    assert st["host_chunks"] > 0 and st["page_outs"] > 0
    assert s.runtime.n_paged_layers == n_paged and s.runtime.swa_bytes > 0   # the sliding layers keep their ring


def truncate_within_the_ring_and_beyond(path, vocab: int) -> None:
    """Exact evals over a pool of 256 against the full cache: decode 20, go back 12, the same 12 again give
    the logits they gave; a truncate further back than the ring holds is refused and changes nothing."""
    m = core.Model(str(path), n_threads=2)
    kw = dict(max_ctx=4096, chunk_tokens=16, ubatch=128, kv_type="f16")
    full = core.Runtime(m, pool_tokens=0, **kw)
    paged = core.Runtime(m, pool_tokens=256, **kw)
    prompt = ids(700, 14, vocab)
    full.eval(prompt)
    paged.eval(prompt, exact=True)
    dec = ids(20, 15, vocab)
    seen = []
    for t in dec:
        one = np.asarray([t], np.int32)
        seen.append(full.eval(one))
        assert np.array_equal(paged.eval(one, exact=True), seen[-1])
    for rt in (full, paged):
        rt.truncate(rt.n_past - 12)
        again = np.stack([rt.eval(dec[i:i + 1], exact=rt is paged) for i in range(8, 20)])
        assert np.array_equal(again, np.stack(seen[8:]))
    r = paged.max_rewind
    assert 0 < r < paged.n_past
    n = paged.n_past
    with pytest.raises(ValueError):
        paged.truncate(n - r - 1)
    assert paged.n_past == n
    probe = ids(1, 16, vocab)
    assert np.array_equal(paged.eval(probe, exact=True), full.eval(probe))


def rpc_split_is_refused(path, vocab: int, op: str) -> None:
    """Layers on an RPC server: an op off kvflash's list for remote devices refuses the first eval, naming the op,
    and the runtime is left as it was."""
    from test_rpc import _start_server
    _, ep = _start_server()
    m = core.Model(str(path), n_threads=1, rpc=[ep], tensor_split=[1, 1])
    rt = core.Runtime(m, max_ctx=512, kv_type="f16")
    with pytest.raises(ValueError, match=op):
        rt.eval(ids(10, 1, vocab))
    assert rt.n_past == 0


def snapshot_round_trip_mid_decode(path, vocab: int, pool, file) -> None:
    """A session saved mid-decode and loaded again continues bit for bit (its text, tokens and logits)."""
    s = session(path, pool)
    "".join(s.generate(ids(700, 12, vocab).tolist(), max_tokens=10, ignore_eos=True))
    s.save(file)
    want = "".join(s.generate(None, max_tokens=20, ignore_eos=True))
    r = kvflash.Session.load(file, path, threads=2)
    got = "".join(r.generate(None, max_tokens=20, ignore_eos=True))
    assert got == want and r.tokens == s.tokens
    assert np.array_equal(r.logits(), s.logits())
    if pool:
        assert r.pager.stats["host_chunks"] > 0


def a_batch_is_its_steps(path, vocab: int, kv_type: str) -> None:
    """Through the sliding ring (its lower edge differs per query) and across a 256-slot edge: a batch's logits
    are its one-token steps', bit for bit."""
    a = runtime(path, kv_type=kv_type, chunk_tokens=16)
    b = runtime(path, kv_type=kv_type, chunk_tokens=16)
    prompt = ids(253, 12, vocab)
    a.eval(prompt)
    b.eval(prompt)
    more = ids(7, 13, vocab)
    assert np.array_equal(a.eval(more, all_logits=True), np.stack([b.eval(more[i:i + 1]) for i in range(len(more))]))


def exact_eval_is_the_full_cache(path, vocab: int, n_paged: int) -> None:
    """Exact evals over a 256-slot pool under a 900-token prompt: the full cache's logits bit for bit (a prompt,
    single tokens, a batch), where the pool alone does not give them."""
    m = core.Model(str(path), n_threads=2)
    kw = dict(max_ctx=2048, chunk_tokens=16, ubatch=128, kv_type="f16")
    full = core.Runtime(m, pool_tokens=0, **kw)
    paged = core.Runtime(m, pool_tokens=256, **kw)
    pooled = core.Runtime(m, pool_tokens=256, **kw)
    prompt = ids(900, 4, vocab)
    want = full.eval(prompt)
    assert np.array_equal(paged.eval(prompt, exact=True), want)
    assert paged.n_paged_layers == n_paged and paged.pager.stats["host_chunks"] > 40
    assert np.abs(pooled.eval(prompt) - want).max() > 1e-4      # the pool alone does not give it
    for t in ids(5, 5, vocab):
        one = np.asarray([t], np.int32)
        assert np.array_equal(paged.eval(one, exact=True), full.eval(one))
    more = ids(9, 6, vocab)
    assert np.array_equal(paged.eval(more, all_logits=True, exact=True), full.eval(more, all_logits=True))
