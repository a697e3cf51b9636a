// Matrix products over a batch with one-token arithmetic (the CPU backend).
//
// ggml's CPU matmul rounds a batch differently from one row: for n >= 2 rows a q8_0 / q5_0 / q4_0 /
// f16 weight goes through llamafile's tinyBLAS, a repacked weight (q4_K, q4_0, iq4_nl interleaves)
// through the 4-row gemm, and AMX weights have one-row copies of their own -- each sums in another
// order than the one-row path, so the last bits of a product depend on how many tokens were
// evaluated together.  Exact mode's verification pass must produce, for every token of its batch,
// what a one-token eval produces (the full cache decodes one token at a time), bit for bit.
//
// one_row_products(w, x) is w·x with every column computed as ggml computes a one-column product of
// the same weight: for a weight in plain memory (the file mapping) one custom op that quantizes each
// column to the weight's vec_dot type and takes one vec_dot per (row, column) -- ggml's one-row path,
// but reading each weight row once for all columns; for a weight in one of ggml's extra buffers
// (repacked, AMX), one ggml product per column, concatenated (the weight is read once per column).
#pragma once

#include "ggml.h"

namespace kvflash {

// w: [K, M] (a weight; any type the CPU backend multiplies), x: [K, n] f32 -> [M, n] f32.
// plain: w's bytes are in ggml's own layout in host memory (no extra buffer's conversion).
ggml_tensor *one_row_products(ggml_context *ctx, ggml_tensor *w, ggml_tensor *x, bool plain);

// Nodes one_row_products adds to a graph for n columns (the graph's node budget).
int64_t one_row_products_nodes(int64_t n, bool plain);

}  // namespace kvflash
