#include "kvflash/attn_cpu.h"
#include "kvflash/attn_rows.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvflash {

// ---- quantized keys: integer dot products against a quantized query
//
// For q8_0 and q4_0 K the query is quantized the way ggml quantizes activations for its
// q8_0 matmuls (blocks of 32, scale = max|x| / 127, round to nearest), and K . q is an
// int8 (q8_0) or nibble (q4_0) dot product per block with the two block scales applied
// once per block.  The error against the f32 path is the query's rounding, the same
// error ggml's own q8_0 x q8_0 matmuls make on the weights' side.
struct QuantQuery {
    std::vector<int8_t> qs;    // [rows][D]
    std::vector<float> d;      // [rows][D/32] block scales (NaN: the row held a NaN or inf)
    std::vector<int32_t> sum;  // [rows][D/32] sums of the quantized values (q4_0's -8 offset)
};

static void quantize_query(const float *x, int64_t D, int8_t *qs, float *qd, int32_t *qsum) {
    for (int64_t b = 0; b < D / 32; ++b) {
        const float *xb = x + b * 32;
        float amax = 0.f;
        bool finite = true;
        for (int j = 0; j < 32; ++j) {
            const float ax = std::fabs(xb[j]);
            finite = finite && ax <= std::numeric_limits<float>::max();
            amax = std::max(amax, ax);
        }
        if (!finite) {   // propagate as the f32 path would: a NaN score
            std::fill(qs + b * 32, qs + b * 32 + 32, int8_t(0));
            qd[b] = std::numeric_limits<float>::quiet_NaN();
            qsum[b] = 0;
            continue;
        }
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int j = 0; j < 32; ++j) {
            const int v = int(std::nearbyint(xb[j] * id));
            qs[b * 32 + j] = int8_t(v);
            sum += v;
        }
        qd[b] = d;
        qsum[b] = sum;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 int32 partial sums of k[j] * q[j] over 32 int8 lanes (|k| <= 127, as q8_0 stores).
static inline __m256i dot_s8(__m256i kx, __m256i qx) {
    const __m256i ax = _mm256_sign_epi8(kx, kx), sy = _mm256_sign_epi8(qx, kx);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
#endif
}
// The same for 32 unsigned bytes against int8 lanes (nibbles 0..15, or q8_0 biased by +128 with VNNI;
// without VNNI maddubs saturates past 2 x 127 x 128, which nibbles never reach).
static inline __m256i dot_u4(__m256i nib, __m256i qx) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), nib, qx);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(nib, qx), _mm256_set1_epi16(1));
#endif
}
// The horizontal sums of four accumulators, as dots() does.
static inline __m128 hsum4(__m256 s0, __m256 s1, __m256 s2, __m256 s3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp(r) of x = n ln2 + r (ln2 in two parts, |r| <= ln2/2): a degree-6 polynomial with Cephes' expf
// coefficients (~1 ulp), for 8 or 16 lanes; the caller applies 2^n.
// O: the lane width's operations (Ops8 / Ops16).
template <typename O>
static inline typename O::V exp_poly(typename O::V x, typename O::V n) {
    typename O::V r = O::fnmadd(n, O::set1(0.693359375f), x);
    r = O::fnmadd(n, O::set1(-2.12194440e-4f), r);
    typename O::V p = O::set1(1.9875691500e-4f);
    for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
        p = O::fmadd(p, r, O::set1(c));
    return O::fmadd(p, O::mul(r, r), O::add(r, O::set1(1.0f)));
}
struct Ops8 {
    using V = __m256;
    static V set1(float x) { return _mm256_set1_ps(x); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) over 8 lanes for the softmax's shifted scores (x <= 0): x = n ln2 + r, |r| <= ln2/2, a
// degree-6 polynomial for exp(r) (Cephes' expf coefficients, ~1 ulp), times 2^n.  Lanes below
// -87 (-inf: a masked slot) give exactly 0; a NaN stays NaN.
static inline __m256 exp_nonpos(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 dead = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(lo, x);   // a NaN x passes through (max_ps returns its second operand then)
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 p = exp_poly<Ops8>(x, n);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

// sc[a] = exp(sc[a] - m) for a < na; returns their sum.  A last group of fewer than 8 is padded with
// -inf (exactly 0 after the exp), so a score gets the same value and lane whatever follows it.
static inline float exp_shifted(float *sc, int na, float m) {
    int a = 0;
    float l = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (; a + 8 <= na; a += 8) {
        const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + a), mv));
        _mm256_storeu_ps(sc + a, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (a < na) {
        alignas(32) float t[8];
        const int w = na - a;
        for (int j = 0; j < 8; ++j) t[j] = j < w ? sc[a + j] : -std::numeric_limits<float>::infinity();
        const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_load_ps(t), mv));
        _mm256_store_ps(t, e);
        for (int j = 0; j < w; ++j) sc[a + j] = t[j];
        acc = _mm256_add_ps(acc, e);
        a = na;
    }
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    l = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#endif
    for (; a < na; ++a) {
        sc[a] = std::exp(sc[a] - m);
        l += sc[a];
    }
    return l;
}

// A tile's quantized keys unpacked once for all the query heads of their group: per visible row
// its D values as bytes (q8_0: the int8 values, biased by +128 where the dot is u8 x s8 (VNNI);
// q4_0: the nibbles 0..15) and its block scales.  The dot is then
//   sum_b kd[b] * qd[b] * (sum_j kq[j] * qs[j] - bias * qsum[b]),  bias = 128 (biased q8_0), 8 (q4_0).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static constexpr bool kQ8Biased = true;
#else
static constexpr bool kQ8Biased = false;
#endif

