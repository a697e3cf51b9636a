"""Exactness of the native forward pass (kvflash._core.Runtime) on tiny GGUF models.

Every test here compares logits against an independent expectation and can fail:

1. Full cache, f16 KV: logits vs the float64 numpy reference (tests/reference.py)
   for a batched prompt, token-by-token decode, and a gemma3 context long enough
   for the sliding-window ring to wrap around.
2. (removed: pool >= context compared one graph with itself over the same keys.)
3. Shuffled block placement (chunks paged out and recalled into other blocks):
   same logits (1e-6) and the same greedy tokens as identity placement.
4. Eviction and recall: with a pool smaller than the context, evicted positions
   contribute exactly nothing and recalled ones count again, from whichever block
   they land in; the whole logit trajectory matches a reference that sees, per
   query, exactly the positions resident in the pool when that query ran.
5. (bad input: test_model_files.py.)

Error metric: ``rel_err(a, b) = max|a - b| / max|b|`` over the whole array being
compared (b = reference), threshold TOL = 1e-3.

Which attention kernel runs matters at this precision.  On the CPU the runtime
has two (Runtime(attn=...)): kvflash's own split-K pool kernel (attn="pool";
csrc/kvflash/attn_cpu.cpp: Q, K, V and accumulators in f32) and ggml's
ggml_flash_attn_ext (attn="ggml"); the default "auto" uses the pool kernel for
pieces of up to pool_attn_max_tokens queries (by default every piece) and ggml above.  ggml's CPU flash
attention (ggml-cpu/ops.cpp) itself has a "tiled" path (all f32) for >= 64
queries with f16 KV and otherwise a "one_chunk" path that converts Q to f16 and
accumulates softmax(QK)V *in an f16 vector* (VKQ16: ggml_vec_mad_f16 /
ggml_vec_scale_f16), keys in pool-slot order with an online softmax.  That f16
accumulator alone costs ~1-3e-3 relative error in the logits of a tiny model, so
wherever attn="ggml" runs pieces of < 64 queries, the reference's attention is
replaced by :func:`ggml_onechunk_attn`, a float64 emulation of that kernel with
the same f16 rounding points, fed the real slot order (residual: f32-vs-f64
noise flipping single f16 roundings, a few 1e-4).  Everything else (attn="auto"
or "pool", and ggml's tiled path) is compared with the exact softmax reference.
gemma3's GELU is evaluated through ggml's f16 lookup table
(``gelu_fp16_table=True``) in all references.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("gguf")
core = pytest.importorskip("kvflash._core")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import RefModel  # noqa: E402
from tinygguf import write_tiny_model  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
TOL = 1e-3
N_SWA = 16  # gemma3 sliding window for the tiny model
BIG = np.iinfo(np.int64).max


def rel_err(a, b) -> float:
    """max|a - b| / max|b| over the whole array (b is the reference)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _f16(a):
    return np.asarray(a, dtype=np.float64).astype(np.float16).astype(np.float64)


def model_kw(arch: str) -> dict:
    # head_dim 32: a whole q8_0/q4_0 block per head.  n_embd = n_head*head_dim (qwen2).
    kw = dict(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=256,
              weight_type="f32", seed=7)
    if arch == "gemma3":
        # period-6 pattern: layers 0-4 sliding, layer 5 global (paged)
        kw.update(n_layer=6, gemma_sliding_window=N_SWA)
    return kw


_MODELS: dict = {}
_ALL_VISIBLE: dict = {}  # eviction test: all-visible reference logits per (arch, n, seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(arch) -> (info from write_tiny_model, kvflash Model with one thread)."""

    def get(arch):
        if arch not in _MODELS:
            path = tmp_path_factory.mktemp("exact") / f"{arch}.gguf"
            info = write_tiny_model(path, arch, **model_kw(arch))
            _MODELS[arch] = (info, core.Model(str(path), n_threads=1))
        return _MODELS[arch]

    yield get
    _MODELS.clear()


