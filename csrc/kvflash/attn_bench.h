// The attention bench's harness (csrc/kvflash/attn_bench.cpp, built into the Python module only).
#pragma once

#include <cstdint>
#include <vector>

#include "kvflash/attn_cpu.h"

namespace kvflash {

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
