// The registry of architecture families, and the graph blocks they share.
#include "kvflash/arch.h"
#include "kvflash/one_row_cpu.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

namespace kvflash {

// Registration: one entry per family, each defined in its arch_*.cpp.
#define KVFLASH_ARCHS(X) \
    X(kArchLlama) X(kArchQwen2) X(kArchQwen3) X(kArchQwen3Moe) X(kArchGemma3) X(kArchQwen35) X(kArchQwen35Moe) X(kArchGptOss) X(kArchLaguna) X(kArchGemma4)

#define KVFLASH_DECLARE(name) extern const ArchOps name;
KVFLASH_ARCHS(KVFLASH_DECLARE)
#define KVFLASH_ENTRY(name) &name,
static const ArchOps *const kArchs[] = {KVFLASH_ARCHS(KVFLASH_ENTRY)};

const ArchOps *find_arch(const std::string &name) {
    for (const ArchOps *a : kArchs)
        if (name == a->name) return a;
    return nullptr;
}

std::string arch_list() {
    std::string s;
    for (const ArchOps *a : kArchs) s += (s.empty() ? "" : ", ") + std::string(a->name);
    return s;
}

ggml_tensor *Forward::norm(ggml_tensor *t, ggml_tensor *w) const {
    return ggml_mul(ctx, ggml_rms_norm(ctx, t, hp->rms_eps), w);
}

ggml_tensor *Forward::attention(int32_t il, ggml_tensor *q, ggml_tensor *k, ggml_tensor *v, float q_scale,
                                float kq_scale) {
    const int32_t D = hp->head_dim_at(il), H = hp->n_head_at(il), Hkv = hp->n_head_kv_at(il);
    const bool swa = hp->is_swa[il] != 0;
    const int32_t src = hp->kv_source(il);   // >= 0: this layer reads that layer's KV and stores none
    ggml_tensor *freq = weights(il).rope_freqs;   // [n_rot / 2] frequency factors, or none
    const float base = swa ? hp->rope_base_swa : hp->rope_base, scale = swa ? hp->rope_scale_swa : hp->rope_scale;
    const int n_rot = swa ? hp->n_rot_swa : hp->n_rot;   // < D: partial RoPE (ggml keeps the other dims)
    // YaRN's terms (0, 1, 32, 1 and the trained context unless the file asks for YaRN: model.h); plain RoPE
    // on sliding layers where the family says so (laguna: no ramp, no magnitude, as llama.cpp zeroes them)
    const bool plain = swa && hp->rope_swa_plain;
    const int n_orig = int(plain ? hp->n_ctx_train : hp->rope_n_ctx_orig);
    const float ext = plain ? 0.f : hp->rope_ext_factor, mag = plain ? 1.f : hp->rope_attn_factor,
                bfast = plain ? 0.f : hp->rope_beta_fast, bslow = plain ? 0.f : hp->rope_beta_slow;
    if (hp->rope_multi) {
        int sections[4];
        std::copy(hp->rope_sections, hp->rope_sections + 4, sections);
        q = ggml_rope_multi(ctx, q, pos4, freq, n_rot, sections, hp->rope_mode, n_orig, base, scale, ext, mag, bfast,
                            bslow);
        if (k)
            k = ggml_rope_multi(ctx, k, pos4, freq, n_rot, sections, hp->rope_mode, n_orig, base, scale, ext, mag,
                                bfast, bslow);
    } else {
        q = ggml_rope_ext(ctx, q, pos, freq, n_rot, hp->rope_mode, n_orig, base, scale, ext, mag, bfast, bslow);
        if (k) k = ggml_rope_ext(ctx, k, pos, freq, n_rot, hp->rope_mode, n_orig, base, scale, ext, mag, bfast, bslow);
    }
    const LayerCache &c = caches[il];
    ggml_tensor *sinks = weights(il).attn_sinks;   // [H] f32, or none
    if (c.paged && n_capture > 0) {
        ggml_tensor *ql = ggml_view_3d(ctx, q, D, H, n_capture, q->nb[1], q->nb[2], size_t(n - n_capture) * q->nb[2]);
        ql = ggml_cont(ctx, ql);
        ggml_set_output(ql);
        ggml_build_forward_expand(gf, ql);
        q_out.push_back(ql);
    }
    if (q_scale != 1.0f) q = ggml_scale(ctx, q, q_scale);

    if (stored_k.size() < caches.size()) {
        stored_k.resize(caches.size(), nullptr);
        stored_v.resize(caches.size(), nullptr);
    }
    ggml_tensor *ks, *vs;
    if (src >= 0) {
        // a shared-KV layer: its source's rows as written this graph (the source is an earlier layer)
        if (size_t(src) >= stored_k.size() || !stored_k[size_t(src)] || k || v)
            throw std::logic_error("layer " + std::to_string(il) + " reads layer " + std::to_string(src) +
                                   "'s KV, which this graph has not written");
        ks = stored_k[size_t(src)];
        vs = stored_v[size_t(src)];
    } else {
        // Store K/V rows at their slots (RoPE already applied with the logical position).
        ks = ggml_set_rows(ctx, c.k, ggml_reshape_2d(ctx, k, int64_t(D) * Hkv, n), c.slots);
        vs = ggml_set_rows(ctx, c.v, ggml_reshape_2d(ctx, v, int64_t(D) * Hkv, n), c.slots);
        ggml_build_forward_expand(gf, ks);
        ggml_build_forward_expand(gf, vs);
        stored_k[size_t(il)] = ks;
        stored_v[size_t(il)] = vs;
    }
    // The last layer of a graph whose logits are the last token's: its attention output reaches
    // nothing but that token's logits (no later layer reads the other rows' hidden states), so only
    // the last query attends, over the same rows with its own mask row.  The rows it writes above
    // are every token's, as before.  (A query's result does not depend on the batch around it.)
    const bool last_only = last_row_only && n > 1 && il == hp->n_layer - 1;
    const int64_t nq = last_only ? 1 : n;
    ggml_tensor *mask = c.mask;
    if (last_only) {
        q = ggml_view_3d(ctx, q, D, H, 1, q->nb[1], q->nb[2], size_t(n - 1) * q->nb[2]);
        if (mask) mask = ggml_view_2d(ctx, mask, mask->ne[0], 1, mask->nb[1], size_t(n - 1) * mask->nb[1]);
    }
    ggml_tensor *att;
    if (pool_attn && c.params->rows) {
        // Exact mode: the rows come through the layer's row table (pool and host store); the
        // stored tensors are operands for the order after their writes.
        c.params->scale = kq_scale;
        att = pool_attention_cpu(ctx, q, ks, vs, mask, c.params, sinks);
    } else if (pool_attn) {
        ggml_tensor *k2 = ggml_view_2d(ctx, ks, ks->ne[0], c.n_kv, ks->nb[1], 0);
        ggml_tensor *v2 = ggml_view_2d(ctx, vs, vs->ne[0], c.n_kv, vs->nb[1], 0);
        c.params->scale = kq_scale;
        att = pool_attention_cpu(ctx, q, k2, v2, mask, c.params, sinks);  // [D, H, nq]
    } else {
        // k: [D, n_kv, Hkv] viewed from the stored rows [n_embd_k, n_kv].
        ggml_tensor *kv_k = ggml_view_3d(ctx, ks, D, c.n_kv, Hkv, ks->nb[1], ggml_row_size(ks->type, D), 0);
        ggml_tensor *kv_v = ggml_view_3d(ctx, vs, D, c.n_kv, Hkv, vs->nb[1], ggml_row_size(vs->type, D), 0);
        ggml_tensor *qp = ggml_permute(ctx, q, 0, 2, 1, 3);  // [D, n, H]
        att = ggml_flash_attn_ext(ctx, qp, kv_k, kv_v, mask, kq_scale, 0.f, 0.f);
        if (sinks) ggml_flash_attn_ext_add_sinks(att, sinks);
        ggml_prec_set_acc(att, GGML_PREC_F32);
    }
    att = ggml_reshape_2d(ctx, att, int64_t(D) * H, nq);
    return last_only ? ggml_repeat_4d(ctx, att, int64_t(D) * H, n, 1, 1) : att;
}

ggml_tensor *Forward::mm(ggml_tensor *w, ggml_tensor *x) const {
    if (!one_row || x->ne[1] == 1) return ggml_mul_mat(ctx, w, x);
    return one_row_products(ctx, w, x, model->plain(w));
}

ggml_tensor *Forward::mm_id(ggml_tensor *w, ggml_tensor *x, ggml_tensor *ids) const {
    if (!one_row || x->ne[2] == 1) return ggml_mul_mat_id(ctx, w, x, ids);
    // one routed product per token (a decode step's very call), joined pairwise along the tokens
    std::vector<ggml_tensor *> parts;
    for (int64_t j = 0; j < x->ne[2]; ++j) {
        ggml_tensor *xj = ggml_view_3d(ctx, x, x->ne[0], x->ne[1], 1, x->nb[1], x->nb[2], size_t(j) * x->nb[2]);
        ggml_tensor *ij = ggml_view_2d(ctx, ids, ids->ne[0], 1, ids->nb[1], size_t(j) * ids->nb[1]);
        parts.push_back(ggml_mul_mat_id(ctx, w, xj, ij));
    }
    while (parts.size() > 1) {
        std::vector<ggml_tensor *> next;
        for (size_t i = 0; i + 1 < parts.size(); i += 2) next.push_back(ggml_concat(ctx, parts[i], parts[i + 1], 2));
        if (parts.size() % 2) next.push_back(parts.back());
        parts.swap(next);
    }
    return parts[0];
}

ggml_tensor *Forward::ffn(int32_t il, ggml_tensor *x) {
    const LayerWeights &L = weights(il);
    if (!L.ffn_gate_inp) return mm(L.ffn_down, ggml_swiglu_split(ctx, mm(L.ffn_gate, x), mm(L.ffn_up, x)));
    // The routed mixture, as llama.cpp's build_moe_ffn computes it for these options.
    const int64_t E = hp->n_embd, X = hp->n_expert, k = hp->n_expert_used;
    ggml_tensor *logits = mm(L.ffn_gate_inp, x);  // [X, n]
    if (L.ffn_gate_inp_b) logits = ggml_add(ctx, logits, L.ffn_gate_inp_b);
    const Hparams::Gating gating = hp->expert_gating;
    ggml_tensor *probs = gating == Hparams::Gating::Sigmoid         ? ggml_sigmoid(ctx, logits)
                         : gating == Hparams::Gating::SoftmaxWeight ? logits   // the softmax comes after the pick
                                                                    : ggml_soft_max(ctx, logits);
    // the score-correction bias moves the choice only; the weights stay the unbiased probabilities
    ggml_tensor *choice = L.ffn_exp_probs_b ? ggml_add(ctx, probs, L.ffn_exp_probs_b) : probs;
    ggml_tensor *picked = ggml_argsort_top_k(ctx, choice, int(k));  // [k, n] i32
    ggml_tensor *w = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, X, n), picked);  // [1, k, n]
    if (gating == Hparams::Gating::SoftmaxWeight)   // a softmax over the chosen k logits
        w = ggml_reshape_3d(ctx, ggml_soft_max(ctx, ggml_reshape_2d(ctx, w, k, n)), 1, k, n);
    if (hp->expert_weights_norm) {
        ggml_tensor *w2 = ggml_reshape_2d(ctx, w, k, n);
        // the sum kept off zero at f16's smallest normal, as llama.cpp does
        ggml_tensor *sum = ggml_clamp(ctx, ggml_sum_rows(ctx, w2), 6.103515625e-5f, INFINITY);
        w = ggml_reshape_3d(ctx, ggml_div(ctx, w2, sum), 1, k, n);
    }
    if (hp->expert_weights_scale != 0.f && hp->expert_weights_scale != 1.f) w = ggml_scale(ctx, w, hp->expert_weights_scale);
    ggml_tensor *xr = ggml_reshape_3d(ctx, x, E, 1, n);
    ggml_tensor *gate, *up;
    if (L.ffn_gate_up_exps) {
        ggml_tensor *gu = mm_id(L.ffn_gate_up_exps, xr, picked);  // [2F, k, n]: gate, then up
        const int64_t F = gu->ne[0] / 2;
        gate = ggml_view_3d(ctx, gu, F, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], 0);
        up = ggml_view_3d(ctx, gu, F, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], size_t(F) * gu->nb[0]);
    } else {
        up = mm_id(L.ffn_up_exps, xr, picked);
        gate = mm_id(L.ffn_gate_exps, xr, picked);
    }
    // each picked expert's own biases (gpt-oss)
    if (L.ffn_up_exps_b) up = ggml_add_id(ctx, up, L.ffn_up_exps_b, picked);
    if (L.ffn_gate_exps_b) gate = ggml_add_id(ctx, gate, L.ffn_gate_exps_b, picked);
    ggml_tensor *act = hp->expert_act == Hparams::ExpertAct::SwigluOai ? ggml_swiglu_oai(ctx, gate, up, 1.702f, 7.0f)
                                                                      : ggml_swiglu_split(ctx, gate, up);
    ggml_tensor *experts = mm_id(L.ffn_down_exps, act, picked);  // [E, k, n]
    if (L.ffn_down_exps_b) experts = ggml_add_id(ctx, experts, L.ffn_down_exps_b, picked);
    experts = ggml_mul(ctx, experts, w);
    // the experts summed in selection order
    ggml_tensor *out = ggml_view_2d(ctx, experts, E, n, experts->nb[2], 0);
    for (int64_t i = 1; i < k; ++i)
        out = ggml_add(ctx, out, ggml_view_2d(ctx, experts, E, n, experts->nb[2], size_t(i) * experts->nb[1]));
    if (k == 1) out = ggml_cont(ctx, out);
    if (L.ffn_up_shexp) {
        ggml_tensor *sh = mm(L.ffn_down_shexp, ggml_swiglu_split(ctx, mm(L.ffn_gate_shexp, x), mm(L.ffn_up_shexp, x)));
        if (L.ffn_gate_inp_shexp) sh = ggml_mul(ctx, sh, ggml_sigmoid(ctx, mm(L.ffn_gate_inp_shexp, x)));  // [1, n] gate
        out = ggml_add(ctx, out, sh);
    }
    return out;
}

