#include "kvflash/attn_cpu.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvflash {

static constexpr int kTile = 32;

// Row converters for the KV types we page, written as plain loops the compiler
// vectorizes (ggml-base's generic converters are built without host flags).
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t f;
    if (exp == 0) {
        if (man == 0) f = sign;
        else {  // subnormal
            int e = -1;
            uint32_t m = man;
            do { ++e; m <<= 1; } while (!(m & 0x400));
            f = sign | uint32_t(127 - 15 - e) << 23 | (m & 0x3ff) << 13;
        }
    } else if (exp == 31) f = sign | 0x7f800000u | man << 13;
    else f = sign | (exp + 112) << 23 | man << 13;
    float out;
    std::memcpy(&out, &f, 4);
    return out;
#endif
}

typedef void (*row_to_f32)(const void *src, float *dst, int64_t n);

static void f16_to_f32(const void *src, float *dst, int64_t n) {
    const uint16_t *h = static_cast<const uint16_t *>(src);
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(h + i))));
#endif
    for (; i < n; ++i) dst[i] = half_to_float(h[i]);
}

// The f16 scale that opens every q8_0 / q4_0 block.
static inline float block_scale(const uint8_t *b) {
    uint16_t dh;
    std::memcpy(&dh, b, 2);
    return half_to_float(dh);
}

static void q8_0_to_f32(const void *src, float *dst, int64_t n) {
    const uint8_t *b = static_cast<const uint8_t *>(src);  // blocks of {f16 d; int8 qs[32]}
    for (int64_t ib = 0; ib < n / 32; ++ib, b += 34) {
        const float d = block_scale(b);
        const int8_t *qs = reinterpret_cast<const int8_t *>(b + 2);
        float *o = dst + ib * 32;
        for (int j = 0; j < 32; ++j) o[j] = d * float(qs[j]);
    }
}

static void q4_0_to_f32(const void *src, float *dst, int64_t n) {
    const uint8_t *b = static_cast<const uint8_t *>(src);  // blocks of {f16 d; uint8 qs[16]}
    for (int64_t ib = 0; ib < n / 32; ++ib, b += 18) {
        const float d = block_scale(b);
        const uint8_t *qs = b + 2;
        float *o = dst + ib * 32;
        for (int j = 0; j < 16; ++j) {
            o[j] = d * float(int(qs[j] & 0x0f) - 8);
            o[j + 16] = d * float(int(qs[j] >> 4) - 8);
        }
    }
}

// out[a] = dot(q, K[a]) for a < na; K rows of D floats (D % 8 == 0 on the AVX2 path).
static void dots(const float *q, const float *K, int na, int64_t D, float *out) {
    int a = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        for (; a + 4 <= na; a += 4) {
            const float *k0 = K + size_t(a) * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            for (int64_t e = 0; e < D; e += 8) {
                const __m256 qv = _mm256_loadu_ps(q + e);
                s0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + e), s0);
                s1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + e), s1);
                s2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + e), s2);
                s3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + e), s3);
            }
            // Horizontal sums of the four accumulators at once.
            const __m256 h01 = _mm256_hadd_ps(s0, s1), h23 = _mm256_hadd_ps(s2, s3);
            const __m256 h = _mm256_hadd_ps(h01, h23);  // per 128-bit lane: s0 s1 s2 s3 partials
            const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(out + a, r);
        }
    }
#endif
    for (; a < na; ++a) {
        const float *kr = K + size_t(a) * D;
        float d = 0.f;
        for (int64_t e = 0; e < D; ++e) d += q[e] * kr[e];
        out[a] = d;
    }
}

// acc[0..D) = acc * corr + sum_a p[a] * V[a]
static void axpys(float *acc, float corr, const float *p, const float *V, int na, int64_t D) {
    int64_t e0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 c = _mm256_set1_ps(corr);
    for (; e0 + 32 <= D; e0 += 32) {
        __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0), c), a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0 + 8), c);
        __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0 + 16), c), a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + e0 + 24), c);
        for (int a = 0; a < na; ++a) {
            const __m256 pv = _mm256_set1_ps(p[a]);
            const float *vr = V + size_t(a) * D + e0;
            a0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr), a0);
            a1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8), a1);
            a2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 16), a2);
            a3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 24), a3);
        }
        _mm256_storeu_ps(acc + e0, a0);
        _mm256_storeu_ps(acc + e0 + 8, a1);
        _mm256_storeu_ps(acc + e0 + 16, a2);
        _mm256_storeu_ps(acc + e0 + 24, a3);
    }
