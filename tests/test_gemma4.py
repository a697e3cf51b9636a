"""gemma4 (issue 41) on tiny random-weight GGUFs (tinygguf.write_tiny_gemma4).

The dense model ("main"): 7 layers [S, S, G, S, G, S, G] (S sliding over a 32-token window, G global); the last
two share KV (layer 5, sliding, reads layer 3's cache; layer 6, global, reads layer 4's: llama.cpp's mapping);
global layers with 64-wide heads, 1 K/V head, no attn_v (K = V) and RoPE over the whole head with rope_freqs
(the converter's "proportional" RoPE: a quarter of the pairs rotate), sliding layers with 32-wide heads, 2 K/V
heads (head_count_kv per layer), attn_v, their own base and RoPE dims; q/k norms and the weightless V norm;
per-layer embeddings (16 per layer); layer_output_scale; FFN widths per layer (the shared layers double, as
use_double_wide_mlp); the final softcap.  The MoE model ("moe"): the same pattern and sharing, no per-layer
embeddings, K = V on every layer, 8 experts (2 used) beside the dense MLP on every layer, the router's norm and
scale, the per-expert output scale; "fused" the same with one ffn_gate_up_exps.

1. Logits for every token against llama.cpp's own forward pass (libllama from the pinned sdist,
   tests/llama_ref.py; marker `peer`), f16 K/V on both sides, 300 tokens (past the window): kvflash's
   ggml_flash_attn_ext path one token at a time is llama.cpp's flash attention one token at a time bit for bit
   (one thread); batched, both attention paths against llama.cpp with flash attention within 1e-3 and every
   argmax the same; against llama.cpp without flash attention (test_gptoss.py's tolerance: normalised error
   <= 2e-3, >= 97% of argmaxes the same), batched and one token.  Why the batched comparisons are not tighter
   than 1e-3: ggml's GELU reads an f16 table, so the last-bit differences of two summation orders move a GeGLU
   input across an f16 rounding edge now and then; llama.cpp's own batched and one-token runs with flash
   attention differ by 1.4e-3 (main) and 9.4e-4 (moe).
2. What the test model exercises: the keys read as llama.cpp reads them; each feature moves the logits (so the
   agreement above covers it); the captured queries are the paged layers' (2 of 7: the shared global layer
   pages nothing); the two attention paths agree.
3. Paging (familyutil's conformance checks): only the global layers with KV of their own are paged, the sliding
   ones keep the ring, the shared ones keep nothing; a batch is its steps; exact evals and exact mode's greedy
   decode are the full cache's bit for bit; a pool under the prompt decodes; truncates within the ring re-read,
   beyond it are refused.  Layers on RPC servers run there (every op of gemma4's graph is on kvflash's remote
   list), the shared layers reading a remote layer's KV: the one process's logits bit for bit.
4. A snapshot round trip mid-decode continues bit for bit.
5. Bad files are clear errors (the gemma4 tokenizer itself: tests/test_vocab_core.py's vectors).
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
from tinygguf import N_BASE_TOKENS, write_tiny_gemma4  # noqa: E402

NE_TOL = 2e-3
ARGMAX_MIN = 0.97
FA_TOL = 1e-3
V = N_BASE_TOKENS - 2
PATTERN = [True, True, False, True, False, True, False]
FF = [96] * 5 + [192] * 2
MOE = dict(n_expert=8, n_embd_per_layer=0, k_eq_v="all")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma4")
    # seeds: with these, llama.cpp's own two attention paths agree to about 1e-3 on the test prompt (with
    # others a token's expert scores or a GeGLU input sit on an f16 rounding edge and they differ by 1e-2)
    return {
        "main": write_tiny_gemma4(d / "g.gguf", seed=2, n_ff=FF),
        "moe": write_tiny_gemma4(d / "m.gguf", seed=3, **MOE),
        "fused": write_tiny_gemma4(d / "f.gguf", seed=2, fused_gate_up=True, **MOE),
    }


def _ids(n, seed):
    return familyutil.ids(n, seed, V)


_runtime = familyutil.runtime


# --------------------------------------------------------------------------- 1. llama.cpp
@pytest.mark.peer
@pytest.mark.parametrize("model", ["main", "moe"])
def test_ggml_path_one_token_is_llama_cpp_s(models, model):
    """kvflash's ggml_flash_attn_ext path one token at a time against llama.cpp's flash attention one token at a
    time, one thread each: the same kernels in the same order, bit for bit (measured 0 on both models)."""
    familyutil.ggml_path_one_token_matches_llama_cpp(models[model]["path"], V, f"gemma4 {model}", 1e-6)


@pytest.mark.peer
@pytest.mark.parametrize("model", ["main", "moe", "fused"])
@pytest.mark.parametrize("attn", ["pool", "ggml"])
def test_batched_logits_match_llama_cpp_flash_attention(models, model, attn):
    """Batched against llama.cpp's flash attention (ggml's tiled f32 kernel): summation order, made visible by
    the GELU table (module docstring).  Measured 2.2e-4 / 2.4e-4 (main), 1.1e-4 (moe)."""
    familyutil.batched_logits_match_llama_cpp_flash_attention(models[model]["path"], V, attn, f"gemma4 {model}",
                                                              FA_TOL)


@pytest.mark.peer
@pytest.mark.parametrize("model", ["main", "moe"])
@pytest.mark.parametrize("attn,batched", [("pool", True), ("pool", False), ("ggml", True)],
                         ids=["pool-batched", "pool-one-token", "ggml-batched"])
def test_logits_match_llama_cpp(models, model, attn, batched):
    """Against llama.cpp without flash attention (its f16 rounding of Q and the softmax weights): as large as
    llama.cpp's own two attention paths differ (measured 1.1e-3 main, 7.5e-4 moe, both)."""
    familyutil.logits_match_llama_cpp(models[model]["path"], V, attn, batched, f"gemma4 {model}", NE_TOL, ARGMAX_MIN)


