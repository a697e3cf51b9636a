// Qwen3.5 / 3.6 hybrids (qwen35, and qwen35moe with routed experts and a shared expert): Gated DeltaNet
// linear-attention layers with a full-attention layer every full_attention_interval-th (or as the file's
// attention.recurrent_layers lists).  Full-attention layers: a gated query (wq's rows hold each head's
// query, then its gate; the output is multiplied by sigmoid(gate)), q/k RMS norms, interleaved
// multi-section RoPE over a partial head (n_rot < head dim), paged like any attention layer.  Recurrent
// layers: q/k/v from one projection through a causal conv (kernel d_conv, SiLU), q and k L2-normed, the
// gated delta rule (ggml_gated_delta_net) with decay -exp(A) softplus(alpha + dt_bias) and write strength
// sigmoid(beta), the output RMS-normed and gated by SiLU(z); their state is the runtime's RecurrentState.
// Every layer: pre-norm, the block, a residual; then post_attention_norm, the FFN, a residual.
// MTP / nextn blocks at the end of the file (nextn_predict_layers) are not loaded.
#include "kvflash/arch.h"

#include <cmath>
#include <stdexcept>

namespace kvflash {

namespace {

void read_qwen35(const GGUFKeys &kv, Hparams &hp) {
    hp.rope_mode = GGML_ROPE_TYPE_IMROPE;
    hp.rope_multi = true;
    const std::vector<int64_t> sec = kv.get_ints(kv.arch + ".rope.dimension_sections", 4, true);
    int64_t sum = 0;
    for (size_t i = 0; i < sec.size(); ++i) {
        if (sec[i] < 0 || sec[i] > hp.n_rot) throw std::invalid_argument(kv.file + ": rope.dimension_sections out of range");
        hp.rope_sections[i] = int(sec[i]);
        sum += sec[i];
    }
    if (sum <= 0) throw std::invalid_argument(kv.file + ": rope.dimension_sections are all 0");
    // MTP / nextn blocks follow the trunk's layers
    const int64_t nextn = kv.a("nextn_predict_layers", 0, false);
    if (nextn < 0 || nextn >= hp.n_layer)
        throw std::invalid_argument(kv.file + ": nextn_predict_layers " + std::to_string(nextn) + " leaves no trunk layers");
    const int32_t n_all = hp.n_layer;
    hp.n_layer_nextn = int32_t(nextn);
    hp.n_layer = n_all - hp.n_layer_nextn;
    hp.is_swa.assign(size_t(hp.n_layer), 0);
    hp.is_recr.assign(size_t(hp.n_layer), 0);
    const std::vector<int64_t> recr = kv.get_ints(kv.arch + ".attention.recurrent_layers", size_t(n_all), false);
    if (!recr.empty()) {
        if (recr.size() != size_t(n_all) && recr.size() != 1)
            throw std::invalid_argument(kv.file + ": attention.recurrent_layers has " + std::to_string(recr.size()) +
                                        " values for " + std::to_string(n_all) + " layers");
        for (int32_t il = 0; il < hp.n_layer; ++il) hp.is_recr[size_t(il)] = recr[recr.size() == 1 ? 0 : size_t(il)] != 0;
    } else {
        const int64_t interval = kv.a("full_attention_interval", 4, false);
        if (interval <= 0) throw std::invalid_argument(kv.file + ": full_attention_interval must be > 0");
        for (int32_t il = 0; il < hp.n_layer; ++il) hp.is_recr[size_t(il)] = (il + 1) % interval != 0;
    }
    bool any_attn = false;
    for (uint8_t r : hp.is_recr) any_attn = any_attn || !r;
    if (!any_attn) throw std::invalid_argument(kv.file + ": every layer is recurrent; kvflash pages attention layers");
    auto ssm = [&](const char *k) {
        const int64_t v = kv.a(k, 0, true);
        if (v <= 0 || v > (int64_t(1) << 20)) throw std::invalid_argument(kv.file + ": " + kv.arch + "." + k + " out of range");
        return int32_t(v);
    };
    hp.ssm_d_conv = ssm("ssm.conv_kernel");
    hp.ssm_d_inner = ssm("ssm.inner_size");
    hp.ssm_d_state = ssm("ssm.state_size");
    hp.ssm_dt_rank = ssm("ssm.time_step_rank");
    hp.ssm_n_group = ssm("ssm.group_count");
    if (hp.ssm_d_conv < 2) throw std::invalid_argument(kv.file + ": ssm.conv_kernel must be >= 2");
    if (hp.ssm_d_inner % hp.ssm_dt_rank != 0 || hp.ssm_d_inner / hp.ssm_dt_rank != hp.ssm_d_state)
        throw std::invalid_argument(kv.file + ": ssm.inner_size must be ssm.time_step_rank x ssm.state_size (the delta rule's "
                                              "value heads are as wide as its keys)");
    if (hp.ssm_dt_rank % hp.ssm_n_group != 0)
        throw std::invalid_argument(kv.file + ": ssm.time_step_rank must be a multiple of ssm.group_count");
    hp.attn_out_gate = true;
    if (hp.n_expert > 0) {
        hp.n_ff_exp = expert_width(kv, hp.n_ff / hp.n_expert_used);
        hp.n_ff_shexp = int32_t(kv.a("expert_shared_feed_forward_length", hp.n_ff, false));
        if (hp.n_ff_shexp <= 0) throw std::invalid_argument(kv.file + ": the shared expert's width is missing");
        hp.expert_weights_norm = true;
    } else if (hp.n_ff <= 0) {
        throw std::invalid_argument(kv.file + ": feed_forward_length is missing");
    }
}

void read_qwen35moe(const GGUFKeys &kv, Hparams &hp) {
    if (hp.n_expert == 0) throw std::invalid_argument(kv.file + ": a qwen35moe file needs expert_count and expert_used_count");
    read_qwen35(kv, hp);
}

void read_qwen35_dense(const GGUFKeys &kv, Hparams &hp) {
    refuse_experts(kv, hp);
    read_qwen35(kv, hp);
}

void load_layer(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L) {
    auto w = [&](const char *s) { return TensorLoader::weight(il, s); };
    const int64_t E = hp.n_embd, D = hp.head_dim_k;
    L.attn_norm = t.get(w("attn_norm"), {E});
    L.ffn_norm = t.get(w("post_attention_norm"), {E});   // the FFN's pre-norm
    if (!hp.is_recr[size_t(il)]) {
        L.wq = t.get(w("attn_q"), {E, 2 * D * hp.n_head});
        L.wk = t.get(w("attn_k"), {E, hp.n_embd_k()});
        L.wv = t.get(w("attn_v"), {E, hp.n_embd_v()});
        L.wo = t.get(w("attn_output"), {D * hp.n_head, E});
        L.q_norm = t.get(w("attn_q_norm"), {D});
        L.k_norm = t.get(w("attn_k_norm"), {D});
    } else {
        const int64_t C = hp.ssm_conv_channels(), Hv = hp.ssm_dt_rank;
        L.wqkv = t.get(w("attn_qkv"), {E, C});
        L.wqkv_gate = t.get(w("attn_gate"), {E, hp.ssm_d_inner});
        L.ssm_conv1d = t.get(w("ssm_conv1d"), {hp.ssm_d_conv, C});
        if (L.ssm_conv1d->type != GGML_TYPE_F32)
            throw std::invalid_argument(t.file + ": tensor '" + w("ssm_conv1d") + "' must be F32 (ggml's conv takes F32)");
        L.ssm_dt = t.get(TensorLoader::bias(il, "ssm_dt"), {Hv});
        L.ssm_a = t.get("blk." + std::to_string(il) + ".ssm_a", {Hv});
        L.ssm_beta = t.get(w("ssm_beta"), {E, Hv});
        L.ssm_alpha = t.get(w("ssm_alpha"), {E, Hv});
        L.ssm_norm = t.get(w("ssm_norm"), {hp.ssm_d_state});
        L.ssm_out = t.get(w("ssm_out"), {hp.ssm_d_inner, E});
    }
    load_ffn(t, hp, il, L);
}

ggml_tensor *embed(Forward &f) { return ggml_get_rows(f.ctx, f.model->tok_embd, f.tokens); }

// cur [n_embd, n] (normed) -> [n_embd, n]: gated full attention over the pool.
ggml_tensor *attention(Forward &f, int32_t il, ggml_tensor *cur) {
    ggml_context *ctx = f.ctx;
    const Hparams &hp = *f.hp;
    const LayerWeights &L = f.weights(il);
    const int64_t D = hp.head_dim_k, H = hp.n_head, n = f.n;
    ggml_tensor *qg = f.mm(L.wq, cur);   // [2 D H, n]: per head the query, then its gate
    const size_t es = ggml_element_size(qg);
    ggml_tensor *q = ggml_view_3d(ctx, qg, D, H, n, es * D * 2, es * D * 2 * H, 0);
    ggml_tensor *gate = ggml_cont_2d(ctx, ggml_view_3d(ctx, qg, D, H, n, es * D * 2, es * D * 2 * H, es * D), D * H, n);
    q = f.norm(q, L.q_norm);
    ggml_tensor *k = f.norm(ggml_reshape_3d(ctx, f.mm(L.wk, cur), D, hp.n_head_kv, n), L.k_norm);
    ggml_tensor *v = f.mm(L.wv, cur);
    ggml_tensor *o = f.attention(il, q, k, v, 1.0f, hp.attn_scale);   // [D H, n]
    o = ggml_mul(ctx, o, ggml_sigmoid(ctx, gate));
    return f.mm(L.wo, o);
}

// q or k rows [S, heads, n] -> L2-normalised (as llama.cpp: an RMS norm with eps / S, times 1 / sqrt(S)).
ggml_tensor *l2_norm(ggml_context *ctx, ggml_tensor *x, float eps) {
    const float S = float(x->ne[0]);
    return ggml_scale(ctx, ggml_rms_norm(ctx, x, eps / S), 1.0f / std::sqrt(S));
}

// cur [n_embd, n] (normed) -> [n_embd, n]: the Gated DeltaNet block, its state read from and written to
// the layer's rings.
ggml_tensor *linear_attention(Forward &f, int32_t il, ggml_tensor *cur) {
    ggml_context *ctx = f.ctx;
    const Hparams &hp = *f.hp;
    const LayerWeights &L = f.weights(il);
    const LayerCache &c = f.caches[size_t(il)];
    const int64_t n = f.n, S = hp.ssm_d_state, Hk = hp.ssm_n_group, Hv = hp.ssm_dt_rank, C = hp.ssm_conv_channels();
    const int64_t dc = hp.ssm_d_conv;
    ggml_tensor *qkv = f.mm(L.wqkv, cur);        // [C, n]
    ggml_tensor *z = f.mm(L.wqkv_gate, cur);     // [S Hv, n]
    ggml_tensor *beta = ggml_sigmoid(ctx, ggml_reshape_4d(ctx, f.mm(L.ssm_beta, cur), 1, Hv, n, 1));
    ggml_tensor *alpha = ggml_add(ctx, f.mm(L.ssm_alpha, cur), L.ssm_dt);                 // [Hv, n]
    ggml_tensor *g = ggml_reshape_4d(ctx, ggml_mul(ctx, ggml_softplus(ctx, alpha), L.ssm_a), 1, Hv, n, 1);

    // the conv over the d_conv - 1 inputs before the piece and the piece's own; the piece's last inputs
    // go to the ring for the pieces after it
    ggml_tensor *prev = ggml_get_rows(ctx, c.conv, f.conv_in);                              // [C, dc - 1]
    ggml_tensor *ci = ggml_concat(ctx, prev, qkv, 1);                                        // [C, dc - 1 + n]
    // the rows written are taken from the concat, so they are written after prev is read (a long
    // piece's last rows may land where its first reads were)
    const int64_t nw = f.conv_out->ne[0];
    ggml_tensor *keep = ggml_view_2d(ctx, ci, C, nw, ci->nb[1], size_t(dc - 1 + n - nw) * ci->nb[1]);
    ggml_build_forward_expand(f.gf, ggml_set_rows(ctx, c.conv, keep, f.conv_out));
    ggml_tensor *sx = ggml_cont(ctx, ggml_transpose(ctx, ci));                               // [dc - 1 + n, C]
    sx = ggml_reshape_3d(ctx, sx, dc - 1 + n, C, 1);
    ggml_tensor *conv = ggml_silu(ctx, ggml_ssm_conv(ctx, sx, L.ssm_conv1d));              // [C, n, 1]
    const size_t es = ggml_element_size(conv);
    ggml_tensor *q = ggml_view_4d(ctx, conv, S, Hk, n, 1, es * S, conv->nb[1], conv->nb[1] * n, 0);
    ggml_tensor *k = ggml_view_4d(ctx, conv, S, Hk, n, 1, es * S, conv->nb[1], conv->nb[1] * n, es * S * Hk);
    ggml_tensor *v = ggml_view_4d(ctx, conv, S, Hv, n, 1, es * S, conv->nb[1], conv->nb[1] * n, es * 2 * S * Hk);
    q = l2_norm(ctx, q, hp.rms_eps);
    k = l2_norm(ctx, k, hp.rms_eps);

    // the state after the position before the piece; the op's snapshots (newest first) to the ring
    ggml_tensor *s0 = ggml_reshape_4d(ctx, ggml_get_rows(ctx, c.ssm, f.ssm_in), S, S, Hv, 1);
    const int64_t K = f.ssm_out->ne[0];
    ggml_tensor *out = ggml_gated_delta_net(ctx, q, k, v, g, beta, s0, K);
    const int64_t attn_elems = S * Hv * n, state_elems = S * S * Hv;
    ggml_tensor *o = ggml_view_4d(ctx, out, S, Hv, n, 1, es * S, es * S * Hv, es * attn_elems, 0);
    ggml_tensor *snaps = ggml_view_2d(ctx, out, state_elems, K, es * state_elems, es * attn_elems);
    ggml_build_forward_expand(f.gf, ggml_set_rows(ctx, c.ssm, snaps, f.ssm_out));

    ggml_tensor *zz = ggml_reshape_4d(ctx, z, S, Hv, n, 1);
    o = ggml_mul(ctx, f.norm(o, L.ssm_norm), ggml_silu(ctx, zz));
    return f.mm(L.ssm_out, ggml_reshape_2d(ctx, o, S * Hv, n));
}

ggml_tensor *layer(Forward &f, int32_t il, ggml_tensor *x) {
    ggml_context *ctx = f.ctx;
    const LayerWeights &L = f.weights(il);
    ggml_tensor *cur = f.norm(x, L.attn_norm);
    cur = f.hp->is_recr[size_t(il)] ? linear_attention(f, il, cur) : attention(f, il, cur);
    x = ggml_add(ctx, x, cur);
    return ggml_add(ctx, x, f.ffn(il, f.norm(x, L.ffn_norm)));
}

}  // namespace

extern const ArchOps kArchQwen35, kArchQwen35Moe;
const ArchOps kArchQwen35{"qwen35", read_qwen35_dense, load_layer, embed, layer, true};
const ArchOps kArchQwen35Moe{"qwen35moe", read_qwen35moe, load_layer, embed, layer, true};

}  // namespace kvflash