static void unpack_keys(ggml_type t, const uint8_t *kb, int64_t nb, uint8_t *kq, float *kd) {
    const int64_t bs = t == GGML_TYPE_Q8_0 ? 34 : 18;
    for (int64_t b = 0; b < nb; ++b, kb += bs) {
        kd[b] = block_scale(kb);
        uint8_t *o = kq + b * 32;
        if (t == GGML_TYPE_Q8_0) {
            if (kQ8Biased)
                for (int j = 0; j < 32; ++j) o[j] = uint8_t(kb[2 + j] ^ 0x80);
            else
                std::memcpy(o, kb + 2, 32);
        } else {
            for (int j = 0; j < 16; ++j) {
                o[j] = kb[2 + j] & 0x0f;
                o[j + 16] = kb[2 + j] >> 4;
            }
        }
    }
}

static inline int32_t key_bias(ggml_type t) { return t == GGML_TYPE_Q8_0 ? (kQ8Biased ? 128 : 0) : 8; }

// One unpacked key row against one quantized query (the scalar path).
static inline float dot_unpacked(ggml_type t, const uint8_t *kq, const float *kd, int64_t nb, const int8_t *qs,
                                 const float *qd, const int32_t *qsum) {
    const int32_t bias = key_bias(t);
    float s = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
        int32_t acc = 0;
        for (int j = 0; j < 32; ++j) {
            const int32_t kv = t == GGML_TYPE_Q8_0 && !kQ8Biased ? int32_t(int8_t(kq[b * 32 + j])) : int32_t(kq[b * 32 + j]);
            acc += kv * int32_t(qs[b * 32 + j]);
        }
        s += kd[b] * qd[b] * float(acc - bias * qsum[b]);
    }
    return s;
}

// out[a] = dot(unpacked key row a, the quantized query) for a < na; rows D bytes apart, scales nb apart.
static void dots_quant(ggml_type t, const uint8_t *kq, const float *kd, int na, int64_t nb, const int8_t *qs,
                       const float *qd, const int32_t *qsum, float *out) {
    const int64_t D = nb * 32;
    int a = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const float bias = float(key_bias(t));
    for (; a + 4 <= na; a += 4) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        float off[4] = {0.f, 0.f, 0.f, 0.f};
        for (int64_t b = 0; b < nb; ++b) {
            const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + b * 32));
            const float qb = qd[b], qo = bias * float(qsum[b]);
            for (int r = 0; r < 4; ++r) {
                const __m256i kx = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(kq + (a + r) * D + b * 32));
                const float d = kd[(a + r) * nb + b] * qb;
                const __m256i p = t == GGML_TYPE_Q8_0 && !kQ8Biased ? dot_s8(kx, qx) : dot_u4(kx, qx);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d), acc[r]);
                off[r] += d * qo;
            }
        }
        __m128 r4 = hsum4(acc[0], acc[1], acc[2], acc[3]);
        r4 = _mm_sub_ps(r4, _mm_loadu_ps(off));
        _mm_storeu_ps(out + a, r4);
    }
#endif
    for (; a < na; ++a) out[a] = dot_unpacked(t, kq + a * D, kd + a * nb, nb, qs, qd, qsum);
}


// Stands in for rows no query of a tile sees (free, evicted or unwritten slots may hold any bytes):
// zero scales, zero values, so they add exact zeros.  Wide enough for a 2048-element f16 head.
alignas(64) static const char kZeroRow[4096] = {};

// Where row s of a K or V operand starts: the tensor's own row s, or the row table's (chunk sizes are
// powers of two in practice: a shift and a mask, not a division, per row).
struct RowAt {
    const char *base;
    size_t nb1;
    const char *const *chunks = nullptr;
    int64_t rows = 0, mask = -1;
    int shift = -1;
    RowAt(const ggml_tensor *t, const RowTable *tab, bool is_k)
        : base(static_cast<const char *>(t->data)), nb1(t->nb[1]) {
        if (tab) {
            chunks = is_k ? tab->k.data() : tab->v.data();
            rows = tab->chunk_rows;
            if ((rows & (rows - 1)) == 0) {
                shift = __builtin_ctzll(uint64_t(rows));
                mask = rows - 1;
            }
        }
    }
    const char *operator()(int64_t s) const {
        if (!chunks) return base + size_t(s) * nb1;
        if (shift >= 0) return chunks[s >> shift] + size_t(s & mask) * nb1;
        return chunks[s / rows] + size_t(s % rows) * nb1;
    }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KVFLASH_TILED_ATTN 1
// ---- the tiled integer kernel (AVX-512 VNNI; q8_0 / q4_0 K and V)
//
// 16 visible pool rows at a time, one per zmm lane.  K is gathered once per tile into a transposed
// tile of 4-byte groups (group t, lane a = elements 4t..4t+3 of row a, as unsigned bytes: q8_0 biased
// by +128, q4_0's nibbles as stored), so that one dpbusd against the query's 4 bytes broadcast adds a
// partial dot to all 16 rows at once: no horizontal sums, and the tile is shared by every query head
// of the KV group and every query of the batch.  Per 32-element block the int32 sum loses the bias
// (bias x the query block's sum) and takes both block scales.  The scores come out as 16 lanes, so
// scale, mask, max and exp run on vectors.  V is never converted to an f32 row: each row's block is
// widened in registers and added, weighted by p x its block scale, to up to 8 heads' accumulators.
namespace {
constexpr int kLanes = 16;

struct TiledScratch {
    std::vector<int32_t> kt;   // [D/4][16] transposed K groups (integer dots)
    std::vector<float> kf;     // [D][16] the same keys widened to f32 (f32 dots)
    std::vector<float> kd, vd; // [nb][16] block scales of K and V
    std::vector<float> pw;     // [R][nb][16] p x V block scale
    std::vector<float> acc, m, l, corr;
    std::vector<int8_t> qs;
    std::vector<float> qd;
    std::vector<int32_t> qsum;
};

// The f16 scales of one block of 16 rows (at byte off of each row), as floats.  Plain loads: a
// 16-lane gather costs more here than the 16 loads it stands for.
inline __m512 row_scales(const char *const *rows, int64_t off) {
    alignas(32) uint16_t h[16];
    for (int a = 0; a < 16; ++a) {
        std::memcpy(&h[a], rows[a] + off, 2);
        // scalar load + store, not a chain of vector inserts (the vector shuffle port is the busy one)
        __asm__ volatile("" ::: "memory");
    }
    return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i *>(h)));
}
}  // namespace

