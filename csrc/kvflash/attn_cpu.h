// Attention over the pool for the CPU backend, as two ggml custom ops.
//
// ggml's CPU flash attention walks the cache one (query head, key) pair at a
// time and re-reads each K/V row once per query head; at decode that makes
// attention, not memory, the cost that grows with the cache.  This path
// streams the pool once per KV head: every K/V row is dequantized once and used
// by all query heads of its GQA group and all queries of the batch, and the
// pool is split into ranges that the threads take independently (split-K).
// A second op merges the ranges' partial softmax states.
//
// Masked (-inf) slots are skipped; a range with no visible slot contributes
// nothing.  Supports any K/V type ggml can convert to f32 (f16, q8_0, q4_0).
#pragma once

#include <cstdint>
#include <vector>

#include "ggml.h"

namespace kvflash {

// Rows read through a chunk table instead of the stored tensor's own rows (exact mode: one walk
// over every position of the context, resident rows from the pool, paged-out rows from the host
// store, in logical order).  Row s of K starts at k[s / chunk_rows] + (s % chunk_rows) * the K
// tensor's row bytes; V likewise.  Every chunk below n_kv / chunk_rows has an entry (a zeroed
// stand-in where nothing is written: such rows are masked).
struct RowTable {
    std::vector<const char *> k, v;
    int32_t chunk_rows = 0;
};

struct PoolAttnParams {
    int32_t n_head_kv = 1;
    int32_t n_split = 1;   // pool ranges (split-K)
    // Slots per range (0: n_kv / n_split rounded up).  A range size that does not follow n_kv keeps a
    // query's partial sums the same whatever the batch and the attended extent around it (see
    // split_for): the runtime sets it.
    int32_t range = 0;
    float scale = 1.f;
    // q8_0 / q4_0 K: integer dots against a quantized query (ggml's q8_0 activation rounding) instead
    // of f32 dots.  Where the tiled AVX-512 kernel is compiled and both K and V are q8_0 / q4_0 that
    // kernel runs either way (dpbusd, or f32 FMAs over keys widened in registers); elsewhere the
    // row-at-a-time paths.  Off in the runtime: see runtime.cpp.
    bool quant_dots = false;
    // The tiled kernel where it applies (q8_0 / q4_0 K and V on AVX-512 VNNI builds); false: the
    // row-at-a-time paths (the bench's and tests' window onto them).
    bool tiled = true;
    // null: row s is row s of the k / v tensors; else rows come through the table (which must
    // outlive the graph's computations) and k / v are only the graph's order (the pool's writes).
    const RowTable *rows = nullptr;
};

// The split-K geometry for n_kv attended slots (a multiple of 256): ranges of 256 slots up to 8K, then
// of 512, 1024, ... so that there are at most 32.  The range size changes only where n_kv passes a
// power of two, so a one-token step and a batch (a verification pass) over nearly the same extent cut
// the rows into the same ranges: the same partial sums, bit for bit.  Returns {n_split, range}.
struct SplitK { int32_t n_split, range; };
SplitK split_for(int64_t n_kv);

// Whether this build has the tiled kernel for q8_0 / q4_0 K and V (AVX-512 F/BW/VL/VNNI at compile
// time); the runtime then uses it for those pools.
bool pool_attention_tiled_available();

// q:    [D, H, n]      f32, contiguous (post-RoPE)
// k, v: [D*Hkv, n_kv]  pool rows (views of the stored pool tensors); with params->rows, any
//                      rows of that width (the table supplies n_kv rows)
// mask: [n_kv, n]      f16, 0 or -inf (its first dimension is n_kv)
// sinks: [H] f32 or null: per query head one more logit (scaled already) in the softmax's
//        denominator, with no value (gpt-oss's attention sinks); merged in the split-K reduce
// returns [D, H, n] f32.  params must outlive the graph's computations.
ggml_tensor *pool_attention_cpu(ggml_context *ctx, ggml_tensor *q, ggml_tensor *k, ggml_tensor *v,
                                ggml_tensor *mask, const PoolAttnParams *params, ggml_tensor *sinks = nullptr);

// Attention probabilities paid by nq captured queries to the pool's slots, for
// one layer: per head a softmax over the slots visible to each query (written
// position <= the query's), averaged over the queries, then
// out[pos] = max(out[pos], that average) over heads.  out has n_pos entries.
// q: [nq][H][D] f32; k: [D*Hkv, >= n_kv] pool rows (any backend; read via ggml).
// The same over raw K rows of any length: row s (row_bytes apart, type `type`)
// holds position row_pos[s] (< 0: unused).  The history scorer feeds it rows
// gathered from the pool and the host store.  chunk_tokens > 0: out has one entry per
// chunk of chunk_tokens positions instead, each head's attention mass summed over the
// chunk (mean over the queries), and the max over heads.  groups (length n_pos) instead
// maps each position to one of n_groups outputs the same way (< 0: counted nowhere).
// sinks ([H], or null): the layer's attention sinks, each one more logit in its head's softmax
// denominator (the probabilities are the layer's own: a head that pays its sink pays the keys less).
void attention_probs_rows(const float *q, int32_t nq, int32_t H, int32_t Hkv, int32_t D, ggml_type type,
                          const uint8_t *rows, size_t row_bytes, int64_t n_rows, const int64_t *row_pos,
                          const int64_t *q_pos, float scale, float *out, int64_t n_pos, int32_t chunk_tokens = 0,
                          const int32_t *groups = nullptr, int64_t n_groups = 0, const float *sinks = nullptr);

void pool_attention_probs(const float *q, int32_t nq, int32_t H, int32_t Hkv, int32_t D, const ggml_tensor *k,
                          int32_t n_kv, const int64_t *slot_pos, const int64_t *q_pos, float scale, float *out,
                          int64_t n_pos, const float *sinks = nullptr);

}  // namespace kvflash