def tokens(n: int, seed: int, n_vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def ring_tokens(n_swa: int, ubatch: int, max_ctx: int) -> int:
    """Sliding-window ring size, as Runtime::init_swa_ring (csrc/kvflash/runtime.cpp) sizes it (pos -> slot pos % R)."""
    r = min((n_swa + ubatch + 255) // 256 * 256, (max_ctx + 255) // 256 * 256)
    return max(r, 256)


def check_ring(rt, info, R):
    hp = info["hparams"]
    n_swa_layers = sum(hp["is_swa"])
    if n_swa_layers:  # K and V, f16 rows of n_head_kv*head_dim
        assert rt.swa_bytes >= n_swa_layers * 2 * R * hp["n_head_kv"] * hp["head_dim"] * 2


def runtime(m, **kw):
    """core.Runtime(m, **kw): a binding that lost a keyword fails here, it is not skipped."""
    return core.Runtime(m, **kw)


def uses_onechunk(attn: str, piece: int) -> bool:
    """Does a graph of `piece` queries run ggml's f16-accumulating one_chunk kernel?"""
    return attn == "ggml" and piece < 64


# --------------------------------------------------------------------------- ggml kernel emulation

def ggml_onechunk_attn(slot_fn):
    """Reference attention emulating ggml's CPU flash-attention one_chunk kernel, f16 K/V.

    slot_fn(il) -> int array: the pool slot of each key, either [n] (the same for
    every query) or [n_q, n_k] (per query: where key k sat when query q ran).
    For every (query, head): Q rounded to f16; keys visited in increasing slot
    order, masked ones skipped; s = q.k * scale; online softmax with the running
    output vector rounded to f16 after every rescale and every multiply-add
    (VKQ16); result = VKQ / S.
    """

    def attn(*, il, q, k, v, mask, kq_scale, pos):
        n, nh, hd = q.shape
        grp = nh // k.shape[1]
        slot = np.asarray(slot_fn(il), dtype=np.int64)
        if slot.ndim == 1:
            slot = np.broadcast_to(slot[None, :], (n, n))
        ks = np.where(mask, slot, BIG)
        L = int(mask.sum(axis=1).max())
        order = np.argsort(ks, axis=1, kind="stable")[:, :L]  # keys in slot order
        valid_o = np.take_along_axis(ks, order, axis=1) != BIG
        qh = _f16(q)
        kk = np.repeat(k, grp, axis=1)
        vv = np.repeat(v, grp, axis=1)
        M = np.full((n, nh), -np.inf)
        S = np.zeros((n, nh))
        acc = np.zeros((n, nh, hd))  # holds f16 values
        with np.errstate(invalid="ignore", over="ignore"):
            for j in range(L):
                kidx = order[:, j]
                vb = valid_o[:, j][:, None]
                s = np.einsum("nhd,nhd->nh", qh, kk[kidx]) * kq_scale
                s = s.astype(np.float32).astype(np.float64)
                newmax = vb & (s > M)
                ms = np.where(newmax, np.exp(np.where(newmax, M - s, 0.0)), 1.0)
                vs = np.where(newmax, 1.0, np.exp(np.where(vb & ~newmax, s - M, 0.0)))
                M = np.where(newmax, s, M)
                a2 = np.where(newmax[..., None], _f16(acc * ms[..., None]), acc)
                upd = _f16(a2 + vv[kidx] * vs[..., None])
                acc = np.where(vb[..., None], upd, acc)
                S = np.where(vb, S * ms + vs, S)
        return acc / S[..., None]

    return attn


def ref_model(info, attn_fn=None) -> RefModel:
    return RefModel(info["weights"], info["hparams"], kv_f16_roundtrip=True,
                    gelu_fp16_table=True, attn_fn=attn_fn)


def full_cache_reference(info, attn: str, piece: int, toks) -> np.ndarray:
    """Reference logits for a full-cache run (identity placement, max_ctx 256) fed in pieces of
    `piece` queries: ggml's one-chunk emulation where that kernel runs, else the exact reference."""
    if uses_onechunk(attn, piece):
        sf = identity_slots(info, ring_tokens(N_SWA, 512, 256))
        return ref_model(info, ggml_onechunk_attn(lambda il: sf(il, len(toks)))).forward(toks)
    return ref_model(info).forward(toks)


def identity_slots(info, R):
    """slot_fn for the full cache: paged layers slot = position, ring layers pos % R."""
    is_swa = info["hparams"]["is_swa"]

    def slot_fn(il, n):
        p = np.arange(n)
        return p % R if is_swa[il] else p

    return slot_fn


# --------------------------------------------------------------------------- 1. vs reference

ATTNS = ["auto", "ggml"]


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("n_prompt", [97, 37])
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_reference(tiny, arch, n_prompt, attn):
    """Full cache, f16 KV, all_logits over an odd-length prompt ending in a partial chunk."""
    info, m = tiny(arch)
    hp = info["hparams"]
    rt = runtime(m, max_ctx=256, kv_type="f16", attn=attn)
    assert rt.full_cache
    toks = tokens(n_prompt, 1, hp["n_vocab"])
    got = rt.eval(toks, all_logits=True)
    assert got.shape == (n_prompt, hp["n_vocab"]) and got.dtype == np.float32
    assert rt.n_past == n_prompt
    ref = full_cache_reference(info, attn, n_prompt, toks)
    err = rel_err(got, ref)
    print(f"{arch} prompt[{n_prompt}] attn={attn} rel_err={err:.2e}")
    assert err <= TOL, f"{arch}: prompt logits rel_err {err:.3e} > {TOL}"
    # the last-token-only path returns the same row
    rt.reset()
    last = rt.eval(toks)
    assert last.shape == (hp["n_vocab"],)
    np.testing.assert_array_equal(last, got[-1])


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decode_matches_reference(tiny, arch, attn):
    """One token per eval over 97 positions; every step's logits vs the reference row."""
    info, m = tiny(arch)
    hp = info["hparams"]
    n = 97
    rt = runtime(m, max_ctx=256, kv_type="f16", attn=attn)
    toks = tokens(n, 2, hp["n_vocab"])
    got = np.stack([rt.eval(toks[i:i + 1]) for i in range(n)])
    assert rt.n_past == n
    ref = full_cache_reference(info, attn, 1, toks)
    err = rel_err(got, ref)
    print(f"{arch} incremental attn={attn} rel_err={err:.2e}")
    assert err <= TOL, f"{arch}: decode logits rel_err {err:.3e} > {TOL}"
    # the model is not degenerate: tokens change the logits
    assert np.abs(got[1:] - got[:-1]).max() > 0.1 * np.abs(got).max()


@pytest.mark.parametrize("ubatch,attn", [(128, "auto"), (8, "auto"), (8, "ggml")])
def test_gemma3_ring_wraparound(tiny, ubatch, attn):
    """gemma3, 560 tokens through a 256-slot sliding-window ring (it wraps twice).

    ubatch=128: pieces of 128 and 48 queries.  ubatch=8: 480 tokens in pieces of
    8, then 80 single-token decode steps.
    """
    info, m = tiny("gemma3")
    hp = info["hparams"]
    n, max_ctx = 560, 1024
    R = ring_tokens(N_SWA, ubatch, max_ctx)
    assert R == 256 < n
    rt = runtime(m, max_ctx=max_ctx, kv_type="f16", ubatch=ubatch, attn=attn)
    check_ring(rt, info, R)
    toks = tokens(n, 3, hp["n_vocab"])
    if ubatch >= 64:
        got = rt.eval(toks, all_logits=True)
    else:
        n_pre = 480
        got = np.concatenate([rt.eval(toks[:n_pre], all_logits=True)]
                             + [rt.eval(toks[i:i + 1])[None] for i in range(n_pre, n)])
    if uses_onechunk(attn, ubatch):
        sf = identity_slots(info, R)
        ref = ref_model(info, ggml_onechunk_attn(lambda il: sf(il, n))).forward(toks)
    else:
        ref = ref_model(info).forward(toks)
    err = rel_err(got, ref)
    print(f"gemma3 ring ubatch={ubatch} attn={attn} rel_err={err:.2e}")
    assert err <= TOL, f"gemma3 ring (ubatch={ubatch}, attn={attn}): rel_err {err:.3e} > {TOL}"
    # the window matters: with every layer global the answer is clearly different
    hp_all = dict(hp, is_swa=[False] * hp["n_layer"])
    wrong = RefModel(info["weights"], hp_all, kv_f16_roundtrip=True, gelu_fp16_table=True).forward(toks[:300])
    assert rel_err(got[:300], wrong) > 20 * TOL


def test_gemma3_ring_holds_window_for_chunk_pieces(tmp_path):
    """Once a prompt outgrows the pool, eval() feeds it in chunk-sized pieces (64
    tokens) even when ubatch is smaller; the sliding-window ring must still hold
    n_swa + piece tokens, or a piece overwrites ring slots its own first queries
    still need (set_rows runs before the attention).

    n_swa=200, ubatch=8 -> ring 256 < 200 + 64.  Positions 512..575 evaluated as
    one 64-token piece must give the same logits as one token at a time from the
    same state (same pool contents, same resident set, no eviction inside chunk 8).
    """
    path = tmp_path / "g200.gguf"
    info = write_tiny_model(path, "gemma3", **dict(model_kw("gemma3"), gemma_sliding_window=200))
    m = core.Model(str(path), n_threads=1)
    toks = tokens(576, 8, info["hparams"]["n_vocab"])
    kw = dict(max_ctx=1024, pool_tokens=512, kv_type="f16", ubatch=8)
    dec, piece = core.Runtime(m, **kw), core.Runtime(m, **kw)
    dec.eval(toks[:512])
    piece.eval(toks[:512])
    want = np.stack([dec.eval(toks[i:i + 1]) for i in range(512, 576)])
    got = piece.eval(toks[512:576], all_logits=True)
    assert np.array_equal(dec.pager.chunk_table()["block"], piece.pager.chunk_table()["block"])
    assert piece.pager.stats["page_outs"] > 0
    err = rel_err(got, want)
    print(f"gemma3 n_swa=200 chunk piece vs decode rel_err={err:.2e}")
    assert err <= TOL, (f"64-token piece differs from token-by-token decode by {err:.3e} "
                        f"(sliding-window ring too small for chunk-sized pieces?)")


# --------------------------------------------------------------------------- 3. shuffled placement

@pytest.mark.parametrize("arch", ARCHS)
def test_shuffled_placement_matches_identity(tiny, arch):
    """Chunks paged out and recalled into different blocks: same greedy tokens, same logits.

    The moved K/V bytes are identical and the first decode step after the shuffle
    agrees to 1e-6.  Later steps agree to 1e-4 only: attention now sums the same
    keys in a different slot order (f32 rounding ~1e-7), and every new token's K/V
    row is quantized to q8_0, where a 1e-7 difference can flip a rounding step
    (1/127 of the block max); such flips accumulate over the 128 steps (measured
    up to ~4e-6 for gemma3, ~5e-7 for the others).
    """
    info, m = tiny(arch)
    nv = info["hparams"]["n_vocab"]
    ref_rt = runtime(m, max_ctx=2048, pool_tokens=1024)
    shuf = runtime(m, max_ctx=2048, pool_tokens=1024)
    toks = tokens(600, 5, nv)
    a = ref_rt.eval(toks)
    b = shuf.eval(toks)
    assert np.array_equal(a, b)
    pg = shuf.pager
    n_used = (600 + 63) // 64
    before = pg.chunk_table()["block"].copy()
    assert np.array_equal(before[:n_used], np.arange(n_used)), "prefill placement is not identity"
    victims = [1, 2, 3, 4]  # not the sink (0) nor the tail window (5..9)
    for c in victims:
        pg.evict(c)
    assert all(pg.chunk_table()["block"][c] == -1 for c in victims)
    for c in victims:  # the free-block stack hands the blocks back in another order
        pg.recall(c)
    after = pg.chunk_table()["block"].copy()
    pg.check_invariants()
    assert len(set(after[:n_used].tolist())) == n_used and (after[:n_used] >= 0).all()
    assert not np.array_equal(after[:n_used], np.arange(n_used)), f"placement still identity: {after[:n_used]}"
    st = pg.stats
    assert st["page_outs"] >= len(victims) and st["page_ins"] >= len(victims)
    sp = pg.slot_positions()
    for c in range(n_used):
        blk = after[c]
        lo, hi = c * 64, min((c + 1) * 64, 600)
        np.testing.assert_array_equal(sp[blk * 64: blk * 64 + hi - lo], np.arange(lo, hi))
        for layer in range(len(m.global_layers)):  # the bytes travelled intact
            for rows in ("k_rows", "v_rows"):
                x = getattr(pg, rows)(layer)[blk * 64: blk * 64 + hi - lo]
                y = getattr(ref_rt.pager, rows)(layer)[lo:hi]
                assert np.array_equal(x, y), f"chunk {c} {rows} layer {layer} changed"

    errs = []
    nxt = int(np.argmax(a))
    for step in range(128):
        t = np.array([nxt], dtype=np.int32)
        la, lb = ref_rt.eval(t), shuf.eval(t)
        errs.append(rel_err(lb, la))
        ta, tb = int(np.argmax(la)), int(np.argmax(lb))
        assert ta == tb, f"{arch}: greedy token differs at step {step}: {ta} vs {tb}"
        nxt = ta
    print(f"{arch} shuffled rel_err step0={errs[0]:.2e} max={max(errs):.2e}")
    assert errs[0] <= 1e-6, f"{arch}: first step after shuffling rel_err {errs[0]:.3e} > 1e-6"
    assert max(errs) <= 1e-4, f"{arch}: shuffled placement rel_err {max(errs):.3e} > 1e-4"
    assert np.array_equal(shuf.pager.chunk_table()["block"][victims], after[victims])
    assert shuf.pager.stats["page_outs"] == st["page_outs"]  # nothing moved during decode


# --------------------------------------------------------------------------- 4. eviction

@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("recall", [False, True], ids=["evict", "recall"])
def test_evicted_positions_contribute_nothing(tiny, arch, attn, recall):
    """Pool of 512 (8 blocks, 6 protected), 600 tokens evaluated one at a time, f16 KV.

    After each step the resident set (slot -> position) is recorded; query q of
    the reference sees exactly the positions resident when q ran (paged layers;
    gemma3 sliding layers keep their ring/window rule), and for the ggml kernel
    keys are visited in that step's slot order.  The whole trajectory must match.
    recall: every 5 steps once the pool is full, a reselect to random scores pages
    chunks out and brings others back from the host store, into whatever block is
    free: a recalled chunk whose bytes or placement were wrong breaks the match.
    """
    info, m = tiny(arch)
    hp = info["hparams"]
    n, P, max_ctx = 600, 512, 1024
    rt = runtime(m, max_ctx=max_ctx, pool_tokens=P, kv_type="f16", attn=attn)
    assert rt.pool_tokens == P
    toks = tokens(n, 6, hp["n_vocab"])
    rng = np.random.default_rng(11)
    slot_of = np.full((n, n), BIG, dtype=np.int64)  # [query, key] -> pool slot when the query ran
    got = np.empty((n, hp["n_vocab"]), dtype=np.float32)
    for i in range(n):
        got[i] = rt.eval(toks[i:i + 1])
        sp = rt.pager.slot_positions()
        s = np.nonzero(sp >= 0)[0]
        assert sp.max() == i  # the newest position is resident, nothing beyond it
        slot_of[i, sp[s]] = s
        if recall and i >= P and i % 5 == 0:
            rt.pager.reselect(rng.random(i // 64 + 1).astype(np.float32))
            rt.pager.check_invariants()
    st = rt.pager.stats
    assert st["page_outs"] > 0, st
    if recall:
        assert st["page_ins"] >= 5, st  # chunks really came back from the host store
    else:
        assert st["page_ins"] == 0, st
    rt.pager.check_invariants()
    visible = slot_of != BIG
    causal = np.tril(np.ones((n, n), bool))
    assert not (visible & ~causal).any()
    assert visible[:P][causal[:P]].all()  # nothing was evicted before the pool filled up
    assert (causal & ~visible).sum() > 0  # ... and afterwards some positions really were missing
    assert visible[np.arange(n), np.arange(n)].all()

    is_swa = hp["is_swa"]
    R = ring_tokens(hp["n_swa"], 512, max_ctx)
    ring = np.arange(n) % R
    vis3 = np.stack([causal if is_swa[il] else visible for il in range(hp["n_layer"])])
    attn_fn = ggml_onechunk_attn(lambda il: ring if is_swa[il] else slot_of) if uses_onechunk(attn, 1) else None
    ref = ref_model(info, attn_fn).forward(toks, visible=vis3)
    err = rel_err(got, ref)
    # dropping the visibility (everything visible) is clearly wrong
    key = (arch, n, 6)
    if key not in _ALL_VISIBLE:
        _ALL_VISIBLE[key] = ref_model(info).forward(toks)
    wrong = _ALL_VISIBLE[key]
    err_wrong = rel_err(got, wrong)
    print(f"{arch} eviction attn={attn} rel_err={err:.2e} (all-visible reference: {err_wrong:.2e}); "
          f"page_outs={st['page_outs']}")
    assert err <= TOL, f"{arch}: eviction trajectory rel_err {err:.3e} > {TOL}"
    assert err_wrong > 20 * TOL