// One 32-element V block of the tile's rows added into N <= 4 (head, query) rows' accumulators (acc
// rows acc_stride floats apart), which are first scaled by their softmax corrections; pw: per row, 16
// lanes of p x V block scale, pstride floats apart.  N is a template parameter so the 4N accumulators
// stay in registers.  Every row is summed the same way whatever N is (even and odd tile rows in two
// accumulator sets, added at the end), so a query's result does not depend on the batch around it.
template <int N>
static inline void v_block_accumulate(float *acc, size_t acc_stride, const float *pw, size_t pstride,
                                      const float *corr, const char *const *vrow, int64_t boff, int cnt, bool v8) {
    static_assert(N >= 1 && N <= 4, "4 rows at most: two accumulator sets of 2N registers each");
    constexpr int S = 2;   // a second set of accumulators for odd tile rows: 4N chains hide the FMA latency
    __m512 A0[S][N], A1[S][N];
    for (int j = 0; j < N; ++j) {
        const __m512 c = _mm512_set1_ps(corr[j]);
        A0[0][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * acc_stride), c);
        A1[0][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * acc_stride + 16), c);
        if (S == 2) A0[S - 1][j] = A1[S - 1][j] = _mm512_setzero_ps();
    }
    const __m512i low4 = _mm512_set1_epi32(0x0f), eight = _mm512_set1_epi32(8);
    auto row = [&](int a, __m512 *B0, __m512 *B1) {
        const char *vb = vrow[a] + boff;
        __m512 x0, x1;
        if (v8) {
            x0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(vb))));
            x1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(vb + 16))));
        } else {   // element j: low nibble of byte j, element j + 16: its high nibble; both minus 8
            const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(vb)));
            x0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(u, low4), eight));
            x1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(u, 4), eight));
        }
        for (int j = 0; j < N; ++j) {
            const __m512 w = _mm512_set1_ps(pw[j * pstride + a]);
            B0[j] = _mm512_fmadd_ps(w, x0, B0[j]);
            B1[j] = _mm512_fmadd_ps(w, x1, B1[j]);
        }
    };
    int a = 0;
    for (; a + S <= cnt; a += S) {
        row(a, A0[0], A1[0]);
        if (S == 2) row(a + 1, A0[S - 1], A1[S - 1]);
    }
    if (a < cnt) row(a, A0[0], A1[0]);
    for (int j = 0; j < N; ++j) {
        if (S == 2) {
            A0[0][j] = _mm512_add_ps(A0[0][j], A0[S - 1][j]);
            A1[0][j] = _mm512_add_ps(A1[0][j], A1[S - 1][j]);
        }
        _mm512_storeu_ps(acc + j * acc_stride, A0[0][j]);
        _mm512_storeu_ps(acc + j * acc_stride + 16, A1[0][j]);
    }
}

// One step of a register transpose of 32-bit groups held in N zmm registers (N = 8: 16 rows x 8 groups,
// N = 4: 16 rows x 4 groups): it swaps bit `bit` of the register index with bit `bit` of the lane index,
// pairing the registers that differ in that bit, two permutes per pair.  After log2(N) steps register t
// holds group t of every row, the rows in the lane order the loads arranged for that.
template <int N>
static inline void transpose_stage(__m512i *Z, int bit) {
    alignas(64) int32_t lo[16], hi[16];
    const int m = 1 << bit;
    for (int L = 0; L < 16; ++L) {
        lo[L] = (L & m ? 16 : 0) + (L & ~m);
        hi[L] = (L & m ? 16 : 0) + (L | m);
    }
    const __m512i ilo = _mm512_load_si512(lo), ihi = _mm512_load_si512(hi);
    for (int x = 0; x < N; ++x) {
        if (x & m) continue;
        const __m512i a = Z[x], b = Z[x | m];
        Z[x] = _mm512_permutex2var_epi32(a, ilo, b);
        Z[x | m] = _mm512_permutex2var_epi32(a, ihi, b);
    }
}

