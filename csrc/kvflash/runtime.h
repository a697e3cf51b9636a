// Runtime: one session's decoding state over a Model, with the KV cache paged.
//
// Per session: the paged pool for globally attending layers, a ring of the window
// for sliding-window layers (gemma3), the compute graphs, the mask inputs and the
// captured queries.  Two cache modes over the same code: full cache (pool = max
// context, identity placement) and kvflash (pool < context).  The runtime holds no
// policy: scoring (scoring.h) reads what it exposes and, through a CacheObserver,
// hears about every write, truncation and reset.
//
// Shapes follow ggml order (innermost first).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "kvflash/model.h"
#include "kvflash/memory.h"
#include "kvflash/pool.h"

namespace kvflash {

struct RuntimeConfig {
    int64_t max_ctx = 4096;
    int32_t pool_tokens = 0;          // 0: full cache (pool = max_ctx rounded up)
    std::string kv_type = "q8_0";
    int32_t chunk_tokens = 64, sink_chunks = 1, tail_window_chunks = 4;
    int32_t ubatch = 512;             // prefill ubatch while the prompt fits the pool
    // > 0: a scoring runtime that evaluates only the first eval_layers layers (a drafter
    // cut short: K/V and captured queries of those layers, no logits -- eval returns zeros).
    int32_t eval_layers = 0;
    int32_t prefill_piece = 0;        // piece once eviction starts (0: chunk_tokens), chunk-aligned
    std::string host = "ram";         // "ram" | "file" (parse_host_backing)
    std::string host_path;
    int64_t max_host_bytes = 0;       // cap on the host store (0: none); past it eval throws HostStoreFull
    // Attention kernel on the CPU: "pool" (kvflash's split-K op over the pool),
    // "ggml" (ggml_flash_attn_ext), or "auto" (pool for pieces of up to
    // pool_attn_max_tokens queries, ggml above).  Other backends (CUDA) always use
    // ggml_flash_attn_ext with the pager's F16 mask: "auto" and "ggml" mean that
    // there, "pool" is refused (std::invalid_argument).
    std::string attn = "auto";
    int32_t pool_attn_max_tokens = 1 << 30;
    // Post-RoPE queries of the last capture_queries tokens of each eval are kept
    // (per paged layer) for relevance scoring; 0 disables.
    int32_t capture_queries = 1;
    // Recurrent layers (qwen35): the SSM states kept for rewinds (truncates of up to recurrent_snapshots - 1
    // tokens, exact mode's rejected drafts); each costs one state per recurrent layer.
    int32_t recurrent_snapshots = 8;
    // ... and host checkpoints of their state at chunk boundaries passed (one a piece at most), thinned
    // out with age (the newest dense, older ones further apart), so a rewind past the snapshots (a
    // prompt's settling re-read, a chat's next turn) reads again from a checkpoint near the cut instead
    // of from the start.  Each costs the recurrent layers' whole state in host RAM.
    int32_t recurrent_checkpoints = 8;
};

// chunk_tokens 'auto' (the CLI's and the server's default; C params.chunk_tokens = 0): the largest of 64, 32 and
// 16 tokens that leaves a policy at least kAutoChunkFreeSlots chunks of the pool besides the sink, the tail window
// and the open chunk, else 16; the pooled prefill still reads pieces of 64 tokens where they fit (one chunk
// otherwise). In 64-token chunks a 512-token pool (1/16 of 8K) leaves a policy 2 free slots of its 8 (6 are
// protected): enough for one needle (SmolLM2 at 8K on tuning data: qk kept it in 10 of 12 trials with either
// chunk size), not for what several needles need (Gemma-3 at 4K, 1/8: all four multi-value needles kept in 3 of
// 4 trials with 16-token chunks, 0 of 4 with 64; only 16-token chunks reached 1/16: bench/results/tuning/ruler-4k,
// tuning/chunk-smollm2-8k-512). A full cache (pool_tokens 0) keeps 64 and the default piece.
inline constexpr int32_t kAutoChunkFreeSlots = 24;
struct ChunkGeometry {
    int32_t chunk_tokens = 64;
    int32_t prefill_piece = 0;        // RuntimeConfig::prefill_piece (0: one chunk)
};
ChunkGeometry auto_chunk_geometry(int32_t pool_tokens, int32_t sink_chunks, int32_t tail_window_chunks);

struct RuntimeStats {
    int64_t n_eval_calls = 0, n_tokens_evaluated = 0;
    double t_graph_ms = 0, t_compute_ms = 0, t_mask_ms = 0;
};

class Runtime;

// How one eval reads and keeps.
struct EvalOptions {
    // Attention over every position of the context in logical order -- resident rows from the
    // pool, paged-out rows straight from the host store -- as the full cache computes it (the same
    // rows, ranges and order; the CPU backend only).  Pieces are cut as the full cache cuts them
    // (ubatch) where the pool's evictable room holds them.  Exact mode's prefill and verification.
    bool exact = false;
    // With exact: pieces that start at or past this position are pooled ones (cut and attended as
    // without exact); a piece that would cross it ends there (0: no limit).
    int64_t exact_until = 0;
    // Keep the queries of every token of the call beside the capture window (a verification pass
    // whose tail may be truncated away); trim_captured() brings the window back to capture_queries.
    bool capture_all = false;
    // Matrix products with one-token arithmetic for every token of the call (one_row_cpu.h): the
    // logits and K/V rows of each token are what a one-token eval computes, bit for bit, whatever the
    // batch (ggml's batched kernels round differently).  A verification pass; the CPU backend only.
    bool one_row_products = false;
    // Called after each piece with (tokens done, tokens in the call); what it throws ends the eval as a
    // failure does (all or nothing).  The bindings' prefill progress.
    std::function<void(int32_t done, int32_t total)> progress;
};

// Thrown by Runtime::eval when its interrupt hook asked it to stop between pieces.
struct EvalInterrupted : std::runtime_error {
    EvalInterrupted() : std::runtime_error("eval: interrupted") {}
};

// State derived from the cache's contents (scoring keeps some) follows it through these calls.
struct CacheObserver {
    virtual ~CacheObserver() = default;
    // Positions [pos0, pos0 + n) were just written (and are resident).
    virtual void evaluated(const Runtime &rt, int64_t pos0, int32_t n) = 0;
    // Positions >= n_past are gone (0: a reset).
    virtual void truncated(const Runtime &rt, int64_t n_past) = 0;
    // Positions [pos0, pos0 + n), written before, were computed again in place (Runtime::reread).
    virtual void rewritten(const Runtime &rt, int64_t pos0, int32_t n) { evaluated(rt, pos0, n); }
};

class Runtime {
public:
    Runtime(std::shared_ptr<Model> model, RuntimeConfig cfg);
    ~Runtime();

