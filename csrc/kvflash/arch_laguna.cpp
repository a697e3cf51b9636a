// Laguna (poolside's MoE family; llama.cpp's LLM_ARCH_LAGUNA, general.architecture "laguna").  Every
// layer: RMS pre-norm; q, k, v and a gate from the same normed input; per-head RMS norms on q and k; NeoX
// RoPE over the first n_rot dims of a head (partial where n_rot < head dim); attention with softmax scale
// 1/sqrt(head dim); the attention's output times softplus(gate), the gate one value per head or one per
// element (read from the gate tensor's width); the output projection; a residual; ffn_norm and the
// feed-forward: the dense SwiGLU on the first leading_dense_block_count layers, else the routed mixture
// (sigmoid gating by default; the score-correction bias exp_probs_b moves the choice of the top k, not
// their weights; the weights normed and scaled as the file says) plus one always-on shared expert with no
// gate of its own; a residual.
//
// With attention.sliding_window > 0 the layers slide in a period of 4 that starts with a global layer
// (llama.cpp's load_swa_pattern(4, dense_first), or the file's per-layer array): sliding layers keep the
// runtime's ring, only the global ones are paged.  The two kinds differ in their query head count
// (attention.head_count per layer; K/V heads are one count), and in their RoPE: YaRN (rope.scaling) over
// rope.dimension_count on the global layers, plain RoPE with its own base (rope.freq_base_swa) over
// rope.dimension_count_swa on the sliding ones.  Without a window every layer is global.
#include "kvflash/arch.h"

#include <cmath>
#include <stdexcept>