struct Ops16 {
    using V = __m512;
    static V set1(float x) { return _mm512_set1_ps(x); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
};

// exp_nonpos over 16 lanes: the same reduction and polynomial, 2^n applied by scalef.
static inline __m512 exp512_nonpos(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 live = _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ);   // not below -87 (NaN lanes stay live)
    x = _mm512_max_ps(lo, x);   // a NaN x passes through
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 p = exp_poly<Ops16>(x, n);
    return _mm512_maskz_scalef_ps(live, p, n);
}

// One transposed group of signed bytes (lane a: elements 4t..4t+3 of row a) as four 16-lane f32
// vectors, element j of every row at out + j * 16.
static inline void widen_group(__m512i z, float *out) {
    _mm512_storeu_ps(out, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(z, 24), 24)));
    _mm512_storeu_ps(out + 16, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(z, 16), 24)));
    _mm512_storeu_ps(out + 32, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(z, 8), 24)));
    _mm512_storeu_ps(out + 48, _mm512_cvtepi32_ps(_mm512_srai_epi32(z, 24)));
}

static void attn_partial_tiled(ggml_tensor *dst, int ith, int nth, const PoolAttnParams *P) {
    const ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *mask = dst->src[3];
    const int64_t D = q->ne[0], H = q->ne[1], n = q->ne[2], n_kv = mask->ne[0];
    const int64_t Hkv = P->n_head_kv, G = H / Hkv, S = P->n_split, R = G * n, nb = D / 32;
    const RowAt k_at(k, P->rows, true), v_at(v, P->rows, false);
    const int64_t range = P->range > 0 ? P->range : (n_kv + S - 1) / S;
    const bool k8 = k->type == GGML_TYPE_Q8_0, v8 = v->type == GGML_TYPE_Q8_0;
    const int64_t kbs = k8 ? 34 : 18, vbs = v8 ? 34 : 18;
    const size_t k_head = size_t(nb * kbs), v_head = size_t(nb * vbs);
    const int32_t kbias = k8 ? 128 : 8;
    const size_t k_row = size_t(k->ne[0] / 32 * kbs), v_row = size_t(v->ne[0] / 32 * vbs);   // all heads
    const bool int_dots = P->quant_dots;   // else f32 dots of the unrounded query with the widened keys
    static thread_local TiledScratch tls;
    TiledScratch &T = tls;
    T.kt.resize(size_t(D / 4) * kLanes);
    T.kf.resize(size_t(D) * kLanes);
    T.kd.resize(size_t(nb) * kLanes);
    T.vd.resize(size_t(nb) * kLanes);
    T.pw.resize(size_t(R) * nb * kLanes);
    T.acc.resize(size_t(R) * D);
    T.m.resize(size_t(R));
    T.l.resize(size_t(R) * kLanes);
    T.corr.resize(size_t(R));
    T.qs.resize(size_t(R) * D);
    T.qd.resize(size_t(R) * nb);
    T.qsum.resize(size_t(R) * nb);
    // raw pointers: the thread_local itself is looked up through a call in a shared library
    int32_t *kt_ = T.kt.data(), *qsum_ = T.qsum.data();
    float *kf_ = T.kf.data();
    float *kd_ = T.kd.data(), *vd_ = T.vd.data(), *pw_ = T.pw.data(), *acc_ = T.acc.data(), *m_ = T.m.data(),
          *l_ = T.l.data(), *corr_ = T.corr.data(), *qd_ = T.qd.data();
    int8_t *qs_ = T.qs.data();
    constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
    // One (head, query) row's 16 scaled, masked scores of a tile -> its running max, correction,
    // per-lane sums and p x V block scale.  The running max moves only when some lane passes it (NaN
    // lanes never do, and the reduction ignores them, as the f32 path does); most tiles skip the
    // reduction and the scalar exp.
    auto scores_to_weights = [&](size_t r, __m512 sc) {
        float *pw = &pw_[r * nb * kLanes];
        float mnew = m_[r], corr = 1.f;
        if (_mm512_cmp_ps_mask(sc, _mm512_set1_ps(mnew), _CMP_GT_OQ)) {
            mnew = _mm512_reduce_max_ps(_mm512_max_ps(sc, _mm512_set1_ps(NEG_INF)));
            corr = std::exp(m_[r] - mnew);   // exp(-inf) = 0 on the first tile
        }
        if (mnew == NEG_INF) {   // nothing visible to this row yet
            std::fill(pw, pw + nb * kLanes, 0.f);
            corr_[r] = 1.f;
            return;
        }
        const __m512 p = exp512_nonpos(_mm512_sub_ps(sc, _mm512_set1_ps(mnew)));
        float *lv = &l_[r * kLanes];   // per-lane sums, added up once per range
        _mm512_storeu_ps(lv, _mm512_fmadd_ps(_mm512_loadu_ps(lv), _mm512_set1_ps(corr), p));
        m_[r] = mnew;
        corr_[r] = corr;
        for (int64_t b = 0; b < nb; ++b)
            _mm512_storeu_ps(pw + b * kLanes, _mm512_mul_ps(p, _mm512_loadu_ps(&vd_[size_t(b) * kLanes])));
    };
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    auto mask_row = [&](int64_t i) {
        return reinterpret_cast<const uint16_t *>(static_cast<const char *>(mask->data) + i * mask->nb[1]);
    };

    // Each thread takes a contiguous run of (range, KV head) items, heads inner: the heads of one range
    // share the pool rows' cache lines, so they are read from memory once.
    const int64_t n_items = Hkv * S, it0 = n_items * ith / nth, it1 = n_items * (ith + 1) / nth;
    for (int64_t item = it0; item < it1; ++item) {
        const int64_t g = item % Hkv, sp = item / Hkv;
        const int64_t s0 = sp * range, s1 = std::min(n_kv, s0 + range);
        std::fill(acc_, acc_ + R * D, 0.f);
        std::fill(m_, m_ + R, NEG_INF);
        std::fill(l_, l_ + R * kLanes, 0.f);
        for (int64_t hh = 0; hh < G; ++hh)
            for (int64_t i = 0; i < n; ++i) {
                const size_t r = size_t(hh) * n + i;
                const float *qv = reinterpret_cast<const float *>(static_cast<const char *>(q->data) +
                                                                  (g * G + hh) * q->nb[1] + i * q->nb[2]);
                if (int_dots) quantize_query(qv, D, &qs_[r * D], &qd_[r * nb], &qsum_[r * nb]);
            }
        // Tiles are 16-slot groups in place (not compacted): a group any query sees part of is taken
        // whole, its lanes masked per query.  A slot then has the same lane and tile whatever the other
        // queries of the batch see (a sliding window's lower edge differs per query), so a query's sums
        // do not depend on its batch; groups no query sees are skipped.
        int64_t grp = s0;
        for (;;) {
            int32_t slot[kLanes];
            int cnt = 0;
            uint32_t seen_any = 0;   // lanes some query sees; the others read a zero row (they may hold anything)
            while (grp < s1) {
                const int64_t w = std::min<int64_t>(kLanes, s1 - grp);
                const __mmask32 inwin = __mmask32((1u << w) - 1u);
                __mmask32 vis = 0;
                for (int64_t i = 0; i < n; ++i)
                    vis |= _mm512_mask_cmpneq_epi16_mask(inwin, _mm512_maskz_loadu_epi16(inwin, mask_row(i) + grp),
                                                         _mm512_set1_epi16(short(kF16NegInf)));
                const int64_t g0 = grp;
                grp += w;
                if (!vis) continue;
                for (int a = 0; a < int(w); ++a) slot[a] = int32_t(g0 + a);
                cnt = int(w);
                seen_any = uint32_t(vis);
                break;
            }
            if (cnt == 0) break;
#if defined(__GNUC__)
            // The first head of a range to pass asks for whole pool rows two tiles ahead (the other heads
            // then find them in L2): K/V arrive from L3 or memory once the weights have swept the caches.
            if (g == 0 || item == it0) {
                for (int64_t j = int64_t(slot[cnt - 1]) + 1 + kLanes, je = std::min(s1, j + kLanes); j < je; ++j) {
                    const char *kr = k_at(j), *vr = v_at(j);
                    for (size_t o = 0; o < k_row; o += 64) __builtin_prefetch(kr + o);
                    __builtin_prefetch(kr + k_row - 1);
                    for (size_t o = 0; o < v_row; o += 64) __builtin_prefetch(vr + o);
                    __builtin_prefetch(vr + v_row - 1);
                }
            }
#endif
            for (int a = cnt; a < kLanes; ++a) slot[a] = slot[0];
            const char *krow[kLanes];
            const char *vrow0[kLanes];
            for (int a = 0; a < kLanes; ++a) {
                const bool live = (seen_any >> a) & 1u;
                krow[a] = live ? k_at(slot[a]) + g * k_head : kZeroRow;
                vrow0[a] = live ? v_at(slot[a]) + g * v_head : kZeroRow;
            }
            // K: the transposed tile and the block scales; V: the block scales.
            for (int64_t b = 0; b < nb; ++b) {
                _mm512_storeu_ps(&kd_[size_t(b) * kLanes], row_scales(krow, b * kbs));
                _mm512_storeu_ps(&vd_[size_t(b) * kLanes], row_scales(vrow0, b * vbs));
                int32_t *kt = &kt_[size_t(b) * 8 * kLanes];
                const int64_t off = b * kbs + 2;
                if (k8) {   // 16 rows x 8 groups: Z[p] = rows p and p + 8, then Z[t] = group t of rows 0..15
                    __m512i Z[8];
                    for (int p = 0; p < 8; ++p)
                        Z[p] = _mm512_inserti64x4(
                            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(krow[p] + off))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i *>(krow[p + 8] + off)), 1);
                    transpose_stage<8>(Z, 2);
                    transpose_stage<8>(Z, 1);
                    transpose_stage<8>(Z, 0);
                    if (int_dots)
                        for (int t = 0; t < 8; ++t)
                            _mm512_storeu_si512(kt + t * kLanes, _mm512_xor_si512(Z[t], _mm512_set1_epi8(char(0x80))));
                    else
                        for (int t = 0; t < 8; ++t) widen_group(Z[t], &kf_[size_t(b * 32 + 4 * t) * kLanes]);
                } else {    // 16 rows x 4 groups: Z[p] = rows p, p + 4, p + 8, p + 12; nibbles split after
                    __m512i Z[4];
                    for (int p = 0; p < 4; ++p) {
                        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i *>(krow[p] + off)));
                        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i *>(krow[p + 4] + off)), 1);
                        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i *>(krow[p + 8] + off)), 2);
                        Z[p] = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i *>(krow[p + 12] + off)), 3);
                    }
                    transpose_stage<4>(Z, 1);
                    transpose_stage<4>(Z, 0);
                    const __m512i lo4 = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
                    for (int t = 0; t < 4; ++t) {
                        const __m512i lo = _mm512_and_si512(Z[t], lo4), hi = _mm512_and_si512(_mm512_srli_epi16(Z[t], 4), lo4);
                        if (int_dots) {
                            _mm512_storeu_si512(kt + t * kLanes, lo);
                            _mm512_storeu_si512(kt + (t + 4) * kLanes, hi);
                        } else {   // element 4t + j: low nibbles; 16 + 4t + j: high nibbles; both minus 8
                            widen_group(_mm512_sub_epi8(lo, eight), &kf_[size_t(b * 32 + 4 * t) * kLanes]);
                            widen_group(_mm512_sub_epi8(hi, eight), &kf_[size_t(b * 32 + 16 + 4 * t) * kLanes]);
                        }
                    }
                }
            }
            // Scores of the tile for every (head, query) row; p x V scale for the accumulation.
            for (int64_t i = 0; i < n; ++i) {
                const uint16_t *mr = mask_row(i);
                __mmask16 seen = 0;
                for (int a = 0; a < cnt; ++a) seen |= __mmask16((mr[slot[a]] != kF16NegInf) << a);
                for (int64_t hh = 0; hh < G; ++hh) {
                    const size_t r = size_t(hh) * n + i;
                    if (!int_dots) {   // f32: the query as it is against the widened keys, 4 chains per block
                        const float *qv = reinterpret_cast<const float *>(static_cast<const char *>(q->data) +
                                                                          (g * G + hh) * q->nb[1] + i * q->nb[2]);
                        __m512 sc = _mm512_setzero_ps();
                        for (int64_t b = 0; b < nb; ++b) {
                            const float *kf = &kf_[size_t(b) * 32 * kLanes];
                            const float *qb = qv + b * 32;
                            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                            for (int e = 0; e < 32; e += 4) {
                                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(kf + (e + 0) * kLanes), _mm512_set1_ps(qb[e + 0]), a0);
                                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(kf + (e + 1) * kLanes), _mm512_set1_ps(qb[e + 1]), a1);
                                a2 = _mm512_fmadd_ps(_mm512_loadu_ps(kf + (e + 2) * kLanes), _mm512_set1_ps(qb[e + 2]), a2);
                                a3 = _mm512_fmadd_ps(_mm512_loadu_ps(kf + (e + 3) * kLanes), _mm512_set1_ps(qb[e + 3]), a3);
                            }
                            const __m512 sb = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
                            sc = _mm512_fmadd_ps(sb, _mm512_loadu_ps(&kd_[size_t(b) * kLanes]), sc);
                        }
                        scores_to_weights(r, _mm512_mask_mul_ps(_mm512_set1_ps(NEG_INF), seen, sc, _mm512_set1_ps(P->scale)));
                        continue;
                    }
                    const int32_t *q4 = reinterpret_cast<const int32_t *>(&qs_[r * D]);
                    __m512 sc = _mm512_setzero_ps();
                    for (int64_t b = 0; b < nb; ++b) {
                        const int32_t *kt = &kt_[size_t(b) * 8 * kLanes];
                        __m512i d0 = _mm512_setzero_si512(), d1 = d0;
                        for (int t = 0; t < 8; t += 2) {
                            d0 = _mm512_dpbusd_epi32(d0, _mm512_loadu_si512(kt + t * kLanes), _mm512_set1_epi32(q4[b * 8 + t]));
                            d1 = _mm512_dpbusd_epi32(d1, _mm512_loadu_si512(kt + (t + 1) * kLanes), _mm512_set1_epi32(q4[b * 8 + t + 1]));
                        }
                        const __m512i dq = _mm512_sub_epi32(_mm512_add_epi32(d0, d1),
                                                            _mm512_set1_epi32(kbias * qsum_[r * nb + b]));
                        const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(&kd_[size_t(b) * kLanes]), _mm512_set1_ps(qd_[r * nb + b]));
                        sc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dq), w, sc);
                    }
                    scores_to_weights(r, _mm512_mask_mul_ps(_mm512_set1_ps(NEG_INF), seen, sc, _mm512_set1_ps(P->scale)));
                }
            }
            // V: per block, up to 8 rows' accumulators in registers while the tile's rows are added.
            const char *const *vrow = vrow0;
            for (int64_t b = 0; b < nb; ++b)
                for (int64_t r0 = 0; r0 < R; r0 += 4) {   // 4 rows a call: every row summed the same way
                    const int64_t rn = std::min<int64_t>(4, R - r0);
                    float *acc = &acc_[size_t(r0) * D + b * 32];
                    const float *pw = &pw_[(size_t(r0) * nb + b) * kLanes];
                    const float *corr = &corr_[size_t(r0)];
                    const size_t pstride = size_t(nb) * kLanes;   // (vrow + 2: past the block scale)
                    switch (rn) {
#define KVF_V_CASE(N) case N: v_block_accumulate<N>(acc, size_t(D), pw, pstride, corr, vrow, b * vbs + 2, cnt, v8); break;
                        KVF_V_CASE(1) KVF_V_CASE(2) KVF_V_CASE(3) KVF_V_CASE(4)
#undef KVF_V_CASE
                    }
                }
        }
        for (int64_t hh = 0; hh < G; ++hh)
            for (int64_t i = 0; i < n; ++i) {
                const size_t r = size_t(hh) * n + i;
                float *out = reinterpret_cast<float *>(static_cast<char *>(dst->data) + (g * G + hh) * dst->nb[1] +
                                                       i * dst->nb[2] + sp * dst->nb[3]);
                out[0] = m_[r];
                out[1] = _mm512_reduce_add_ps(_mm512_loadu_ps(&l_[r * kLanes]));
                std::memcpy(out + 2, &acc_[r * D], sizeof(float) * D);
            }
    }
}

