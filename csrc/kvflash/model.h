// GGUF models on ggml, decoding through the paged KV pool.
//
// Model:   weights and hyper-parameters read from a GGUF file, every key and
//          tensor shape validated before ggml sees it.  On the CPU backend the
//          weights are the mmap'd file; on CUDA (a KVFLASH_CUDA build) they are
//          uploaded into a ggml-cuda buffer and the mapping is dropped.  Every
//          runtime over a model computes on the model's backend (pool, ring and
//          graphs live there too).  Immutable once loaded; many runtimes may share it.
// Runtime: per-session state: the paged pool for globally attending layers, a
//          ring of the window for sliding-window layers (gemma3), compute graphs,
//          and the mask inputs.  Two cache modes over the same code: full cache
//          (pool = max context, identity placement) and kvflash (pool < context).
//
// Shapes follow ggml order (innermost first): x: [n_embd, n_tokens].
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"
#include "kvflash/pool.h"

namespace kvflash {

enum class Arch { LLAMA, QWEN2, QWEN3, GEMMA3 };
const char *arch_name(Arch a);

struct Hparams {
    Arch arch = Arch::LLAMA;
    int32_t n_layer = 0, n_embd = 0, n_ff = 0, n_head = 0, n_head_kv = 0;
    int32_t head_dim_k = 0, head_dim_v = 0, n_rot = 0, n_vocab = 0;
    int64_t n_ctx_train = 0;
    float rms_eps = 1e-5f;
    float rope_base = 10000.f, rope_scale = 1.f;      // global layers
    float rope_base_swa = 10000.f, rope_scale_swa = 1.f;
    int rope_mode = 0;                                // 0 normal (llama), 2 neox
    int32_t n_swa = 0;                                // sliding window (0: none)
    std::vector<uint8_t> is_swa;                      // per layer
    float attn_scale = 0.f;                           // softmax scale
    float final_softcap = 0.f;
    int32_t n_embd_k() const { return head_dim_k * n_head_kv; }
    int32_t n_embd_v() const { return head_dim_v * n_head_kv; }
};

// Devices a model can be loaded on: "cpu", "cuda" (= "cuda:0") or "cuda:N".
struct Device {
    enum class Kind { CPU, CUDA } kind = Kind::CPU;
    int32_t index = 0;
    std::string name() const;   // "cpu" | "cuda:N"
};
// Parses a device string.  Throws std::invalid_argument for anything else (naming
// the accepted forms), and for "cuda..." in a build without CUDA (saying how to
// rebuild with it).  Does not check that the CUDA device exists (load does).
Device parse_device(const std::string &s);
// Was this build compiled with KVFLASH_CUDA (ggml-cuda linked in)?
bool cuda_compiled();
// CUDA devices visible now (0 without CUDA compiled in, or without a driver/device).
int32_t cuda_device_count();

struct LayerWeights {
    ggml_tensor *attn_norm = nullptr, *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
    ggml_tensor *bq = nullptr, *bk = nullptr, *bv = nullptr;
    ggml_tensor *q_norm = nullptr, *k_norm = nullptr, *attn_post_norm = nullptr;
    ggml_tensor *ffn_norm = nullptr, *ffn_gate = nullptr, *ffn_up = nullptr, *ffn_down = nullptr;
    ggml_tensor *ffn_post_norm = nullptr;
};

class Model {
public:
    // Throws std::invalid_argument naming the problem (not a GGUF, truncated,
    // unsupported architecture, missing key or tensor, wrong shape).
    // device: see parse_device.  "cuda" needs a KVFLASH_CUDA build and a visible device
    // (std::invalid_argument otherwise; std::runtime_error if the weights do not fit).
    static std::shared_ptr<Model> load(const std::string &path, int32_t n_threads = 0,
                                       const std::string &device = "cpu");
    ~Model();
    Model(const Model &) = delete;
    Model &operator=(const Model &) = delete;

    const Hparams &hparams() const { return hp_; }
    const std::string &path() const { return path_; }
    size_t weight_bytes() const { return weight_bytes_; }
    ggml_backend_t backend() const { return backend_; }
    const Device &device() const { return device_; }
    bool on_cpu() const { return device_.kind == Device::Kind::CPU; }
    // Free and total bytes of the model's device now, from ggml's device memory query
    // (on CUDA: cudaMemGetInfo, so free is what is left after the weights and whatever
    // else is allocated; on the CPU ggml reports free == total, physical RAM).
    std::pair<size_t, size_t> device_memory() const;
    // CPU threads for the CPU backend's kernels; on CUDA only recorded.
    void set_n_threads(int32_t n);
    int32_t n_threads() const { return n_threads_; }
    // Model layer indices whose attention is global (these are paged).
    std::vector<int32_t> global_layers() const;

    ggml_tensor *tok_embd = nullptr, *output_norm = nullptr, *output = nullptr;
    std::vector<LayerWeights> layers;

private:
    Model() = default;
    std::string path_;
    Device device_;
    Hparams hp_;
    gguf_context *gguf_ = nullptr;
    ggml_context *meta_ = nullptr;
    ggml_backend_t backend_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
    void *map_ = nullptr;             // the file mapping (CPU backend only; unmapped after a CUDA upload)
    size_t map_bytes_ = 0, weight_bytes_ = 0;
    int32_t n_threads_ = 1;
};

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
    std::string host = "ram";         // "ram" | "file"
    std::string host_path;
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
    // Keep per-chunk key summaries (min, max, mean of post-RoPE K per paged layer),
    // computed when a chunk seals while it is still resident (the qk policy).
    bool chunk_summaries = false;
};