void full_rope(const GGUFKeys &kv, const Hparams &hp) {
    if (hp.n_rot != hp.head_dim_k)
        throw std::invalid_argument(kv.file + ": partial RoPE (rope.dimension_count " + std::to_string(hp.n_rot) +
                                    " != head dim " + std::to_string(hp.head_dim_k) + ") is not supported for " + kv.arch);
}

void read_swa_pattern(const GGUFKeys &kv, Hparams &hp, int64_t default_period, bool dense_first) {
    const std::string pk = kv.arch + ".attention.sliding_window_pattern";
    const int64_t pid = kv.find(pk);
    if (pid >= 0 && gguf_get_kv_type(kv.g, pid) == GGUF_TYPE_ARRAY) {
        const std::vector<int64_t> per = kv.get_ints(pk, size_t(hp.n_layer), true);
        if (per.size() != size_t(hp.n_layer))
            throw std::invalid_argument(kv.file + ": attention.sliding_window_pattern has " + std::to_string(per.size()) +
                                        " values for " + std::to_string(hp.n_layer) + " layers");
        for (int32_t il = 0; il < hp.n_layer; ++il) hp.is_swa[size_t(il)] = per[size_t(il)] != 0;
    } else {
        const int64_t period = kv.a("attention.sliding_window_pattern", default_period, false);
        if (period < 0 || period > (int64_t(1) << 30))
            throw std::invalid_argument(kv.file + ": attention.sliding_window_pattern = " + std::to_string(period) +
                                        " is out of range");
        for (int32_t il = 0; il < hp.n_layer; ++il)
            hp.is_swa[size_t(il)] = period == 0 || (dense_first ? il % period != 0 : (il % period) < period - 1);
    }
    bool any_global = false;
    for (uint8_t s : hp.is_swa) any_global = any_global || !s;
    if (!any_global)
        throw std::invalid_argument(kv.file + ": attention.sliding_window_pattern leaves no global layer; kvflash pages "
                                              "the global layers");
}

