"""The CPU pool attention op against numpy, on K/V rows given as bytes of their type.

For q8_0 / q4_0 K the integer kernel (quant_dots=True, not the runtime's default: the tiled AVX-512
VNNI kernel where the build has it) quantizes the query per 32-element block (scale max|x| / 127, round to
nearest even, as ggml quantizes activations for its q8_0 matmuls) and takes integer dot products: against a float64 emulation of exactly that it must agree to float rounding, and against the
unquantized f32 attention no further than the query's rounding itself moves it.  The f32 path (quant_dots=False) must
agree with the f32 reference to float rounding, in the tiled kernel (q8_0 / q4_0 on AVX-512 VNNI builds)
and in the row-at-a-time one (tiled=False).  Masked slots contribute nothing in either."""
from __future__ import annotations

import numpy as np
import pytest

_core = pytest.importorskip("kvflash._core")


def _rows(rng, kind: str, n_kv: int, width: int):
    """Random rows of a KV type as bytes, and their values as float64 (what the bytes mean)."""
    nb = width // 32
    if kind == "f16":
        x = rng.standard_normal((n_kv, width)).astype(np.float16)
        return x.view(np.uint8).reshape(n_kv, -1), x.astype(np.float64)
    d = rng.uniform(0.005, 0.05, (n_kv, nb)).astype(np.float16)
    if kind == "q8_0":
        qs = rng.integers(-127, 128, (n_kv, nb, 32), dtype=np.int8)
        blocks = np.concatenate([d.view(np.uint8).reshape(n_kv, nb, 2), qs.view(np.uint8)], axis=2)
        vals = d.astype(np.float64)[..., None] * qs.astype(np.float64)
    else:   # q4_0: {f16 d; 16 bytes}, element j = low nibble of byte j - 8, element j + 16 = high nibble - 8
        nib = rng.integers(0, 16, (n_kv, nb, 32), dtype=np.uint8)
        packed = (nib[..., :16] | (nib[..., 16:] << 4)).astype(np.uint8)
        blocks = np.concatenate([d.view(np.uint8).reshape(n_kv, nb, 2), packed], axis=2)
        vals = d.astype(np.float64)[..., None] * (nib.astype(np.float64) - 8)
    return blocks.reshape(n_kv, -1).copy(), vals.reshape(n_kv, width)


def _quantize_query(x: np.ndarray) -> np.ndarray:
    """x (..., D) as the kernel quantizes it, returned dequantized (float64)."""
    b = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    d = (np.abs(b).max(-1, keepdims=True) / 127.0).astype(np.float32).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        idn = np.where(d > 0, (1.0 / d.astype(np.float32)).astype(np.float64), 0.0)
    q = np.rint((b * idn).astype(np.float32))
    return (q * d).reshape(x.shape)


def _reference(q, K, V, visible, Hkv, scale):
    n, H, D = q.shape
    G = H // Hkv
    out = np.zeros((n, H, D))
    for i in range(n):
        vis = np.nonzero(visible[i])[0]
        for h in range(H):
            g = h // G
            k = K[vis, g * D:(g + 1) * D]
            v = V[vis, g * D:(g + 1) * D]
            s = (k @ q[i, h].astype(np.float64)) * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v
    return out


CASES = [("q8_0", 1, 9, 3, 64, 700), ("q8_0", 5, 4, 1, 128, 300), ("q4_0", 1, 9, 3, 64, 700),
         ("q4_0", 3, 8, 2, 32, 257), ("f16", 2, 9, 3, 64, 400)]


