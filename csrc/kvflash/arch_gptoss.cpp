// gpt-oss (OpenAI's open-weight MoE family; llama.cpp's LLM_ARCH_OPENAI_MOE, general.architecture
// "gpt-oss").  Every layer: RMS pre-norm; attention with q/k/v biases, NeoX RoPE (YaRN in the released
// files: rope.scaling.type "yarn"), a learned sink per query head (one more logit in each softmax's
// denominator, with no value), softmax scale 1/sqrt(head dim), the output projection's bias; a residual;
// then post_attention_norm (the feed-forward's pre-norm) and a routed mixture: the router's logits plus
// its bias, the top k of those logits, a softmax over the k chosen (llama.cpp's SOFTMAX_WEIGHT gating),
// each expert's gate, up and down products with the expert's own biases (ggml_add_id), the clamped
// SwiGLU of gpt-oss (ggml_swiglu_oai, alpha 1.702, limit 7); a residual.  Sliding-window attention on
// alternate layers (attention.sliding_window_pattern, default 2: even layers slide, odd layers are
// global): the sliding layers keep the runtime's ring, only the global ones are paged.
#include "kvflash/arch.h"

#include <cmath>
#include <stdexcept>

namespace kvflash {

namespace {

void read_gptoss(const GGUFKeys &kv, Hparams &hp) {
    full_rope(kv, hp);   // llama.cpp's tensors are n_rot wide per head: rope.dimension_count must be the head dim
    hp.rope_mode = GGML_ROPE_TYPE_NEOX;
    if (hp.n_expert == 0) throw std::invalid_argument(kv.file + ": a gpt-oss file needs expert_count and expert_used_count");
    if (!kv.has("expert_feed_forward_length"))
        throw std::invalid_argument(kv.file + ": metadata key '" + kv.arch + ".expert_feed_forward_length' is missing");
    hp.n_ff_exp = expert_width(kv, 0);
    hp.expert_gating = Hparams::Gating::SoftmaxWeight;
    hp.expert_act = Hparams::ExpertAct::SwigluOai;
    hp.expert_weights_norm = false;
    // llama.cpp's gpt-oss graph reads no expert_weights_scale (its weights are the softmax over the k):
    // kvflash follows it, whatever the file says.
    hp.expert_weights_scale = 0.f;

    const int64_t n_swa = kv.a("attention.sliding_window", 0, true);
    if (n_swa <= 0 || n_swa > (int64_t(1) << 30))
        throw std::invalid_argument(kv.file + ": attention.sliding_window = " + std::to_string(n_swa) +
                                    " is out of range (a gpt-oss file slides its windowed layers over > 0 tokens)");
    hp.n_swa = int32_t(n_swa);
    // The pattern (llama.cpp's set_swa_pattern): a period of 2 by default, its last layer global.
    read_swa_pattern(kv, hp, 2, false);
    // Sliding layers: the global layers' base unless the file has its own, and the same frequency scale
    // (YaRN's ext_factor and magnitude apply to every layer: model.h).
    hp.rope_base_swa = kv.finite("rope.freq_base_swa", hp.rope_base, true);
    hp.rope_scale_swa = hp.rope_scale;
    hp.attn_scale = 1.0f / std::sqrt(float(hp.n_rot));
}

void load_layer(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L) {
    auto w = [&](const char *s) { return TensorLoader::weight(il, s); };
    // the biases, F32 (ggml_add_id and the bias adds take F32)
    auto b = [&](const char *s, const std::vector<int64_t> &shape, bool required = true) {
        return f32_tensor(t, TensorLoader::bias(il, s), shape, required, "biases");
    };
    const int64_t E = hp.n_embd, D = hp.head_dim_k, H = hp.n_head, X = hp.n_expert, F = hp.n_ff_exp;
    L.attn_norm = t.get(w("attn_norm"), {E});
    L.wq = t.get(w("attn_q"), {E, D * H});
    L.wk = t.get(w("attn_k"), {E, hp.n_embd_k()});
    L.wv = t.get(w("attn_v"), {E, hp.n_embd_v()});
    // llama.cpp takes each of the q/k/v biases where the file has it
    L.bq = b("attn_q", {D * H}, false);
    L.bk = b("attn_k", {hp.n_embd_k()}, false);
    L.bv = b("attn_v", {hp.n_embd_v()}, false);
    L.wo = t.get(w("attn_output"), {D * H, E});
    L.bo = b("attn_output", {E});
    L.attn_sinks = f32_tensor(t, w("attn_sinks"), {H}, true, "biases");
    L.ffn_norm = t.get(w("post_attention_norm"), {E});   // the feed-forward's pre-norm
    L.ffn_gate_inp = t.get(w("ffn_gate_inp"), {E, X});
    L.ffn_gate_inp_b = b("ffn_gate_inp", {X});
    L.ffn_gate_exps = t.get(w("ffn_gate_exps"), {E, F, X});
    L.ffn_up_exps = t.get(w("ffn_up_exps"), {E, F, X});
    L.ffn_down_exps = t.get(w("ffn_down_exps"), {F, E, X});
    L.ffn_gate_exps_b = b("ffn_gate_exps", {F, X});
    L.ffn_up_exps_b = b("ffn_up_exps", {F, X});
    L.ffn_down_exps_b = b("ffn_down_exps", {E, X});
}

ggml_tensor *embed(Forward &f) { return ggml_get_rows(f.ctx, f.model->tok_embd, f.tokens); }

// x: [n_embd, n] -> [n_embd, n].
ggml_tensor *layer(Forward &f, int32_t il, ggml_tensor *x) {
    ggml_context *ctx = f.ctx;
    const Hparams &hp = *f.hp;
    const LayerWeights &L = f.weights(il);
    ggml_tensor *cur = f.norm(x, L.attn_norm);
    ggml_tensor *q = f.mm(L.wq, cur), *k = f.mm(L.wk, cur), *v = f.mm(L.wv, cur);
    if (L.bq) q = ggml_add(ctx, q, L.bq);
    if (L.bk) k = ggml_add(ctx, k, L.bk);
    if (L.bv) v = ggml_add(ctx, v, L.bv);
    q = ggml_reshape_3d(ctx, q, hp.head_dim_k, hp.n_head, f.n);     // [D, H, n]
    k = ggml_reshape_3d(ctx, k, hp.head_dim_k, hp.n_head_kv, f.n);  // [D, Hkv, n]
    cur = f.attention(il, q, k, v, 1.0f, hp.attn_scale);            // the layer's sinks included
    cur = ggml_add(ctx, f.mm(L.wo, cur), L.bo);
    x = ggml_add(ctx, x, cur);
    return ggml_add(ctx, x, f.ffn(il, f.norm(x, L.ffn_norm)));
}

}  // namespace

extern const ArchOps kArchGptOss;
const ArchOps kArchGptOss{"gpt-oss", read_gptoss, load_layer, embed, layer, /*whole_layers=*/true, /*yarn=*/true};

}  // namespace kvflash
