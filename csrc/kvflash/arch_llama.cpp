// The llama family: llama, and switches on it -- qwen2 (q/k/v biases), qwen3 (RMS norms on q and k
// per head) and qwen3moe (qwen3 with routed experts).  The qwen variants use NEOX RoPE.  llama with
// experts (Mixtral's layout) and qwen3moe take their FFN from Forward::ffn's mixture.
#include "kvflash/arch.h"

namespace kvflash {

namespace {

// llama with experts is Mixtral's layout: experts as wide as feed_forward_length, softmax routing, the
// chosen weights normalised (llama.cpp's llama graph).
void read_llama(const GGUFKeys &kv, Hparams &hp) {
    full_rope(kv, hp);
    hp.rope_mode = 0;
    if (hp.n_expert > 0) {
        hp.n_ff_exp = expert_width(kv, hp.n_ff);
        hp.expert_weights_norm = true;
    }
}
void read_neox(const GGUFKeys &kv, Hparams &hp) {
    full_rope(kv, hp);
    refuse_experts(kv, hp);
    hp.rope_mode = GGML_ROPE_TYPE_NEOX;
}
// qwen3moe: qwen3's attention, every layer's FFN routed (softmax over the experts, the chosen weights
// normalised, not scaled), experts expert_feed_forward_length wide (else n_ff / n_expert_used).
void read_qwen3moe(const GGUFKeys &kv, Hparams &hp) {
    full_rope(kv, hp);
    hp.rope_mode = GGML_ROPE_TYPE_NEOX;
    if (hp.n_expert == 0) throw std::invalid_argument(kv.file + ": a qwen3moe file needs expert_count and expert_used_count");
    hp.n_ff_exp = expert_width(kv, hp.n_ff / hp.n_expert_used);
    hp.expert_weights_norm = true;
}

void load_none(const TensorLoader &, const Hparams &, int32_t, LayerWeights &) {}

void load_qwen2(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L) {
    L.bq = t.get(TensorLoader::bias(il, "attn_q"), {int64_t(hp.head_dim_k) * hp.n_head});
    L.bk = t.get(TensorLoader::bias(il, "attn_k"), {hp.n_embd_k()});
    L.bv = t.get(TensorLoader::bias(il, "attn_v"), {hp.n_embd_v()});
}

void load_qwen3(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L) {
    L.q_norm = t.get(TensorLoader::weight(il, "attn_q_norm"), {hp.head_dim_k});
    L.k_norm = t.get(TensorLoader::weight(il, "attn_k_norm"), {hp.head_dim_k});
}

ggml_tensor *embed(Forward &f) { return ggml_get_rows(f.ctx, f.model->tok_embd, f.tokens); }

// x: [n_embd, n] -> [n_embd, n]: pre-norm attention and SwiGLU FFN, each a residual.
ggml_tensor *layer(Forward &f, int32_t il, ggml_tensor *x) {
    ggml_context *ctx = f.ctx;
    const Hparams &hp = *f.hp;
    const LayerWeights &L = f.weights(il);
    ggml_tensor *cur = f.norm(x, L.attn_norm);
    ggml_tensor *q = f.mm(L.wq, cur);
    ggml_tensor *k = f.mm(L.wk, cur);
    ggml_tensor *v = f.mm(L.wv, cur);
    if (L.bq) { q = ggml_add(ctx, q, L.bq); k = ggml_add(ctx, k, L.bk); v = ggml_add(ctx, v, L.bv); }
    q = ggml_reshape_3d(ctx, q, hp.head_dim_k, hp.n_head, f.n);     // [D, H, n]
    k = ggml_reshape_3d(ctx, k, hp.head_dim_k, hp.n_head_kv, f.n);  // [D, Hkv, n]
    if (L.q_norm) {
        q = f.norm(q, L.q_norm);
        k = f.norm(k, L.k_norm);
    }
    cur = f.attention(il, q, k, v, 1.0f, hp.attn_scale);
    cur = f.mm(L.wo, cur);
    x = ggml_add(ctx, x, cur);

    cur = f.ffn(il, f.norm(x, L.ffn_norm));
    return ggml_add(ctx, x, cur);
}

}  // namespace

extern const ArchOps kArchLlama, kArchQwen2, kArchQwen3, kArchQwen3Moe;
const ArchOps kArchLlama{"llama", read_llama, load_none, embed, layer};
const ArchOps kArchQwen2{"qwen2", read_neox, load_qwen2, embed, layer};
const ArchOps kArchQwen3{"qwen3", read_neox, load_qwen3, embed, layer};
const ArchOps kArchQwen3Moe{"qwen3moe", read_qwen3moe, load_qwen3, embed, layer};

}  // namespace kvflash
