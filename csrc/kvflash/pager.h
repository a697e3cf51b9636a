// The pager: which logical 64-token chunk of the context lives in which block of
// the fixed-size device pool, and which live only in the host store.
//
// Terms
//   position p  logical token index, 0 <= p < max_ctx
//   chunk c     p / chunk_tokens
//   block b     a run of chunk_tokens pool slots [b*chunk_tokens, (b+1)*chunk_tokens)
//   slot        block(c) * chunk_tokens + p % chunk_tokens
//
// State is kept as parallel arrays with -1 as "none" (chunk -> block, chunk ->
// host buffer, block -> chunk, slot -> position).  The bookkeeping here knows
// nothing about tensors: moving a chunk's bytes is delegated to a ChunkMover
// (the ggml pool on CPU or CUDA, or a plain byte array in tests).
//
// Protection: the first sink_chunks chunks (attention sinks) and the tail window
// (the append-head chunk and the tail_window_chunks before it) are never evicted.
//
// Eviction order: without scores, least recently used first.  After
// set_scores()/reselect(), lowest score first, ties by recency; chunks that
// have no score yet (written after the scores were set) rank above all scored ones.
//
// Errors: bad arguments throw std::invalid_argument / std::out_of_range before
// anything changes; "no room" is a return value and also changes nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvflash/host_store.h"

namespace kvflash {

struct PagerConfig {
    int32_t chunk_tokens = 64;
    int32_t pool_tokens = 0;          // rounded up to a multiple of 256 by validate()
    int32_t sink_chunks = 1;
    int32_t tail_window_chunks = 4;
    int64_t max_ctx = 0;              // logical context the pager addresses
    int64_t max_host_bytes = 0;       // cap on the host store (0: none); past it a page-out throws HostStoreFull

    // Smallest legal pool for this config: (sinks + tail + 2) chunks, rounded up to 256.
    int32_t min_pool_tokens() const;
    // Throws std::invalid_argument naming the fix; rounds pool_tokens up to 256.
    void validate();
};

// Moves one chunk's raw bytes (all paged layers, K and V) between a pool block
// and a host buffer of chunk_bytes().  Implementations may queue the copies
// asynchronously as long as fence() orders them before any later use.
class ChunkMover {
public:
    virtual ~ChunkMover() = default;
    virtual size_t chunk_bytes() const = 0;
    virtual void page_out(int32_t block, uint8_t *dst) = 0;      // pool -> host
    virtual void page_in(int32_t block, const uint8_t *src) = 0; // host -> pool
    // All queued copies are complete (or ordered before the next compute).
    virtual void fence() {}
};

struct PagerStats {
    int64_t page_outs = 0, page_ins = 0;
    int64_t clean_skips = 0;          // evictions that needed no copy (host copy current)
    int64_t bytes_out = 0, bytes_in = 0;
    int64_t epoch = 0;                // bumped on every residency change
    int32_t resident_chunks = 0, host_chunks = 0, materialised_chunks = 0;
    int32_t n_blocks = 0, free_blocks = 0;
    size_t resident_bytes = 0;        // the pool's bytes (allocated at pool size)
    size_t host_bytes = 0;            // bytes held in host buffers
    size_t host_reserved_bytes = 0;   // slab capacity
};

enum class AllocResult { OK, NO_ROOM };

class Pager {
public:
    // mover must outlive the pager.  host: where evicted chunks go.
    Pager(PagerConfig cfg, ChunkMover *mover, HostStore::Backing backing = HostStore::Backing::RAM,
          std::string host_path = "", HostAllocator host_alloc = {});

    const PagerConfig &config() const { return cfg_; }
    int32_t n_blocks() const { return n_blocks_; }
    int32_t n_chunks() const { return n_chunks_; }

    // Slots for positions [pos0, pos0+n), in order, marking them written.  Chunks
    // not resident get a block (free, else by evicting a victim; recalled from the
    // host if they were paged out).  NO_ROOM if the span needs more blocks than can
    // be freed without touching protected chunks or the span itself.
    // Throws std::out_of_range for a span outside [0, max_ctx), invalid_argument for n <= 0.
    AllocResult alloc_span(int64_t pos0, int32_t n, int32_t *slots_out);

    // Slot of a written, resident position, or -1.
    int32_t slot_of(int64_t pos) const;

