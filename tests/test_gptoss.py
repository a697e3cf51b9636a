"""gpt-oss (issue 41) on tiny random-weight GGUFs (tinygguf.write_tiny_gptoss): 4 layers, the even ones
sliding over a 32-token window (llama.cpp's pattern 2), attention sinks ~ N(1, 1) per head, q/k/v and
output biases, 8 experts (2 used) with a router bias and per-expert biases, swiglu_oai reaching its clamps,
YaRN (factor 8 over an original context of 256).

1. Logits for every token against llama.cpp's own forward pass (libllama from the pinned sdist,
   tests/llama_ref.py; marker `peer`), f16 K/V on both sides, 300 tokens (past the window and past YaRN's
   original context), through both attention paths (kvflash's CPU pool kernel, attn="pool", and
   ggml_flash_attn_ext, attn="ggml").  Against llama.cpp without flash attention, test_hybrid.py's tolerance:
   normalised error ||kvflash - llama.cpp|| / ||llama.cpp|| <= 2e-3 over the whole [tokens, vocab] array and
   the argmax of >= 97% of rows the same (measured 1.6e-3: llama.cpp rounds Q and the softmax weights to f16
   there, and this model's routing, 2 of 8 experts, turns that into a few near-tie flips with other seeds);
   against llama.cpp with flash attention, the peer of the same kernels: batched 3e-5 (both paths), the ggml
   path one token at a time bit for bit.  That the comparisons have something to catch: the same weights
   without sinks, without the window and without YaRN give other logits (test 2).
2. The kernel's sinks against numpy (split-K merge, row tables, a query that sees nothing), the two
   attention paths against each other, and the scorers' softmax (history_attention) with the sinks in
   its denominator.
3. Paging (only the global layers are paged; the sliding ones keep the ring): a batch is its one-token
   steps bit for bit; exact evals over a pool far smaller than the prompt are the full cache bit for bit;
   exact mode's greedy tokens and logits are the full cache's (lru and qk); a pooled session decodes past
   its pool; truncates within the ring's reach re-read to the same logits, beyond it are refused.  Layers on
   an RPC server are refused at the first eval (ggml_add_id is not on the remote op list), clearly.
4. A snapshot round trip mid-decode continues bit for bit (full cache and pool 256).
5. Bad files are clear errors; the tokenizer (gpt2 BPE, pre-tokenizer gpt-4o, harmony's end-of-turn
   tokens) and the harmony chat template (the sdist's openai-gpt-oss-120b.jinja) work.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("gguf")
core = pytest.importorskip("kvflash._core")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import familyutil  # noqa: E402
import llama_ref  # noqa: E402
from tinygguf import write_tiny_gptoss, write_tiny_model  # noqa: E402

NE_TOL = 2e-3
ARGMAX_MIN = 0.97
V = 266            # random prompts from the byte-level tokens, not the harmony specials


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptoss")
    return {
        "main": write_tiny_gptoss(d / "g.gguf", seed=3),
        # the same weights (the same draws) with one feature off
        "nosink": write_tiny_gptoss(d / "nosink.gguf", seed=3, sink_mean=-80.0, sink_std=0.0),
        "wide": write_tiny_gptoss(d / "wide.gguf", seed=3, n_swa=4096),
        "noyarn": write_tiny_gptoss(d / "noyarn.gguf", seed=3, yarn_factor=None),
        "bigsink": write_tiny_gptoss(d / "bigsink.gguf", seed=3, sink_mean=5.0, sink_std=0.5),
    }


def _ids(n, seed):
    return familyutil.ids(n, seed, V)


_runtime = familyutil.runtime
_session = familyutil.session
_eval = familyutil.eval_logits


# --------------------------------------------------------------------------- 1. llama.cpp
@pytest.mark.peer
@pytest.mark.parametrize("attn,batched", [("pool", True), ("pool", False), ("ggml", True)],
                         ids=["pool-batched", "pool-one-token", "ggml-batched"])
def test_logits_match_llama_cpp(models, attn, batched):
    """Against llama.cpp without flash attention (test_hybrid.py's comparison).  Not the ggml path one token at
    a time: ggml's one-query flash-attention kernel accumulates in f16, which alone moves this model's logits
    by ~1.4e-2 from llama.cpp's non-flash attention (qwen3moe's by 6e-3, a dense qwen3's by 2e-3);
    test_ggml_path_matches_llama_cpp_flash_attention compares that path with its own peer."""
    familyutil.logits_match_llama_cpp(models["main"]["path"], V, attn, batched, "gpt-oss", NE_TOL, ARGMAX_MIN)


@pytest.mark.peer
@pytest.mark.parametrize("attn", ["pool", "ggml"])
def test_batched_logits_match_llama_cpp_flash_attention(models, attn):
    """llama.cpp with flash attention on, batched, takes ggml's tiled all-f32 kernel: no f16 rounding of Q or
    of the softmax weights on its side, so what is left is summation order (measured 3e-5 here, against
    1.6e-3 without flash attention).  The tight check of the sinks, YaRN, the biases and the routing."""
    familyutil.batched_logits_match_llama_cpp_flash_attention(models["main"]["path"], V, attn, "gpt-oss", 2e-4)


@pytest.mark.peer
def test_ggml_path_matches_llama_cpp_flash_attention(models):
    """kvflash's ggml_flash_attn_ext path one token at a time against llama.cpp's flash attention one token at
    a time: one thread on both sides (two split the one-query kernel's work by the attended extent, which
    differs: kvflash's ring and pool against llama.cpp's cells), the same kernels in the same order: equal
    to float rounding (bit for bit here)."""
    familyutil.ggml_path_one_token_matches_llama_cpp(models["main"]["path"], V, "gpt-oss", 1e-5)


@pytest.mark.peer
def test_mxfp4_experts_match_llama_cpp(tmp_path):
    """The released files store the experts as MXFP4: loaded as they are (mapped, or repacked where ggml's CPU
    kernels take them), the ggml path one token at a time is llama.cpp's flash attention one token at a time,
    one thread each, to float rounding (bit for bit here).  (Batched comparisons are not tight for MXFP4: its
    products quantize the activations to q8_0 per 32 values, so a difference in the last bit of one activation
    can move a whole block's rounding, and from there the routing.)"""
    path = write_tiny_gptoss(tmp_path / "mx.gguf", seed=3, expert_type="mxfp4")["path"]
    toks = _ids(80, seed=1)
    ref = llama_ref.logits(path, toks, batched=False, flash_attn=True, threads=1)
    for repack in (True, False):
        m = core.Model(str(path), n_threads=1, repack=repack)
        got = _eval(core.Runtime(m, max_ctx=2048, kv_type="f16", ubatch=512, attn="ggml"), toks, False)
        ne = llama_ref.normalized_error(got, ref)
        print(f"gpt-oss mxfp4 experts (repack={repack}), attn=ggml one-token vs llama.cpp flash attention: {ne:.3g}")
        assert ne <= 1e-5, (repack, ne)


# --------------------------------------------------------------------------- 2. what the test model exercises
def test_the_model_reads_its_keys(models):
    hp = core.Model(models["main"]["path"], n_threads=1).hparams
    assert hp["arch"] == "gpt-oss" and hp["is_swa"] == [True, False, True, False] and hp["n_swa"] == 32
    assert hp["rope_ext_factor"] == 1.0 and hp["rope_scale"] == np.float32(1 / 8) and hp["rope_n_ctx_orig"] == 256
    # llama.cpp's magnitude: (0.1 ln 8 + 1) / (1 + 0.1 ln 8) (ggml's rope multiplies its own factor back)
    assert abs(hp["rope_attn_factor"] - 1.0) < 1e-6
    assert abs(hp["attn_scale"] - 32 ** -0.5) < 1e-7
    plain = core.Model(models["noyarn"]["path"], n_threads=1).hparams
    assert plain["rope_ext_factor"] == 0.0 and plain["rope_scale"] == 1.0 and plain["rope_attn_factor"] == 1.0


def test_sinks_window_and_yarn_matter(models):
    """Each feature moves the logits: the peer test's agreement covers it."""
    toks = _ids(300, seed=1)
    out = {k: _runtime(models[k]["path"]).eval(toks, all_logits=True) for k in ("main", "nosink", "wide", "noyarn")}
    ne = lambda a, b: llama_ref.normalized_error(out[a], out[b])  # noqa: E731
    assert ne("nosink", "main") > 0.05
    assert ne("noyarn", "main") > 0.02
    # the window: the same before a token sees past it, other after
    early = llama_ref.normalized_error(out["wide"][:32], out["main"][:32])
    late = llama_ref.normalized_error(out["wide"][64:], out["main"][64:])
    assert early < 1e-5 and late > 0.02, (early, late)


def _rows(rng, kind, n_kv, width):
    x = rng.standard_normal((n_kv, width))
    if kind == "f16":
        x = x.astype(np.float16)
        return x.view(np.uint8).reshape(n_kv, -1), x.astype(np.float64)
    import gguf
    q = gguf.quants.quantize(x.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    return q.reshape(n_kv, -1), gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).astype(np.float64)


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("n_split,table_rows", [(1, 0), (4, 0), (4, 16)])
def test_pool_kernel_sinks_against_numpy(kind, tiled, n_split, table_rows):
    rng = np.random.default_rng(5)
    n, H, Hkv, D, n_kv, scale = 5, 4, 2, 32, 96, 32 ** -0.5
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    kb, K = _rows(rng, kind, n_kv, Hkv * D)
    vb, Vv = _rows(rng, kind, n_kv, Hkv * D)
    visible = (rng.random((n, n_kv)) < 0.6).astype(np.uint8)
    visible[2] = 0                                      # a query that sees no slot: zeros, as ggml gives
    sinks = np.array([1.5, -2.0, 0.3, 6.0], np.float32)   # the last one outweighs every key
    got = core.pool_attention(q, kb, vb, visible, kind, Hkv, scale, n_split=n_split, n_threads=2, tiled=tiled,
                              table_rows=table_rows, sinks=sinks)
    want = np.zeros((n, H, D))
    G = H // Hkv
    for i in range(n):
        vis = np.nonzero(visible[i])[0]
        for h in range(H):
            g = h // G
            s = (K[vis, g * D:(g + 1) * D] @ q[i, h].astype(np.float64)) * scale
            m = max(s.max() if len(s) else -np.inf, float(sinks[h]))
            p = np.exp(s - m)
            want[i, h] = p @ Vv[vis, g * D:(g + 1) * D] / (p.sum() + np.exp(float(sinks[h]) - m))
    assert np.all(got[2] == 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    plain = core.pool_attention(q, kb, vb, visible, kind, Hkv, scale, n_split=n_split, n_threads=2, tiled=tiled,
                                table_rows=table_rows)
    assert np.abs(plain - got).max() > 0.05         # the sinks took their share


def test_the_attention_paths_agree(models):
    """ggml_flash_attn_ext (sinks through ggml_flash_attn_ext_add_sinks) against the pool kernel, batched: ggml's
    CPU flash attention takes its tiled f32 kernel for a batch, so they differ by summation order (9e-6)."""
    familyutil.attention_paths_agree(models["main"]["path"], V, 1e-4)


def test_the_scorers_count_the_sinks(models):
    """history_attention's softmax per head has the sink in its denominator, as the layer's: the mass all the
    history's keys receive (one group; the max over heads and layers) is below 1 with sinks (here ~N(5, 0.5),
    so that a head's sink keeps a share against 600 keys), 1 without."""
    mass = {}
    for k in ("bigsink", "nosink"):
        rt = _runtime(models[k]["path"], pool_tokens=256, chunk_tokens=16, ubatch=128, capture_queries=8)
        rt.eval(_ids(600, seed=3))
        assert rt.pager.stats["host_chunks"] > 0       # part of the history is read from the host store
        mass[k] = float(rt.history_attention(n_threads=2, groups=np.zeros(rt.n_past, np.int32))[0])
        res = rt.attention_scores()                    # the resident slots alone (the same softmax)
        assert np.isfinite(res).all() and res.max() <= 1.0
    assert abs(mass["nosink"] - 1.0) < 1e-5
    assert mass["bigsink"] < 0.99, mass


# --------------------------------------------------------------------------- 3. paging
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_a_batch_is_its_steps(models, kv_type):
    familyutil.a_batch_is_its_steps(models["main"]["path"], V, kv_type)


def test_exact_eval_is_the_full_cache(models):
    familyutil.exact_eval_is_the_full_cache(models["main"]["path"], V, n_paged=2)


@pytest.mark.parametrize("policy", ["lru", "qk"])
def test_exact_greedy_is_the_full_cache(models, policy):
    familyutil.exact_greedy_is_the_full_cache(models["main"]["path"], V, policy)


def test_pool_smaller_than_the_prompt_runs(models):
    familyutil.pool_smaller_than_the_prompt_runs(models["main"]["path"], V, n_paged=2)


def test_truncate_within_the_ring_and_beyond(models):
    familyutil.truncate_within_the_ring_and_beyond(models["main"]["path"], V)


def test_rpc_splits_are_refused_clearly(models):
    """Layers on an RPC server: the experts' biases (ggml_add_id) are not on kvflash's list of ops for remote
    devices, so the first eval is refused, naming the op, and the runtime is left as it was."""
    familyutil.rpc_split_is_refused(models["main"]["path"], V, "ADD_ID")


# --------------------------------------------------------------------------- 4. snapshots
@pytest.mark.parametrize("pool", [None, 256], ids=["full", "pool256"])
def test_snapshot_round_trip_mid_decode(models, tmp_path, pool):
    familyutil.snapshot_round_trip_mid_decode(models["main"]["path"], V, pool, tmp_path / "g.kvf")


# --------------------------------------------------------------------------- 5. files, tokenizer, chat
@pytest.mark.parametrize("kw,match", [
    (dict(drop=("blk.1.attn_sinks.weight",)), "missing tensor 'blk.1.attn_sinks.weight'"),
    (dict(drop=("blk.0.attn_output.bias",)), "missing tensor 'blk.0.attn_output.bias'"),
    (dict(drop=("blk.2.ffn_down_exps.bias",)), "missing tensor 'blk.2.ffn_down_exps.bias'"),
    (dict(drop=("blk.0.ffn_gate_inp.bias",)), "missing tensor 'blk.0.ffn_gate_inp.bias'"),
    (dict(retype={"blk.0.ffn_up_exps.bias": np.float16}), "biases must be F32"),
    (dict(retype={"blk.0.attn_sinks.weight": np.float16}), "must be F32"),
    (dict(extra={"gpt-oss.attention.sliding_window": None}), "sliding_window' is missing"),
    (dict(n_swa=0), "sliding_window = 0"),
    (dict(swa_pattern=[True] * 4), "no global layer"),
    (dict(extra={"gpt-oss.expert_feed_forward_length": None}), "expert_feed_forward_length' is missing"),
    (dict(extra={"gpt-oss.expert_count": None, "gpt-oss.expert_used_count": None}), "needs expert_count"),
    (dict(extra={"gpt-oss.expert_used_count": 9}), "expert_used_count"),
    (dict(yarn_factor=-2.0), "rope.scaling.factor"),
    (dict(extra={"gpt-oss.rope.scaling.original_context_length": 0}), "original_context_length"),
    (dict(extra={"gpt-oss.rope.scaling.type": "longrope"}), "longrope"),
    (dict(extra={"gpt-oss.rope.dimension_count": 16}), "partial RoPE"),
    (dict(extra={"gpt-oss.attention.head_count": 8}), "'blk.0.attn_q.weight' has shape"),
    (dict(extra={"gpt-oss.attention.sliding_window_pattern": [True, False]}), "2 values for 4 layers"),
])
def test_bad_files(tmp_path, kw, match):
    bad = write_tiny_gptoss(tmp_path / "bad.gguf", seed=1, **kw)
    with pytest.raises(ValueError, match=match):
        core.Model(bad["path"], n_threads=1)


def test_yarn_is_refused_where_the_family_does_not_take_it(tmp_path):
    p = tmp_path / "l.gguf"
    write_tiny_model(p, "llama", extra={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match="'yarn' is not supported for llama"):
        core.Model(str(p), n_threads=1)


def test_a_pattern_array_and_a_period(tmp_path):
    per = write_tiny_gptoss(tmp_path / "a.gguf", seed=1, swa_pattern=[False, True, True, False])
    assert core.Model(per["path"], n_threads=1).hparams["is_swa"] == [False, True, True, False]
    three = write_tiny_gptoss(tmp_path / "b.gguf", seed=1, swa_pattern=3)
    assert core.Model(three["path"], n_threads=1).hparams["is_swa"] == [True, True, False, True]


def _harmony_template():
    from kvflash import _registry
    return (_registry.vocab_dir() / "templates" / "openai-gpt-oss-120b.jinja").read_text()


def test_tokenizer_and_harmony_chat(tmp_path):
    """The gpt2 vocabulary with the gpt-4o pre-tokenizer loads; llama.cpp's end-of-generation set for
    harmony (<|return|> and <|call|>, not <|end|>, which closes every message); the real gpt-oss template
    renders in kvflash's sandbox and a chat session generates from it."""
    info = write_tiny_gptoss(tmp_path / "c.gguf", seed=2, chat_template=_harmony_template())
    s = _session(info["path"])
    tok = s.tokenizer
    ids = {t: info["vocab"]["tokens"].index(t) for t in ("<|return|>", "<|call|>", "<|end|>", "<|start|>")}
    assert {ids["<|return|>"], ids["<|call|>"]} <= set(tok.eot_ids) and ids["<|end|>"] not in tok.eot_ids
    text = "Hello there, the answer's 12345!"
    assert tok.decode(tok.encode(text, add_special=False)) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the hat"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert prompt.startswith("<|start|>system<|message|>") and prompt.endswith("<|start|>assistant")
    assert "<|start|>user<|message|>the hat<|end|>" in prompt
    enc = tok.encode_chat(msgs)
    assert ids["<|start|>"] in enc and ids["<|end|>"] in enc     # the specials are tokens, not text
    out = "".join(s.chat(msgs, max_tokens=8, ignore_eos=True))
    assert isinstance(out, str) and len(s.tokens) == len(enc) + 8