enum class QKMode { MEAN = 0, BOUND = 1 };

struct RuntimeStats {
    int64_t n_eval_calls = 0, n_tokens_evaluated = 0;
    double t_graph_ms = 0, t_compute_ms = 0, t_mask_ms = 0;
};

class Runtime {
public:
    Runtime(std::shared_ptr<Model> model, RuntimeConfig cfg);
    ~Runtime();

    // Evaluate tokens at positions [n_past, n_past + n) and append them to the
    // cache.  logits_out: n_vocab floats (last token) or n * n_vocab (all_logits).
    // Throws invalid_argument for bad tokens, out_of_range past max_ctx.
    void eval(const int32_t *tokens, int32_t n, bool all_logits, float *logits_out);
    int64_t n_past() const { return n_past_; }
    void truncate(int64_t n_past);
    void reset();

    const Model &model() const { return *model_; }
    const RuntimeConfig &config() const { return cfg_; }
    bool full_cache() const { return full_cache_; }
    Pager &pager() { return *cache_->pager; }
    const Pager &pager() const { return *cache_->pager; }
    KVPool &pool() { return *cache_->pool; }
    size_t swa_bytes() const;         // sliding-window ring bytes (not paged)
    const RuntimeStats &stats() const { return stats_; }
    // Post-RoPE keys of chunk c for paged layer index il, dequantized to f32:
    // out [chunk_tokens][n_embd_k]; rows of unwritten positions are zero.
    // Precondition: chunk resident.  (Used by the qk policy's chunk summaries.)
    // Orders itself after queued compute and copies (sync_for_host_read).
    void chunk_keys(int32_t c, int32_t il, float *out) const;

    // Captured queries of the last eval: [n_paged][n_captured][n_head][head_dim], post-RoPE,
    // for positions n_past - n_captured .. n_past - 1.
    int32_t n_captured() const { return n_captured_; }
    const std::vector<float> &captured_queries() const { return captured_q_; }
    // Score chunks [0, n) against the last captured query: per paged layer the max
    // over query heads of q . summary (MEAN: the chunk's L2-normalised mean key;
    // BOUND: sum_d max(q_d min_d, q_d max_d), an upper bound of q . k over the chunk),
    // then the mean over layers.  Chunks without a summary score +inf (not yet sealed).
    void qk_scores(QKMode mode, float *out, int32_t n) const;
    // Attention paid to each position by the captured queries: per layer and head a
    // softmax over the visible positions, averaged over the queries; max over heads
    // and layers.  out[p] for p < n (0 for positions not visible/resident).
    void attention_scores(float *out, int64_t n) const;
    // The same over the whole history, paged-out chunks included: K rows are read
    // from the pool for resident chunks and from the host store for the rest (the
    // host copy is bit-exact), so the scores are what a full cache would give for
    // these queries.  One pass over every key per call; layers split over n_threads.
    // per_chunk: out[c] for the n chunks instead -- per layer and head the attention
    // mass the chunk receives (summed over its positions), then the max over heads and layers.
    // q_first, q_count: use only those captured queries (in capture order; q_count < 0: all from
    // q_first), e.g. the earliest of them as a baseline for the latest.  n_layers > 0: only the
    // first n_layers paged layers (early layers carry the retrieval signal; later ones add noise).
    void history_attention(float *out, int64_t n, int32_t n_threads, bool per_chunk = false,
                           const int32_t *groups = nullptr, int32_t q_first = 0, int32_t q_count = -1,
                           int32_t n_layers = 0) const;

private:
    struct Graph;
    Graph *get_graph(int32_t n, int32_t n_kv, bool all_logits);
    bool use_pool_attn(int32_t n) const;
    void build(Graph &g, int32_t n, int32_t n_kv, bool all_logits);
    void finish_graph(Graph &g);   // backend op check + allocation
    void eval_piece(const int32_t *tokens, int32_t n, bool all_logits, float *logits_out);
    // Before the host reads pool rows or graph outputs: wait for every queued page
    // copy (the pool's fence: the copy stream on CUDA) and every queued kernel
    // (ggml_backend_synchronize), since ggml-cuda's tensor_get runs on its own
    // stream (copy_engine.h, rule (4)).  No-ops on the CPU backend.
    void sync_for_host_read() const;
    void chunk_keys_synced(int32_t c, int32_t il, float *out) const;

    std::shared_ptr<Model> model_;
    RuntimeConfig cfg_;
    bool full_cache_ = false;
    int32_t n_eval_layers_ = 0;           // layers evaluated (all, or eval_layers)
    std::unique_ptr<PagedCache> cache_;
    std::vector<int32_t> paged_index_;    // model layer -> pool layer (-1: sliding)
    // sliding-window ring (gemma3): [n_embd_k, swa_tokens] per sliding layer
    int32_t swa_tokens_ = 0;
    ggml_context *swa_ctx_ = nullptr;
    ggml_backend_buffer_t swa_buf_ = nullptr;
    std::vector<ggml_tensor *> swa_k_, swa_v_;
    std::vector<int64_t> swa_pos_;
    std::unique_ptr<Graph> decode_graph_, batch_graph_;
    std::vector<uint16_t> decode_mask_;
    int64_t decode_mask_epoch_ = -1;
    int64_t n_past_ = 0;
    RuntimeStats stats_;
    std::vector<float> captured_q_;
    int32_t n_captured_ = 0;
    // chunk summaries: [n_chunks][n_paged][n_embd_k] each
    std::vector<float> summ_min_, summ_max_, summ_mean_;
    std::vector<uint8_t> summ_ready_;
    void summarize_sealed(int64_t pos0, int32_t n);
};

}  // namespace kvflash