static bool tiled_applies(const PoolAttnParams *P, const ggml_tensor *k, const ggml_tensor *v, int64_t D) {
    auto quant = [](ggml_type t) { return t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0; };
    return P->tiled && quant(k->type) && quant(v->type) && D % 32 == 0;
}
#endif

// partials: [D + 2, H, n, S]: per range the running max m, the sum l, and acc[D].
// One kernel body on purpose: the row loop, the online softmax and the dequantize-and-accumulate
// share registers and early exits that a split into helpers would hide from the compiler.
static void attn_partial(ggml_tensor *dst, int ith, int nth, void *ud) {
    const auto *P = static_cast<const PoolAttnParams *>(ud);
    const ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *mask = dst->src[3];
    const int64_t D = q->ne[0], H = q->ne[1], n = q->ne[2], n_kv = mask->ne[0];
#if defined(KVFLASH_TILED_ATTN)
    if (tiled_applies(P, k, v, D)) return attn_partial_tiled(dst, ith, nth, P);
#endif
    const int64_t Hkv = P->n_head_kv, G = H / Hkv, S = P->n_split;
    const int64_t range = P->range > 0 ? P->range : (n_kv + S - 1) / S;
    const row_to_f32 tk = converter(k->type), tv = converter(v->type);
    const size_t k_head = ggml_row_size(k->type, D), v_head = ggml_row_size(v->type, D);
    const RowAt k_at(k, P->rows, true), v_at(v, P->rows, false);

    // q8_0 / q4_0 keys: integer dot products against the quantized queries (see dots_quant)
    const bool int_k = P->quant_dots && (k->type == GGML_TYPE_Q8_0 || k->type == GGML_TYPE_Q4_0) && D % 32 == 0;
    const int64_t nb = D / 32;
    thread_local std::vector<float> Kt, Vt, sc, acc, mrow, lrow;
    thread_local std::vector<int32_t> vis;
    thread_local std::vector<uint8_t> live;   // per tile slot: does any query see it
    thread_local std::vector<uint8_t> kq;   // the tile's unpacked keys (unpack_keys)
    thread_local std::vector<float> kd;
    thread_local QuantQuery qq;
    if (int_k) {
        qq.qs.resize(size_t(G) * n * D);
        qq.d.resize(size_t(G) * n * nb);
        qq.sum.resize(size_t(G) * n * nb);
        kq.resize(size_t(kTile) * D);
        kd.resize(size_t(kTile) * nb);
    }
    Kt.resize(size_t(kTile) * D);
    Vt.resize(size_t(kTile) * D);
    sc.resize(kTile);
    acc.resize(size_t(G) * n * D);
    mrow.resize(size_t(G) * n);
    lrow.resize(size_t(G) * n);
    vis.resize(kTile);
    live.resize(kTile);

    for (int64_t item = ith; item < Hkv * S; item += nth) {
        const int64_t g = item / S, sp = item % S;
        const int64_t s0 = sp * range, s1 = std::min(n_kv, s0 + range);
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(mrow.begin(), mrow.end(), -std::numeric_limits<float>::infinity());
        std::fill(lrow.begin(), lrow.end(), 0.f);
        if (int_k)
            for (int64_t hh = 0; hh < G; ++hh)
                for (int64_t i = 0; i < n; ++i) {
                    const size_t r = size_t(hh) * n + i;
                    const float *qv = reinterpret_cast<const float *>(static_cast<const char *>(q->data) +
                                                                      (g * G + hh) * q->nb[1] + i * q->nb[2]);
                    quantize_query(qv, D, &qq.qs[r * D], &qq.d[r * nb], &qq.sum[r * nb]);
                }
        for (int64_t t0 = s0; t0 < s1; t0 += kTile) {
            const int64_t nt = std::min<int64_t>(kTile, s1 - t0);
#if defined(__GNUC__)
            // The next tile's K/V rows of this head, asked for now: the rows are a strided walk (one KV
            // head's bytes out of each pool row) and the compute of one tile hides their latency.
            for (int64_t j = t0 + kTile, je = std::min(s1, t0 + 2 * kTile); j < je; ++j) {
                const char *kr = k_at(j) + g * k_head;
                const char *vr = v_at(j) + g * v_head;
                __builtin_prefetch(kr);
                __builtin_prefetch(kr + k_head - 1);
                __builtin_prefetch(vr);
                __builtin_prefetch(vr + v_head - 1);
            }
#endif
            // Which tile slots does any query see?  Dequantize only those.
            int nvis = 0;
            for (int64_t j = 0; j < nt; ++j) {
                bool any = false;
                for (int64_t i = 0; i < n && !any; ++i) {
                    const auto *mr = reinterpret_cast<const uint16_t *>(static_cast<const char *>(mask->data) + i * mask->nb[1]);
                    any = mr[t0 + j] != kF16NegInf;
                }
                live[j] = any;
                if (any) ++nvis;
            }
            if (nvis == 0) continue;
            // The whole tile in place (masked slots add exact zeros; slots no query sees are zero rows,
            // whatever bytes they hold): a slot keeps its lane whatever the other queries of the batch
            // see, so a query's sums do not depend on its batch.
            nvis = int(nt);
            for (int a = 0; a < nvis; ++a) vis[a] = a;
            for (int a = 0; a < nvis; ++a) {
                const int64_t s = t0 + vis[a];
                const char *krow = live[a] ? k_at(s) + g * k_head : kZeroRow;
                if (int_k) unpack_keys(k->type, reinterpret_cast<const uint8_t *>(krow), nb, &kq[size_t(a) * D], &kd[size_t(a) * nb]);
                else tk(krow, &Kt[size_t(a) * D], D);
                tv(live[a] ? v_at(s) + g * v_head : kZeroRow, &Vt[size_t(a) * D], D);
            }
            for (int64_t i = 0; i < n; ++i) {
                const auto *mr = reinterpret_cast<const uint16_t *>(static_cast<const char *>(mask->data) + i * mask->nb[1]);
                for (int64_t hh = 0; hh < G; ++hh) {
                    const int64_t h = g * G + hh;
                    const float *qv = reinterpret_cast<const float *>(static_cast<const char *>(q->data) + h * q->nb[1] + i * q->nb[2]);
                    constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
                    const size_t r = size_t(hh) * n + i;
                    if (int_k) dots_quant(k->type, kq.data(), kd.data(), nvis, nb, &qq.qs[r * D], &qq.d[r * nb],
                                          &qq.sum[r * nb], sc.data());
                    else dots(qv, Kt.data(), nvis, D, sc.data());
                    float tmax = NEG_INF;
                    for (int a = 0; a < nvis; ++a) {
                        sc[a] = mr[t0 + vis[a]] == kF16NegInf ? NEG_INF : sc[a] * P->scale;
                        tmax = std::max(tmax, sc[a]);
                    }
                    if (tmax == NEG_INF) continue;
                    const float mnew = std::max(mrow[r], tmax);
                    const float corr = std::exp(mrow[r] - mnew);  // exp(-inf) = 0 on the first tile
                    const float l = lrow[r] * corr + exp_shifted(sc.data(), nvis, mnew);
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

// dst: [D, H, n] <- merge of the S ranges in partials [D + 2, H, n, S].  With sinks (src[1], [H] f32:
// gpt-oss), head h's sink is one more logit (already scaled) in the denominator with no value: the
// running max takes it in and the sum adds exp(sink - max), so a query that sees no slot gets zeros, as
// ggml's attention does.
static void attn_reduce(ggml_tensor *dst, int ith, int nth, void *) {
    const ggml_tensor *pt = dst->src[0];
    const float *sinks = dst->src[1] ? static_cast<const float *>(dst->src[1]->data) : nullptr;
    const int64_t D = dst->ne[0], H = dst->ne[1], n = dst->ne[2], S = pt->ne[3];
    for (int64_t r = ith; r < H * n; r += nth) {
        const int64_t h = r % H, i = r / H;
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s) {
            const float *p = reinterpret_cast<const float *>(static_cast<const char *>(pt->data) + h * pt->nb[1] + i * pt->nb[2] + s * pt->nb[3]);
            if (p[1] > 0.f) M = std::max(M, p[0]);
        }
        if (sinks) M = std::max(M, sinks[h]);
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
        if (sinks) L += std::exp(sinks[h] - M);
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int64_t e = 0; e < D; ++e) out[e] *= inv;
    }
}

SplitK split_for(int64_t n_kv) {
    int64_t range = 256;
    while ((n_kv + range - 1) / range > 32) range *= 2;
    return {int32_t(std::max<int64_t>(1, (n_kv + range - 1) / range)), int32_t(range)};
}

bool pool_attention_tiled_available() {
#if defined(KVFLASH_TILED_ATTN)
    return true;
#else
    return false;
#endif
}

ggml_tensor *pool_attention_cpu(ggml_context *ctx, ggml_tensor *q, ggml_tensor *k, ggml_tensor *v, ggml_tensor *mask,
                                const PoolAttnParams *params, ggml_tensor *sinks) {
    GGML_ASSERT(q->type == GGML_TYPE_F32 && mask->type == GGML_TYPE_F16);
    GGML_ASSERT(!sinks || (sinks->type == GGML_TYPE_F32 && ggml_is_contiguous(sinks) && ggml_nelements(sinks) == q->ne[1]));
    GGML_ASSERT(mask->ne[1] >= q->ne[2]);
    GGML_ASSERT(ggml_row_size(k->type, q->ne[0]) <= sizeof(kZeroRow) && ggml_row_size(v->type, q->ne[0]) <= sizeof(kZeroRow));
    // With a row table its owner fills it before each compute, covering every attended row.
    if (!params->rows) GGML_ASSERT(k->ne[1] == mask->ne[0] && v->ne[1] == k->ne[1]);
    const int64_t D = q->ne[0], H = q->ne[1], n = q->ne[2];
    ggml_tensor *args[4] = {q, k, v, mask};
    ggml_tensor *part = ggml_custom_4d(ctx, GGML_TYPE_F32, D + 2, H, n, params->n_split, args, 4, attn_partial,
                                       GGML_N_TASKS_MAX, const_cast<PoolAttnParams *>(params));
    ggml_tensor *rargs[2] = {part, sinks};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, D, H, n, 1, rargs, sinks ? 2 : 1, attn_reduce, GGML_N_TASKS_MAX, nullptr);
}

}  // namespace kvflash
