// The pool attention op alone against a plain read pass and a memcpy (python -m kvflash.bench attention).
// Compiled into the Python module, not into libkvflash: the bench's harness ships with the bench only.
#include "kvflash/attn_bench.h"
#include "kvflash/attn_rows.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

// ---------------------------------------------------------------- micro-benchmark (bench attention)
namespace kvflash {

namespace {
// A read pass a compiler cannot drop: every 64-byte line loaded, xor-folded into one value.
uint64_t read_pass(const std::vector<const uint8_t *> &bufs, size_t bytes_each) {
    uint64_t acc = 0;
    for (const uint8_t *b : bufs) {
#if defined(__AVX2__)
        __m256i x0 = _mm256_setzero_si256(), x1 = x0;
        size_t i = 0;
        for (; i + 64 <= bytes_each; i += 64) {
            x0 = _mm256_xor_si256(x0, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + i)));
            x1 = _mm256_xor_si256(x1, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + i + 32)));
        }
        alignas(32) uint64_t lanes[4];
        _mm256_store_si256(reinterpret_cast<__m256i *>(lanes), _mm256_xor_si256(x0, x1));
        acc ^= lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
        for (; i < bytes_each; ++i) acc ^= b[i];
#else
        for (size_t i = 0; i < bytes_each; i += 8) {
            uint64_t w;
            std::memcpy(&w, b + i, std::min<size_t>(8, bytes_each - i));
            acc ^= w;
        }
#endif
    }
    return acc;
}
}  // namespace

