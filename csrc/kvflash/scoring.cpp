#include "kvflash/scoring.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <stdexcept>
#include <string>
#include <thread>

#include "ggml-alloc.h"
#include "kvflash/attn_cpu.h"
#include "kvflash/rpc.h"

namespace kvflash {

// ---------------------------------------------------------------- chunk summaries

void ChunkSummaries::rewritten(const Runtime &rt, int64_t pos0, int32_t n) {
    const int64_t C = rt.config().chunk_tokens;
    for (int64_t c = pos0 / C; c <= (pos0 + n - 1) / C && c < int64_t(ready_.size()); ++c) ready_[size_t(c)] = 0;
    evaluated(rt, pos0, n);
}

void ChunkSummaries::evaluated(const Runtime &rt, int64_t pos0, int32_t n) {
    const Pager &pg = rt.pager();
    const int32_t C = rt.config().chunk_tokens, L = rt.pool().n_layers(), E = rt.model().hparams().n_embd_k();
    const int32_t D = rt.model().hparams().head_dim_k;
    const size_t per_chunk = size_t(L) * E;
    if (ready_.size() != size_t(pg.n_chunks())) {
        ready_.assign(pg.n_chunks(), 0);
        min_.assign(per_chunk * pg.n_chunks(), 0.f);
        max_.assign(per_chunk * pg.n_chunks(), 0.f);
        mean_.assign(per_chunk * pg.n_chunks(), 0.f);
    }
    std::vector<float> keys(size_t(C) * E);
    bool synced = false;
    for (int64_t c = pos0 / C; c <= (pos0 + n - 1) / C; ++c) {
        if (ready_[c] || pg.n_written(int32_t(c)) != C || pg.block_of(int32_t(c)) < 0) continue;
        if (!synced) {
            rt.sync_for_host_read();  // once per eval, before the first pool read
            synced = true;
        }
        for (int32_t l = 0; l < L; ++l) {
            rt.chunk_keys_synced(int32_t(c), l, keys.data());
            float *mn = &min_[c * per_chunk + size_t(l) * E], *mx = &max_[c * per_chunk + size_t(l) * E];
            float *me = &mean_[c * per_chunk + size_t(l) * E];
            for (int32_t e = 0; e < E; ++e) { mn[e] = keys[e]; mx[e] = keys[e]; me[e] = 0.f; }
            for (int32_t i = 0; i < C; ++i)
                for (int32_t e = 0; e < E; ++e) {
                    const float x = keys[size_t(i) * E + e];
                    mn[e] = std::min(mn[e], x);
                    mx[e] = std::max(mx[e], x);
                    me[e] += x;
                }
            // Mean key per KV head, L2-normalised.
            for (int32_t g = 0; g < E / D; ++g) {
                double ss = 0;
                for (int32_t d = 0; d < D; ++d) ss += double(me[g * D + d]) * me[g * D + d];
                const float inv = ss > 0 ? float(1.0 / std::sqrt(ss)) : 0.f;
                for (int32_t d = 0; d < D; ++d) me[g * D + d] *= inv;
            }
        }
        ready_[c] = 1;
    }
}

void ChunkSummaries::truncated(const Runtime &rt, int64_t n_past) {
    for (size_t c = size_t(n_past / rt.config().chunk_tokens); c < ready_.size(); ++c) ready_[c] = 0;
}

void ChunkSummaries::qk_scores(const Runtime &rt, QKMode mode, float *out, int32_t n) const {
    const Hparams &hp = rt.model().hparams();
    const int32_t L = rt.pool().n_layers(), E = hp.n_embd_k(), D = hp.head_dim_k, H = hp.n_head;
    const int32_t G = H / hp.n_head_kv, nc = rt.n_captured();
    if (n < 0 || n > rt.pager().n_chunks()) throw std::out_of_range("qk_scores: bad chunk count");
    if (nc == 0) throw std::invalid_argument("qk_scores: no query captured yet (evaluate a token first)");
    const std::vector<float> &cq = rt.captured_queries();
    const size_t per_layer_q = size_t(nc) * H * D, per_chunk = size_t(L) * E;
    for (int32_t c = 0; c < n; ++c) {
        if (size_t(c) >= ready_.size() || !ready_[c]) { out[c] = std::numeric_limits<float>::infinity(); continue; }
        double total = 0;
        for (int32_t l = 0; l < L; ++l) {
            const float *q = cq.data() + l * per_layer_q + size_t(nc - 1) * H * D;  // the last captured query
            float best = -std::numeric_limits<float>::infinity();
            for (int32_t h = 0; h < H; ++h) {
                const size_t at = c * per_chunk + size_t(l) * E + size_t(h / G) * D;
                const float *qh = q + size_t(h) * D;
                float s = 0.f;
                if (mode == QKMode::MEAN) {
                    for (int32_t d = 0; d < D; ++d) s += qh[d] * mean_[at + d];
                } else {
                    for (int32_t d = 0; d < D; ++d) s += std::max(qh[d] * min_[at + d], qh[d] * max_[at + d]);
                }
                best = std::max(best, s);
            }
            total += best;
        }
        out[c] = float(total / L);
    }
}

// ---------------------------------------------------------------- attention over the pool

namespace {

// Pool layer il's attention sinks ([n_head], read from wherever the weights are), or empty when the layer
// has none: the scorers' softmaxes take them as the layer's attention does.
std::vector<float> layer_sinks(const Runtime &rt, int32_t il) {
    const int32_t layer = rt.pool().layer(il).layer;
    const ggml_tensor *t = rt.model().layers[size_t(layer)].attn_sinks;
    if (!t) return {};
    std::vector<float> s(size_t(ggml_nelements(t)));
    std::unique_lock<std::mutex> lock(rt.model().compute_mutex(), std::defer_lock);
    if (rt.model().layer_remote(layer) >= 0) lock.lock();   // read over the server's connection, the model's
    ggml_backend_tensor_get(const_cast<ggml_tensor *>(t), s.data(), 0, ggml_nbytes(t));
    return s;
}

const float *or_null(const std::vector<float> &v) { return v.empty() ? nullptr : v.data(); }

}  // namespace

void attention_scores(const Runtime &rt, float *out, int64_t n) {
    const Hparams &hp = rt.model().hparams();
    const int32_t L = rt.pool().n_layers(), D = hp.head_dim_k, H = hp.n_head, nc = rt.n_captured();
    if (nc == 0) throw std::invalid_argument("attention_scores: no query captured yet");
    rt.sync_for_host_read();  // pool_attention_probs reads the pool's K rows
    std::fill(out, out + n, 0.f);
    const Pager &pg = rt.pager();
    std::vector<int64_t> qpos(nc);
    for (int32_t i = 0; i < nc; ++i) qpos[i] = rt.n_past() - nc + i;
    for (int32_t l = 0; l < L; ++l) {
        const float *q = rt.captured_queries().data() + size_t(l) * nc * H * D;
        const std::vector<float> sinks = layer_sinks(rt, l);
        pool_attention_probs(q, nc, H, hp.n_head_kv, D, rt.pool().k(l), pg.used_extent(), pg.slot_positions().data(),
                             qpos.data(), hp.attn_scale, out, n, or_null(sinks));
    }
}

// ---------------------------------------------------------------- attention over the history

namespace {

// One paged layer's K rows for the first n_chunks chunks, from the pool or the host store.
// rows: [n_chunks * C][row bytes]; row_pos: the position each row holds (-1: none).
void gather_history_rows(const Runtime &rt, int32_t il, int32_t n_chunks, int64_t n_pos, const std::vector<size_t> &host_off,
                         std::vector<uint8_t> &rows, std::vector<uint8_t> &pool_rows, std::vector<int64_t> &row_pos) {
    const Pager &pg = rt.pager();
    const int32_t C = rt.config().chunk_tokens;
    ggml_tensor *k = rt.pool().k(il);
    const size_t rb = k->nb[1];
    rows.resize(size_t(n_chunks) * C * rb);
    row_pos.assign(size_t(n_chunks) * C, -1);
    // the resident part of the pool, read once (one tensor_get, not one per chunk)
    const int32_t extent = pg.used_extent();
    pool_rows.resize(size_t(extent) * rb);
    if (extent > 0) ggml_backend_tensor_get(k, pool_rows.data(), 0, pool_rows.size());
    for (int32_t c = 0; c < n_chunks; ++c) {
        const int32_t w = std::min<int64_t>(pg.n_written(c), n_pos - int64_t(c) * C);
        if (w <= 0) continue;
        const uint8_t *src = nullptr;
        const int32_t b = pg.block_of(c);
        if (b >= 0) src = pool_rows.data() + size_t(b) * C * rb;
        else if (pg.host_of(c) >= 0) src = pg.host_store().ptr(pg.host_of(c)) + host_off[il];
        if (!src) continue;
        std::memcpy(rows.data() + size_t(c) * C * rb, src, size_t(w) * rb);
        for (int32_t i = 0; i < w; ++i) row_pos[size_t(c) * C + i] = int64_t(c) * C + i;
    }
}

// ---- the device share: layers whose K rows are not in this process's memory -- a pool slice on an RPC
// server (Model::remote_layers), or a GPU runtime's pool (the runtime's own backend) -- scored where they are
//
// The softmax of a query head runs over the whole history, part resident on the device, part in the
// host store.  Round 1: the device computes, per (query, head), the max and the sum of exps of its
// resident slots' logits (stock ops: the K rows cast to f32, one product, a max pool, exp, row sums)
// and returns those two numbers; the host computes the same for its host-store rows, and merges them
// into the history's max M and normaliser Z.  Round 2: the device sends, per resident slot, the max over
// heads of sum_i exp(logit - M) / Z / n_queries (the score history_attention gives a token), and the host
// computes it for its rows.  Per layer the device gets the queries and a visibility mask and gives back a
// few floats per query head and one per slot, never the keys.  The logits are f32 dot products of
// dequantized keys as on the host, summed in the device's order: scores agree with the host path to float
// rounding, not bit for bit.

struct BufFree {
    void operator()(ggml_backend_buffer_t b) const { ggml_backend_buffer_free(b); }
};
struct AllocFree {
    void operator()(ggml_gallocr_t a) const { ggml_gallocr_free(a); }
};
using AllocPtr = std::unique_ptr<std::remove_pointer_t<ggml_gallocr_t>, AllocFree>;
using CtxPtr = std::unique_ptr<ggml_context, void (*)(ggml_context *)>;

// A share's inputs in its device's memory, for up to S_cap resident slots and nq_cap queries: the mask
// [S, nq] (0 visible, -1e30 not) and, per pool layer of the share, the queries [D, nq, H], the history's
// max M and 1 / (Z nq) [1, nq, H].  A call with fewer writes their first elements and views them.
struct ShareInputs {
    CtxPtr ctx{nullptr, ggml_free};
    std::unique_ptr<ggml_backend_buffer, BufFree> buf;
    ggml_tensor *mask = nullptr;
    std::vector<ggml_tensor *> q, m, w;   // by pool layer (nullptr: not in the share)
    int32_t S_cap = 0, nq_cap = 0;
};

ShareInputs share_inputs(const Runtime &rt, ggml_backend_buffer_type_t buft, const std::vector<int32_t> &layers,
                         int32_t S_cap, int32_t nq_cap) {
    const Hparams &hp = rt.model().hparams();
    const int32_t D = hp.head_dim_k, H = hp.n_head;
    ShareInputs in;
    in.S_cap = S_cap;
    in.nq_cap = nq_cap;
    ggml_init_params ip{ggml_tensor_overhead() * (3 * layers.size() + 2), nullptr, true};
    in.ctx.reset(ggml_init(ip));
    if (!in.ctx) throw std::runtime_error("device scoring: ggml_init failed");
    in.mask = ggml_new_tensor_3d(in.ctx.get(), GGML_TYPE_F32, S_cap, nq_cap, 1);
    const size_t L = size_t(rt.pool().n_layers());
    in.q.assign(L, nullptr);
    in.m.assign(L, nullptr);
    in.w.assign(L, nullptr);
    for (int32_t il : layers) {
        in.q[size_t(il)] = ggml_new_tensor_3d(in.ctx.get(), GGML_TYPE_F32, D, nq_cap, H);
        in.m[size_t(il)] = ggml_new_tensor_3d(in.ctx.get(), GGML_TYPE_F32, 1, nq_cap, H);
        in.w[size_t(il)] = ggml_new_tensor_3d(in.ctx.get(), GGML_TYPE_F32, 1, nq_cap, H);
    }
    in.buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(in.ctx.get(), buft));
    if (!in.buf) throw std::runtime_error("device scoring: the device could not allocate the queries");
    return in;
}

// Input t seen as [a, b, c] (its first a*b*c elements); a view even at its own shape, so the graph of the
// largest call (a reservation's) has the nodes of every smaller one.
ggml_tensor *input_as(ggml_context *ctx, ggml_tensor *t, int64_t a, int64_t b, int64_t c) {
    return ggml_view_3d(ctx, t, a, b, c, size_t(a) * sizeof(float), size_t(a * b) * sizeof(float), 0);
}

// A round's outputs for S resident slots and nq queries, per layer of the share in order.  Round 0: per
// (query, head) the resident slots' max and sum of exps (two outputs a layer, [1, nq, H]); round 1: per
// resident slot the max over heads of the queries' mean probability ([1, S]).  A CPU (an RPC server's) takes
// one product per head, the queries [D, nq, H], the keys dotted in place in f32.  gpu: one-column products,
// the queries [D, 1, H nq], over each KV head's keys copied into rows of their own: what a GPU computes in
// f32 (ggml-vulkan's matrix kernels round both operands to f16 on a device with f16 arithmetic and take a
// strided operand through f16 on any; its one-column kernel reads f32).
std::vector<ggml_tensor *> build_share_round(ggml_context *ctx, int round, const Runtime &rt, const ShareInputs &in,
                                             const std::vector<int32_t> &layers, int32_t S, int32_t nq, bool gpu) {
    const Hparams &hp = rt.model().hparams();
    const int32_t D = hp.head_dim_k, H = hp.n_head, Hkv = hp.n_head_kv;
    ggml_tensor *mask = input_as(ctx, in.mask, S, nq, 1);
    // the masked, scaled logits of layer il: [S, nq, H]
    auto logits = [&](int32_t il) {
        ggml_tensor *k = rt.pool().k(il);
        ggml_tensor *k32 = ggml_cast(ctx, ggml_view_2d(ctx, k, k->ne[0], S, k->nb[1], 0), GGML_TYPE_F32);   // [D Hkv, S]
        ggml_tensor *k3 = ggml_view_3d(ctx, k32, D, S, Hkv, k32->nb[1], size_t(D) * sizeof(float), 0);
        if (gpu && Hkv > 1) k3 = ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_3d(ctx, k32, D, Hkv, S), 0, 2, 1, 3));
        // gpu: a column a (head, query), [D, 1, H nq]: batch h nq + i takes KV head (h nq + i) / (G nq) = h / G
        ggml_tensor *q = input_as(ctx, in.q[size_t(il)], D, gpu ? 1 : nq, gpu ? int64_t(H) * nq : H);
        ggml_tensor *kq = ggml_mul_mat(ctx, k3, q);
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        if (gpu) kq = ggml_reshape_3d(ctx, kq, S, nq, H);   // [S, 1, H nq] is [S, nq, H] in memory
        return ggml_add(ctx, ggml_scale(ctx, kq, hp.attn_scale), mask);
    };
    std::vector<ggml_tensor *> o;
    for (int32_t il : layers) {
        if (round == 0) {
            ggml_tensor *ms = logits(il);
            ggml_tensor *m = ggml_pool_1d(ctx, ggml_reshape_2d(ctx, ms, S, int64_t(nq) * H), GGML_OP_POOL_MAX, S, S, 0);
            ggml_tensor *e = ggml_exp(ctx, ggml_sub(ctx, ms, ggml_reshape_3d(ctx, m, 1, nq, H)));
            o.push_back(m);
            o.push_back(ggml_sum_rows(ctx, e));
        } else {
            ggml_tensor *M = input_as(ctx, in.m[size_t(il)], 1, nq, H), *W = input_as(ctx, in.w[size_t(il)], 1, nq, H);
            ggml_tensor *p = ggml_mul(ctx, ggml_exp(ctx, ggml_sub(ctx, logits(il), M)), W);            // [S, nq, H]
            ggml_tensor *ps = ggml_sum_rows(ctx, ggml_cont(ctx, ggml_permute(ctx, p, 1, 0, 2, 3)));  // [1, S, H]
            ggml_tensor *ph = ggml_cont(ctx, ggml_transpose(ctx, ggml_reshape_2d(ctx, ps, S, H)));     // [H, S]
            o.push_back(ggml_pool_1d(ctx, ph, GGML_OP_POOL_MAX, H, H, 0));                             // [1, S]
        }
    }
    return o;
}