#endif
    for (int64_t e = e0; e < D; ++e) {
        float x = acc[e] * corr;
        for (int a = 0; a < na; ++a) x += p[a] * V[size_t(a) * D + e];
        acc[e] = x;
    }
}

static row_to_f32 converter(ggml_type t) {
    switch (t) {
        case GGML_TYPE_F16: return f16_to_f32;
        case GGML_TYPE_Q8_0: return q8_0_to_f32;
        case GGML_TYPE_Q4_0: return q4_0_to_f32;
        default: return nullptr;
    }
}
static constexpr uint16_t kF16NegInf = 0xFC00;

// partials: [D + 2, H, n, S]: per range the running max m, the sum l, and acc[D].
// One kernel body on purpose: the row loop, the online softmax and the dequantize-and-accumulate
// share registers and early exits that a split into helpers would hide from the compiler.
static void attn_partial(ggml_tensor *dst, int ith, int nth, void *ud) {
    const auto *P = static_cast<const PoolAttnParams *>(ud);
    const ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *mask = dst->src[3];
    const int64_t D = q->ne[0], H = q->ne[1], n = q->ne[2], n_kv = k->ne[1];
    const int64_t Hkv = P->n_head_kv, G = H / Hkv, S = P->n_split;
    const int64_t range = (n_kv + S - 1) / S;
    const row_to_f32 tk = converter(k->type), tv = converter(v->type);
    const size_t k_head = ggml_row_size(k->type, D), v_head = ggml_row_size(v->type, D);

    thread_local std::vector<float> Kt, Vt, sc, acc, mrow, lrow;
    thread_local std::vector<int32_t> vis;
    Kt.resize(size_t(kTile) * D);
    Vt.resize(size_t(kTile) * D);
    sc.resize(kTile);
    acc.resize(size_t(G) * n * D);
    mrow.resize(size_t(G) * n);
    lrow.resize(size_t(G) * n);
    vis.resize(kTile);

    for (int64_t item = ith; item < Hkv * S; item += nth) {
        const int64_t g = item / S, sp = item % S;
        const int64_t s0 = sp * range, s1 = std::min(n_kv, s0 + range);
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(mrow.begin(), mrow.end(), -std::numeric_limits<float>::infinity());
        std::fill(lrow.begin(), lrow.end(), 0.f);
        for (int64_t t0 = s0; t0 < s1; t0 += kTile) {
            const int64_t nt = std::min<int64_t>(kTile, s1 - t0);
            // Which tile slots does any query see?  Dequantize only those.
            int nvis = 0;
            for (int64_t j = 0; j < nt; ++j) {
                bool any = false;
                for (int64_t i = 0; i < n && !any; ++i) {
                    const auto *mr = reinterpret_cast<const uint16_t *>(static_cast<const char *>(mask->data) + i * mask->nb[1]);
                    any = mr[t0 + j] != kF16NegInf;
                }
                if (any) vis[nvis++] = int32_t(j);
            }
            if (nvis == 0) continue;
            for (int a = 0; a < nvis; ++a) {
                const int64_t s = t0 + vis[a];
                tk(static_cast<const char *>(k->data) + s * k->nb[1] + g * k_head, &Kt[size_t(a) * D], D);
                tv(static_cast<const char *>(v->data) + s * v->nb[1] + g * v_head, &Vt[size_t(a) * D], D);
            }
            for (int64_t i = 0; i < n; ++i) {
                const auto *mr = reinterpret_cast<const uint16_t *>(static_cast<const char *>(mask->data) + i * mask->nb[1]);
                for (int64_t hh = 0; hh < G; ++hh) {
                    const int64_t h = g * G + hh;
                    const float *qv = reinterpret_cast<const float *>(static_cast<const char *>(q->data) + h * q->nb[1] + i * q->nb[2]);
                    constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
                    dots(qv, Kt.data(), nvis, D, sc.data());
                    float tmax = NEG_INF;
                    for (int a = 0; a < nvis; ++a) {
                        sc[a] = mr[t0 + vis[a]] == kF16NegInf ? NEG_INF : sc[a] * P->scale;
                        tmax = std::max(tmax, sc[a]);
                    }
                    if (tmax == NEG_INF) continue;
                    const size_t r = size_t(hh) * n + i;
                    const float mnew = std::max(mrow[r], tmax);
                    const float corr = std::exp(mrow[r] - mnew);  // exp(-inf) = 0 on the first tile
                    float l = lrow[r] * corr;
                    for (int a = 0; a < nvis; ++a) {
                        sc[a] = std::exp(sc[a] - mnew);
                        l += sc[a];
                    }
                    axpys(&acc[r * D], corr, sc.data(), Vt.data(), nvis, D);
                    mrow[r] = mnew;
                    lrow[r] = l;
                }
            }
        }
        for (int64_t hh = 0; hh < G; ++hh)
            for (int64_t i = 0; i < n; ++i) {
                const size_t r = size_t(hh) * n + i;
                float *out = reinterpret_cast<float *>(static_cast<char *>(dst->data) + (g * G + hh) * dst->nb[1] +
                                                       i * dst->nb[2] + sp * dst->nb[3]);
                out[0] = mrow[r];
                out[1] = lrow[r];
                std::memcpy(out + 2, &acc[r * D], sizeof(float) * D);
            }
    }
}