void refuse_experts(const GGUFKeys &kv, const Hparams &hp) {
    if (hp.n_expert > 0)
        throw std::invalid_argument(kv.file + ": a " + kv.arch + " file with experts (expert_count " +
                                    std::to_string(hp.n_expert) + ") is not a model kvflash knows");
}

int32_t expert_width(const GGUFKeys &kv, int64_t fallback) {
    const int64_t f = kv.a("expert_feed_forward_length", fallback, false);
    if (f <= 0 || f > (int64_t(1) << 30))
        throw std::invalid_argument(kv.file + ": the experts' width (expert_feed_forward_length " + std::to_string(f) +
                                    ") is out of range");
    return int32_t(f);
}

ggml_tensor *f32_tensor(const TensorLoader &t, const std::string &name, const std::vector<int64_t> &shape,
                        bool required, const char *what) {
    ggml_tensor *x = t.get(name, shape, required);
    if (x && x->type != GGML_TYPE_F32)
        throw std::invalid_argument(t.file + ": tensor '" + name + "' has type " + ggml_type_name(x->type) + "; " +
                                    what + " must be F32: re-convert the model");
    return x;
}

void load_ffn(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L) {
    if (hp.n_expert > 0) return load_moe(t, hp, il, L);
    const int64_t E = hp.n_embd;
    L.ffn_gate = t.get(TensorLoader::weight(il, "ffn_gate"), {E, hp.n_ff});
    L.ffn_up = t.get(TensorLoader::weight(il, "ffn_up"), {E, hp.n_ff});
    L.ffn_down = t.get(TensorLoader::weight(il, "ffn_down"), {hp.n_ff, E});
}