size_t share_max_nodes(size_t n_layers) { return 32 * n_layers + 16; }

// A round's graph in a context of its own over the metadata buffer meta.
ggml_cgraph *share_graph(std::vector<uint8_t> &meta, CtxPtr &ctx, int round, const Runtime &rt, const ShareInputs &in,
                         const std::vector<int32_t> &layers, int32_t S, int32_t nq, bool gpu, std::vector<ggml_tensor *> &outs) {
    const size_t max_nodes = share_max_nodes(layers.size());
    meta.resize(ggml_tensor_overhead() * max_nodes + ggml_graph_overhead_custom(max_nodes, false));
    ggml_init_params gp{meta.size(), meta.data(), true};
    ctx.reset(ggml_init(gp));
    if (!ctx) throw std::runtime_error("device scoring: ggml_init failed");
    ggml_cgraph *gf = ggml_new_graph_custom(ctx.get(), max_nodes, false);
    outs = build_share_round(ctx.get(), round, rt, in, layers, S, nq, gpu);
    for (ggml_tensor *t : outs) {
        ggml_set_output(t);
        ggml_build_forward_expand(gf, t);
    }
    return gf;
}

// Where a share's rounds run: the device, its inputs, and per round an allocator reserved beforehand
// (a GPU runtime's) or none (an RPC server's: one made for the graph, nodes checked against the list).
struct ShareDevice {
    ggml_backend_t backend;
    ggml_backend_buffer_type_t buft;
    const ShareInputs *in;
    ggml_gallocr_t alloc[2];
    bool rpc;
};

