// Relevance scoring over a Runtime's cache: the kernels policies call, kept out of
// the runtime so it stays policy-free.  Each reads the runtime's captured queries
// and its pool (and, for the history, the host store); none changes residency.
// Precondition for all: at least one query captured (std::invalid_argument otherwise).
#pragma once

#include <cstdint>
#include <vector>

#include "kvflash/runtime.h"

namespace kvflash {

enum class QKMode { MEAN = 0, BOUND = 1 };

// Per-chunk key summaries -- min, max and the L2-normalised mean of the post-RoPE
// keys, per paged layer -- computed when a chunk seals while still resident.
// Install on a runtime with set_observer; the qk-bound / qk-mean policies score them.
class ChunkSummaries final : public CacheObserver {
public:
    void evaluated(const Runtime &rt, int64_t pos0, int32_t n) override;
    void truncated(const Runtime &rt, int64_t n_past) override;
    // Scores chunks [0, n) against the last captured query: per paged layer the max
    // over query heads of q . summary (MEAN: the chunk's normalised mean key; BOUND:
    // sum_d max(q_d min_d, q_d max_d), an upper bound of q . k over the chunk), then
    // the mean over layers.  Chunks without a summary (not sealed yet) score +inf.
    // n in [0, n_chunks] (std::out_of_range otherwise).
    void qk_scores(const Runtime &rt, QKMode mode, float *out, int32_t n) const;

private:
    // [n_chunks][n_paged][n_embd_k] each
    std::vector<float> min_, max_, mean_;
    std::vector<uint8_t> ready_;
};

// Attention paid to each position by the captured queries, over the resident pool:
// per layer and head a softmax over the visible slots, averaged over the queries;
// max over heads and layers.  out[p] for p < n (0 for positions not visible/resident).
void attention_scores(const Runtime &rt, float *out, int64_t n);

// The same over the whole history, paged-out chunks included: K rows are read from
// the pool for resident chunks and from the host store for the rest (the host copy
// is bit-exact), so the scores are what a full cache would give for these queries.
// One pass over every key per call; layers split over n_threads.
// per_chunk: out[c] for n chunks instead -- per layer and head the attention mass the
// chunk receives (summed over its positions), then the max over heads and layers.
// groups (length n_past, values < n or negative): the same with out[g] for group g.
// q_first, q_count: use only those captured queries (capture order; q_count < 0: all
// from q_first), e.g. the earliest of them as a baseline for the latest.
void history_attention(const Runtime &rt, float *out, int64_t n, int32_t n_threads, bool per_chunk = false,
                       const int32_t *groups = nullptr, int32_t q_first = 0, int32_t q_count = -1);

}  // namespace kvflash