# --------------------------------------------------------------------------- 2. what the test model exercises
def test_the_model_reads_its_keys(models):
    hp = core.Model(models["main"]["path"], n_threads=1).hparams
    assert hp["arch"] == "gemma4" and hp["is_swa"] == PATTERN and hp["n_swa"] == 32
    assert hp["head_dim"] == 64 and hp["head_dim_swa"] == 32 and hp["n_head"] == 4
    assert hp["n_head_kv"] == 1 and hp["n_head_kv_per_layer"] == [2, 2, 1, 2, 1, 2, 1]
    assert hp["kv_src"] == [-1, -1, -1, -1, -1, 3, 4]
    assert hp["n_rot"] == 64 and hp["n_rot_swa"] == 32 and hp["rope_base"] == 1e6 and hp["rope_base_swa"] == 1e4
    assert hp["attn_scale"] == 1.0 and hp["final_softcap"] == 30.0 and hp["n_embd_per_layer"] == 16
    assert hp["n_ff_per_layer"] == FF
    m = core.Model(models["main"]["path"], n_threads=1)
    assert m.global_layers == [2, 4]                 # layer 6 is global but reads layer 4's KV: not paged
    moe = core.Model(models["moe"]["path"], n_threads=1).hparams
    assert moe["n_embd_per_layer"] == 0 and moe["n_ff_per_layer"] == [96] * 7


def test_an_absent_softcap_is_llama_cpp_s_30(tmp_path):
    """llama.cpp's default final_logit_softcapping is 30 where a gemma4 file has none (gemma3's is 0)."""
    a = write_tiny_gemma4(tmp_path / "a.gguf", seed=2, softcap=None)
    b = write_tiny_gemma4(tmp_path / "b.gguf", seed=2, softcap=30.0)
    toks = _ids(40, seed=1)
    assert np.array_equal(_runtime(a["path"]).eval(toks, all_logits=True), _runtime(b["path"]).eval(toks, all_logits=True))
    assert core.Model(a["path"], n_threads=1).hparams["final_softcap"] == 30.0