void load_moe(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L) {
    auto w = [&](const char *s) { return TensorLoader::weight(il, s); };
    const int64_t E = hp.n_embd, X = hp.n_expert, F = hp.n_ff_exp;
    L.ffn_gate_inp = t.get(w("ffn_gate_inp"), {E, X});
    L.ffn_gate_up_exps = t.get(w("ffn_gate_up_exps"), {E, 2 * F, X}, false);
    if (!L.ffn_gate_up_exps) {
        L.ffn_gate_exps = t.get(w("ffn_gate_exps"), {E, F, X});
        L.ffn_up_exps = t.get(w("ffn_up_exps"), {E, F, X});
    }
    L.ffn_down_exps = t.get(w("ffn_down_exps"), {F, E, X});
    if (hp.n_ff_shexp > 0) {
        const int64_t S = hp.n_ff_shexp;
        L.ffn_gate_inp_shexp = t.get(w("ffn_gate_inp_shexp"), {E});
        L.ffn_gate_shexp = t.get(w("ffn_gate_shexp"), {E, S});
        L.ffn_up_shexp = t.get(w("ffn_up_shexp"), {E, S});
        L.ffn_down_shexp = t.get(w("ffn_down_shexp"), {S, E});
    }
}

ggml_tensor *Forward::head(ggml_tensor *x, bool all_logits) const {
    if (!all_logits && n > 1) x = ggml_view_2d(ctx, x, hp->n_embd, 1, x->nb[1], size_t(n - 1) * x->nb[1]);
    x = norm(x, model->output_norm);
    ggml_tensor *logits = mm(model->output_for(one_row ? 1 : int32_t(x->ne[1])), x);
    if (hp->final_softcap > 0.f) {
        logits = ggml_scale(ctx, logits, 1.0f / hp->final_softcap);
        logits = ggml_tanh(ctx, logits);
        logits = ggml_scale(ctx, logits, hp->final_softcap);
    }
    return logits;
}

}  // namespace kvflash
