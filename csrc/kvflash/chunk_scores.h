// Chunk scores from token scores, and the qk policy's peak scoring: one implementation for the
// C API and the Python policies (qk and the drafter), so both paths rank chunks the same way.
#pragma once

#include <cstdint>

namespace kvflash {

class Runtime;

// Token scores to chunk scores.  x: [n] token scores; chunk_of: [n] the chunk of each token, in
// [0, n_chunks), or negative for a token of no chunk (it still spreads to its neighbours).  Each token first takes the max of itself and the `spread` tokens on
// either side (in token order, across chunk edges: a fact spans the words after the one attended
// to), then a chunk takes its peak token.  Chunks no token maps to score one below the lowest
// scored chunk, so they rank last without a sentinel that breaks a sort.  out: [n_chunks].
void chunk_peaks(const double *x, int64_t n, const int32_t *chunk_of, int32_t n_chunks, int32_t spread,
                 float *out);

// The qk policy's default scoring ("peak"), with the target's own captured queries.
struct PeakScoring {
    int32_t n_queries = 8;   // the latest captured queries score the history
    int32_t contrast = 32;   // minus what the n_queries ending `contrast` tokens earlier pay (0: off)
    int32_t spread = 4;      // chunk_peaks' spread
    int32_t n_layers = 0;    // the first n_layers paged layers only (0: all)
};

// The qk policy's default layer count: a quarter of the paged layers but at least 8 (all when
// there are fewer).  Early layers carry the retrieval signal; max over every layer lets later
// layers' spikes drown it (SmolLM2, tuning splits: bench/results README).
inline int32_t qk_auto_layers(int32_t n_paged) {
    const int32_t q = (n_paged + 3) / 4;
    return n_paged < 8 ? n_paged : (q > 8 ? q : 8);
}

// Minimum captured queries PeakScoring needs for its contrast to apply.
inline int32_t peak_capture(const PeakScoring &p) { return p.n_queries + p.contrast; }

// out: [n_chunks] chunk scores of the runtime's history (positions [0, n_past)): per token the
// attention the last n_queries captured queries pay it (history_attention: paged-out keys
// included), minus the baseline's when contrast > 0 and enough queries are captured, then
// chunk_peaks with chunk = position / chunk_tokens.  Throws std::invalid_argument on bad params.
void qk_peak_scores(const Runtime &rt, const PeakScoring &p, float *out, int32_t n_chunks, int32_t n_threads);

}  // namespace kvflash
