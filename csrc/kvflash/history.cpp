// Runtime::history_attention: attention of the captured queries over every key
// of the history, resident or paged out.  The qk policy's exact mode.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kvflash/attn_cpu.h"
#include "kvflash/model.h"
#include "kvflash/pool.h"

namespace kvflash {

// groups (length n_past, values < n or negative): out[g] is the attention mass group g
// receives per layer and head, max over them (per_chunk is groups = position / chunk).
void Runtime::history_attention(float *out, int64_t n, int32_t n_threads, bool per_chunk,
                                const int32_t *groups, int32_t q_first, int32_t q_count, int32_t n_layers) const {
    if (n_captured_ == 0) throw std::invalid_argument("history_attention: no query captured yet");
    if (q_count < 0) q_count = n_captured_ - q_first;
    if (q_first < 0 || q_count <= 0 || q_first + q_count > n_captured_)
        throw std::invalid_argument("history_attention: queries [" + std::to_string(q_first) + ", " +
                                    std::to_string(q_first + q_count) + ") are not among the " +
                                    std::to_string(n_captured_) + " captured");
    std::fill(out, out + n, 0.f);
    const Hparams &hp = model_->hparams();
    const Pager &pg = *cache_->pager;
    const KVPool &pool = *cache_->pool;
    if (n_layers < 0) throw std::invalid_argument("history_attention: n_layers must be >= 0 (0: all)");
    const int32_t L_all = pool.n_layers(), D = hp.head_dim_k, H = hp.n_head, C = cfg_.chunk_tokens;
    const int32_t L = n_layers > 0 ? std::min(n_layers, L_all) : L_all;
    const int64_t n_pos = groups ? n_past_ : per_chunk ? std::min<int64_t>(n * C, n_past_) : std::min<int64_t>(n, n_past_);
    const int32_t n_chunks = int32_t((n_pos + C - 1) / C);
    if (n_chunks == 0) return;
    sync_for_host_read();
    // Byte offset of layer il's K rows inside a host chunk: [il][K rows][V rows].
    std::vector<size_t> host_off(L_all + 1, 0);
    for (int32_t il = 0; il < L_all; ++il)
        host_off[il + 1] = host_off[il] + size_t(C) * (pool.k(il)->nb[1] + pool.v(il)->nb[1]);
    std::vector<int64_t> qpos(q_count);
    for (int32_t i = 0; i < q_count; ++i) qpos[i] = n_past_ - n_captured_ + q_first + i;

    auto one_layer = [&](int32_t il, float *acc, std::vector<uint8_t> &rows, std::vector<uint8_t> &pool_rows,
                         std::vector<int64_t> &row_pos) {
        ggml_tensor *k = pool.k(il);
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
        const float *q = captured_q_.data() + (size_t(il) * n_captured_ + q_first) * H * D;
        attention_probs_rows(q, q_count, H, hp.n_head_kv, D, k->type, rows.data(), rb, int64_t(n_chunks) * C,
                             row_pos.data(), qpos.data(), hp.attn_scale, acc, n_pos, per_chunk ? C : 0, groups, n);
    };

    const int32_t T = std::max(1, std::min(n_threads, L));
    std::vector<std::vector<float>> accs(T, std::vector<float>(size_t(n), 0.f));
    std::vector<std::thread> pool_threads;
    std::vector<std::string> errors(T);
    auto worker = [&](int32_t t) {
        try {
            std::vector<uint8_t> rows, pool_rows;
            std::vector<int64_t> row_pos;
            for (int32_t il = t; il < L; il += T) one_layer(il, accs[t].data(), rows, pool_rows, row_pos);
        } catch (const std::exception &e) {
            errors[t] = e.what();
        }
    };
    for (int32_t t = 1; t < T; ++t) pool_threads.emplace_back(worker, t);
    worker(0);
    for (auto &th : pool_threads) th.join();
    for (const auto &e : errors)
        if (!e.empty()) throw std::runtime_error("history_attention: " + e);
    for (const auto &a : accs)
        for (int64_t p = 0; p < n; ++p) out[p] = std::max(out[p], a[p]);
}

}  // namespace kvflash
