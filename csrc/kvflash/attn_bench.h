// The attention op's harnesses (csrc/kvflash/attn_bench.cpp, built into the Python module only): the op
// once over caller arrays (the tests' window onto the kernel) and the bench's timing loop.
#pragma once

#include <cstdint>
#include <vector>

#include "kvflash/attn_cpu.h"

namespace kvflash {

// The op once over caller arrays (the tests' window onto the kernel): q [n][H][D] f32,
// k and v n_kv rows of D*Hkv elements of `type`, visible [n][n_kv] (nonzero: the query
// sees the slot), out [n][H][D].  Throws invalid_argument on bad shapes or types.
void pool_attention_once(const float *q, int32_t n, int32_t H, int32_t Hkv, int32_t D, ggml_type type,
                         const uint8_t *k, const uint8_t *v, int64_t n_kv, const uint8_t *visible, float scale,
                         int32_t n_split, int32_t n_threads, bool quant_dots, float *out, bool tiled = true,
                         int32_t table_rows = 0, const float *sinks = nullptr);
// table_rows > 0: the rows are first scattered into chunks of table_rows rows, laid out in a
// shuffled order, and read through a RowTable (the exact mode's path), zeroed past n_kv.
// sinks ([H], or null): per-head attention sinks (pool_attention_cpu).

// The pool attention op alone, for the bench: n_layers independent K/V pools of n_kv
// slots (random rows of `type`, every slot visible), one decode query per layer, all
// layers in one graph computed with n_threads, as a decode step's attention parts.
// Each iteration also times one plain read pass (one thread, every K/V byte loaded
// once) and a memcpy of the same bytes, in an order rotated per iteration; seconds per
// iteration for each, and the K/V bytes one iteration touches.
struct AttnBenchResult {
    std::vector<double> attn_s, read_s, copy_s;
    double kv_bytes = 0;
    int32_t n_split = 1;
};
AttnBenchResult bench_pool_attention(int32_t n_kv, int32_t head_dim, int32_t n_head, int32_t n_head_kv, ggml_type type,
                                     int32_t n_threads, int32_t n_layers, int32_t n_queries, int32_t iters,
                                     uint64_t seed, bool quant_dots = false, bool tiled = true);

}  // namespace kvflash