// dst: [D, H, n] <- merge of the S ranges in partials [D + 2, H, n, S].
static void attn_reduce(ggml_tensor *dst, int ith, int nth, void *) {
    const ggml_tensor *pt = dst->src[0];
    const int64_t D = dst->ne[0], H = dst->ne[1], n = dst->ne[2], S = pt->ne[3];
    for (int64_t r = ith; r < H * n; r += nth) {
        const int64_t h = r % H, i = r / H;
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s) {
            const float *p = reinterpret_cast<const float *>(static_cast<const char *>(pt->data) + h * pt->nb[1] + i * pt->nb[2] + s * pt->nb[3]);
            if (p[1] > 0.f) M = std::max(M, p[0]);
        }
        float *out = reinterpret_cast<float *>(static_cast<char *>(dst->data) + h * dst->nb[1] + i * dst->nb[2]);
        std::fill(out, out + D, 0.f);
        float L = 0.f;
        for (int64_t s = 0; s < S; ++s) {
            const float *p = reinterpret_cast<const float *>(static_cast<const char *>(pt->data) + h * pt->nb[1] + i * pt->nb[2] + s * pt->nb[3]);
            if (!(p[1] > 0.f)) continue;
            const float w = std::exp(p[0] - M);
            L += w * p[1];
            for (int64_t e = 0; e < D; ++e) out[e] += w * p[2 + e];
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int64_t e = 0; e < D; ++e) out[e] *= inv;
    }
}

ggml_tensor *pool_attention_cpu(ggml_context *ctx, ggml_tensor *q, ggml_tensor *k, ggml_tensor *v, ggml_tensor *mask,
                                const PoolAttnParams *params) {
    GGML_ASSERT(q->type == GGML_TYPE_F32 && mask->type == GGML_TYPE_F16);
    GGML_ASSERT(k->ne[1] == mask->ne[0] && v->ne[1] == k->ne[1] && mask->ne[1] >= q->ne[2]);
    const int64_t D = q->ne[0], H = q->ne[1], n = q->ne[2];
    ggml_tensor *args[4] = {q, k, v, mask};
    ggml_tensor *part = ggml_custom_4d(ctx, GGML_TYPE_F32, D + 2, H, n, params->n_split, args, 4, attn_partial,
                                       GGML_N_TASKS_MAX, const_cast<PoolAttnParams *>(params));
    ggml_tensor *rargs[1] = {part};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, D, H, n, 1, rargs, 1, attn_reduce, GGML_N_TASKS_MAX, nullptr);
}

}  // namespace kvflash

namespace kvflash {

void attention_probs_rows(const float *q, int32_t nq, int32_t H, int32_t Hkv, int32_t D, ggml_type type,
                          const uint8_t *rows, size_t row_bytes, int64_t n_rows, const int64_t *row_pos,
                          const int64_t *q_pos, float scale, float *out, int64_t n_pos, int32_t chunk_tokens,
                          const int32_t *groups, int64_t n_groups) {
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
                          int64_t n_pos) {
    if (n_kv <= 0 || nq <= 0) return;
    std::vector<uint8_t> raw(size_t(n_kv) * k->nb[1]);
    ggml_backend_tensor_get(const_cast<ggml_tensor *>(k), raw.data(), 0, raw.size());
    attention_probs_rows(q, nq, H, Hkv, D, k->type, raw.data(), k->nb[1], n_kv, slot_pos, q_pos, scale, out, n_pos, 0);
}

}  // namespace kvflash