void pool_attention_once(const float *qd, int32_t n, int32_t H, int32_t Hkv, int32_t D, ggml_type type,
                         const uint8_t *kd, const uint8_t *vd, int64_t n_kv, const uint8_t *visible, float scale,
                         int32_t n_split, int32_t n_threads, bool quant_dots, float *out, bool tiled,
                         int32_t table_rows, const float *sinks) {
    if (n < 1 || H < 1 || Hkv < 1 || H % Hkv || D < 1 || n_kv < 1 || n_split < 1 || n_threads < 1)
        throw std::invalid_argument("pool_attention: need n, heads, head_dim, slots, ranges and threads >= 1 and "
                                    "n_head a multiple of n_head_kv");
    if (table_rows < 0) throw std::invalid_argument("pool_attention: table_rows must be >= 0 (0: no row table)");
    if (!converter(type)) throw std::invalid_argument("pool_attention: K/V type must be f16, q8_0 or q4_0");
    if ((int64_t(D) * Hkv) % ggml_blck_size(type))
        throw std::invalid_argument("pool_attention: a K/V row is not a whole number of blocks of its type");
    const size_t row = ggml_row_size(type, int64_t(D) * Hkv);
    const size_t mem = 2 * row * size_t(n_kv) + size_t(D) * H * n * 4 * 2 + size_t(n_kv) * n * 2 +
                       size_t(D + 2) * H * n * n_split * 4 + size_t(H) * 4 + 8 * ggml_tensor_overhead() + ggml_graph_overhead() +
                       (size_t(1) << 16);
    ggml_init_params ip{mem, nullptr, false};
    ggml_context *ctx = ggml_init(ip);
    if (!ctx) throw std::runtime_error("pool_attention: out of memory");
    struct Free { ggml_context *c; ~Free() { ggml_free(c); } } guard{ctx};
    ggml_tensor *q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, H, n);
    std::memcpy(q->data, qd, ggml_nbytes(q));
    ggml_tensor *k = ggml_new_tensor_2d(ctx, type, int64_t(D) * Hkv, n_kv);
    ggml_tensor *v = ggml_new_tensor_2d(ctx, type, int64_t(D) * Hkv, n_kv);
    std::memcpy(k->data, kd, ggml_nbytes(k));
    std::memcpy(v->data, vd, ggml_nbytes(v));
    ggml_tensor *mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n);
    auto *mm = static_cast<uint16_t *>(mask->data);
    for (int64_t i = 0; i < int64_t(n) * n_kv; ++i) mm[i] = visible[i] ? 0 : kF16NegInf;
    PoolAttnParams params;
    params.n_head_kv = Hkv;
    params.n_split = n_split;
    params.scale = scale;
    params.quant_dots = quant_dots;
    params.tiled = tiled;
    // The exact mode's path: the same rows scattered into chunks stored in a scrambled order (and
    // zeroed past n_kv), reached through a table; the op's k / v operands then only carry the widths.
    RowTable table;
    std::vector<uint8_t> scattered;
    if (table_rows > 0) {
        const int64_t nch = (n_kv + table_rows - 1) / table_rows;
        const size_t cb = size_t(table_rows) * row;
        scattered.assign(2 * cb * size_t(nch), 0);
        table.chunk_rows = table_rows;
        table.k.resize(nch);
        table.v.resize(nch);
        for (int64_t c = 0; c < nch; ++c) {
            const int64_t at = nch - 1 - c;   // stored in reverse: chunk c's bytes away from c's place
            uint8_t *kc = scattered.data() + size_t(2 * at) * cb, *vc = kc + cb;
            const int64_t r0 = c * table_rows, nr = std::min<int64_t>(table_rows, n_kv - r0);
            std::memcpy(kc, kd + size_t(r0) * row, size_t(nr) * row);
            std::memcpy(vc, vd + size_t(r0) * row, size_t(nr) * row);
            table.k[c] = reinterpret_cast<const char *>(kc);
            table.v[c] = reinterpret_cast<const char *>(vc);
        }
        params.rows = &table;
        std::memset(k->data, 0xAB, ggml_nbytes(k));   // never read through the table path
        std::memset(v->data, 0xAB, ggml_nbytes(v));
    }
    ggml_tensor *st = nullptr;
    if (sinks) {
        st = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, H);
        std::memcpy(st->data, sinks, ggml_nbytes(st));
    }
    ggml_tensor *o = pool_attention_cpu(ctx, q, k, v, mask, &params, st);
    ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, o);
    ggml_cplan plan = ggml_graph_plan(gf, n_threads, nullptr);
    std::vector<uint8_t> work(plan.work_size + 64);
    plan.work_data = work.data();
    if (ggml_graph_compute(gf, &plan) != GGML_STATUS_SUCCESS) throw std::runtime_error("pool_attention: compute failed");
    std::memcpy(out, o->data, ggml_nbytes(o));
}

