// Relevance scoring over a Runtime's cache: the kernels policies call, kept out of
// the runtime so it stays policy-free.  Each reads the runtime's captured queries
// and its pool (and, for the history, the host store); none changes residency.
// Precondition for all: at least one query captured (std::invalid_argument otherwise).
#pragma once

#include <cstdint>
#include <string>
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
    // a reread chunk's keys changed: its summary is taken again
    void rewritten(const Runtime &rt, int64_t pos0, int32_t n) override;
    // Scores chunks [0, n) against the last captured query: per paged layer the max
    // over query heads of q . summary (MEAN: the chunk's normalised mean key; BOUND:
    // sum_d max(q_d min_d, q_d max_d), an upper bound of q . k over the chunk), then
    // the mean over layers.  Chunks without a summary (not sealed yet) score +inf.
    // n in [0, n_chunks] (std::out_of_range otherwise).
    void qk_scores(const Runtime &rt, QKMode mode, float *out, int32_t n) const;

private:
    friend class Snapshot;
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
// from q_first), e.g. the earliest of them as a baseline for the latest.  n_layers > 0:
// only the first n_layers paged layers (early layers carry the retrieval signal; the
// max over every layer lets later layers' spikes drown it); 0: all.
// Token scores of keys that live on a device are computed there with stock ggml ops, the
// host-store rows here, one softmax merged over both (agreeing with the host's arithmetic to
// float rounding): an RPC server's pool slice, and a GPU runtime's pool on its own backend with
// buffers reserved at the first call (keys_on_device = false: a GPU pool's resident rows are read
// back and scored here instead, as per_chunk and groups always are).
void history_attention(const Runtime &rt, float *out, int64_t n, int32_t n_threads, bool per_chunk = false,
                       const int32_t *groups = nullptr, int32_t q_first = 0, int32_t q_count = -1,
                       int32_t n_layers = 0, bool keys_on_device = true);

// A GPU runtime's device scoring (history_attention's share on its backend): the device bytes reserved for
// it (inputs and both rounds' compute buffers; 0 before the first call or when the device cannot score),
// the slots and queries they were reserved for, and why the device cannot score when it cannot (an op its
// backend lacks, memory): its keys are then read back to the host.
struct DeviceScoringInfo {
    size_t bytes = 0;
    int32_t slots = 0, queries = 0;
    std::string unusable;
};
DeviceScoringInfo device_scoring_info(const Runtime &rt);

// ---- chunk scores from token scores: one implementation for the C API and the Python
// policies (qk and the drafter), so both paths rank chunks the same way.

// Token scores to chunk scores.  x: [n] token scores; chunk_of: [n] the chunk of each token, in
// [0, n_chunks), or negative for a token of no chunk (it still spreads to its neighbours).  Each token first takes the max of itself and the `spread` tokens on
// either side (in token order, across chunk edges: a fact spans the words after the one attended
// to), then a chunk takes its peak token.  Chunks no token maps to score one below the lowest
// scored chunk, so they rank last without a sentinel that breaks a sort.  out: [n_chunks].
// carry > spread: a token also takes the score of the tokens up to `carry` before it, a hair below
// the source's (the value of a fact follows its key: the chunk after a key near a chunk edge ranks
// right behind the key's chunk instead of tying it).
void chunk_peaks(const double *x, int64_t n, const int32_t *chunk_of, int32_t n_chunks, int32_t spread,
                 float *out, int32_t carry = 0);

// Token scores to chunk scores, the mean way (the reference's): each token takes the max of itself and
// the `spread` tokens on either side, then a centred moving average of smooth_width (numpy's convolve
// "same"; <= 1: none), then each chunk the mean of its tokens (chunk_of as chunk_peaks'; tokens of no
// chunk are dropped; a chunk no token maps to scores 0).  out: [n_chunks].
void chunk_means(const double *x, int64_t n, const int32_t *chunk_of, int32_t n_chunks, int32_t spread,
                 int32_t smooth_width, float *out);
// The centred moving average chunk_means and qk's "token" aggregate use, in place, rounded to float.
void moving_average(std::vector<double> &x, int32_t width);
// Each entry the max of itself and its `reach` neighbours on either side (0: a copy), into out.
void spread_max(const double *x, int64_t n, int32_t reach, double *out);