namespace kvflash {

namespace {

// A bool key (or an integer one) under "<arch>."; def when absent.
bool flag(const GGUFKeys &kv, const char *suffix, bool def) {
    const std::string k = kv.arch + "." + suffix;
    const int64_t id = kv.find(k);
    if (id < 0) return def;
    if (gguf_get_kv_type(kv.g, id) == GGUF_TYPE_BOOL) return gguf_get_val_bool(kv.g, id);
    return kv.get_int(k, 0, true) != 0;
}

void read_laguna(const GGUFKeys &kv, Hparams &hp) {
    hp.rope_mode = GGML_ROPE_TYPE_NEOX;
    if (hp.n_expert == 0) throw std::invalid_argument(kv.file + ": a laguna file needs expert_count and expert_used_count");
    if (!kv.has("expert_feed_forward_length"))
        throw std::invalid_argument(kv.file + ": metadata key '" + kv.arch + ".expert_feed_forward_length' is missing");
    hp.n_ff_exp = expert_width(kv, 0);
    const int64_t lead = kv.a("leading_dense_block_count", 0, true);
    if (lead < 0 || lead > hp.n_layer)
        throw std::invalid_argument(kv.file + ": leading_dense_block_count = " + std::to_string(lead) + " is out of [0, " +
                                    std::to_string(hp.n_layer) + "]");
    hp.n_layer_dense_lead = int32_t(lead);
    if (lead > 0 && hp.n_ff <= 0)
        throw std::invalid_argument(kv.file + ": leading dense layers need " + kv.arch + ".feed_forward_length");
    // gating: llama.cpp's expert_gating_func (absent or 0: sigmoid, laguna's default; 1 softmax; 2 sigmoid)
    const int64_t gating = kv.a("expert_gating_func", 0, false);
    if (gating == 1) hp.expert_gating = Hparams::Gating::Softmax;
    else if (gating == 0 || gating == 2) hp.expert_gating = Hparams::Gating::Sigmoid;
    else
        throw std::invalid_argument(kv.file + ": expert_gating_func " + std::to_string(gating) +
                                    " is not one kvflash's laguna takes (1 softmax, 2 sigmoid)");
    hp.expert_weights_norm = flag(kv, "expert_weights_norm", false);
    hp.expert_weights_scale = kv.finite("expert_weights_scale", 0.0, false);
    // one shared expert (the count defaults to 1); its width from the file, else the routed width times the count
    const int64_t n_shared = kv.a("expert_shared_count", 1, false);
    if (n_shared < 1 || n_shared > 64)
        throw std::invalid_argument(kv.file + ": expert_shared_count = " + std::to_string(n_shared) +
                                    " is out of range (laguna has a shared expert)");
    const int64_t shexp = kv.a("expert_shared_feed_forward_length", 0, false);
    const int64_t width = shexp != 0 ? shexp : int64_t(hp.n_ff_exp) * n_shared;
    if (width <= 0 || width > (int64_t(1) << 30))
        throw std::invalid_argument(kv.file + ": expert_shared_feed_forward_length = " + std::to_string(width) +
                                    " is out of range");
    hp.n_ff_shexp = int32_t(width);

    const int64_t n_swa = kv.a("attention.sliding_window", 0, false);
    if (n_swa < 0 || n_swa > (int64_t(1) << 30))
        throw std::invalid_argument(kv.file + ": attention.sliding_window = " + std::to_string(n_swa) + " is out of range");
    if (n_swa > 0) {
        hp.n_swa = int32_t(n_swa);
        // the pattern: a period of 4 by default whose first layer is global (set_swa_pattern's dense_first)
        read_swa_pattern(kv, hp, 4, true);
        // sliding layers: plain RoPE (frequency scale 1, no YaRN), their own base and dimension count
        hp.rope_base_swa = kv.finite("rope.freq_base_swa", hp.rope_base, true);
        hp.rope_scale_swa = 1.0f;
        hp.rope_swa_plain = true;
        const int64_t rot = kv.a("rope.dimension_count_swa", hp.n_rot, false);
        if (rot <= 0 || rot > hp.head_dim_k || rot % 2)
            throw std::invalid_argument(kv.file + ": rope.dimension_count_swa " + std::to_string(rot) +
                                        " must be even and in [2, head dim " + std::to_string(hp.head_dim_k) + "]");
        hp.n_rot_swa = int32_t(rot);
    }
    hp.attn_scale = 1.0f / std::sqrt(float(hp.head_dim_k));
}

void load_layer(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L) {
    auto w = [&](const char *s) { return TensorLoader::weight(il, s); };
    const int64_t E = hp.n_embd, D = hp.head_dim_k, H = hp.n_head_at(il), X = hp.n_expert, F = hp.n_ff_exp;
    L.attn_norm = t.get(w("attn_norm"), {E});
    L.wq = t.get(w("attn_q"), {E, D * H});
    L.wk = t.get(w("attn_k"), {E, hp.n_embd_k()});
    L.wv = t.get(w("attn_v"), {E, hp.n_embd_v()});
    L.wo = t.get(w("attn_output"), {D * H, E});
    L.q_norm = t.get(w("attn_q_norm"), {D});
    L.k_norm = t.get(w("attn_k_norm"), {D});
    // the output gate: one value per head or per element, by the tensor's width (nothing else is a gate)
    const std::string gname = w("attn_gate");
    const ggml_tensor *g = ggml_get_tensor(t.meta, gname.c_str());
    const int64_t gw = g ? g->ne[1] : H;
    if (gw != H && gw != D * H)
        throw std::invalid_argument(t.file + ": tensor '" + gname + "' gates " + std::to_string(gw) +
                                    " outputs; a laguna gate has " + std::to_string(H) + " (per head) or " +
                                    std::to_string(D * H) + " (per element) at layer " + std::to_string(il));
    L.attn_gate = t.get(gname, {E, gw});
    L.ffn_norm = t.get(w("ffn_norm"), {E});
    if (il < hp.n_layer_dense_lead) {
        L.ffn_gate = t.get(w("ffn_gate"), {E, hp.n_ff});
        L.ffn_up = t.get(w("ffn_up"), {E, hp.n_ff});
        L.ffn_down = t.get(w("ffn_down"), {hp.n_ff, E});
        return;
    }
    L.ffn_gate_inp = t.get(w("ffn_gate_inp"), {E, X});
    L.ffn_exp_probs_b = f32_tensor(t, TensorLoader::bias(il, "exp_probs_b"), {X});
    L.ffn_gate_exps = t.get(w("ffn_gate_exps"), {E, F, X});
    L.ffn_up_exps = t.get(w("ffn_up_exps"), {E, F, X});
    L.ffn_down_exps = t.get(w("ffn_down_exps"), {F, E, X});
    const int64_t S = hp.n_ff_shexp;
    L.ffn_gate_shexp = t.get(w("ffn_gate_shexp"), {E, S});
    L.ffn_up_shexp = t.get(w("ffn_up_shexp"), {E, S});
    L.ffn_down_shexp = t.get(w("ffn_down_shexp"), {S, E});
}

ggml_tensor *embed(Forward &f) { return ggml_get_rows(f.ctx, f.model->tok_embd, f.tokens); }

// x: [n_embd, n] -> [n_embd, n].
ggml_tensor *layer(Forward &f, int32_t il, ggml_tensor *x) {
    ggml_context *ctx = f.ctx;
    const Hparams &hp = *f.hp;
    const LayerWeights &L = f.weights(il);
    const int64_t D = hp.head_dim_k, H = hp.n_head_at(il);
    ggml_tensor *cur = f.norm(x, L.attn_norm);
    ggml_tensor *q = ggml_reshape_3d(ctx, f.mm(L.wq, cur), D, H, f.n);              // [D, H, n]
    ggml_tensor *k = ggml_reshape_3d(ctx, f.mm(L.wk, cur), D, hp.n_head_kv, f.n);   // [D, Hkv, n]
    ggml_tensor *v = f.mm(L.wv, cur);
    ggml_tensor *gate = f.mm(L.attn_gate, cur);                                      // [H or D*H, n]
    q = f.norm(q, L.q_norm);
    k = f.norm(k, L.k_norm);
    cur = f.attention(il, q, k, v, 1.0f, hp.attn_scale);                             // [D*H, n]
    gate = ggml_softplus(ctx, gate);
    if (L.attn_gate->ne[1] == H) {   // one value per head, over the head's D outputs
        cur = ggml_mul(ctx, ggml_reshape_3d(ctx, cur, D, H, f.n), ggml_reshape_3d(ctx, gate, 1, H, f.n));
        cur = ggml_reshape_2d(ctx, cur, D * H, f.n);
    } else {
        cur = ggml_mul(ctx, cur, gate);
    }
    x = ggml_add(ctx, f.mm(L.wo, cur), x);
    return ggml_add(ctx, f.ffn(il, f.norm(x, L.ffn_norm)), x);
}

}  // namespace

extern const ArchOps kArchLaguna;
const ArchOps kArchLaguna{"laguna", read_laguna, load_layer, embed, layer, /*whole_layers=*/true, /*yarn=*/true,
                          /*per_layer_heads=*/true};

}  // namespace kvflash
