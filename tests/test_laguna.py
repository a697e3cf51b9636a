"""laguna (issue 41) on tiny random-weight GGUFs (tinygguf.write_tiny_laguna): 5 layers in llama.cpp's period of 4
with the global layer first (layers 0 and 4 global, 1-3 sliding over a 32-token window), 4 query heads on the
global layers and 6 on the sliding ones (2 K/V heads everywhere), YaRN (factor 8 over an original context of
256) over 16 of the 32 dims of a head on the global layers (partial RoPE), plain RoPE with its own base over all
32 on the sliding ones, q/k norms, the softplus output gate (per head; per element in a variant), a leading
dense layer then 8 experts (2 used) with sigmoid routing, the score-correction bias (~N(0, 1): it moves the
choice), the weights normed and scaled by 2.5, and a shared expert of its own width.

1. Logits for every token against llama.cpp's own forward pass (libllama from the pinned sdist,
   tests/llama_ref.py; marker `peer`), f16 K/V on both sides, 300 tokens (past the window and past YaRN's
   original context), through both attention paths (kvflash's CPU pool kernel, attn="pool", and
   ggml_flash_attn_ext, attn="ggml"): against llama.cpp without flash attention, test_gptoss.py's tolerance
   (normalised error <= 2e-3 over the whole [tokens, vocab] array, the argmax of >= 97% of rows the same);
   against llama.cpp with flash attention, batched 2e-4 (both paths), the ggml path one token at a time 1e-5;
   the per-element gate and a file without a window (every layer global, as Laguna-M.1) the same way.  That the
   comparisons have something to catch: the same weights without the gate, without the bias, without YaRN and
   without the window give other logits (test 2).
2. The two attention paths against each other; the captured queries (the paged layers' 4 heads, not the sliding
   layers' 6) and the scorers over them.
3. Paging (only the global layers are paged; the sliding ones keep the ring): a batch is its one-token steps bit
   for bit; exact evals over a pool far smaller than the prompt are the full cache bit for bit; exact mode's
   greedy tokens and logits are the full cache's (lru and qk); a pooled session decodes past its pool; truncates
   within the ring's reach re-read to the same logits, beyond it are refused.  Layers on an RPC server are
   refused at the first eval (softplus is not on the remote op list), clearly.
4. A snapshot round trip mid-decode continues bit for bit (full cache and pool 256).
5. Bad files are clear errors; the tokenizer with the laguna pre-tokenizer (digits one at a time) works.
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
from tinygguf import N_BASE_TOKENS, write_tiny_laguna  # noqa: E402

NE_TOL = 2e-3
ARGMAX_MIN = 0.97
V = N_BASE_TOKENS - 2   # random prompts from the byte-level tokens and merges, not bos/eos


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("laguna")
    return {
        "main": write_tiny_laguna(d / "l.gguf", seed=4),
        # the same weights (the same draws) with one feature off
        "nogate": write_tiny_laguna(d / "nogate.gguf", seed=4, gate_std=0.0),
        "nobias": write_tiny_laguna(d / "nobias.gguf", seed=4, probs_bias_std=0.0),
        "wide": write_tiny_laguna(d / "wide.gguf", seed=4, n_swa=4096),
        "noyarn": write_tiny_laguna(d / "noyarn.gguf", seed=4, yarn_factor=None),
        # other layouts: the per-element gate; no window (every layer global, one head count: Laguna-M.1)
        "elem": write_tiny_laguna(d / "elem.gguf", seed=6, gate="per_element"),
        "full": write_tiny_laguna(d / "full.gguf", seed=5, n_swa=0, gate="per_element", n_dense_lead=2),
    }


def _ids(n, seed):
    return familyutil.ids(n, seed, V)


_runtime = familyutil.runtime
_session = familyutil.session


# --------------------------------------------------------------------------- 1. llama.cpp
@pytest.mark.peer
@pytest.mark.parametrize("attn,batched", [("pool", True), ("pool", False), ("ggml", True)],
                         ids=["pool-batched", "pool-one-token", "ggml-batched"])
def test_logits_match_llama_cpp(models, attn, batched):
    """Against llama.cpp without flash attention (test_gptoss.py's comparison; the ggml path one token at a time
    is compared with its own peer below: ggml's one-query flash-attention kernel accumulates in f16).  Measured
    7.2e-4 on all three.  The weights' seed matters here: with seeds 3 and 5 (of 0-7) llama.cpp's own two
    attention paths differ by 1.7e-2 / 7.9e-3 on this prompt, one token's sigmoid scores tying within f16's
    rounding of Q and the softmax weights and its experts changing; the flash-attention comparisons below held
    at seed 3 too (4.6e-5)."""
    familyutil.logits_match_llama_cpp(models["main"]["path"], V, attn, batched, "laguna", NE_TOL, ARGMAX_MIN)


@pytest.mark.peer
@pytest.mark.parametrize("model", ["main", "elem", "full"])
@pytest.mark.parametrize("attn", ["pool", "ggml"])
def test_batched_logits_match_llama_cpp_flash_attention(models, model, attn):
    """llama.cpp with flash attention on, batched, takes ggml's tiled all-f32 kernel: what is left is summation
    order.  The tight check of the per-layer heads and RoPE, the gate (per head and per element), the routing
    with its bias, the shared expert and the dense lead; "full" has no window (every layer paged)."""
    familyutil.batched_logits_match_llama_cpp_flash_attention(models[model]["path"], V, attn, f"laguna {model}", 2e-4)


@pytest.mark.peer
def test_ggml_path_matches_llama_cpp_flash_attention(models):
    """kvflash's ggml_flash_attn_ext path one token at a time against llama.cpp's flash attention one token at
    a time, one thread each: the same kernels in the same order."""
    familyutil.ggml_path_one_token_matches_llama_cpp(models["main"]["path"], V, "laguna", 1e-5)


# --------------------------------------------------------------------------- 2. what the test model exercises
def test_the_model_reads_its_keys(models):
    hp = core.Model(models["main"]["path"], n_threads=1).hparams
    assert hp["arch"] == "laguna" and hp["is_swa"] == [False, True, True, True, False] and hp["n_swa"] == 32
    assert hp["n_head"] == 4 and hp["n_head_per_layer"] == [4, 6, 6, 6, 4] and hp["n_head_kv"] == 2
    assert hp["n_rot"] == 16 and hp["n_rot_swa"] == 32 and hp["head_dim"] == 32
    assert hp["rope_base"] == 500000.0 and hp["rope_base_swa"] == 10000.0 and hp["rope_scale_swa"] == 1.0
    assert hp["rope_ext_factor"] == 1.0 and hp["rope_scale"] == np.float32(1 / 8) and hp["rope_n_ctx_orig"] == 256
    assert hp["n_layer_dense_lead"] == 1 and abs(hp["attn_scale"] - 32 ** -0.5) < 1e-7
    full = core.Model(models["full"]["path"], n_threads=1).hparams
    assert full["is_swa"] == [False] * 5 and full["n_swa"] == 0 and full["n_head_per_layer"] == [4] * 5


def test_gate_bias_window_and_yarn_matter(models):
    """Each feature moves the logits: the peer test's agreement covers it."""
    toks = _ids(300, seed=1)
    out = {k: _runtime(models[k]["path"]).eval(toks, all_logits=True)
           for k in ("main", "nogate", "nobias", "wide", "noyarn")}
    ne = lambda a, b: llama_ref.normalized_error(out[a], out[b])  # noqa: E731
    assert ne("nogate", "main") > 0.05
    assert ne("nobias", "main") > 0.05
    assert ne("noyarn", "main") > 0.02
    # the window: the same before a token sees past it, other after
    early = llama_ref.normalized_error(out["wide"][:32], out["main"][:32])
    late = llama_ref.normalized_error(out["wide"][64:], out["main"][64:])
    assert early < 1e-5 and late > 0.02, (early, late)


def test_the_attention_paths_agree(models):
    """ggml_flash_attn_ext against the pool kernel, batched (ggml's tiled f32 kernel for a batch): summation order."""
    for k in ("main", "full"):
        familyutil.attention_paths_agree(models[k]["path"], V, 1e-4)


def test_captured_queries_and_scorers(models):
    """The paged (global) layers' queries are captured at their own head count (4), the sliding layers' 6 never
    enter; the scorers read them over the pool and the host store."""
    familyutil.captured_queries_and_scorers(models["main"]["path"], V, (2, 8, 4, 32))


# --------------------------------------------------------------------------- 3. paging
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_a_batch_is_its_steps(models, kv_type):
    familyutil.a_batch_is_its_steps(models["main"]["path"], V, kv_type)


@pytest.mark.parametrize("model,n_paged", [("main", 2), ("full", 5)])
def test_exact_eval_is_the_full_cache(models, model, n_paged):
    familyutil.exact_eval_is_the_full_cache(models[model]["path"], V, n_paged)


@pytest.mark.parametrize("policy", ["lru", "qk"])
def test_exact_greedy_is_the_full_cache(models, policy):
    familyutil.exact_greedy_is_the_full_cache(models["main"]["path"], V, policy)


def test_pool_smaller_than_the_prompt_runs(models):
    familyutil.pool_smaller_than_the_prompt_runs(models["main"]["path"], V, n_paged=2)


def test_truncate_within_the_ring_and_beyond(models):
    familyutil.truncate_within_the_ring_and_beyond(models["main"]["path"], V)


def test_rpc_splits_are_refused_clearly(models):
    """Layers on an RPC server: the gate's softplus is not on kvflash's list of ops for remote devices, so the
    first eval is refused, naming the op, and the runtime is left as it was."""
    familyutil.rpc_split_is_refused(models["main"]["path"], V, "SOFTPLUS")


# --------------------------------------------------------------------------- 4. snapshots
@pytest.mark.parametrize("pool", [None, 256], ids=["full", "pool256"])
def test_snapshot_round_trip_mid_decode(models, tmp_path, pool):
    familyutil.snapshot_round_trip_mid_decode(models["main"]["path"], V, pool, tmp_path / "l.kvf")


# --------------------------------------------------------------------------- 5. files, tokenizer
@pytest.mark.parametrize("kw,match", [
    (dict(drop=("blk.2.attn_gate.weight",)), "missing tensor 'blk.2.attn_gate.weight'"),
    (dict(reshape={"blk.1.attn_gate.weight": (7, 64)}), "gates 7 outputs; a laguna gate has 6 .per head. or 192"),
    (dict(drop=("blk.4.exp_probs_b.bias",)), "missing tensor 'blk.4.exp_probs_b.bias'"),
    (dict(retype={"blk.1.exp_probs_b.bias": np.float16}), "must be F32"),
    (dict(drop=("blk.3.ffn_up_shexp.weight",)), "missing tensor 'blk.3.ffn_up_shexp.weight'"),
    (dict(drop=("blk.0.ffn_gate.weight",)), "missing tensor 'blk.0.ffn_gate.weight'"),
    (dict(drop=("blk.0.attn_q_norm.weight",)), "missing tensor 'blk.0.attn_q_norm.weight'"),
    (dict(reshape={"blk.1.attn_q.weight": (128, 64)}), "'blk.1.attn_q.weight' has shape"),
    (dict(extra={"laguna.leading_dense_block_count": None}), "leading_dense_block_count' is missing"),
    (dict(extra={"laguna.leading_dense_block_count": 9}), "leading_dense_block_count = 9"),
    (dict(extra={"laguna.expert_feed_forward_length": None}), "expert_feed_forward_length' is missing"),
    (dict(extra={"laguna.expert_count": None, "laguna.expert_used_count": None}), "needs expert_count"),
    (dict(extra={"laguna.expert_gating_func": 3}), "expert_gating_func 3"),
    (dict(extra={"laguna.attention.head_count": [4, 6, 6]}), "3 values for 5 layers"),
    (dict(extra={"laguna.attention.head_count": [4, 6, 6, 6, 6]}), "global layers' attention.head_count differ"),
    (dict(extra={"laguna.attention.head_count": [4, 5, 6, 6, 4]}), "not a multiple of head_count_kv"),
    (dict(extra={"laguna.attention.sliding_window_pattern": [True] * 5}), "no global layer"),
    (dict(extra={"laguna.attention.sliding_window_pattern": [True, False]}), "2 values for 5 layers"),
    (dict(n_rot_swa=48), "dimension_count_swa 48"),
    (dict(extra={"laguna.rope.dimension_count": 15}), "rope.dimension_count 15"),
    (dict(yarn_factor=-2.0), "rope.scaling.factor"),
])
def test_bad_files(tmp_path, kw, match):
    bad = write_tiny_laguna(tmp_path / "bad.gguf", seed=1, **kw)
    with pytest.raises(ValueError, match=match):
        core.Model(bad["path"], n_threads=1)


def test_per_layer_heads_are_laguna_s_alone(tmp_path):
    """Another family with attention.head_count as an array: one value everywhere loads, varying values are
    refused (its graph has one count)."""
    from tinygguf import write_tiny_gptoss
    ok = write_tiny_gptoss(tmp_path / "a.gguf", seed=1, extra={"gpt-oss.attention.head_count": [4] * 4})
    assert core.Model(ok["path"], n_threads=1).hparams["n_head_per_layer"] == [4] * 4
    bad = write_tiny_gptoss(tmp_path / "b.gguf", seed=1, extra={"gpt-oss.attention.head_count": [4, 2, 4, 2]})
    with pytest.raises(ValueError, match="varies by layer.*gpt-oss takes one count"):
        core.Model(bad["path"], n_threads=1)


def test_a_pattern_array_and_a_period(tmp_path):
    per = write_tiny_laguna(tmp_path / "a.gguf", seed=1, swa_pattern=[False, True, False, True, True])
    hp = core.Model(per["path"], n_threads=1).hparams
    assert hp["is_swa"] == [False, True, False, True, True] and hp["n_head_per_layer"] == [4, 6, 4, 6, 6]
    two = write_tiny_laguna(tmp_path / "b.gguf", seed=1, swa_pattern=2)
    assert core.Model(two["path"], n_threads=1).hparams["is_swa"] == [False, True, False, True, False]


def test_tokenizer_laguna_pre(tmp_path):
    """The laguna pre-tokenizer (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LAGUNA) loads and splits numbers into single
    digits: with a merge "1"+"2" in the vocabulary, gpt-4o's pre-tokenizer (digits in threes) joins "12",
    laguna's never does."""
    lag = write_tiny_laguna(tmp_path / "t.gguf", seed=2, extra_merges=[("1", "2")])
    g2 = write_tiny_laguna(tmp_path / "g.gguf", seed=2, extra_merges=[("1", "2")], pre="gpt-4o")
    tl = _session(lag["path"]).tokenizer
    tg = _session(g2["path"]).tokenizer
    assert tl.pre == "laguna"
    twelve = lag["vocab"]["tokens"].index("12")
    assert twelve in tg.encode("x 123", add_special=False)
    assert twelve not in tl.encode("x 123", add_special=False)
    text = "Hello there, the answer's 12345!\n\nnext line"
    assert tl.decode(tl.encode(text, add_special=False)) == text


def _laguna_templates():
    from kvflash import _registry
    return {p.name: p.read_text() for p in sorted((_registry.vocab_dir() / "templates").glob("poolside-Laguna-*.jinja"))}


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]


