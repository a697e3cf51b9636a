#include "kvflash/scoring.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>

#include "kvflash/attn_cpu.h"

namespace kvflash {

// ---------------------------------------------------------------- chunk summaries

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
        pool_attention_probs(q, nc, H, hp.n_head_kv, D, rt.pool().k(l), pg.used_extent(), pg.slot_positions().data(),
                             qpos.data(), hp.attn_scale, out, n);
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

}  // namespace

void history_attention(const Runtime &rt, float *out, int64_t n, int32_t n_threads, bool per_chunk,
                       const int32_t *groups, int32_t q_first, int32_t q_count, int32_t n_layers) {
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

    const int32_t T = std::max(1, std::min(n_threads, L));
    std::vector<std::vector<float>> accs(T, std::vector<float>(size_t(n), 0.f));
    std::vector<std::thread> workers;
    std::vector<std::string> errors(T);
    auto worker = [&](int32_t t) {
        try {
            std::vector<uint8_t> rows, pool_rows;
            std::vector<int64_t> row_pos;
            for (int32_t il = t; il < L; il += T) {
                gather_history_rows(rt, il, n_chunks, n_pos, host_off, rows, pool_rows, row_pos);
                const float *q = rt.captured_queries().data() + (size_t(il) * nc + q_first) * H * D;
                attention_probs_rows(q, q_count, H, hp.n_head_kv, D, pool.k(il)->type, rows.data(), pool.k(il)->nb[1],
                                     int64_t(n_chunks) * C, row_pos.data(), qpos.data(), hp.attn_scale, accs[t].data(),
                                     n_pos, per_chunk ? C : 0, groups, n);
            }
        } catch (const std::exception &e) {
            errors[t] = e.what();
        }
    };
    for (int32_t t = 1; t < T; ++t) workers.emplace_back(worker, t);
    worker(0);
    for (auto &th : workers) th.join();
    for (const auto &e : errors)
        if (!e.empty()) throw std::runtime_error("history_attention: " + e);
    for (const auto &a : accs)
        for (int64_t p = 0; p < n; ++p) out[p] = std::max(out[p], a[p]);
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
    if (p.n_queries < 1 || p.contrast < 0 || p.spread < 0 || p.n_layers < 0 || p.carry < 0)
        throw std::invalid_argument("qk peak scoring: n_queries >= 1, contrast, spread, n_layers, carry >= 0");
    const int32_t n_cap = rt.n_captured();
    const int64_t n = rt.n_past(), C = rt.config().chunk_tokens;
    if (n_chunks < 0 || n_chunks > (n + C - 1) / C)
        throw std::invalid_argument("qk peak scoring: n_chunks " + std::to_string(n_chunks) + " exceeds the history's");
    std::vector<float> tok(static_cast<size_t>(n));
    const int32_t first = std::max(0, n_cap - p.n_queries);
    history_attention(rt, tok.data(), n, n_threads, false, nullptr, first, n_cap - first, p.n_layers);
    std::vector<double> x(tok.begin(), tok.end());
    const int32_t b0 = n_cap - p.n_queries - p.contrast;
    if (p.contrast > 0 && b0 >= 0) {   // the baseline: the queries ending `contrast` tokens earlier
        history_attention(rt, tok.data(), n, n_threads, false, nullptr, b0, p.n_queries, p.n_layers);
        for (int64_t i = 0; i < n; ++i) x[size_t(i)] -= tok[size_t(i)];
    }
    std::vector<int32_t> chunk_of(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) chunk_of[size_t(i)] = i / C < n_chunks ? int32_t(i / C) : -1;
    chunk_peaks(x.data(), n, chunk_of.data(), n_chunks, p.spread, out, p.carry);
}

}  // namespace kvflash
