// Gemma 4 (llama.cpp's LLM_ARCH_GEMMA4, general.architecture "gemma4").  Embeddings scaled by sqrt(n_embd).
// Every layer: RMS pre-norm; q from the normed input, per-head RMS norm (q_norm); k and v likewise, v from
// attn_v or, where the layer has none, the very product k is (K = V), k normed by k_norm, v by a plain RMS
// norm without a weight; NeoX RoPE; attention with softmax scale 1; the output projection, post_attention_norm
// and a residual.  The feed-forward: ffn_norm, GeGLU (gelu(gate) * up), down; on a MoE layer (one with a
// router) that dense MLP's output is normed by post_ffw_norm_1 and added to the experts' (their input normed
// by pre_ffw_norm_2; the router reads rms_norm(x) / sqrt(n_embd) * ffn_gate_inp.scale; softmax over all
// experts, the top k kept and renormed, GeGLU experts, each expert's output times its ffn_down_exps.scale;
// the sum normed by post_ffw_norm_2); post_ffw_norm and a residual.  Then, where the model has per-layer
// embeddings (E2B/E4B), gelu(inp_gate x) times the layer's slice of the per-layer input, projected back
// (proj), normed (post_norm) and added; then the layer's output times layer_output_scale where the file has
// one.  The head: output norm, output (or the tied embedding), the final logit softcap.
//
// Layers: a per-layer sliding-window pattern (an array, as llama.cpp requires).  The sliding layers have
// their own head dim (attention.key_length_swa), K/V head count (head_count_kv per layer), RoPE base
// (rope.freq_base_swa) and RoPE dims (rope.dimension_count_swa); the global ones attention.key_length and
// RoPE with the frequency factors of rope_freqs ("proportional" RoPE: 1e30 on the dims left unrotated).
// kvflash keeps one geometry per kind: every global layer one (the pool's), every sliding layer one (the
// ring's).  The last attention.shared_kv_layers layers store no KV: each reads the cache of layer
// n_kv - 2 (a sliding one) or n_kv - 1 (a global one), n_kv = n_layer - shared, as llama.cpp maps them
// (its KV cache's reuse callback); kvflash checks the source is of the same kind, where llama.cpp would
// assert.  Only the global layers with their own KV are paged; the sliding ones keep the runtime's ring.
#include "kvflash/arch.h"

#include <cmath>
#include <stdexcept>