// A GPU runtime's share: its inputs and both rounds' compute buffers, reserved once at the first
// rescore for every slot of the pool and the capture window's queries over every paged layer on the
// device, and kept with the runtime (Runtime::scorer_state), so a rescore allocates and frees no device
// memory: per-call buffers on the runtime's context crashed Debian 12's lavapipe (ggml-vulkan's scratch
// buffers regrown after other buffers of the context were freed; runtime.h, backend()).
struct DeviceScoring final : Runtime::ScorerState {
    std::vector<int32_t> layers;   // pool layers in the device's memory
    ShareInputs in;
    AllocPtr alloc[2];
    std::string unusable;          // why the device cannot score (an op it lacks, memory): the host reads its keys
};

// The pool layers a GPU runtime's device holds (not host memory, not an RPC server's).
std::vector<int32_t> device_layers(const Runtime &rt) {
    std::vector<int32_t> ls;
    for (int32_t il = 0; il < rt.pool().n_layers(); ++il)
        if (!rt.pool().layer_host_accessible(il) && rt.model().layer_remote(rt.pool().layer(il).layer) < 0) ls.push_back(il);
    return ls;
}

// The runtime's device scoring, reserved for nq queries or more (anew when nq outgrows it); nullptr when
// the device cannot score (unusable says why).
DeviceScoring *device_scoring(const Runtime &rt, int32_t nq) {
    auto &state = rt.scorer_state();
    auto *ds = dynamic_cast<DeviceScoring *>(state.get());
    if (ds && !ds->unusable.empty()) return nullptr;
    if (ds && nq <= ds->in.nq_cap) return ds;
    state.reset();   // the smaller reservation goes before the larger one is made
    auto fresh = std::make_unique<DeviceScoring>();
    fresh->layers = device_layers(rt);
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(rt.backend());
    const int32_t S_cap = rt.pool().pool_tokens(), nq_cap = std::max(nq, rt.config().capture_queries);
    try {
        fresh->in = share_inputs(rt, buft, fresh->layers, S_cap, nq_cap);
        for (int round = 0; round < 2 && fresh->unusable.empty(); ++round) {
            std::vector<uint8_t> meta;
            CtxPtr ctx(nullptr, ggml_free);
            std::vector<ggml_tensor *> outs;
            ggml_cgraph *gf = share_graph(meta, ctx, round, rt, fresh->in, fresh->layers, S_cap, nq_cap, true, outs);
            for (int i = 0; i < ggml_graph_n_nodes(gf) && fresh->unusable.empty(); ++i)
                if (!ggml_backend_supports_op(rt.backend(), ggml_graph_node(gf, i)))
                    fresh->unusable = std::string("the device cannot run ") + ggml_op_desc(ggml_graph_node(gf, i));
            if (!fresh->unusable.empty()) break;
            fresh->alloc[round].reset(ggml_gallocr_new(buft));
            if (!ggml_gallocr_reserve(fresh->alloc[round].get(), gf))
                fresh->unusable = "cannot reserve the scoring graphs' compute buffer on the device";
        }
    } catch (const std::exception &e) {
        fresh->unusable = e.what();
    }
    if (!fresh->unusable.empty()) {   // keep the reason, not the buffers
        fresh->in = ShareInputs{};
        fresh->alloc[0].reset();
        fresh->alloc[1].reset();
    }
    ds = fresh.get();
    state = std::move(fresh);
    return ds->unusable.empty() ? ds : nullptr;
}

