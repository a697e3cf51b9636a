"""Self-checks for the tiny GGUF writer (tinygguf.py) and numpy reference (reference.py)."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tinygguf  # noqa: E402
from reference import RefModel, load_gguf, rope  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
F32 = gguf.GGMLQuantizationType.F32
F16 = gguf.GGMLQuantizationType.F16


def _kw(arch, **over):
    kw = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, seed=1)
    if arch == "gemma3":
        kw.update(n_layer=7, gemma_sliding_window=4)
    kw.update(over)
    return kw


def _write(tmp_path, arch, name=None, **over):
    kw = _kw(arch, **over)
    path = tmp_path / (name or f"{arch}-{kw.get('weight_type', 'f32')}-{kw.get('tie_embeddings', True)}.gguf")
    return tinygguf.write_tiny_model(path, arch, **kw)


def _fields(reader):
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _expected_tensors(arch, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, tied):
    """GGUF name -> ggml ne, as created by src/models/<arch>.cpp load_arch_tensors."""
    nq, nkv = n_head * head_dim, n_head_kv * head_dim
    t = {"token_embd.weight": [n_embd, n_vocab], "output_norm.weight": [n_embd]}
    if not tied:
        t["output.weight"] = [n_embd, n_vocab]
    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = [n_embd]
        t[p + "attn_q.weight"] = [n_embd, nq]
        t[p + "attn_k.weight"] = [n_embd, nkv]
        t[p + "attn_v.weight"] = [n_embd, nkv]
        t[p + "attn_output.weight"] = [nq, n_embd]
        t[p + "ffn_norm.weight"] = [n_embd]
        t[p + "ffn_gate.weight"] = [n_embd, n_ff]
        t[p + "ffn_up.weight"] = [n_embd, n_ff]
        t[p + "ffn_down.weight"] = [n_ff, n_embd]
        if arch == "qwen2":
            t[p + "attn_q.bias"] = [nq]
            t[p + "attn_k.bias"] = [nkv]
            t[p + "attn_v.bias"] = [nkv]
        if arch in ("qwen3", "gemma3"):
            t[p + "attn_q_norm.weight"] = [head_dim]
            t[p + "attn_k_norm.weight"] = [head_dim]
        if arch == "gemma3":
            t[p + "post_attention_norm.weight"] = [n_embd]
            t[p + "post_ffw_norm.weight"] = [n_embd]
    return t


# --------------------------------------------------------------------------
# file format
# --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("weight_type", ["f32", "f16"])
@pytest.mark.parametrize("tied", [True, False])
def test_gguf_layout(tmp_path, arch, weight_type, tied):
    kw = _kw(arch, weight_type=weight_type, tie_embeddings=tied)
    res = _write(tmp_path, arch, weight_type=weight_type, tie_embeddings=tied)
    n_vocab = res["hparams"]["n_vocab"]
    assert n_vocab == tinygguf.N_BASE_TOKENS
    reader = gguf.GGUFReader(res["path"])
    f = _fields(reader)

    # metadata
    assert f["general.architecture"] == arch
    a = arch
    assert f[f"{a}.context_length"] == 4096
    assert f[f"{a}.embedding_length"] == kw["n_embd"]
    assert f[f"{a}.block_count"] == kw["n_layer"]
    assert f[f"{a}.feed_forward_length"] == kw["n_ff"]
    assert f[f"{a}.attention.head_count"] == kw["n_head"]
    assert f[f"{a}.attention.head_count_kv"] == kw["n_head_kv"]
    assert f[f"{a}.attention.key_length"] == kw["head_dim"]
    assert f[f"{a}.attention.value_length"] == kw["head_dim"]
    assert f[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6, rel=1e-6)
    assert f[f"{a}.rope.freq_base"] == 10000.0
    if arch == "llama":
        assert f["llama.rope.dimension_count"] == kw["head_dim"]
        assert f["llama.vocab_size"] == n_vocab
    if arch == "gemma3":
        assert f["gemma3.attention.sliding_window"] == 4
        assert f["gemma3.rope.freq_base_swa"] == 10000.0
        assert "gemma3.attention.sliding_window_pattern" not in f  # llama.cpp default period 6
    else:
        assert f"{a}.attention.sliding_window" not in f
    assert f["general.file_type"] == (1 if weight_type == "f16" else 0)

    # tokenizer
    assert f["tokenizer.ggml.model"] == "gpt2"
    assert f["tokenizer.ggml.pre"] == "default"
    toks = f["tokenizer.ggml.tokens"]
    assert len(toks) == n_vocab
    assert len(f["tokenizer.ggml.token_type"]) == n_vocab
    assert len(f["tokenizer.ggml.merges"]) > 0  # llama.cpp refuses gpt2 vocabs without merges
    for m in f["tokenizer.ggml.merges"]:
        l, r = m.split(" ")
        assert l + r in toks
    assert toks[f["tokenizer.ggml.bos_token_id"]] == "<|bos|>"
    assert toks[f["tokenizer.ggml.eos_token_id"]] == "<|eos|>"
    assert toks[ord("A")] == "A" and toks[ord(" ")] == "Ġ" and toks[ord("\n")] == "Ċ"

    # tensors: exact name set, ne shapes, storage types, exact values
    exp = _expected_tensors(arch, kw["n_layer"], kw["n_embd"], kw["n_head"], kw["n_head_kv"],
                            kw["head_dim"], kw["n_ff"], n_vocab, tied)
    got = {t.name: t for t in reader.tensors}
    assert set(got) == set(exp)
    for name, ne in exp.items():
        t = got[name]
        assert [int(x) for x in t.shape] == ne, name
        if len(ne) == 1:
            assert t.tensor_type == F32, name
        else:
            assert t.tensor_type == (F16 if weight_type == "f16" else F32), name
        assert res["weights"][name].shape == tuple(reversed(ne)), name

    weights, hp = load_gguf(res["path"])
    assert set(weights) == set(res["weights"])
    for name in weights:
        np.testing.assert_array_equal(weights[name], res["weights"][name], err_msg=name)
    for k, v in res["hparams"].items():
        assert hp[k] == v, k


def test_gemma3_hparams_and_swa_pattern(tmp_path):
    res = _write(tmp_path, "gemma3", n_layer=13, head_dim=32, gemma_sliding_window=8)
    hp = res["hparams"]
    # every 6th layer (il % 6 == 5) is global
    assert hp["is_swa"] == [il % 6 != 5 for il in range(13)]
    assert hp["n_swa"] == 8
    assert hp["attn_scale"] == pytest.approx(1.0 / math.sqrt(32))  # 1/sqrt(head_dim), not n_embd/n_head
    assert hp["embd_scale"] == pytest.approx(8.0)
    assert hp["rope_type"] == "neox" and hp["ffn_act"] == "gelu_tanh"
    _, hp2 = load_gguf(res["path"])
    assert hp2 == hp
    # explicit per-layer pattern and the no-SWA configuration
    res = _write(tmp_path, "gemma3", n_layer=3, gemma_swa_pattern=[True, False, True])
    assert load_gguf(res["path"])[1]["is_swa"] == [True, False, True]
    res = _write(tmp_path, "gemma3", n_layer=3, gemma_sliding_window=0)
    assert load_gguf(res["path"])[1]["is_swa"] == [False, False, False]
    assert load_gguf(res["path"])[1]["n_swa"] == 0


def test_rope_modes_per_arch(tmp_path):
    for arch, mode in [("llama", "norm"), ("qwen2", "neox"), ("qwen3", "neox"), ("gemma3", "neox")]:
        assert tinygguf.ROPE_TYPE[arch] == mode
        assert _write(tmp_path, arch, n_layer=1)["hparams"]["rope_type"] == mode


def test_qwen2_rejects_mismatched_head_dim(tmp_path):
    with pytest.raises(ValueError):
        tinygguf.write_tiny_model(tmp_path / "x.gguf", "qwen2", head_dim=32)


def test_n_vocab_padding(tmp_path):
    res = tinygguf.write_tiny_model(tmp_path / "p.gguf", "llama", n_vocab=300)
    assert res["hparams"]["n_vocab"] == 300
    f = _fields(gguf.GGUFReader(res["path"]))
    assert len(f["tokenizer.ggml.tokens"]) == 300
    assert f["tokenizer.ggml.tokens"][299] == "<|reserved_33|>"
    with pytest.raises(ValueError):
        tinygguf.write_tiny_model(tmp_path / "q.gguf", "llama", n_vocab=256)


# --------------------------------------------------------------------------
# rope
# --------------------------------------------------------------------------

def test_rope_against_complex_formula():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 8))
    pos = np.array([0, 1, 2, 7, 100])
    base = 10000.0
    inv = base ** (-np.arange(4) * 2.0 / 8)
    ang = pos[:, None, None] * inv[None, None, :]
    # NORM: consecutive pairs as complex numbers
    c = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * ang)
    exp_norm = np.empty_like(x)
    exp_norm[..., 0::2], exp_norm[..., 1::2] = c.real, c.imag
    np.testing.assert_allclose(rope(x, pos, base, "norm"), exp_norm, atol=1e-12)
    # NEOX: halves as complex numbers
    c = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * ang)
    np.testing.assert_allclose(rope(x, pos, base, "neox"), np.concatenate([c.real, c.imag], -1), atol=1e-12)
    # position 0 is the identity, and the modes differ elsewhere
    np.testing.assert_array_equal(rope(x, np.zeros(5, int), base, "norm"), x)
    assert not np.allclose(rope(x, pos, base, "norm"), rope(x, pos, base, "neox"))


# --------------------------------------------------------------------------
# forward pass sanity
# --------------------------------------------------------------------------

TOKENS = [264, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10, 256, 30]


@pytest.fixture(params=ARCHS)
def model(request, tmp_path):
    arch = request.param
    res = _write(tmp_path, arch, tie_embeddings=(arch != "qwen2"))
    return res, RefModel.from_gguf(res["path"])


def test_forward_finite_deterministic_nondegenerate(model):
    res, m = model
    out = m.forward(TOKENS)
    assert out.shape == (len(TOKENS), res["hparams"]["n_vocab"])
    assert out.dtype == np.float64
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, m.forward(TOKENS))
    # same as a model built from the writer's in-memory weights
    np.testing.assert_array_equal(out, RefModel(res["weights"], res["hparams"]).forward(TOKENS))
    # logits are spread out, rows differ from each other, O(1) magnitude
    assert 0.2 < out.std(axis=1).min() and out.std(axis=1).max() < 20
    assert np.abs(np.diff(out, axis=0)).max() > 0.1
    assert len(set(out.argmax(axis=1).tolist())) > 1


def test_causal(model):
    _, m = model
    a = m.forward(TOKENS)
    t2 = list(TOKENS)
    t2[10:] = [5, 6, 7, 8, 9, 10]
    b = m.forward(t2)
    np.testing.assert_allclose(a[:10], b[:10], rtol=0, atol=1e-12)
    assert np.abs(a[10:] - b[10:]).max() > 1e-3
    # prefix-only pass gives the same logits
    np.testing.assert_allclose(m.forward(TOKENS[:7]), a[:7], rtol=0, atol=1e-12)


def test_relative_position_invariance(model):
    """RoPE is the only positional signal: a uniform position shift changes nothing."""
    _, m = model
    a = m.forward(TOKENS)
    b = m.forward(TOKENS, positions=np.arange(len(TOKENS)) + 37)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-9)
    # but non-uniform positions do matter
    pos = np.arange(len(TOKENS))
    pos[5:] += 3
    assert np.abs(m.forward(TOKENS, positions=pos) - a).max() > 1e-4


def test_visible_mask_drops_key(model):
    _, m = model
    n = len(TOKENS)
    a = m.forward(TOKENS)
    j = 4
    vis = np.ones((n, n), dtype=bool)
    vis[:, j] = False
    vis[j, j] = True  # query j must still see something
    b = m.forward(TOKENS, visible=vis)
    np.testing.assert_allclose(a[: j + 1], b[: j + 1], rtol=0, atol=1e-12)
    assert np.abs(a[j + 1:] - b[j + 1:]).max() > 1e-3
    # callable and per-layer forms agree with the matrix form
    c = m.forward(TOKENS, visible=lambda qi, kj: bool(vis[qi, kj]))
    np.testing.assert_array_equal(b, c)
    d = m.forward(TOKENS, visible=np.broadcast_to(vis, (m.hp["n_layer"], n, n)))
    np.testing.assert_array_equal(b, d)
    e = m.forward(TOKENS, visible=lambda il, qi, kj: bool(vis[qi, kj]))
    np.testing.assert_array_equal(b, e)


def test_evicted_key_equals_removed_token(model):
    """Hiding key j from every other query == running without token j (positions kept)."""
    _, m = model
    n = len(TOKENS)
    j = 6
    vis = np.ones((n, n), dtype=bool)
    vis[:, j] = False
    vis[j, j] = True
    a = m.forward(TOKENS, visible=vis)
    keep = [i for i in range(n) if i != j]
    b = m.forward([TOKENS[i] for i in keep], positions=np.array(keep))
    np.testing.assert_allclose(a[keep], b, rtol=0, atol=1e-10)


def test_fully_masked_query_raises(model):
    _, m = model
    n = 4
    vis = np.ones((n, n), dtype=bool)
    vis[2, :] = False
    with pytest.raises(ValueError):
        m.forward(TOKENS[:n], visible=vis)


def test_kv_f16_roundtrip(model):
    _, m = model
    a = m.forward(TOKENS)
    b, det = m.forward(TOKENS, kv_f16_roundtrip=True, return_details=True)
    diff = np.abs(a - b).max()
    assert 0 < diff < 1e-2
    for k, v in zip(det["k"], det["v"]):
        np.testing.assert_array_equal(k, k.astype(np.float16).astype(np.float64))
        np.testing.assert_array_equal(v, v.astype(np.float16).astype(np.float64))
    m2 = RefModel(m.w, m.hp, kv_f16_roundtrip=True)
    np.testing.assert_array_equal(m2.forward(TOKENS), b)


@pytest.mark.parametrize("arch", ARCHS)
def test_gqa_head_mapping(tmp_path, arch):
    """Query head h reads KV head h // (n_head/n_head_kv) (ggml mul_mat broadcast)."""
    res = _write(tmp_path, arch, n_layer=1)
    w = dict(res["weights"])
    hd = res["hparams"]["head_dim"]
    w["blk.0.attn_v.weight"] = w["blk.0.attn_v.weight"].copy()
    w["blk.0.attn_v.weight"][hd:] = 0.0  # kv head 1 -> zero values
    if "blk.0.attn_v.bias" in w:
        w["blk.0.attn_v.bias"] = w["blk.0.attn_v.bias"].copy()
        w["blk.0.attn_v.bias"][hd:] = 0.0
    _, det = RefModel(w, res["hparams"]).forward(TOKENS[:5], return_details=True)
    attn = det["attn"][0]  # [n, n_head=4, hd]
    assert np.abs(attn[:, :2]).min(axis=-1).max() > 0  # heads 0,1 <- kv head 0
    assert np.abs(attn[:, :2]).max() > 1e-3
    np.testing.assert_array_equal(attn[:, 2:], 0.0)  # heads 2,3 <- kv head 1


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_qk_norm_is_per_head(tmp_path, arch):
    """q/k RMSNorm runs over head_dim per head (RoPE preserves the per-head norm)."""
    res = _write(tmp_path, arch, n_layer=1)
    w = dict(res["weights"])
    w["blk.0.attn_q_norm.weight"] = np.ones_like(w["blk.0.attn_q_norm.weight"])
    w["blk.0.attn_k_norm.weight"] = np.ones_like(w["blk.0.attn_k_norm.weight"])
    hp = res["hparams"]
    _, det = RefModel(w, hp).forward(TOKENS[:5], return_details=True)
    q, k = det["q"][0], det["k"][0]
    if arch == "gemma3":
        q = q / hp["attn_scale"]
    hd = hp["head_dim"]
    np.testing.assert_allclose(np.sum(q * q, axis=-1), hd, rtol=1e-4)
    np.testing.assert_allclose(np.sum(k * k, axis=-1), hd, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_head_dim_not_n_embd_over_n_head(tmp_path, arch):
    res = _write(tmp_path, arch, head_dim=32)
    reader = gguf.GGUFReader(res["path"])
    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    assert shapes["blk.0.attn_q.weight"] == [64, 128]
    assert shapes["blk.0.attn_k.weight"] == [64, 64]
    assert shapes["blk.0.attn_output.weight"] == [128, 64]
    out = RefModel.from_gguf(res["path"]).forward(TOKENS[:6])
    assert np.isfinite(out).all()


def test_f16_weights_model(tmp_path):
    res32 = _write(tmp_path, "qwen3", weight_type="f32")
    res16 = _write(tmp_path, "qwen3", weight_type="f16")
    w = res16["weights"]["blk.0.attn_q.weight"]
    np.testing.assert_array_equal(w, w.astype(np.float16).astype(np.float64))
    a = RefModel.from_gguf(res32["path"]).forward(TOKENS)
    b = RefModel.from_gguf(res16["path"]).forward(TOKENS)
    assert 0 < np.abs(a - b).max() < 0.05  # same seed, only rounding differs


# --------------------------------------------------------------------------
# gemma3 sliding window
# --------------------------------------------------------------------------

def test_gemma3_swa_mask_rule(tmp_path):
    res = _write(tmp_path, "gemma3", n_layer=6, gemma_sliding_window=4)
    m = RefModel(res["weights"], res["hparams"])
    pos = np.arange(10)
    swa = m.layer_mask(pos, 0)
    glob = m.layer_mask(pos, 5)
    d = pos[:, None] - pos[None, :]
    np.testing.assert_array_equal(swa, (d >= 0) & (d < 4))  # pos_q - pos_k < n_swa
    np.testing.assert_array_equal(glob, d >= 0)


def test_gemma3_swa_receptive_field(tmp_path):
    """With L sliding layers of window w, token 0 reaches exactly positions <= L*(w-1)."""
    L, wnd = 5, 4
    res = _write(tmp_path, "gemma3", n_layer=L, gemma_sliding_window=wnd)
    assert res["hparams"]["is_swa"] == [True] * L
    m = RefModel(res["weights"], res["hparams"])
    toks = [264] + [40 + i for i in range(21)]
    a = m.forward(toks)
    b = m.forward([265] + toks[1:])
    diff = np.abs(a - b).max(axis=1)
    reach = L * (wnd - 1)
    assert (diff[: reach + 1] > 1e-9).all()
    np.testing.assert_array_equal(diff[reach + 1:], 0.0)
    # with one global layer (index 5 of 6) the change reaches everything
    res = _write(tmp_path, "gemma3", n_layer=6, gemma_sliding_window=wnd)
    m = RefModel(res["weights"], res["hparams"])
    diff = np.abs(m.forward(toks) - m.forward([265] + toks[1:])).max(axis=1)
    assert (diff > 1e-9).all()


def test_gemma3_swa_uses_local_rope_base(tmp_path):
    res_a = _write(tmp_path, "gemma3", n_layer=6, rope_base=1e6, gemma_rope_base_swa=10000.0)
    res_b = _write(tmp_path, "gemma3", "b.gguf", n_layer=6, rope_base=1e6, gemma_rope_base_swa=500.0)
    assert res_a["hparams"]["rope_base_swa"] == 10000.0 and res_b["hparams"]["rope_base_swa"] == 500.0
    a = RefModel.from_gguf(res_a["path"]).forward(TOKENS)
    b = RefModel.from_gguf(res_b["path"]).forward(TOKENS)
    assert np.abs(a - b).max() > 1e-4  # local base affects SWA layers
    # omitted key -> llama.cpp default 10000
    res_c = _write(tmp_path, "gemma3", "c.gguf", n_layer=6, rope_base=1e6, gemma_rope_base_swa=None)
    assert "gemma3.rope.freq_base_swa" not in _fields(gguf.GGUFReader(res_c["path"]))
    np.testing.assert_array_equal(RefModel.from_gguf(res_c["path"]).forward(TOKENS), a)


def test_gemma3_embedding_scale_and_softcap(tmp_path):
    res = _write(tmp_path, "gemma3", n_layer=6, final_logit_softcapping=3.0)
    m = RefModel.from_gguf(res["path"])
    assert m.hp["final_logit_softcapping"] == 3.0
    out = m.forward(TOKENS)
    assert np.abs(out).max() < 3.0
    hp = dict(m.hp, final_logit_softcapping=0.0)
    raw = RefModel(m.w, hp).forward(TOKENS)
    np.testing.assert_allclose(out, 3.0 * np.tanh(raw / 3.0), atol=1e-12)
    # the sqrt(n_embd) input scale matters
    hp2 = dict(hp, embd_scale=1.0)
    assert np.abs(RefModel(m.w, hp2).forward(TOKENS) - raw).max() > 1e-3