namespace kvflash {

namespace {

void read_gemma4(const GGUFKeys &kv, Hparams &hp) {
    hp.rope_mode = GGML_ROPE_TYPE_NEOX;
    const int64_t n_swa = kv.a("attention.sliding_window", 0, true);
    if (n_swa <= 0 || n_swa > (int64_t(1) << 30))
        throw std::invalid_argument(kv.file + ": attention.sliding_window = " + std::to_string(n_swa) + " is out of range");
    hp.n_swa = int32_t(n_swa);
    // the pattern: one bool per layer (llama.cpp reads it as an array and nothing else)
    const std::string pk = kv.arch + ".attention.sliding_window_pattern";
    const int64_t pid = kv.need(pk, true);
    if (gguf_get_kv_type(kv.g, pid) != GGUF_TYPE_ARRAY)
        kv.bad(pk, "must be an array of one bool per layer for gemma4");
    read_swa_pattern(kv, hp, 0, false);

    // the sliding layers' head dim (K = V), RoPE dims and base
    const int64_t dk = kv.a("attention.key_length_swa", 0, true), dv = kv.a("attention.value_length_swa", 0, true);
    if (dk <= 0 || dk > 1024 || dv <= 0 || dv > 1024)
        throw std::invalid_argument(kv.file + ": attention.key_length_swa / value_length_swa = " + std::to_string(dk) +
                                    " / " + std::to_string(dv) + " are out of range");
    if (dk != dv)
        throw std::invalid_argument(kv.file + ": gemma4 needs key_length_swa == value_length_swa (" + std::to_string(dk) +
                                    " != " + std::to_string(dv) + ")");
    hp.head_dim_swa = int32_t(dk);
    const int64_t rot = kv.a("rope.dimension_count_swa", hp.n_rot, false);
    if (rot <= 0 || rot > hp.head_dim_swa || rot % 2)
        throw std::invalid_argument(kv.file + ": rope.dimension_count_swa " + std::to_string(rot) +
                                    " must be even and in [2, the sliding head dim " + std::to_string(hp.head_dim_swa) + "]");
    hp.n_rot_swa = int32_t(rot);
    hp.rope_base_swa = kv.finite("rope.freq_base_swa", 10000.0, true);
    hp.rope_scale_swa = 1.0f;

    // K/V heads per layer: one count for the global layers (the pool's) and one for the sliding ones (the ring's)
    int32_t g = -1, s = -1;
    for (int32_t il = 0; il < hp.n_layer; ++il) {
        const int32_t h = hp.n_head_kv_l[size_t(il)];
        int32_t &want = hp.is_swa[size_t(il)] ? s : g;
        if (want >= 0 && h != want)
            throw std::invalid_argument(kv.file + ": the " + (hp.is_swa[size_t(il)] ? "sliding" : "global") +
                                        " layers' attention.head_count_kv differ (" + std::to_string(want) + " and " +
                                        std::to_string(h) + " at layer " + std::to_string(il) +
                                        "); kvflash keeps one K/V geometry per kind of layer");
        want = h;
    }
    hp.n_head_kv = g;
    hp.n_head_kv_swa = s > 0 ? s : g;

    // shared KV: the last `shared` layers read an earlier layer's cache (llama.cpp's reuse callback)
    const int64_t shared = kv.a("attention.shared_kv_layers", 0, false);
    if (shared < 0 || (shared > 0 && hp.n_layer - shared < 2))
        throw std::invalid_argument(kv.file + ": attention.shared_kv_layers = " + std::to_string(shared) + " leaves " +
                                    std::to_string(hp.n_layer - shared) + " of " + std::to_string(hp.n_layer) +
                                    " layers with KV of their own; gemma4 needs at least 2");
    if (shared > 0) {
        const int32_t from = hp.n_layer - int32_t(shared);
        hp.kv_src.assign(size_t(hp.n_layer), -1);
        for (int32_t il = from; il < hp.n_layer; ++il) {
            const int32_t src = from - (hp.is_swa[size_t(il)] ? 2 : 1);
            if (hp.is_swa[size_t(src)] != hp.is_swa[size_t(il)])
                throw std::invalid_argument(
                    kv.file + ": shared-KV layer " + std::to_string(il) + " (" + (hp.is_swa[size_t(il)] ? "sliding" : "global") +
                    ") would read layer " + std::to_string(src) + "'s KV, which is " +
                    (hp.is_swa[size_t(src)] ? "sliding" : "global") +
                    ": the two layers before the shared ones must be a sliding layer, then a global one");
            hp.kv_src[size_t(il)] = src;
        }
    }

    // per-layer embeddings (llama.cpp requires the key; 0: none)
    const int64_t ple = kv.a("embedding_length_per_layer_input", 0, true);
    if (ple < 0 || ple > (int64_t(1) << 20))
        throw std::invalid_argument(kv.file + ": embedding_length_per_layer_input = " + std::to_string(ple) +
                                    " is out of range");
    hp.n_embd_per_layer = int32_t(ple);

    // the MoE variant: softmax over every expert, the top k renormed, no scale
    if (hp.n_expert > 0) {
        const std::vector<int64_t> fe = kv.get_ints(kv.arch + ".expert_feed_forward_length", size_t(hp.n_layer), true);
        for (int64_t f : fe)
            if (f != fe[0])
                throw std::invalid_argument(kv.file + ": expert_feed_forward_length varies by layer; kvflash's gemma4 "
                                                      "takes one width for every layer's experts");
        hp.n_ff_exp = expert_width(kv, fe.empty() ? 0 : fe[0]);
        hp.expert_gating = Hparams::Gating::Softmax;
        hp.expert_weights_norm = true;
        hp.expert_weights_scale = 1.0f;
    }
    if (hp.n_ff_l.empty())
        throw std::invalid_argument(kv.file + ": metadata key '" + kv.arch + ".feed_forward_length' is missing (gemma4's "
                                              "MoE layers have a dense MLP too)");
    hp.attn_scale = 1.0f;   // Gemma 4 scales nothing before the softmax (q and k are normed)
    // absent: llama.cpp's default of 30 (llama_hparams; gemma4 keeps it where gemma3 sets 0); 0: none
    hp.final_softcap = kv.finite("final_logit_softcapping", 30.0, false);
    if (hp.final_softcap < 0) throw std::invalid_argument(kv.file + ": final_logit_softcapping must be >= 0");
}

void load_model(const TensorLoader &t, const Hparams &hp, Model &m) {
    if (hp.n_embd_per_layer <= 0) return;
    const int64_t P = hp.n_embd_per_layer, NL = hp.n_layer;
    m.per_layer_tok_embd = t.get("per_layer_token_embd.weight", {P * NL, hp.n_vocab});
    m.per_layer_model_proj = t.get("per_layer_model_proj.weight", {hp.n_embd, P * NL});
    m.per_layer_proj_norm = t.get("per_layer_proj_norm.weight", {P});
}

void load_layer(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L) {
    auto w = [&](const char *s) { return TensorLoader::weight(il, s); };
    const int64_t E = hp.n_embd, D = hp.head_dim_at(il), H = hp.n_head_at(il), Hkv = hp.n_head_kv_at(il);
    const bool own_kv = hp.kv_source(il) < 0;
    // the second-level weight scales llama.cpp multiplies in where a file has them (NVFP4 conversions): not here
    for (const char *s : {"attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "ffn_gate", "ffn_up", "ffn_down",
                          "ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps"}) {
        const std::string n = "blk." + std::to_string(il) + "." + s + ".scale";
        if (ggml_get_tensor(t.meta, n.c_str()))
            throw std::invalid_argument(t.file + ": tensor '" + n + "' (a weight's second-level scale) is not supported "
                                                 "by kvflash's gemma4");
    }
    if (ggml_get_tensor(t.meta, w("attn_qkv").c_str()))
        throw std::invalid_argument(t.file + ": a fused '" + w("attn_qkv") + "' is not supported by kvflash's gemma4 "
                                             "(separate attn_q / attn_k / attn_v are)");
    L.attn_norm = t.get(w("attn_norm"), {E});
    L.wq = t.get(w("attn_q"), {E, D * H});
    L.wk = t.get(w("attn_k"), {E, D * Hkv}, own_kv);
    L.wv = t.get(w("attn_v"), {E, D * Hkv}, false);   // absent: V is K's product (attention_k_eq_v)
    L.wo = t.get(w("attn_output"), {D * H, E});
    L.q_norm = t.get(w("attn_q_norm"), {D});
    L.k_norm = t.get(w("attn_k_norm"), {D}, own_kv);
    L.attn_post_norm = t.get(w("post_attention_norm"), {E});
    L.out_scale = f32_tensor(t, w("layer_output_scale"), {1}, false);
    if (!hp.is_swa[size_t(il)]) L.rope_freqs = f32_tensor(t, "rope_freqs.weight", {hp.head_dim_k / 2}, true);
    const int64_t F = hp.n_ff_at(il);
    L.ffn_norm = t.get(w("ffn_norm"), {E});
    L.ffn_gate = t.get(w("ffn_gate"), {E, F});
    L.ffn_up = t.get(w("ffn_up"), {E, F});
    L.ffn_down = t.get(w("ffn_down"), {F, E});
    L.ffn_post_norm = t.get(w("post_ffw_norm"), {E});
    if (hp.n_expert > 0) L.ffn_gate_inp = t.get(w("ffn_gate_inp"), {E, hp.n_expert}, false);   // a MoE layer
    if (L.ffn_gate_inp) {
        const int64_t X = hp.n_expert, FE = hp.n_ff_exp;
        L.ffn_gate_inp_s = f32_tensor(t, "blk." + std::to_string(il) + ".ffn_gate_inp.scale", {E}, true);
        L.ffn_pre_norm_2 = t.get(w("pre_ffw_norm_2"), {E});
        L.ffn_post_norm_1 = t.get(w("post_ffw_norm_1"), {E});
        L.ffn_post_norm_2 = t.get(w("post_ffw_norm_2"), {E});
        L.ffn_gate_up_exps = t.get(w("ffn_gate_up_exps"), {E, 2 * FE, X}, false);
        if (!L.ffn_gate_up_exps) {
            L.ffn_gate_exps = t.get(w("ffn_gate_exps"), {E, FE, X});
            L.ffn_up_exps = t.get(w("ffn_up_exps"), {E, FE, X});
        }
        L.ffn_down_exps = t.get(w("ffn_down_exps"), {FE, E, X});
        L.ffn_down_exps_s = f32_tensor(t, "blk." + std::to_string(il) + ".ffn_down_exps.scale", {X}, false);
    }
    if (hp.n_embd_per_layer > 0) {
        const int64_t P = hp.n_embd_per_layer;
        L.per_layer_inp_gate = t.get(w("inp_gate"), {E, P});
        L.per_layer_proj = t.get(w("proj"), {P, E});
        L.per_layer_post_norm = t.get(w("post_norm"), {E});
    }
}

ggml_tensor *embed(Forward &f) {
    ggml_context *ctx = f.ctx;
    const Hparams &hp = *f.hp;
    ggml_tensor *x = ggml_get_rows(ctx, f.model->tok_embd, f.tokens);  // [n_embd, n]
    x = ggml_scale(ctx, x, std::sqrt(float(hp.n_embd)));
    if (f.model->per_layer_tok_embd) {
        // the per-layer inputs: the token's own rows of the per-layer table (scaled by sqrt(P)) plus the
        // embedding's projection (scaled by 1/sqrt(n_embd), RMS-normed per layer), times 1/sqrt(2)
        const int64_t P = hp.n_embd_per_layer, NL = hp.n_layer;
        ggml_tensor *pl = ggml_get_rows(ctx, f.model->per_layer_tok_embd, f.tokens);   // [P * NL, n]
        pl = ggml_scale(ctx, ggml_reshape_3d(ctx, pl, P, NL, f.n), std::sqrt(float(P)));
        ggml_tensor *proj = f.mm(f.model->per_layer_model_proj, x);                    // [P * NL, n]
        proj = ggml_scale(ctx, proj, 1.0f / std::sqrt(float(hp.n_embd)));
        proj = f.norm(ggml_reshape_3d(ctx, proj, P, NL, f.n), f.model->per_layer_proj_norm);
        pl = ggml_scale(ctx, ggml_add(ctx, proj, pl), 1.0f / std::sqrt(2.0f));
        f.per_layer_inp = ggml_cont(ctx, ggml_permute(ctx, pl, 0, 2, 1, 3));            // [P, n, NL]
    }
    return x;
}

// The routed experts of a MoE layer on x [n_embd, n] (normed by pre_ffw_norm_2), the router's logits [X, n]
// given: as llama.cpp's build_moe_ffn for gemma4's options (softmax, top k, renormed, GeGLU, the per-expert scale).
ggml_tensor *experts(Forward &f, const LayerWeights &L, ggml_tensor *x, ggml_tensor *logits) {
    ggml_context *ctx = f.ctx;
    const Hparams &hp = *f.hp;
    const int64_t E = hp.n_embd, X = hp.n_expert, k = hp.n_expert_used, n = f.n;
    ggml_tensor *probs = ggml_soft_max(ctx, logits);                                    // [X, n]
    ggml_tensor *picked = ggml_argsort_top_k(ctx, probs, int(k));                       // [k, n] i32
    ggml_tensor *w = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, X, n), picked);  // [1, k, n]
    ggml_tensor *w2 = ggml_reshape_2d(ctx, w, k, n);
    ggml_tensor *sum = ggml_clamp(ctx, ggml_sum_rows(ctx, w2), 6.103515625e-5f, INFINITY);
    w = ggml_reshape_3d(ctx, ggml_div(ctx, w2, sum), 1, k, n);
    ggml_tensor *xr = ggml_reshape_3d(ctx, x, E, 1, n);
    ggml_tensor *gate, *up;
    if (L.ffn_gate_up_exps) {
        ggml_tensor *gu = f.mm_id(L.ffn_gate_up_exps, xr, picked);   // [2F, k, n]: gate, then up
        const int64_t F = gu->ne[0] / 2;
        gate = ggml_view_3d(ctx, gu, F, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], 0);
        up = ggml_view_3d(ctx, gu, F, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], size_t(F) * gu->nb[0]);
    } else {
        up = f.mm_id(L.ffn_up_exps, xr, picked);
        gate = f.mm_id(L.ffn_gate_exps, xr, picked);
    }
    ggml_tensor *out = f.mm_id(L.ffn_down_exps, ggml_geglu_split(ctx, gate, up), picked);   // [E, k, n]
    if (L.ffn_down_exps_s) {
        // each picked expert's own scale (the same values llama.cpp picks through a repeat, without one)
        ggml_tensor *ids = ggml_reshape_1d(ctx, ggml_cont(ctx, picked), k * n);
        ggml_tensor *s = ggml_get_rows(ctx, ggml_reshape_2d(ctx, L.ffn_down_exps_s, 1, X), ids);   // [1, k n]
        out = ggml_mul(ctx, out, ggml_reshape_3d(ctx, s, 1, k, n));
    }
    out = ggml_mul(ctx, out, w);
    ggml_tensor *sumx = ggml_view_2d(ctx, out, E, n, out->nb[2], 0);   // summed in selection order
    for (int64_t i = 1; i < k; ++i)
        sumx = ggml_add(ctx, sumx, ggml_view_2d(ctx, out, E, n, out->nb[2], size_t(i) * out->nb[1]));
    if (k == 1) sumx = ggml_cont(ctx, sumx);
    return sumx;
}