// One round computed on the share's device (the caller holds the model's compute lock), its outputs read back.
std::vector<std::vector<float>> run_share_round(const ShareDevice &dev, int round, const Runtime &rt,
                                                const std::vector<int32_t> &layers, int32_t S, int32_t nq) {
    std::vector<uint8_t> meta;
    CtxPtr ctx(nullptr, ggml_free);
    std::vector<ggml_tensor *> outs;
    ggml_cgraph *gf = share_graph(meta, ctx, round, rt, *dev.in, layers, S, nq, !dev.rpc, outs);
    if (dev.rpc) check_rpc_graph(gf);   // stock ops only
    AllocPtr own;
    ggml_gallocr_t ga = dev.alloc[round];
    if (!ga) {
        own.reset(ggml_gallocr_new(dev.buft));
        ga = own.get();
    }
    if (!ggml_gallocr_alloc_graph(ga, gf)) throw std::runtime_error("device scoring: cannot allocate the graph");
    if (ggml_backend_graph_compute(dev.backend, gf) != GGML_STATUS_SUCCESS)
        throw std::runtime_error("device scoring: graph compute failed");
    std::vector<std::vector<float>> got;
    for (ggml_tensor *t : outs) {
        got.emplace_back(size_t(ggml_nelements(t)));
        ggml_backend_tensor_get(t, got.back().data(), 0, ggml_nbytes(t));
    }
    return got;
}

