"""What the family test files (test_hybrid, test_gptoss, test_laguna) share: token ids, a runtime and a session
over a tiny GGUF, f16 KV, and logits batched or one token at a time."""
from __future__ import annotations

import numpy as np
import pytest

import kvflash
import kvflash._core as core


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
