// Row types and vector helpers the CPU attention kernels, the attention-probability scorers and
// the attention bench share (internal to the core: not installed).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ggml.h"

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

static inline void f16_to_f32(const void *src, float *dst, int64_t n) {
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

static inline void q8_0_to_f32(const void *src, float *dst, int64_t n) {
    const uint8_t *b = static_cast<const uint8_t *>(src);  // blocks of {f16 d; int8 qs[32]}
    for (int64_t ib = 0; ib < n / 32; ++ib, b += 34) {
        const float d = block_scale(b);
        const int8_t *qs = reinterpret_cast<const int8_t *>(b + 2);
        float *o = dst + ib * 32;
#if defined(__AVX2__)
        const __m256 dv = _mm256_set1_ps(d);
        for (int j = 0; j < 32; j += 8) {
            const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(qs + j)));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_cvtepi32_ps(x), dv));
        }
#else
        for (int j = 0; j < 32; ++j) o[j] = d * float(qs[j]);
#endif
    }
}

static inline void q4_0_to_f32(const void *src, float *dst, int64_t n) {
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

// out[a] = dot(q, K[a]) for a < na; K rows of D floats (D % 8 == 0 on the AVX2 path).  Every row is
// summed the same way wherever it sits (a last group of fewer than 4 rows repeats its last row), so a
// query's scores do not depend on how many rows the batch around it made visible.
static inline void dots(const float *q, const float *K, int na, int64_t D, float *out) {
    int a = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        for (; a < na; a += 4) {
            const int last = na - 1;
            const float *k0 = K + size_t(a) * D, *k1 = K + size_t(std::min(a + 1, last)) * D,
                        *k2 = K + size_t(std::min(a + 2, last)) * D, *k3 = K + size_t(std::min(a + 3, last)) * D;
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
            if (a + 4 <= na) {
                _mm_storeu_ps(out + a, r);
            } else {
                alignas(16) float t[4];
                _mm_store_ps(t, r);
                for (int j = 0; a + j < na; ++j) out[a + j] = t[j];
            }
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
static inline void axpys(float *acc, float corr, const float *p, const float *V, int na, int64_t D) {
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

static inline row_to_f32 converter(ggml_type t) {
    switch (t) {
        case GGML_TYPE_F16: return f16_to_f32;
        case GGML_TYPE_Q8_0: return q8_0_to_f32;
        case GGML_TYPE_Q4_0: return q4_0_to_f32;
        default: return nullptr;
    }
}

static constexpr uint16_t kF16NegInf = 0xFC00;   // an f16 mask entry: the slot is not visible

}  // namespace kvflash