void share_history_attention(const Runtime &rt, const ShareDevice &dev, const std::vector<int32_t> &layers,
                             int32_t q_first, int32_t q_count, int64_t n_pos, const std::vector<size_t> &host_off,
                             float *out, int64_t n_out) {
    const Hparams &hp = rt.model().hparams();
    const Pager &pg = rt.pager();
    const KVPool &pool = rt.pool();
    const int32_t D = hp.head_dim_k, H = hp.n_head, G = H / hp.n_head_kv, C = rt.config().chunk_tokens;
    const int32_t nq = q_count, nc = rt.n_captured(), S = pg.used_extent();
    const float scale = hp.attn_scale, ninf = -std::numeric_limits<float>::infinity();
    const size_t NL = layers.size(), QH = size_t(nq) * H;
    std::vector<int64_t> qpos(nq);
    for (int32_t i = 0; i < nq; ++i) qpos[i] = rt.n_past() - nc + q_first + i;
    // resident slots: their positions and the mask (0 visible, -1e30 not), [nq][S]
    const std::vector<int64_t> &sp = pg.slot_positions();
    std::vector<float> mask(size_t(std::max(S, 1)) * nq, -1e30f);
    std::vector<uint8_t> any_dev(QH, 0);
    for (int32_t i = 0; i < nq; ++i)
        for (int32_t s = 0; s < S; ++s)
            if (sp[size_t(s)] >= 0 && sp[size_t(s)] < n_pos && sp[size_t(s)] <= qpos[i]) {
                mask[size_t(i) * S + s] = 0.f;
                for (int32_t h = 0; h < H; ++h) any_dev[size_t(h) * nq + i] = 1;
            }
    // host-store rows: (chunk's row pointer offset, position)
    struct HostRow { const uint8_t *chunk; int32_t j; int64_t pos; };
    std::vector<HostRow> hrows;
    const int32_t n_chunks = int32_t((n_pos + C - 1) / C);
    for (int32_t c = 0; c < std::min(n_chunks, pg.n_chunks()); ++c) {
        if (pg.block_of(c) >= 0 || pg.host_of(c) < 0) continue;
        const int32_t w = int32_t(std::min<int64_t>(pg.n_written(c), n_pos - int64_t(c) * C));
        for (int32_t j = 0; j < w; ++j) hrows.push_back({pg.host_store().ptr(pg.host_of(c)), j, int64_t(c) * C + j});
    }
    // queries of each layer as [H][nq][D] (ggml [D, nq, H]: heads outermost, for the product's broadcast)
    std::vector<std::vector<float>> qs(NL, std::vector<float>(QH * D));
    for (size_t l = 0; l < NL; ++l) {
        const float *q = rt.captured_queries().data() + (size_t(layers[l]) * nc + q_first) * H * D;
        for (int32_t i = 0; i < nq; ++i)
            for (int32_t h = 0; h < H; ++h)
                std::memcpy(&qs[l][(size_t(h) * nq + i) * D], q + (size_t(i) * H + h) * D, size_t(D) * sizeof(float));
    }
    // the host's rows: logits [row][h][i] (scaled; -inf where the query does not see the row), partials
    std::vector<std::vector<float>> hlog(NL);
    std::vector<float> mh(NL * QH, ninf), Zh(NL * QH, 0.f);
    std::vector<float> krow(size_t(hp.n_embd_k()));
    for (size_t l = 0; l < NL; ++l) {
        const ggml_tensor *k = pool.k(layers[l]);
        const auto *tr = ggml_get_type_traits(k->type);
        hlog[l].assign(hrows.size() * QH, ninf);
        for (size_t r = 0; r < hrows.size(); ++r) {
            const uint8_t *row = hrows[r].chunk + host_off[size_t(layers[l])] + size_t(hrows[r].j) * k->nb[1];
            if (k->type == GGML_TYPE_F32) std::memcpy(krow.data(), row, krow.size() * sizeof(float));
            else tr->to_float(row, krow.data(), int64_t(krow.size()));
            for (int32_t h = 0; h < H; ++h)
                for (int32_t i = 0; i < nq; ++i) {
                    if (hrows[r].pos > qpos[i]) continue;
                    const float *qv = &qs[l][(size_t(h) * nq + i) * D], *kv = &krow[size_t(h / G) * D];
                    float d = 0.f;
                    for (int32_t e = 0; e < D; ++e) d += qv[e] * kv[e];
                    hlog[l][r * QH + size_t(h) * nq + i] = d * scale;
                }
        }
        for (size_t r = 0; r < hrows.size(); ++r)
            for (size_t a = 0; a < QH; ++a) mh[l * QH + a] = std::max(mh[l * QH + a], hlog[l][r * QH + a]);
        for (size_t r = 0; r < hrows.size(); ++r)
            for (size_t a = 0; a < QH; ++a)
                if (hlog[l][r * QH + a] != ninf) Zh[l * QH + a] += std::exp(hlog[l][r * QH + a] - mh[l * QH + a]);
    }
    // the layers' attention sinks (gpt-oss), one more term in each head's normaliser: [layer][h]
    std::vector<std::vector<float>> sinks(NL);
    for (size_t l = 0; l < NL; ++l) sinks[l] = layer_sinks(rt, layers[l]);
    auto sink_term = [&](size_t l, size_t a, float M) {
        return sinks[l].empty() ? 0.f : std::exp(sinks[l][a / size_t(nq)] - M);   // a = h * nq + i
    };
    std::vector<float> Mg(NL * QH, 0.f), Winv(NL * QH, 0.f);
    if (S > 0) {
        const ShareInputs &in = *dev.in;
        // one graph at a time on the model's backends (an RPC server's connection is the model's)
        std::lock_guard<std::mutex> lock(rt.model().compute_mutex());
        ggml_backend_tensor_set(in.mask, mask.data(), 0, size_t(S) * nq * sizeof(float));
        for (size_t l = 0; l < NL; ++l) ggml_backend_tensor_set(in.q[size_t(layers[l])], qs[l].data(), 0, QH * D * sizeof(float));
        // round 1: per (query, head) the resident slots' max and sum of exps
        const auto r1 = run_share_round(dev, 0, rt, layers, S, nq);
        for (size_t l = 0; l < NL; ++l)
            for (size_t a = 0; a < QH; ++a) {
                // [1, nq, H] in memory is [h][i]: a = h * nq + i, as the host's partials
                const float md = any_dev[a] ? r1[2 * l][a] : ninf, Zd = any_dev[a] ? r1[2 * l + 1][a] : 0.f;
                const float M = std::max(md, mh[l * QH + a]);
                if (M == ninf) continue;   // this query sees no key of the history in this layer
                const float Z = (Zd > 0 ? Zd * std::exp(md - M) : 0.f) + (Zh[l * QH + a] > 0 ? Zh[l * QH + a] * std::exp(mh[l * QH + a] - M) : 0.f) +
                                sink_term(l, a, M);
                Mg[l * QH + a] = M;
                Winv[l * QH + a] = Z > 0 ? 1.f / Z / float(nq) : 0.f;
            }
        for (size_t l = 0; l < NL; ++l) {
            ggml_backend_tensor_set(in.m[size_t(layers[l])], &Mg[l * QH], 0, QH * sizeof(float));
            ggml_backend_tensor_set(in.w[size_t(layers[l])], &Winv[l * QH], 0, QH * sizeof(float));
        }
        // round 2: per resident slot, the max over heads of the queries' mean probability
        const auto r2 = run_share_round(dev, 1, rt, layers, S, nq);
        for (size_t l = 0; l < NL; ++l)
            for (int32_t s = 0; s < S; ++s) {
                const int64_t pos = sp[size_t(s)];
                if (pos >= 0 && pos < n_pos && pos < n_out) out[pos] = std::max(out[pos], r2[l][size_t(s)]);
            }
    } else {
        for (size_t l = 0; l < NL; ++l)
            for (size_t a = 0; a < QH; ++a)
                if (mh[l * QH + a] != ninf) {
                    Mg[l * QH + a] = mh[l * QH + a];
                    Winv[l * QH + a] = 1.f / (Zh[l * QH + a] + sink_term(l, a, mh[l * QH + a])) / float(nq);
                }
    }
    // the host's rows with the merged normalisers
    for (size_t l = 0; l < NL; ++l)
        for (size_t r = 0; r < hrows.size(); ++r) {
            float best = 0.f;
            for (int32_t h = 0; h < H; ++h) {
                float acc = 0.f;
                for (int32_t i = 0; i < nq; ++i) {
                    const size_t a = size_t(h) * nq + i;
                    const float lg = hlog[l][r * QH + a];
                    if (lg != ninf) acc += std::exp(lg - Mg[l * QH + a]) * Winv[l * QH + a];
                }
                best = std::max(best, acc);
            }
            if (hrows[r].pos < n_out) out[hrows[r].pos] = std::max(out[hrows[r].pos], best);
        }
}

}  // namespace