def test_each_feature_matters(tmp_path, models):
    """The same weights with one feature off give other logits, so the agreement with llama.cpp covers each."""
    toks = _ids(120, seed=1)
    base = _runtime(models["main"]["path"]).eval(toks, all_logits=True)
    off = {
        "rope_freqs": dict(overrides={"rope_freqs.weight": 1.0}),               # every pair rotates
        "out_scale": dict(overrides={f"blk.{i}.layer_output_scale.weight": 1.0 for i in range(7)}),
        "per_layer": dict(overrides={f"blk.{i}.proj.weight": 0.0 for i in range(7)}),
        "softcap": dict(softcap=0.0),
        "rope_base_swa": dict(rope_base_swa=None),                              # llama.cpp's default 10000 ...
    }
    for k, kw in off.items():
        p = write_tiny_gemma4(tmp_path / f"{k}.gguf", seed=2, n_ff=FF, **kw)["path"]
        ne = llama_ref.normalized_error(_runtime(p).eval(toks, all_logits=True), base)
        if k == "rope_base_swa":
            assert ne == 0.0          # ... which is the test model's own
        else:
            assert ne > 5e-3, (k, ne)   # above every tolerance of the comparisons with llama.cpp
    moe = _runtime(models["moe"]["path"]).eval(toks, all_logits=True)
    p = write_tiny_gemma4(tmp_path / "xs.gguf", seed=3, overrides={f"blk.{i}.ffn_down_exps.scale": 1.0
                                                                   for i in range(7)}, **MOE)["path"]
    assert llama_ref.normalized_error(_runtime(p).eval(toks, all_logits=True), moe) > 1e-2


def test_the_attention_paths_agree(models):
    """ggml_flash_attn_ext against the pool kernel, batched: summation order (and the GELU table's edges)."""
    for k in ("main", "moe"):
        familyutil.attention_paths_agree(models[k]["path"], V, 1e-3)


def test_captured_queries_and_scorers(models):
    """The paged layers' queries (layers 2 and 4: 4 heads of 64) are captured; the sliding layers' 32-wide
    heads and the shared layer's never enter; the scorers read them over the pool and the host store."""
    familyutil.captured_queries_and_scorers(models["main"]["path"], V, (2, 8, 4, 64), n_paged=2)


def test_the_shared_layers_keep_nothing(models):
    """The pool has the two global layers with KV of their own, the ring the three sliding ones: the two shared
    layers add nothing (a ring of 3 layers x 2 heads x 32 dims, f16 K and V)."""
    rt = _runtime(models["main"]["path"], pool_tokens=256, chunk_tokens=16)
    assert rt.n_paged_layers == 2
    assert rt.swa_bytes % (3 * 2 * 2 * 32 * 2) == 0
    rows = rt.swa_bytes // (3 * 2 * 2 * 32 * 2)
    assert 256 <= rows <= 2048


# --------------------------------------------------------------------------- 3. paging
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_a_batch_is_its_steps(models, kv_type):
    familyutil.a_batch_is_its_steps(models["main"]["path"], V, kv_type)


@pytest.mark.parametrize("model", ["main", "moe"])
def test_exact_eval_is_the_full_cache(models, model):
    familyutil.exact_eval_is_the_full_cache(models[model]["path"], V, 2)


@pytest.mark.parametrize("policy", ["lru", "qk"])
def test_exact_greedy_is_the_full_cache(models, policy):
    familyutil.exact_greedy_is_the_full_cache(models["main"]["path"], V, policy)


@pytest.mark.parametrize("model", ["main", "moe"])
def test_pool_smaller_than_the_prompt_runs(models, model):
    familyutil.pool_smaller_than_the_prompt_runs(models[model]["path"], V, n_paged=2)


def test_truncate_within_the_ring_and_beyond(models):
    familyutil.truncate_within_the_ring_and_beyond(models["main"]["path"], V)


