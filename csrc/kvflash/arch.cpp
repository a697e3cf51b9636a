// The registry of architecture families, and the graph blocks they share.
#include "kvflash/arch.h"
#include "kvflash/one_row_cpu.h"

#include <algorithm>

namespace kvflash {

// Registration: one entry per family, each defined in its arch_*.cpp.
#define KVFLASH_ARCHS(X) X(kArchLlama) X(kArchQwen2) X(kArchQwen3) X(kArchGemma3)

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
    const int32_t D = hp->head_dim_k, H = hp->n_head, Hkv = hp->n_head_kv;
    const bool swa = hp->is_swa[il] != 0;
    const float base = swa ? hp->rope_base_swa : hp->rope_base, scale = swa ? hp->rope_scale_swa : hp->rope_scale;
    q = ggml_rope_ext(ctx, q, pos, nullptr, hp->n_rot, hp->rope_mode, int(hp->n_ctx_train), base, scale, 0.f, 1.f, 32.f, 1.f);
    k = ggml_rope_ext(ctx, k, pos, nullptr, hp->n_rot, hp->rope_mode, int(hp->n_ctx_train), base, scale, 0.f, 1.f, 32.f, 1.f);
    const LayerCache &c = caches[il];
    if (c.paged && n_capture > 0) {
        ggml_tensor *ql = ggml_view_3d(ctx, q, D, H, n_capture, q->nb[1], q->nb[2], size_t(n - n_capture) * q->nb[2]);
        ql = ggml_cont(ctx, ql);
        ggml_set_output(ql);
        ggml_build_forward_expand(gf, ql);
        q_out.push_back(ql);
    }
    if (q_scale != 1.0f) q = ggml_scale(ctx, q, q_scale);

    // Store K/V rows at their slots (RoPE already applied with the logical position).
    ggml_tensor *ks = ggml_set_rows(ctx, c.k, ggml_reshape_2d(ctx, k, hp->n_embd_k(), n), c.slots);
    ggml_tensor *vs = ggml_set_rows(ctx, c.v, ggml_reshape_2d(ctx, v, hp->n_embd_v(), n), c.slots);
    ggml_build_forward_expand(gf, ks);
    ggml_build_forward_expand(gf, vs);
    ggml_tensor *att;
    if (pool_attn && c.params->rows) {
        // Exact mode: the rows come through the layer's row table (pool and host store); the
        // stored tensors are operands for the order after their writes.
        c.params->scale = kq_scale;
        att = pool_attention_cpu(ctx, q, ks, vs, c.mask, c.params);
    } else if (pool_attn) {
        ggml_tensor *k2 = ggml_view_2d(ctx, ks, ks->ne[0], c.n_kv, ks->nb[1], 0);
        ggml_tensor *v2 = ggml_view_2d(ctx, vs, vs->ne[0], c.n_kv, vs->nb[1], 0);
        c.params->scale = kq_scale;
        att = pool_attention_cpu(ctx, q, k2, v2, c.mask, c.params);  // [D, H, n]
    } else {
        // k: [D, n_kv, Hkv] viewed from the stored rows [n_embd_k, n_kv].
        ggml_tensor *kv_k = ggml_view_3d(ctx, ks, D, c.n_kv, Hkv, ks->nb[1], ggml_row_size(ks->type, D), 0);
        ggml_tensor *kv_v = ggml_view_3d(ctx, vs, D, c.n_kv, Hkv, vs->nb[1], ggml_row_size(vs->type, D), 0);
        ggml_tensor *qp = ggml_permute(ctx, q, 0, 2, 1, 3);  // [D, n, H]
        att = ggml_flash_attn_ext(ctx, qp, kv_k, kv_v, c.mask, kq_scale, 0.f, 0.f);
        ggml_prec_set_acc(att, GGML_PREC_F32);
    }
    return ggml_reshape_2d(ctx, att, int64_t(D) * H, n);
}

ggml_tensor *Forward::mm(ggml_tensor *w, ggml_tensor *x) const {
    if (!one_row || x->ne[1] == 1) return ggml_mul_mat(ctx, w, x);
    return one_row_products(ctx, w, x, model->plain(w));
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