AttnBenchResult bench_pool_attention(int32_t n_kv, int32_t D, int32_t H, int32_t Hkv, ggml_type type,
                                     int32_t n_threads, int32_t n_layers, int32_t n_queries, int32_t iters,
                                     uint64_t seed, bool quant_dots, bool tiled) {
    if (n_kv < 64 || D < 32 || D % 32 || H < 1 || Hkv < 1 || H % Hkv || n_threads < 1 || n_layers < 1 ||
        n_queries < 1 || iters < 1)
        throw std::invalid_argument("bench_pool_attention: need n_kv >= 64, head_dim a multiple of 32, n_head a "
                                    "multiple of n_head_kv, and positive threads, layers, queries and iterations");
    if (!converter(type)) throw std::invalid_argument("bench_pool_attention: K/V type must be f16, q8_0 or q4_0");
    const size_t row = ggml_row_size(type, int64_t(D) * Hkv), pool_bytes = row * size_t(n_kv);
    const size_t per_layer_out = size_t(D + 2) * H * n_queries * 32 * 4 + size_t(D) * H * n_queries * 4;
    const size_t mem = size_t(n_layers) * (2 * pool_bytes + per_layer_out + 6 * ggml_tensor_overhead() + 4096) +
                       size_t(D) * H * n_queries * 4 + size_t(n_kv) * n_queries * 2 + ggml_graph_overhead() +
                       64 * ggml_tensor_overhead() + (size_t(1) << 20);
    ggml_init_params ip{mem, nullptr, false};
    ggml_context *ctx = ggml_init(ip);
    if (!ctx) throw std::runtime_error("bench_pool_attention: out of memory");
    struct Free { ggml_context *c; ~Free() { ggml_free(c); } } guard{ctx};
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> tmp(size_t(D) * Hkv * n_kv);
    auto fill = [&](ggml_tensor *t) {
        for (float &x : tmp) x = nd(rng);
        if (type == GGML_TYPE_F16) ggml_fp32_to_fp16_row(tmp.data(), static_cast<ggml_fp16_t *>(t->data), int64_t(tmp.size()));
        else ggml_quantize_chunk(type, tmp.data(), t->data, 0, n_kv, int64_t(D) * Hkv, nullptr);
    };
    ggml_tensor *q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, H, n_queries);
    for (int64_t i = 0; i < ggml_nelements(q); ++i) static_cast<float *>(q->data)[i] = nd(rng);
    ggml_tensor *mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_queries);
    std::memset(mask->data, 0, ggml_nbytes(mask));   // every slot visible to every query
    PoolAttnParams params;
    params.n_head_kv = Hkv;
    params.scale = 1.f / std::sqrt(float(D));
    params.quant_dots = quant_dots;
    params.tiled = tiled;
    // the runtime's choice of ranges
    const SplitK sk = split_for(n_kv);
    params.n_split = sk.n_split;
    params.range = sk.range;
    ggml_cgraph *gf = ggml_new_graph(ctx);
    std::vector<const uint8_t *> bufs;
    for (int32_t l = 0; l < n_layers; ++l) {
        ggml_tensor *k = ggml_new_tensor_2d(ctx, type, int64_t(D) * Hkv, n_kv);
        ggml_tensor *v = ggml_new_tensor_2d(ctx, type, int64_t(D) * Hkv, n_kv);
        fill(k);
        fill(v);
        bufs.push_back(static_cast<const uint8_t *>(k->data));
        bufs.push_back(static_cast<const uint8_t *>(v->data));
        ggml_build_forward_expand(gf, pool_attention_cpu(ctx, q, k, v, mask, &params));
    }
    ggml_cplan plan = ggml_graph_plan(gf, n_threads, nullptr);
    std::vector<uint8_t> work(plan.work_size + 64);
    plan.work_data = work.data();
    std::vector<uint8_t> dst(pool_bytes * bufs.size());
    std::memset(dst.data(), 1, dst.size());
    AttnBenchResult res;
    res.kv_bytes = double(pool_bytes) * double(bufs.size());
    res.n_split = params.n_split;
    volatile uint64_t sink = 0;
    using clk = std::chrono::steady_clock;
    auto secs = [](clk::time_point a, clk::time_point b) { return std::chrono::duration<double>(b - a).count(); };
    if (ggml_graph_compute(gf, &plan) != GGML_STATUS_SUCCESS)   // warm-up: first touches, thread start
        throw std::runtime_error("bench_pool_attention: graph compute failed");
    for (int32_t it = 0; it < iters; ++it) {
        for (int32_t j = 0; j < 3; ++j) {
            const int32_t what = (it + j) % 3;
            const auto t0 = clk::now();
            if (what == 0) {
                if (ggml_graph_compute(gf, &plan) != GGML_STATUS_SUCCESS)
                    throw std::runtime_error("bench_pool_attention: graph compute failed");
                res.attn_s.push_back(secs(t0, clk::now()));
            } else if (what == 1) {
                sink = sink ^ read_pass(bufs, pool_bytes);
                res.read_s.push_back(secs(t0, clk::now()));
            } else {
                for (size_t b = 0; b < bufs.size(); ++b) std::memcpy(dst.data() + b * pool_bytes, bufs[b], pool_bytes);
                res.copy_s.push_back(secs(t0, clk::now()));
            }
        }
    }
    (void)sink;
    return res;
}

}  // namespace kvflash