    // Page chunk c out.  Preconditions (else invalid_argument): resident, not protected.
    void evict(int32_t c);
    // Chunk c's rows were rewritten in place (Runtime::reread): its host copy, if any, is stale and the
    // next page-out copies it.  Precondition: resident (else invalid_argument).
    void mark_dirty(int32_t c);
    // Bring chunk c back from the host.  Preconditions: on host, not resident.
    // NO_ROOM when no block is free and nothing is evictable.
    AllocResult recall(int32_t c);

    // Install per-chunk scores (higher = keep) for chunks [0, n).
    void set_scores(const float *scores, int32_t n);
    void clear_scores();
    // Install scores, then repage to the top-scoring set: protected chunks always,
    // the rest of the pool by score.  Pages out first, then recalls.  Returns the
    // number of chunks moved (outs + ins).
    int32_t reselect(const float *scores, int32_t n);

    // Forget positions >= n_past (a session rewinding); chunks entirely past it are freed.
    void truncate(int64_t n_past);
    // Back to empty: every chunk, score and counter of the session is cleared.
    void reset();

    // F16 mask rows for queries at q_pos[0..n_q): 0 where the slot holds a written
    // position <= q_pos (and > q_pos - window when window > 0), -inf elsewhere.
    // out: [n_q rows][n_kv]; columns past pool_tokens are -inf padding.  n_kv may be
    // below pool_tokens if it covers used_extent() (attention over the occupied prefix).
    void fill_mask(const int64_t *q_pos, int32_t n_q, uint16_t *out, int32_t n_kv,
                   int32_t window = 0) const;

    // Slots [0, used_extent()) cover every occupied block: attention need not look past it.
    int32_t used_extent() const;

    // Slot -> position (-1: free or unwritten), pool_tokens entries.
    const std::vector<int64_t> &slot_positions() const { return slot_pos_; }
    int32_t block_of(int32_t c) const { return block_of_[c]; }
    int32_t host_of(int32_t c) const { return host_of_[c]; }
    bool is_dirty(int32_t c) const { return dirty_[c] != 0; }
    bool is_protected(int32_t c) const;
    bool is_materialised(int32_t c) const { return n_written_[c] > 0; }
    int32_t n_written(int32_t c) const { return n_written_[c]; }
    int64_t head_chunk() const { return head_; }
    const std::vector<float> &scores() const { return score_; }
    bool has_scores() const { return has_scores_; }

    PagerStats stats() const;
    int64_t epoch() const { return stats_.epoch; }
    // Throws std::logic_error describing the first broken invariant.
    void check_invariants() const;
    // Human-readable chunk map: one character per chunk (S sink, T tail, R resident,
    // H host, . empty), then counters.
    std::string dump() const;

    HostStore &host_store() { return *host_; }
    const HostStore &host_store() const { return *host_; }

private:
    friend class Snapshot;   // snapshot.cpp reads and replaces the arrays whole
    bool protected_under(int32_t c, int64_t head) const;
    // Best victim among resident, unprotected chunks not in [lo, hi]; -1 if none.
    int32_t pick_victim(int64_t head, int32_t lo, int32_t hi) const;
    void do_evict(int32_t c);
    void do_place(int32_t c, int32_t b);  // c gets block b (recalling its bytes if on host)
    int32_t take_block(int64_t head, int32_t lo, int32_t hi);
    bool written(int32_t c, int32_t i) const { return (written_[size_t(c) * words_ + i / 64] >> (i % 64)) & 1; }
    void validate_chunk(int32_t c, const char *what) const;

    PagerConfig cfg_;
    ChunkMover *mover_;
    std::unique_ptr<HostStore> host_;
    int32_t n_blocks_ = 0, n_chunks_ = 0, words_ = 0;

    // per chunk
    std::vector<int32_t> block_of_, host_of_, n_written_;
    std::vector<uint8_t> dirty_;
    std::vector<uint64_t> last_use_;
    std::vector<float> score_;
    std::vector<uint64_t> written_;   // words_ bits-words per chunk
    // per block / slot
    std::vector<int32_t> chunk_of_;
    std::vector<int32_t> free_blocks_;  // stack
    std::vector<int64_t> slot_pos_;

    int64_t head_ = -1;
    uint64_t tick_ = 0;
    bool has_scores_ = false;
    PagerStats stats_;
};

}  // namespace kvflash