void history_attention(const Runtime &rt, float *out, int64_t n, int32_t n_threads, bool per_chunk,
                       const int32_t *groups, int32_t q_first, int32_t q_count, int32_t n_layers, bool keys_on_device) {
    const int32_t nc = rt.n_captured();
    if (nc == 0) throw std::invalid_argument("history_attention: no query captured yet");
    if (q_count < 0) q_count = nc - q_first;
    if (q_first < 0 || q_count <= 0 || q_first + q_count > nc)
        throw std::invalid_argument("history_attention: queries [" + std::to_string(q_first) + ", " +
                                    std::to_string(q_first + q_count) + ") are not among the " +
                                    std::to_string(nc) + " captured");
    std::fill(out, out + n, 0.f);
    const Hparams &hp = rt.model().hparams();
    const KVPool &pool = rt.pool();
    if (n_layers < 0) throw std::invalid_argument("history_attention: n_layers must be >= 0 (0: all)");
    const int32_t L_all = pool.n_layers(), D = hp.head_dim_k, H = hp.n_head, C = rt.config().chunk_tokens;
    const int32_t L = n_layers > 0 ? std::min(n_layers, L_all) : L_all;
    const int64_t n_past = rt.n_past();
    const int64_t n_pos = groups ? n_past : per_chunk ? std::min<int64_t>(n * C, n_past) : std::min<int64_t>(n, n_past);
    const int32_t n_chunks = int32_t((n_pos + C - 1) / C);
    if (n_chunks == 0) return;
    rt.sync_for_host_read();
    // Byte offset of layer il's K rows inside a host chunk: [il][K rows][V rows].
    std::vector<size_t> host_off(L_all + 1, 0);
    for (int32_t il = 0; il < L_all; ++il)
        host_off[il + 1] = host_off[il] + size_t(C) * (pool.k(il)->nb[1] + pool.v(il)->nb[1]);
    std::vector<int64_t> qpos(q_count);
    for (int32_t i = 0; i < q_count; ++i) qpos[i] = n_past - nc + q_first + i;

    // Token scores of layers whose K rows are on a device -- an RPC server's pool slice, a GPU runtime's pool --
    // are computed there (share_history_attention: the keys stay where they are); the rest from rows read
    // here.  Per-chunk and grouped scores (the drafter's bridge, qk's chunk aggregate) read every key here.
    std::vector<int32_t> local, on_device;
    struct Remote { ggml_backend_t backend; ggml_backend_buffer_type_t buft; std::vector<int32_t> layers; };
    std::vector<Remote> remote;
    const Model &model = rt.model();
    for (int32_t il = 0; il < L; ++il) {
        const int32_t r = model.layer_remote(pool.layer(il).layer);
        if (per_chunk || groups || pool.layer_host_accessible(il) || (r < 0 && !keys_on_device)) {
            local.push_back(il);
            continue;
        }
        if (r < 0) {
            on_device.push_back(il);
            continue;
        }
        ggml_backend_t be = model.remote_backends()[size_t(r)];
        auto it = std::find_if(remote.begin(), remote.end(), [&](const Remote &x) { return x.backend == be; });
        if (it == remote.end()) {
            remote.push_back({be, model.layer_buft(pool.layer(il).layer), {}});
            it = remote.end() - 1;
        }
        it->layers.push_back(il);
    }
    const int32_t S = rt.pager().used_extent();
    for (const Remote &rs : remote) {
        // an RPC server's: inputs and compute buffers made for this call's shapes
        ShareInputs in;
        if (S > 0) in = share_inputs(rt, rs.buft, rs.layers, S, q_count);
        const ShareDevice dev{rs.backend, rs.buft, &in, {nullptr, nullptr}, true};
        share_history_attention(rt, dev, rs.layers, q_first, q_count, n_pos, host_off, out, n);
    }
    if (!on_device.empty()) {
        // a GPU runtime's own backend, with its inputs and compute buffers reserved once (DeviceScoring); the
        // pool's page copies are queued on that backend too, and sync_for_host_read above waited for them
        const DeviceScoring *ds = device_scoring(rt, q_count);
        if (ds) {
            const ShareDevice dev{rt.backend(), nullptr, &ds->in, {ds->alloc[0].get(), ds->alloc[1].get()}, false};
            share_history_attention(rt, dev, on_device, q_first, q_count, n_pos, host_off, out, n);
        } else {
            local.insert(local.end(), on_device.begin(), on_device.end());
            std::sort(local.begin(), local.end());
        }
    }
    const int32_t NLoc = int32_t(local.size());
    std::vector<std::vector<float>> sinks(local.size());   // read here, before the workers (a GPU's weights)
    for (size_t li = 0; li < local.size(); ++li) sinks[li] = layer_sinks(rt, local[li]);
    const int32_t T = std::max(1, std::min(n_threads, NLoc));
    std::vector<std::vector<float>> accs(T, std::vector<float>(size_t(n), 0.f));
    std::vector<std::thread> workers;
    std::vector<std::string> errors(T);
    auto worker = [&](int32_t t) {
        try {
            std::vector<uint8_t> rows, pool_rows;
            std::vector<int64_t> row_pos;
            for (int32_t li = t; li < NLoc; li += T) {
                const int32_t il = local[size_t(li)];
                gather_history_rows(rt, il, n_chunks, n_pos, host_off, rows, pool_rows, row_pos);
                const float *q = rt.captured_queries().data() + (size_t(il) * nc + q_first) * H * D;
                attention_probs_rows(q, q_count, H, hp.n_head_kv, D, pool.k(il)->type, rows.data(), pool.k(il)->nb[1],
                                     int64_t(n_chunks) * C, row_pos.data(), qpos.data(), hp.attn_scale, accs[t].data(),
                                     n_pos, per_chunk ? C : 0, groups, n, or_null(sinks[size_t(li)]));
            }
        } catch (const std::exception &e) {
            errors[t] = e.what();
        }
    };
    for (int32_t t = 1; t < T && NLoc > 0; ++t) workers.emplace_back(worker, t);
    if (NLoc > 0) worker(0);
    for (auto &th : workers) th.join();
    for (const auto &e : errors)
        if (!e.empty()) throw std::runtime_error("history_attention: " + e);
    for (const auto &a : accs)
        for (int64_t p = 0; p < n; ++p) out[p] = std::max(out[p], a[p]);
}