    // Evaluate tokens at positions [n_past, n_past + n) and append them to the
    // cache.  logits_out: n_vocab floats (last token) or n * n_vocab (all_logits).
    // Throws invalid_argument for bad tokens, out_of_range past max_ctx.  All or
    // nothing: when a piece fails (or the interrupt hook stops it, EvalInterrupted),
    // the pieces already evaluated are truncated away again, so n_past is where it
    // was (unless the sliding-window ring cannot rewind that far: then n_past says
    // how far it got).  The tokens are read more than once: the caller keeps them
    // unchanged for the call (the bindings pass a private copy).
    void eval(const int32_t *tokens, int32_t n, bool all_logits, float *logits_out, EvalOptions opt = {});
    // Asked between the pieces of one eval; true: stop (the bindings check for Ctrl-C).
    void set_interrupt(std::function<bool()> f) { interrupt_ = std::move(f); }
    int64_t n_past() const { return n_past_; }
    // Precondition: 0 <= n_past <= n_past() (std::out_of_range otherwise), and the
    // sliding-window ring still holds the window before n_past (std::invalid_argument).
    void truncate(int64_t n_past);
    // How far back truncate can go from n_past() (the sliding-window ring's slack; no limit without one).
    int64_t max_rewind() const;
    // The largest position <= n a truncate reaches: n when every memory rewinds that far, else the
    // nearest recurrent checkpoint below it the other memories reach, else 0.  The caller reads the
    // tokens from there to n again.
    int64_t rewind_point(int64_t n) const;
    // Where the recurrent state's host checkpoints are (oldest first; none without recurrent layers).
    std::vector<int64_t> checkpoint_positions() const {
        std::vector<int64_t> p;
        for (const auto &c : checkpoints_) p.push_back(c.pos);
        return p;
    }
    void reset();