@pytest.mark.parametrize("model", ["main", "moe"])
def test_layers_on_rpc_servers_equal_one_process(models, model):
    """Layers 0-1 on one loopback server, 2-4 on another, 5-6 here: the shared layers here read layers 3 and 4's
    KV on the second server.  Greedy tokens and every logit equal the one process's bit for bit (every weight
    mapped on both sides, ggml's attention), through page-outs of the remote pool slices."""
    from test_rpc import _start_server
    eps = [_start_server()[1], _start_server()[1]]
    path = models[model]["path"]
    prompt = _ids(500, seed=7)
    runs = []
    for kw in ({}, dict(rpc=eps, tensor_split=[1, 1, 1])):
        m = core.Model(str(path), n_threads=1, repack=False, **kw)
        if kw:
            assert [(r["first"], r["last"]) for r in m.remote_layers] == [(0, 2), (2, 5)]
        rt = core.Runtime(m, max_ctx=1024, pool_tokens=256, chunk_tokens=16, attn="ggml", kv_type="f16")
        logits = [np.array(rt.eval(prompt))]
        toks = []
        for _ in range(10):
            toks.append(int(np.argmax(logits[-1])))
            logits.append(np.array(rt.eval(np.array([toks[-1]], np.int32))))
        runs.append((toks, logits, rt.pager.stats["page_outs"]))
        del rt, m
    (ta, la, pa), (tb, lb, pb) = runs
    assert ta == tb and pa == pb > 0
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


# --------------------------------------------------------------------------- 4. snapshots
@pytest.mark.parametrize("pool", [None, 256], ids=["full", "pool256"])
def test_snapshot_round_trip_mid_decode(models, tmp_path, pool):
    familyutil.snapshot_round_trip_mid_decode(models["main"]["path"], V, pool, tmp_path / "g.kvf")


# --------------------------------------------------------------------------- 5. files
@pytest.mark.parametrize("kw,match", [
    (dict(reshape={"blk.2.attn_q.weight": (128, 64)}), "'blk.2.attn_q.weight' has shape"),
    (dict(reshape={"blk.1.attn_k.weight": (128, 64)}), "'blk.1.attn_k.weight' has shape"),
    (dict(reshape={"blk.3.inp_gate.weight": (8, 64)}), "'blk.3.inp_gate.weight' has shape"),
    (dict(reshape={"per_layer_token_embd.weight": (266, 100)}), "'per_layer_token_embd.weight' has shape"),
    (dict(reshape={"rope_freqs.weight": (16,)}), "'rope_freqs.weight' has shape"),
    (dict(reshape={"blk.0.layer_output_scale.weight": (2,)}), "'blk.0.layer_output_scale.weight' has shape"),
    (dict(drop=("blk.1.attn_k.weight",)), "missing tensor 'blk.1.attn_k.weight'"),
    (dict(drop=("rope_freqs.weight",)), "missing tensor 'rope_freqs.weight'"),
    (dict(drop=("per_layer_model_proj.weight",)), "missing tensor 'per_layer_model_proj.weight'"),
    (dict(drop=("blk.4.attn_q_norm.weight",)), "missing tensor 'blk.4.attn_q_norm.weight'"),
    (dict(retype={"rope_freqs.weight": np.float16}), "must be F32"),
    (dict(extra={"gemma4.attention.sliding_window_pattern": [True, False]}), "2 values for 7 layers"),
    (dict(extra={"gemma4.attention.sliding_window_pattern": [True] * 7}), "no global layer"),
    (dict(extra={"gemma4.attention.sliding_window_pattern": 6}), "must be an array of one bool per layer"),
    (dict(extra={"gemma4.attention.sliding_window_pattern": None}), "sliding_window_pattern' is missing"),
    (dict(extra={"gemma4.attention.sliding_window": None}), "sliding_window' is missing"),
    (dict(extra={"gemma4.attention.key_length_swa": None}), "key_length_swa' is missing"),
    (dict(extra={"gemma4.attention.value_length_swa": 48}), "key_length_swa == value_length_swa"),
    (dict(extra={"gemma4.embedding_length_per_layer_input": None}), "embedding_length_per_layer_input' is missing"),
    (dict(extra={"gemma4.attention.head_count_kv": [2, 2, 1, 2, 2, 2, 1]}), "global layers' attention.head_count_kv"),
    (dict(extra={"gemma4.attention.head_count_kv": [2, 1]}), "head_count_kv has 2 values for 7 layers"),
    (dict(extra={"gemma4.attention.shared_kv_layers": 6}), "shared_kv_layers = 6"),
    (dict(extra={"gemma4.attention.shared_kv_layers": 3}), "shared-KV layer 4 .global. would read layer 3"),
    (dict(extra={"gemma4.rope.dimension_count_swa": 48}), "dimension_count_swa 48"),
    (dict(extra={"gemma4.feed_forward_length": [96, 96]}), "feed_forward_length has 2 values"),
])
def test_bad_files(tmp_path, kw, match):
    bad = write_tiny_gemma4(tmp_path / "bad.gguf", seed=1, **kw)
    with pytest.raises(ValueError, match=match):
        core.Model(bad["path"], n_threads=1)