def test_laguna_chat_templates_render(tmp_path):
    """poolside's templates (the sdist's three) wrap an assistant turn in transformers' {% generation %} block,
    which kvflash's sandbox renders as its body, as llama.cpp's template engine does; a chat session runs from
    a file carrying one."""
    from kvflash.chat_template import ChatTemplates
    tpls = _laguna_templates()
    assert len(tpls) == 3, sorted(tpls)
    ct = ChatTemplates()
    for name, src in tpls.items():
        out = ct.render(src, CHAT, True, {})
        assert out.startswith("〈|EOS|〉<system>") and "Be brief." in out and "Hello!" in out, (name, out)
        assert out.index("Hi there") < out.index("Hello!") < out.index("What is 2+2?"), (name, out)
    assert ct.render(tpls["poolside-Laguna-XS.2.jinja"], CHAT, True, {}) == (
        "〈|EOS|〉<system>\n\nBe brief.\n</system>\n<user>\nHi there\n</user>\n<assistant>\n</think>\nHello!\n"
        "</assistant>\n<user>\nWhat is 2+2?\n</user>\n<assistant>\n</think>")
    info = write_tiny_laguna(tmp_path / "c.gguf", seed=2,
                             extra={"tokenizer.chat_template": tpls["poolside-Laguna-XS.2.jinja"]})
    s = _session(info["path"])
    enc = s.tokenizer.encode_chat(CHAT)
    out = "".join(s.chat(CHAT, max_tokens=4, ignore_eos=True))
    assert isinstance(out, str) and len(s.tokens) == len(enc) + 4