// GeGLU: down(gelu(gate x) * up x).
ggml_tensor *mlp(Forward &f, const LayerWeights &L, ggml_tensor *x) {
    return f.mm(L.ffn_down, ggml_geglu_split(f.ctx, f.mm(L.ffn_gate, x), f.mm(L.ffn_up, x)));
}

// x: [n_embd, n] -> [n_embd, n].
ggml_tensor *layer(Forward &f, int32_t il, ggml_tensor *x) {
    ggml_context *ctx = f.ctx;
    const Hparams &hp = *f.hp;
    const LayerWeights &L = f.weights(il);
    const int64_t D = hp.head_dim_at(il), H = hp.n_head_at(il), Hkv = hp.n_head_kv_at(il), n = f.n;
    ggml_tensor *cur = f.norm(x, L.attn_norm);
    ggml_tensor *q = f.norm(ggml_reshape_3d(ctx, f.mm(L.wq, cur), D, H, n), L.q_norm);   // [D, H, n]
    if (hp.kv_source(il) < 0) {
        ggml_tensor *kp = f.mm(L.wk, cur);
        ggml_tensor *vp = L.wv ? f.mm(L.wv, cur) : kp;   // K = V where the layer has no attn_v
        ggml_tensor *k = f.norm(ggml_reshape_3d(ctx, kp, D, Hkv, n), L.k_norm);
        ggml_tensor *v = ggml_rms_norm(ctx, ggml_reshape_3d(ctx, vp, D, Hkv, n), hp.rms_eps);   // no weight
        cur = f.attention(il, q, k, ggml_reshape_2d(ctx, v, D * Hkv, n), 1.0f, hp.attn_scale);
    } else {
        cur = f.attention(il, q, nullptr, nullptr, 1.0f, hp.attn_scale);   // the source layer's KV
    }
    cur = f.norm(f.mm(L.wo, cur), L.attn_post_norm);
    ggml_tensor *attn_out = ggml_add(ctx, cur, x);

    if (L.ffn_gate_inp) {
        ggml_tensor *dense = f.norm(mlp(f, L, f.norm(attn_out, L.ffn_norm)), L.ffn_post_norm_1);
        // the router reads the residual stream normed without a weight, scaled by 1/sqrt(n_embd), times its scale
        ggml_tensor *r = ggml_scale(ctx, ggml_rms_norm(ctx, attn_out, hp.rms_eps), 1.0f / std::sqrt(float(hp.n_embd)));
        ggml_tensor *logits = f.mm(L.ffn_gate_inp, ggml_mul(ctx, r, L.ffn_gate_inp_s));   // [X, n]
        ggml_tensor *moe = f.norm(experts(f, L, f.norm(attn_out, L.ffn_pre_norm_2), logits), L.ffn_post_norm_2);
        cur = ggml_add(ctx, dense, moe);
    } else {
        cur = mlp(f, L, f.norm(attn_out, L.ffn_norm));
    }
    cur = ggml_add(ctx, f.norm(cur, L.ffn_post_norm), attn_out);

    if (f.per_layer_inp) {
        const int64_t P = hp.n_embd_per_layer;
        ggml_tensor *g = ggml_gelu(ctx, f.mm(L.per_layer_inp_gate, cur));   // [P, n]
        ggml_tensor *mine = ggml_view_2d(ctx, f.per_layer_inp, P, n, f.per_layer_inp->nb[1],
                                         size_t(il) * size_t(f.per_layer_inp->nb[2]));
        g = f.norm(f.mm(L.per_layer_proj, ggml_mul(ctx, g, mine)), L.per_layer_post_norm);   // [n_embd, n]
        cur = ggml_add(ctx, cur, g);
    }
    if (L.out_scale) cur = ggml_mul(ctx, cur, L.out_scale);
    return cur;
}

}  // namespace

extern const ArchOps kArchGemma4;
const ArchOps kArchGemma4{"gemma4",           read_gemma4, load_layer, embed, layer, /*whole_layers=*/true,
                          /*yarn=*/false,     /*per_layer_heads=*/true,  /*per_layer_kv=*/true,
                          /*extra_nodes=*/64, /*load_model=*/load_model};

}  // namespace kvflash