    // Reads the written positions [pos0, pos0 + n) (pos0 + n <= n_past) again IN PLACE with exact
    // attention: each token attends every position before it -- resident rows from the pool, paged-out
    // ones from the host store, as exact prefill does -- and its K/V rows overwrite the ones its first
    // (pooled) read wrote, in its chunk's pool block.  Nothing else changes: n_past, residency, the
    // capture window, the logits.  Repairs the K/V a pooled prefill computed with most of the context
    // out of the pool (issue 40), for the chunks that matter, at the price of reading just them again.
    // Sliding-window layers (gemma3) read the window before pos0 from the sliding history
    // (keep_swa_history) in a scratch ring of their own; the decode ring keeps its rows, those of
    // re-read positions it still holds updated.  The span's chunks must be resident; the rewritten
    // chunks are dirty (their host copies stale) until paged out again.  The CPU backend, in one
    // process, attn 'auto' or 'pool', no recurrent layers: std::invalid_argument otherwise (the reason
    // given); can_reread says so beforehand.  A failure part way leaves each layer's rows either read
    // again or as they were (K/V a pooled read could have made), never anything else.
    void reread(const int32_t *tokens, int64_t pos0, int32_t n);
    // "" when reread(pos0, n) would run, else why not.
    std::string reread_refusal(int64_t pos0, int32_t n) const;
    // Sliding-window layers: keep every position's rows in host RAM from now on (seeded with what the
    // ring holds), so reread can give a past position its window; off frees them.  The rows of the
    // positions evaluated since (sliding layers x positions x (K + V) row bytes, transient: a session
    // keeps them through one prompt's settle).  No-op without sliding layers.
    void keep_swa_history(bool on);
    // The first position of the current context a piece evaluated without every earlier position in
    // the pool (a pooled piece after an eviction; -1: none since the last reset).  The K/V from there on
    // are approximate: what reread repairs.
    int64_t pooled_from() const { return pooled_from_; }
    // The one observer (nullptr: none); it lives as long as the runtime holds it.
    void set_observer(std::shared_ptr<CacheObserver> obs) { observer_ = std::move(obs); }

    const Model &model() const { return *model_; }
    const RuntimeConfig &config() const { return cfg_; }
    bool full_cache() const { return full_cache_; }
    Pager &pager() { return paged_->pager(); }
    const Pager &pager() const { return paged_->pager(); }
    KVPool &pool() { return paged_->pool(); }
    const KVPool &pool() const { return paged_->pool(); }
    size_t swa_bytes() const;         // sliding-window ring bytes (not paged)
    // The memories (memory.h): the paged KV first, then the sliding-window ring when the model has one.
    const std::vector<Memory *> &memories() const { return memories_; }
    RecurrentState *recurrent_state() { return recr_.get(); }
    const RecurrentState *recurrent_state() const { return recr_.get(); }
    bool recurrent() const { return recr_ != nullptr; }
    SlidingRing *ring() { return ring_.get(); }
    const SlidingRing *ring() const { return ring_.get(); }
    const RuntimeStats &stats() const { return stats_; }