@pytest.mark.parametrize("kind,n,H,Hkv,D,n_kv", CASES)
@pytest.mark.parametrize("n_split", [1, 3])
def test_pool_attention_matches_numpy(kind, n, H, Hkv, D, n_kv, n_split):
    rng = np.random.default_rng(hash((kind, n, D, n_split)) % 2**32)
    q = rng.standard_normal((n, H, D)).astype(np.float32) * 2
    kb, K = _rows(rng, kind, n_kv, D * Hkv)
    vb, V = _rows(rng, kind, n_kv, D * Hkv)
    visible = (rng.random((n, n_kv)) < 0.7).astype(np.uint8)
    visible[:, 0] = 1
    scale = 1.0 / np.sqrt(D)
    ref = _reference(q, K, V, visible, Hkv, scale)
    f32 = _core.pool_attention(q, kb, vb, visible, kind, Hkv, scale, n_split=n_split, quant_dots=False)
    tol = 2e-5 * np.abs(ref).max()
    assert np.abs(f32 - ref).max() <= tol, np.abs(f32 - ref).max()
    # the row-at-a-time f32 kernel too (the runtime's where the tiled one does not apply)
    rows = _core.pool_attention(q, kb, vb, visible, kind, Hkv, scale, n_split=n_split, n_threads=2, tiled=False)
    assert np.abs(rows - ref).max() <= tol, np.abs(rows - ref).max()
    got = _core.pool_attention(q, kb, vb, visible, kind, Hkv, scale, n_split=n_split, n_threads=2, quant_dots=True)
    if kind == "f16":   # the integer path is for quantized K only
        np.testing.assert_array_equal(got, f32)
        return
    emu = _reference(_quantize_query(q), K, V, visible, Hkv, scale)
    assert np.abs(got - emu).max() <= tol, np.abs(got - emu).max()
    # against the unquantized query: no further than the query's rounding itself moves the exact result
    # (the emulation's distance), and the integer path is really taken (it differs from the f32 one)
    assert np.abs(got - ref).max() <= np.abs(emu - ref).max() + tol
    assert np.abs(got - f32).max() > 0


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_masked_slots_contribute_nothing_and_a_nan_stays_in_its_head(kind):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    kb, _ = _rows(rng, kind, 128, 128)
    vb, _ = _rows(rng, kind, 128, 128)
    visible = np.ones((2, 128), dtype=np.uint8)
    visible[:, 40:90] = 0
    a = _core.pool_attention(q, kb, vb, visible, kind, 2, 0.125, quant_dots=True)
    kb2, vb2 = kb.copy(), vb.copy()
    kb2[40:90] = rng.integers(0, 256, kb2[40:90].shape, dtype=np.uint8)   # hidden rows changed: no effect
    vb2[40:90] = rng.integers(0, 256, vb2[40:90].shape, dtype=np.uint8)
    b = _core.pool_attention(q, kb2, vb2, visible, kind, 2, 0.125, quant_dots=True)
    np.testing.assert_array_equal(a, b)
    # a NaN in one query head: that head's output is what the f32 path gives, the others stay finite
    q[1, 0, 5] = np.nan
    c = _core.pool_attention(q, kb, vb, visible, kind, 2, 0.125, quant_dots=True)
    f = _core.pool_attention(q, kb, vb, visible, kind, 2, 0.125)
    np.testing.assert_array_equal(np.isfinite(c[1, 0]), np.isfinite(f[1, 0]))
    assert np.isfinite(c[0]).all() and np.isfinite(c[1, 1:]).all()


def test_bad_shapes_are_value_errors():
    q = np.zeros((1, 4, 64), np.float32)
    kb = np.zeros((10, 136), np.uint8)
    with pytest.raises(ValueError, match="rows of q8_0"):
        _core.pool_attention(q, kb[:, :100], kb, np.ones((1, 10), np.uint8), "q8_0", 2, 0.1)
    k3 = np.zeros((10, 204), np.uint8)   # 3 KV heads of 64: 6 q8_0 blocks of 34 bytes
    with pytest.raises(ValueError, match="multiple"):
        _core.pool_attention(q, k3, k3, np.ones((1, 10), np.uint8), "q8_0", 3, 0.1)
    with pytest.raises(ValueError, match="visible"):
        _core.pool_attention(q, kb, kb, np.ones((2, 10), np.uint8), "q8_0", 2, 0.1)
