"""What the family test files (test_hybrid, test_gptoss, test_laguna) share: token ids, a runtime and a session
over a tiny GGUF, f16 KV, and logits batched or one token at a time."""
from __future__ import annotations

import numpy as np

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