    // Post-RoPE keys of chunk c for paged layer index il, dequantized to f32:
    // out [chunk_tokens][n_embd_k]; rows of unwritten positions are zero.
    // Precondition: chunk resident (std::invalid_argument), il a paged layer (std::out_of_range).
    // Orders itself after queued compute and copies (sync_for_host_read).
    void chunk_keys(int32_t c, int32_t il, float *out) const;
    // The same without the sync, for a caller that has just called sync_for_host_read.
    void chunk_keys_synced(int32_t c, int32_t il, float *out) const;
    // Before the host reads pool rows or graph outputs: wait for every queued page
    // copy (the pool's fence: the copy stream on CUDA) and every queued kernel
    // (ggml_backend_synchronize), since ggml-cuda's tensor_get runs on its own
    // stream (copy_engine.h, rule (4)).  No-ops on the CPU backend.
    void sync_for_host_read() const;

    // Captured queries of the last eval: [n_paged][n_captured][n_head][head_dim], post-RoPE,
    // for positions n_past - n_captured .. n_past - 1.
    int32_t n_captured() const { return n_captured_; }
    const std::vector<float> &captured_queries() const { return captured_q_; }
    // Paged layers among the evaluated ones: the captured queries' first dimension.
    int32_t captured_layers() const;
    // Put back a capture window: q holds the queries of positions n_past - k .. n_past - 1,
    // [captured_layers()][k][n_head][head_dim] (what captured_queries() held at this n_past
    // before a later eval and a truncate back to here).  invalid_argument for a k above
    // capture_queries or n_past, or a size that does not fit.
    void set_captured(std::vector<float> q, int32_t k);
    // Keep only the last capture_queries queries of the window (after a capture_all eval).
    void trim_captured();

    // Over a model with layers on RPC servers (Model::remote_layers) graphs run through ggml_backend_sched:
    // a remote layer's nodes on its server (its weights, pool slice and ring are there), the embedding and
    // the head here; every node placed on a server is checked against rpc_op_allowed when its graph is
    // built.  Attention is ggml_flash_attn_ext there ("auto" means "ggml"; "pool" and exact evals are
    // refused with std::invalid_argument).
    // Whether this runtime's graph for n tokens could be placed on a ggml RPC device (rpc.h): throws
    // std::invalid_argument naming the first node its server must not be sent (kvflash's CPU attention
    // op with attn="pool"/"auto"; attn="ggml" graphs are made of stock ops).  Builds a graph, runs nothing.
    void check_remote_ops(int32_t n);

    // Where this runtime computes: the model's backend on the CPU (and with RPC servers); on a GPU a
    // backend of its own on the model's device (ggml_backend_dev_init), so one runtime's buffers and
    // graphs never share a device context's scratch state with another's (ggml-vulkan keeps scratch
    // buffers per context and crashed lavapipe when they grew after another runtime's buffers were freed).
    ggml_backend_t backend() const { return backend_; }

    // What a scorer keeps beside the runtime, freed with it and before its backend: a GPU runtime's
    // history scoring keeps its inputs and compute buffers here, reserved at the first rescore for the
    // largest one (scoring.cpp, DeviceScoring).  Used under the runtime's one-caller rule.
    struct ScorerState {
        virtual ~ScorerState() = default;
    };
    std::unique_ptr<ScorerState> &scorer_state() const { return scorer_state_; }

private:
    friend class Snapshot;   // snapshot.cpp: n_past and the captured queries
    struct Graph;
    Graph *get_graph(int32_t n, int32_t n_kv, bool all_logits, const EvalOptions &opt);
    bool use_pool_attn(int32_t n) const;
    void build(Graph &g, int32_t n, int32_t n_kv, bool all_logits, const EvalOptions &opt);
    void finish_graph(Graph &g);   // backend op check + allocation (a GPU runtime: its slot's reserved allocator)
    void eval_piece(const int32_t *tokens, int32_t n, bool all_logits, float *logits_out, const EvalOptions &opt);
    void set_masks(Graph &g, int64_t pos0, int32_t n, const int32_t *slots, int32_t n_kv);
    void set_exact_rows(Graph &g, int64_t pos0, int32_t n);   // the row tables and causal mask of an exact piece
    void keep_captured(const Graph &g, int32_t cap);
    // truncate, with the recurrent state restored from ck where ck was taken at n_past
    void truncate_to(int64_t n_past, const RecurrentState::HostCheckpoint *ck);
    bool remote() const { return !model_->remote_layers().empty(); }