DeviceScoringInfo device_scoring_info(const Runtime &rt) {
    DeviceScoringInfo info;
    const auto *ds = dynamic_cast<const DeviceScoring *>(rt.scorer_state().get());
    if (!ds) return info;
    info.unusable = ds->unusable;
    if (!ds->unusable.empty()) return info;
    info.slots = ds->in.S_cap;
    info.queries = ds->in.nq_cap;
    info.bytes = ggml_backend_buffer_get_size(ds->in.buf.get());
    for (const auto &a : ds->alloc) info.bytes += ggml_gallocr_get_buffer_size(a.get(), 0);
    return info;
}

void chunk_peaks(const double *x, int64_t n, const int32_t *chunk_of, int32_t n_chunks, int32_t spread,
                 float *out, int32_t carry) {
    if (spread < 0) throw std::invalid_argument("spread must be >= 0, got " + std::to_string(spread));
    if (carry < 0) throw std::invalid_argument("carry must be >= 0, got " + std::to_string(carry));
    const double ninf = -std::numeric_limits<double>::infinity();
    std::vector<double> best(static_cast<size_t>(std::max(n_chunks, 0)), ninf);
    for (int64_t i = 0; i < n; ++i) {
        const int32_t c = chunk_of[i];
        if (c < 0) continue;   // a token of no chunk: it still lends its score to its neighbours
        if (c >= n_chunks)
            throw std::invalid_argument("chunk_of[" + std::to_string(i) + "] = " + std::to_string(c) +
                                        " is not below n_chunks = " + std::to_string(n_chunks));
        double v = x[i];
        for (int64_t j = std::max<int64_t>(0, i - spread); j <= std::min<int64_t>(n - 1, i + spread); ++j)
            v = std::max(v, x[j]);
        // carried from further back: just below the source (1e-6 relative survives the float out)
        for (int64_t j = std::max<int64_t>(0, i - carry); j < i - spread; ++j)
            v = std::max(v, x[j] - (std::fabs(x[j]) * 1e-6 + 1e-30));
        best[size_t(c)] = std::max(best[size_t(c)], v);
    }
    double lo = -ninf;
    for (double b : best)
        if (b != ninf) lo = std::min(lo, b);
    for (int32_t c = 0; c < n_chunks; ++c)
        out[c] = float(best[size_t(c)] != ninf ? best[size_t(c)] : (lo == -ninf ? 0.0 : lo - 1.0));
}

void qk_peak_scores(const Runtime &rt, const PeakScoring &p, float *out, int32_t n_chunks, int32_t n_threads) {
    if (p.n_queries < 1 || p.contrast < 0 || p.spread < 0 || p.n_layers < 0 || p.carry < 0 || p.windows < 1)
        throw std::invalid_argument("qk peak scoring: n_queries, windows >= 1; contrast, spread, n_layers, carry >= 0");
    const int32_t n_cap = rt.n_captured();
    const int64_t n = rt.n_past(), C = rt.config().chunk_tokens;
    if (n_chunks < 0 || n_chunks > (n + C - 1) / C)
        throw std::invalid_argument("qk peak scoring: n_chunks " + std::to_string(n_chunks) + " exceeds the history's");
    std::vector<int32_t> chunk_of(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) chunk_of[size_t(i)] = i / C < n_chunks ? int32_t(i / C) : -1;
    std::vector<float> tok(static_cast<size_t>(n));
    // the baseline: the n_queries ending `contrast` tokens before the latest (when that many are captured)
    const int32_t b0 = n_cap - p.n_queries - p.contrast;
    std::vector<float> base;
    if (p.contrast > 0 && b0 >= 0) {
        base.resize(static_cast<size_t>(n));
        history_attention(rt, base.data(), n, n_threads, false, nullptr, b0, p.n_queries, p.n_layers);
    }
    std::vector<double> x(static_cast<size_t>(n));
    auto window = [&](int32_t first, int32_t count, float *dst) {   // its queries minus the baseline, chunk_peaks
        history_attention(rt, tok.data(), n, n_threads, false, nullptr, first, count, p.n_layers);
        for (int64_t i = 0; i < n; ++i) x[size_t(i)] = double(tok[size_t(i)]) - (base.empty() ? 0.0 : double(base[size_t(i)]));
        chunk_peaks(x.data(), n, chunk_of.data(), n_chunks, p.spread, dst, p.carry);
    };
    // the windows whose queries are all captured, once the baseline is (else the latest alone, as one window)
    const int32_t w_n = base.empty() && p.contrast > 0 ? 1 : std::max(1, std::min(p.windows, n_cap / p.n_queries));
    if (w_n == 1) {
        const int32_t first = std::max(0, n_cap - p.n_queries);
        window(first, n_cap - first, out);
        return;
    }
    // each window's ranks (best score first, ties in chunk order); a chunk its best rank, then its mean rank
    const size_t nc = static_cast<size_t>(n_chunks);
    std::vector<int32_t> best(nc, n_chunks), order(nc);
    std::vector<double> sum(nc, 0.0);
    std::vector<float> sc(nc);
    for (int32_t w = 0; w < w_n; ++w) {
        window(n_cap - p.n_queries * (w + 1), p.n_queries, sc.data());
        for (int32_t c = 0; c < n_chunks; ++c) order[size_t(c)] = c;
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return sc[size_t(a)] > sc[size_t(b)]; });
        for (int32_t r = 0; r < n_chunks; ++r) {
            const int32_t c = order[size_t(r)];
            best[size_t(c)] = std::min(best[size_t(c)], r);
            sum[size_t(c)] += r;
        }
    }
    for (int32_t c = 0; c < n_chunks; ++c)
        out[c] = float(-double(best[size_t(c)]) + 0.5 * (1.0 - sum[size_t(c)] / w_n / std::max(n_chunks, 1)));
}

}  // namespace kvflash

