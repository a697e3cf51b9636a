// The attention-probability scorers over K rows (the qk and drafter policies' history attention).
#include "kvflash/attn_cpu.h"
#include "kvflash/attn_rows.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

namespace kvflash {

void attention_probs_rows(const float *q, int32_t nq, int32_t H, int32_t Hkv, int32_t D, ggml_type type,
                          const uint8_t *rows, size_t row_bytes, int64_t n_rows, const int64_t *row_pos,
                          const int64_t *q_pos, float scale, float *out, int64_t n_pos, int32_t chunk_tokens,
                          const int32_t *groups, int64_t n_groups, const float *sinks) {
    if (n_rows <= 0 || nq <= 0) return;
    const int64_t n_chunks = groups ? n_groups : chunk_tokens > 0 ? (n_pos + chunk_tokens - 1) / chunk_tokens : 0;
    std::vector<double> csum(static_cast<size_t>(n_chunks), 0.0);
    const row_to_f32 conv = converter(type);
    if (!conv) throw std::invalid_argument("attention scores: unsupported K type");
    const int32_t G = H / Hkv;
    const size_t k_head = ggml_row_size(type, D);
    // The rows holding a written position, packed in position order, so that each query's
    // visible keys are a prefix (queries see positions <= their own) and the dot products
    // run four keys at a time over contiguous rows.
    std::vector<int64_t> live;
    for (int64_t s = 0; s < n_rows; ++s)
        if (row_pos[s] >= 0 && row_pos[s] < n_pos) live.push_back(s);
    std::stable_sort(live.begin(), live.end(), [&](int64_t a, int64_t b) { return row_pos[a] < row_pos[b]; });
    const int64_t nl = int64_t(live.size());
    if (nl == 0) return;
    std::vector<int64_t> lpos(static_cast<size_t>(nl));
    for (int64_t j = 0; j < nl; ++j) lpos[size_t(j)] = row_pos[live[size_t(j)]];
    std::vector<int64_t> n_vis(static_cast<size_t>(nq));  // keys visible to query i: a prefix of the packed rows
    for (int32_t i = 0; i < nq; ++i)
        n_vis[size_t(i)] = std::upper_bound(lpos.begin(), lpos.end(), q_pos[i]) - lpos.begin();
    // Per KV group: the logits of every (head of the group, query) pair over blocks of kBlock keys
    // (a block stays in L1 while all pairs read it), then a softmax per pair over its prefix.
    constexpr int64_t kBlock = 128;
    const int64_t n_pair = int64_t(G) * nq;
    std::vector<float> Kg(size_t(nl) * D), lg(size_t(n_pair) * nl), avg(static_cast<size_t>(nl));
    for (int32_t g = 0; g < Hkv; ++g) {
        for (int64_t j = 0; j < nl; ++j) conv(rows + size_t(live[size_t(j)]) * row_bytes + g * k_head, &Kg[size_t(j) * D], D);
        for (int64_t a0 = 0; a0 < nl; a0 += kBlock) {
            for (int32_t hh = 0; hh < G; ++hh)
                for (int32_t i = 0; i < nq; ++i) {
                    const int64_t a1 = std::min(a0 + kBlock, n_vis[size_t(i)]);
                    if (a1 <= a0) continue;
                    const float *qh = q + (size_t(i) * H + g * G + hh) * D;
                    dots(qh, &Kg[size_t(a0) * D], int(a1 - a0), D, &lg[size_t(hh * nq + i) * nl + a0]);
                }
        }
        for (int32_t hh = 0; hh < G; ++hh) {
            std::fill(avg.begin(), avg.end(), 0.f);
            for (int32_t i = 0; i < nq; ++i) {
                const int64_t nv = n_vis[size_t(i)];
                if (nv == 0) continue;
                float *pr = &lg[size_t(hh * nq + i) * nl];
                float mx = -std::numeric_limits<float>::infinity();
                for (int64_t j = 0; j < nv; ++j) mx = std::max(mx, pr[j]);
                float sum = 0.f;
                for (int64_t j = 0; j < nv; ++j) {
                    pr[j] = std::exp((pr[j] - mx) * scale);
                    sum += pr[j];
                }
                // the head's sink takes its share of the mass, as in the layer's attention (past every key:
                // the sum is inf and the keys' shares 0)
                if (sinks) sum += std::exp(sinks[g * G + hh] - mx * scale);
                const float inv = 1.f / sum / float(nq);
                for (int64_t j = 0; j < nv; ++j) avg[size_t(j)] += pr[j] * inv;
            }
            if (chunk_tokens <= 0 && !groups) {
                for (int64_t j = 0; j < nl; ++j) out[lpos[size_t(j)]] = std::max(out[lpos[size_t(j)]], avg[size_t(j)]);
            } else {  // this head's attention mass per chunk (or group); the max over heads
                std::fill(csum.begin(), csum.end(), 0.0);
                for (int64_t j = 0; j < nl; ++j) {
                    const int64_t pos = lpos[size_t(j)];
                    const int64_t c = groups ? groups[pos] : pos / chunk_tokens;
                    if (c >= 0 && c < n_chunks) csum[size_t(c)] += avg[size_t(j)];
                }
                for (int64_t c = 0; c < n_chunks; ++c) out[c] = std::max(out[c], float(csum[c]));
            }
        }
    }
}

void pool_attention_probs(const float *q, int32_t nq, int32_t H, int32_t Hkv, int32_t D, const ggml_tensor *k,
                          int32_t n_kv, const int64_t *slot_pos, const int64_t *q_pos, float scale, float *out,
                          int64_t n_pos, const float *sinks) {
    if (n_kv <= 0 || nq <= 0) return;
    std::vector<uint8_t> raw(size_t(n_kv) * k->nb[1]);
    ggml_backend_tensor_get(const_cast<ggml_tensor *>(k), raw.data(), 0, raw.size());
    attention_probs_rows(q, nq, H, Hkv, D, k->type, raw.data(), k->nb[1], n_kv, slot_pos, q_pos, scale, out, n_pos, 0,
                         nullptr, 0, sinks);
}

}  // namespace kvflash