// The qk policy's default scoring ("peak"), with the target's own captured queries.
struct PeakScoring {
    int32_t n_queries = 8;   // the latest captured queries score the history
    // minus what the n_queries ending `contrast` tokens earlier pay (0: off); 64: the baseline falls before a
    // question that names several keys (32 fell on the first key's mention and cancelled its needle's peak:
    // bench/results/tuning/qk-contrast-gemma3-8k-512)
    int32_t contrast = 64;
    // chunk_peaks' spread; 8 (was 4): on the tuning splits it kept every multi-query needle (Gemma-3 10/10 vs 8/10),
    // multi-value 9/10 vs 3/10, SmolLM2's single needles 9/10 vs 8/10 (bench/results/tuning/qk-shape-*)
    int32_t spread = 8;
    int32_t n_layers = 0;    // the first n_layers paged layers only (0: all)
    int32_t carry = 16;      // chunk_peaks' carry (0: none beyond spread); 16 chosen on the tuning splits
    // query windows: the last windows * n_queries captured queries score as `windows` windows of n_queries
    // (the latest first), each minus the one baseline (the n_queries ending `contrast` tokens before the latest);
    // a chunk takes its best rank in any window (ties: the better mean rank).  A prompt that ends in format
    // tokens (a chat log's next "[16:32] name: ") then still scores with the question's queries a window
    // earlier.  1: one window.  3: on SmolLM2's tuning split it kept 30 + 27 of 60 chat / raw-ask needles (one
    // window 25 + 25) and Gemma-3's multi-query needles as one window did (bench/results/tuning/qk-windows-*)
    int32_t windows = 3;
};

// The qk policy's default layer count: a quarter of the paged layers but at least 8 (all when
// there are fewer).  Early layers carry the retrieval signal; max over every layer lets later
// layers' spikes drown it (SmolLM2, tuning splits: bench/results README).
inline int32_t qk_auto_layers(int32_t n_paged) {
    const int32_t q = (n_paged + 3) / 4;
    return n_paged < 8 ? n_paged : (q > 8 ? q : 8);
}

// The captured queries peak scoring reads: the latest n_queries and the baseline's (n_queries + contrast), or
// every window's (n_queries * windows) if more.
inline int64_t peak_capture(int64_t n_queries, int64_t contrast, int64_t windows) {
    return n_queries * windows > n_queries + contrast ? n_queries * windows : n_queries + contrast;
}

// out: [n_chunks] chunk scores of the runtime's history (positions [0, n_past)): per token the
// attention the last n_queries captured queries pay it (history_attention: paged-out keys
// included), minus the baseline's when contrast > 0 and enough queries are captured, then
// chunk_peaks with chunk = position / chunk_tokens.  With windows > 1 (and the baseline and two
// windows captured), each window of n_queries scores so against the one baseline and a chunk's score
// is -(its best rank in any window) + (1 - its mean rank / n_chunks) / 2: only the order is meant.
// Throws std::invalid_argument on bad params.
void qk_peak_scores(const Runtime &rt, const PeakScoring &p, float *out, int32_t n_chunks, int32_t n_threads);

// ---- the qk policy and its variants, as one setting: what Python's QKPolicy, the C API's
// "qk" / "qk-bound" / "qk-mean" and a snapshot's policy.qk describe, scored by the core.
enum class QkAggregate { Peak, Chunk, Token };

struct QkScoring {
    // "keys": the captured queries attend over every key of the history (history_attention);
    // "bound" / "mean": the last query against the sealed chunks' key summaries (ChunkSummaries).
    std::string mode = "keys";
    // keys only: "peak" (qk_peak_scores), "chunk" (attention mass per chunk), "token" (token
    // scores smoothed by a centred moving average of smooth_width, then the mean per chunk)
    QkAggregate aggregate = QkAggregate::Peak;
    int32_t n_queries = PeakScoring{}.n_queries;   // keys: the latest captured queries that score (summaries: 1)
    int32_t smooth_width = 5;   // "token"'s moving average (recorded whatever the aggregate)
    // "peak" only (0 for the others): PeakScoring's, so the defaults live in one place
    int32_t contrast = PeakScoring{}.contrast, spread = PeakScoring{}.spread, carry = PeakScoring{}.carry;
    int32_t windows = PeakScoring{}.windows;   // "peak" only (1 for the others): PeakScoring's
    int32_t n_layers = -1;      // keys: the first N paged layers (-1: qk_auto_layers, 0: all)

    // The defaults of a mode and aggregate ("" : the mode's own: peak for keys), as QKPolicy's.
    static QkScoring defaults(const std::string &mode, const std::string &aggregate = "");
    // "qk", "qk-bound", "qk-mean".
    std::string name() const { return mode == "keys" ? "qk" : "qk-" + mode; }
    const char *aggregate_name() const;
    bool summaries() const { return mode != "keys"; }
    // The captured queries the runtime must keep (peak: n_queries + contrast, or n_queries * windows if more).
    int32_t capture() const { return mode == "keys" ? static_cast<int32_t>(peak_capture(n_queries, contrast, windows)) : 1; }
    PeakScoring peak(int32_t n_paged) const;   // n_layers resolved for n_paged layers
    // std::invalid_argument with QKPolicy's messages ("qk contrast works on token scores: ...").
    void validate() const;
};

// out: [n_chunks] chunk scores with q's settings (summaries: the runtime's ChunkSummaries, needed
// by the bound / mean modes).  std::invalid_argument when the runtime cannot score them.
void qk_scores(const Runtime &rt, const ChunkSummaries *summaries, const QkScoring &q, float *out, int32_t n_chunks,
               int32_t n_threads);

}  // namespace kvflash