namespace kvflash {

void moving_average(std::vector<double> &x, int32_t width) {
    const int64_t n = int64_t(x.size()), w = width;
    if (w <= 1 || n == 0) return;
    std::vector<double> pre(size_t(n) + 1, 0.0);
    for (int64_t i = 0; i < n; ++i) pre[size_t(i) + 1] = pre[size_t(i)] + x[size_t(i)];
    const int64_t lead = (w - 1) / 2;   // output i is the full convolution's i + lead
    for (int64_t i = 0; i < n; ++i) {
        const int64_t m = i + lead, lo = std::max<int64_t>(0, m - w + 1), hi = std::min<int64_t>(n - 1, m);
        x[size_t(i)] = float((pre[size_t(hi) + 1] - pre[size_t(lo)]) / double(w));
    }
}

void spread_max(const double *x, int64_t n, int32_t reach, double *out) {
    for (int64_t i = 0; i < n; ++i) {
        double m = x[i];
        for (int64_t j = std::max<int64_t>(0, i - reach); j <= std::min<int64_t>(n - 1, i + reach); ++j) m = std::max(m, x[j]);
        out[i] = m;
    }
}

void chunk_means(const double *x, int64_t n, const int32_t *chunk_of, int32_t n_chunks, int32_t spread,
                 int32_t smooth_width, float *out) {
    if (n < 0 || n_chunks < 0 || spread < 0) throw std::invalid_argument("chunk_means: n, n_chunks, spread >= 0");
    std::vector<double> y(static_cast<size_t>(n));
    spread_max(x, n, spread, y.data());
    moving_average(y, smooth_width);
    std::vector<double> sum(size_t(n_chunks), 0.0);
    std::vector<int64_t> cnt(size_t(n_chunks), 0);
    for (int64_t i = 0; i < n; ++i) {
        const int32_t c = chunk_of[i];
        if (c < 0 || c >= n_chunks) continue;
        sum[size_t(c)] += y[size_t(i)];
        ++cnt[size_t(c)];
    }
    for (int32_t c = 0; c < n_chunks; ++c) out[c] = float(sum[size_t(c)] / double(std::max<int64_t>(cnt[size_t(c)], 1)));
}

QkScoring QkScoring::defaults(const std::string &mode, const std::string &aggregate) {
    QkScoring q;
    q.mode = mode;
    const std::string agg = aggregate.empty() ? (mode == "keys" ? "peak" : "chunk") : aggregate;
    if (agg == "peak") q.aggregate = QkAggregate::Peak;
    else if (agg == "chunk") q.aggregate = QkAggregate::Chunk;
    else if (agg == "token") q.aggregate = QkAggregate::Token;
    else throw std::invalid_argument("qk aggregate must be 'chunk', 'token' or 'peak', got '" + agg + "'");
    const bool peak = q.aggregate == QkAggregate::Peak && mode == "keys";
    if (!peak) {
        q.contrast = q.spread = q.carry = 0;
        q.windows = 1;
    }
    if (mode != "keys") {
        q.n_queries = 1;
        q.n_layers = 0;
    }
    return q;
}

const char *QkScoring::aggregate_name() const {
    switch (aggregate) {
    case QkAggregate::Peak: return "peak";
    case QkAggregate::Chunk: return "chunk";
    default: return "token";
    }
}

PeakScoring QkScoring::peak(int32_t n_paged) const {
    PeakScoring p;
    p.n_queries = n_queries;
    p.contrast = contrast;
    p.spread = spread;
    p.carry = carry;
    p.windows = windows;
    p.n_layers = n_layers < 0 ? qk_auto_layers(n_paged) : (n_layers == 0 || n_layers > n_paged ? n_paged : n_layers);
    return p;
}

void QkScoring::validate() const {
    if (mode != "keys" && mode != "bound" && mode != "mean")
        throw std::invalid_argument("qk mode must be one of keys, bound, mean; got '" + mode + "'");
    if (n_queries < 1 || n_queries > 256)
        throw std::invalid_argument("n_queries must be an integer in [1, 256], got " + std::to_string(n_queries));
    if (smooth_width < 0 || smooth_width > 4096)
        throw std::invalid_argument("qk smooth_width must be in [0, 4096], got " + std::to_string(smooth_width));
    const bool peak = aggregate == QkAggregate::Peak && mode == "keys";
    for (auto [what, v] : {std::pair<const char *, int32_t>{"contrast", contrast}, {"spread", spread}, {"carry", carry}}) {
        if (v < 0 || v > 256)
            throw std::invalid_argument(std::string("qk ") + what + " must be a token count in [0, 256] (0: off), got " +
                                        std::to_string(v));
        if (v && !peak)
            throw std::invalid_argument(std::string("qk ") + what +
                                        " works on token scores: use aggregate='peak' (mode 'keys') with it");
    }
    if (windows < 1 || windows > 16)
        throw std::invalid_argument("qk windows must be an integer in [1, 16], got " + std::to_string(windows));
    if (windows > 1 && !peak)
        throw std::invalid_argument("qk windows works on token scores: use aggregate='peak' (mode 'keys') with it");
    if (n_layers < -1)
        throw std::invalid_argument("qk layers must be 'auto' (-1), a positive layer count or every paged layer (0)");
    if (mode != "keys" && (n_layers != 0 || n_queries != 1))
        throw std::invalid_argument("qk layers and n_queries work on the history attention: use mode 'keys' with them");
}

void qk_scores(const Runtime &rt, const ChunkSummaries *summaries, const QkScoring &q, float *out, int32_t n_chunks,
               int32_t n_threads) {
    q.validate();
    const int32_t n_paged = rt.pool().n_layers();
    if (q.mode != "keys") {
        if (!summaries)
            throw std::invalid_argument("the " + q.name() + " scorer needs the runtime's chunk summaries");
        summaries->qk_scores(rt, q.mode == "mean" ? QKMode::MEAN : QKMode::BOUND, out, n_chunks);
        return;
    }
    if (q.aggregate == QkAggregate::Peak) {
        qk_peak_scores(rt, q.peak(n_paged), out, n_chunks, n_threads);
        return;
    }
    const int32_t n_cap = rt.n_captured(), nl = q.peak(n_paged).n_layers;
    const int32_t first = std::max(0, n_cap - q.n_queries);
    if (q.aggregate == QkAggregate::Chunk) {
        history_attention(rt, out, n_chunks, n_threads, true, nullptr, first, n_cap - first, nl);
        return;
    }
    // token scores, a centred moving average of smooth_width (numpy's convolve "same"), a chunk's mean
    const int64_t n = rt.n_past(), C = rt.config().chunk_tokens;
    std::vector<float> tok(static_cast<size_t>(n));
    history_attention(rt, tok.data(), n, n_threads, false, nullptr, first, n_cap - first, nl);
    std::vector<double> x(tok.begin(), tok.end());
    moving_average(x, q.smooth_width);
    for (int32_t c = 0; c < n_chunks; ++c) {
        const int64_t a = int64_t(c) * C, b = std::min<int64_t>(n, a + C);
        double s = 0;
        for (int64_t i = a; i < b; ++i) s += x[size_t(i)];
        out[c] = b > a ? float(s / double(b - a)) : 0.0f;
    }
}

}  // namespace kvflash
