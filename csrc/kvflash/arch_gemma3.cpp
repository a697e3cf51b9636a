// Gemma 3: embeddings scaled by sqrt(n_embd), q/k norms, post-attention and
// post-FFN norms, GeGLU, queries pre-scaled, sliding-window layers in a fixed
// pattern with their own RoPE base, and an optional final logit softcap.
#include "kvflash/arch.h"

#include <cmath>
#include <stdexcept>

namespace kvflash {

namespace {

void read_gemma3(const GGUFKeys &kv, Hparams &hp) {
    full_rope(kv, hp);
    refuse_experts(kv, hp);
    hp.rope_mode = GGML_ROPE_TYPE_NEOX;
    const int64_t n_swa = kv.a("attention.sliding_window", 0, false);
    if (n_swa < 0 || n_swa > (int64_t(1) << 30))
        throw std::invalid_argument(kv.file + ": attention.sliding_window = " + std::to_string(n_swa) + " is out of range");
    hp.n_swa = int32_t(n_swa);
    if (hp.n_swa > 0) {
        const int64_t pattern = kv.a("attention.sliding_window_pattern", 6, false);
        if (pattern <= 0) throw std::invalid_argument(kv.file + ": sliding_window_pattern must be > 0");
        for (int32_t il = 0; il < hp.n_layer; ++il) hp.is_swa[il] = (il % pattern) < pattern - 1;
    }
    hp.rope_base_swa = kv.finite("rope.freq_base_swa", 10000.0, true);
    hp.rope_scale_swa = 1.f;
    // Queries are scaled by 1/sqrt(query_pre_attn_scalar).  An explicit <arch>.attention.scale
    // wins; GGUF conversions write none, and Gemma 3's configs set the scalar to the head dim in
    // every size with 256-wide heads, n_embd / n_head in the one with 128-wide heads (27B).
    if (kv.has("attention.scale")) hp.attn_scale = kv.finite("attention.scale", 0.0, true);
    else if (hp.head_dim_k != 256) hp.attn_scale = 1.0f / std::sqrt(float(hp.n_embd / hp.n_head));
    if (!(hp.attn_scale > 0.f)) throw std::invalid_argument(kv.file + ": attention.scale must be > 0");
    hp.final_softcap = kv.finite("final_logit_softcapping", 0.0, false);
    if (hp.final_softcap < 0) throw std::invalid_argument(kv.file + ": final_logit_softcapping must be >= 0");
}

void load_gemma3(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L) {
    L.q_norm = t.get(TensorLoader::weight(il, "attn_q_norm"), {hp.head_dim_k});
    L.k_norm = t.get(TensorLoader::weight(il, "attn_k_norm"), {hp.head_dim_k});
    L.attn_post_norm = t.get(TensorLoader::weight(il, "post_attention_norm"), {hp.n_embd});
    L.ffn_post_norm = t.get(TensorLoader::weight(il, "post_ffw_norm"), {hp.n_embd});
}

ggml_tensor *embed(Forward &f) {
    ggml_tensor *x = ggml_get_rows(f.ctx, f.model->tok_embd, f.tokens);  // [n_embd, n]
    return ggml_scale(f.ctx, x, std::sqrt(float(f.hp->n_embd)));
}

// x: [n_embd, n] -> [n_embd, n].
ggml_tensor *layer(Forward &f, int32_t il, ggml_tensor *x) {
    ggml_context *ctx = f.ctx;
    const Hparams &hp = *f.hp;
    const LayerWeights &L = f.weights(il);
    ggml_tensor *cur = f.norm(x, L.attn_norm);
    ggml_tensor *q = ggml_reshape_3d(ctx, f.mm(L.wq, cur), hp.head_dim_k, hp.n_head, f.n);     // [D, H, n]
    ggml_tensor *k = ggml_reshape_3d(ctx, f.mm(L.wk, cur), hp.head_dim_k, hp.n_head_kv, f.n);  // [D, Hkv, n]
    ggml_tensor *v = f.mm(L.wv, cur);
    q = f.norm(q, L.q_norm);
    k = f.norm(k, L.k_norm);
    cur = f.attention(il, q, k, v, hp.attn_scale, 1.0f);
    cur = f.norm(f.mm(L.wo, cur), L.attn_post_norm);
    x = ggml_add(ctx, x, cur);

    cur = f.norm(x, L.ffn_norm);
    cur = ggml_geglu_split(ctx, f.mm(L.ffn_gate, cur), f.mm(L.ffn_up, cur));
    cur = f.norm(f.mm(L.ffn_down, cur), L.ffn_post_norm);
    return ggml_add(ctx, x, cur);
}

}  // namespace

extern const ArchOps kArchGemma3;
const ArchOps kArchGemma3{"gemma3", read_gemma3, load_gemma3, embed, layer};

}  // namespace kvflash