    std::shared_ptr<Model> model_;
    RuntimeConfig cfg_;
    // Declared before every member that holds device buffers or graphs: it is destroyed after them.
    struct BackendFree { void operator()(ggml_backend_t b) const { ggml_backend_free(b); } };
    std::unique_ptr<ggml_backend, BackendFree> own_backend_;   // a GPU runtime's own context, or none
    ggml_backend_t backend_ = nullptr;
    // A GPU runtime's compute buffers: one allocator per graph slot (decode, batch), reserved at first
    // use for the slot's largest graph (n_kv = the pool, n = ubatch for the batch slot), so graphs of
    // other sizes reuse the buffer instead of freeing and allocating device memory per shape.
    struct AllocFree { void operator()(ggml_gallocr_t a) const { ggml_gallocr_free(a); } };
    std::unique_ptr<std::remove_pointer_t<ggml_gallocr_t>, AllocFree> dev_alloc_[2];
    mutable std::unique_ptr<ScorerState> scorer_state_;   // (after own_backend_: freed before it)
    int graph_slot_ = -1;      // the slot get_graph is building for (-1: none)
    bool reserving_ = false;   // building a slot's worst case: finish_graph checks it and allocates nothing
    bool full_cache_ = false;
    int32_t n_eval_layers_ = 0;           // layers evaluated (all, or eval_layers)
    std::unique_ptr<PagedMemory> paged_;  // the paged layers' KV: pool, pager, host store
    std::unique_ptr<SlidingRing> ring_;   // the sliding-window layers' ring (gemma3), or none
    std::unique_ptr<RecurrentState> recr_;   // the recurrent layers' state (qwen35), or none
    std::vector<int32_t> recr_index_;     // model layer -> recurrent layer (-1: not one)
    std::vector<RecurrentState::HostCheckpoint> checkpoints_;   // at chunk boundaries, oldest first
    void take_checkpoint();               // after a piece: the last chunk boundary the rings still hold
    std::vector<Memory *> memories_;      // each of the above that exists: truncate and reset ask them all
    std::vector<int32_t> paged_index_;    // model layer -> pool layer (>= 0) or -2 - ring index (sliding)
    std::unique_ptr<Graph> decode_graph_, batch_graph_, exact_graph_, reread_graph_;
    // reread's state: the sliding layers' history (positions [lo, hi), row p at p - base), the scratch
    // ring a reread's sliding layers use (made at the first reread), the graph slot it builds for
    std::vector<ggml_backend_buffer_type_t> ring_bufts_;
    std::unique_ptr<SlidingRing> scratch_ring_;
    struct SwaHistory {
        bool on = false;
        int64_t base = 0, lo = 0, hi = 0;
        std::vector<std::vector<uint8_t>> k, v;   // per ring layer, rows of positions base ..
    } hist_;
    bool rereading_ = false;
    int64_t pooled_from_ = -1;
    void history_put(const SlidingRing &from, int64_t pos0, int32_t n);   // rows of [pos0, pos0 + n) in `from`
    void reread_piece(const int32_t *tokens, int64_t pos0, int32_t n, bool load_window);
    std::vector<char> zero_rows_;         // a chunk of zero rows: the row tables' stand-in for unwritten chunks
    std::vector<uint16_t> decode_mask_;
    int64_t decode_mask_epoch_ = -1;
    int64_t n_past_ = 0;
    RuntimeStats stats_;
    std::vector<float> captured_q_;
    int32_t n_captured_ = 0;
    std::shared_ptr<CacheObserver> observer_;
    std::function<bool()> interrupt_;
};

}  // namespace kvflash