@pytest.mark.parametrize("kw,match", [
    (dict(drop=("blk.2.ffn_gate_inp.scale",)), "missing tensor 'blk.2.ffn_gate_inp.scale'"),
    (dict(drop=("blk.2.post_ffw_norm_2.weight",)), "missing tensor 'blk.2.post_ffw_norm_2.weight'"),
    (dict(reshape={"blk.1.ffn_down_exps.scale": (4,)}), "'blk.1.ffn_down_exps.scale' has shape"),
    (dict(reshape={"blk.0.ffn_up_exps.weight": (8, 16, 64)}), "'blk.0.ffn_up_exps.weight' has shape"),
    (dict(extra={"gemma4.expert_feed_forward_length": None}), "expert_feed_forward_length' is missing"),
    (dict(extra={"gemma4.expert_feed_forward_length": [32, 32, 32, 16, 32, 32, 32]}), "varies by layer"),
])
def test_bad_moe_files(tmp_path, kw, match):
    bad = write_tiny_gemma4(tmp_path / "bad.gguf", seed=1, **dict(MOE, **kw))
    with pytest.raises(ValueError, match=match):
        core.Model(bad["path"], n_threads=1)


def test_other_families_refuse_per_layer_kv_heads(tmp_path):
    """head_count_kv and feed_forward_length as arrays: one value everywhere loads, varying values are refused
    by a family whose graph has one count (gemma4 alone resolves them)."""
    from tinygguf import write_tiny_gptoss
    ok = write_tiny_gptoss(tmp_path / "a.gguf", seed=1, extra={"gpt-oss.attention.head_count_kv": [2] * 4})
    assert core.Model(ok["path"], n_threads=1).hparams["n_head_kv"] == 2
    bad = write_tiny_gptoss(tmp_path / "b.gguf", seed=1, extra={"gpt-oss.attention.head_count_kv": [2, 1, 2, 1]})
    with pytest.raises(ValueError, match="head_count_kv varies by layer.*gpt-oss takes one count"):
        core.Model(bad["path"], n_threads=1)
    bad = write_tiny_gptoss(tmp_path / "c.gguf", seed=1, extra={"gpt-oss.feed_forward_length": [32, 64, 32, 32]})
    with pytest.raises(ValueError, match="feed_forward_length varies by layer"):
        core.Model(bad["path"], n_threads=1)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]


def test_gemma4_chat_templates_render(tmp_path):
    """Gemma 4's templates (the sdist's google-gemma-4-31B-it and its interleaved variant) render in kvflash's
    sandbox; a chat session runs from a file carrying one."""
    from kvflash import _registry
    from kvflash.chat_template import ChatTemplates
    d = _registry.vocab_dir() / "templates"
    tpls = {p.name: p.read_text() for p in sorted(d.glob("google-gemma-4-*.jinja"))}
    assert len(tpls) == 2, sorted(tpls)
    want = ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi there<turn|>\n<|turn>model\nHello!<turn|>\n"
            "<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
    for name, src in tpls.items():
        assert ChatTemplates().render(src, CHAT, True, {"bos_token": "<bos>"}) == want, name
    info = write_tiny_gemma4(tmp_path / "c.gguf", seed=1,
                             extra={"tokenizer.chat_template": tpls["google-gemma-4-31B-it.jinja"]})
    s = familyutil.session(info["path"])
    enc = s.tokenizer.encode_chat(CHAT)
    out = "".join(s.chat(CHAT, max_tokens=4, ignore_eos=True))
    assert isinstance(out, str) and len(s.tokens) == len(enc) + 4
