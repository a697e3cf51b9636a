// The runtime's memories: each kind of per-layer state a Runtime keeps sits behind one set of verbs,
// so truncate, rewind limits and reset are written once (Runtime::truncate asks every memory) and a
// new kind of layer adds a Memory, not another copy of them.  Learned from llama.cpp's memory
// interface (llama_memory_i: attention KV, sliding-window KV, recurrent state and hybrids behind the
// same seq / rollback verbs).
//
//   PagedMemory   the attention KV of the paged (full-attention) layers: the pool, the pager and the
//                 host store (pool.h, pager.h); rewinds to any position (the chunk table forgets).
//   SlidingRing   the sliding-window layers' ring (gemma3): the window plus one piece, on the device;
//                 rewinds only as far as the ring still holds the window before the new end.
//   (issue 38)    recurrent state (conv / SSM), rolled back from snapshots of its own.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "kvflash/pool.h"

namespace kvflash {

class Memory {
public:
    virtual ~Memory() = default;
    virtual const char *kind() const = 0;
    // How many tokens back from the runtime's n_past a truncate can go (INT64_MAX: any).
    virtual int64_t max_rewind() const { return std::numeric_limits<int64_t>::max(); }
    // Why a truncate to n is refused (called when n_past - n > max_rewind()).
    virtual std::string rewind_refusal(int64_t n) const;
    // Positions >= n are forgotten.  The runtime checks max_rewind first: this does not throw.
    virtual void truncate(int64_t n) = 0;
    virtual void reset() = 0;
    // Bytes it holds on the device (or in the CPU backend's RAM).
    virtual size_t device_bytes() const = 0;
};

class PagedMemory final : public Memory {
public:
    explicit PagedMemory(std::unique_ptr<PagedCache> cache) : cache_(std::move(cache)) {}
    const char *kind() const override { return "paged attention KV"; }
    void truncate(int64_t n) override { cache_->pager->truncate(n); }
    void reset() override { cache_->pager->reset(); }
    size_t device_bytes() const override { return cache_->pool->bytes(); }

    Pager &pager() { return *cache_->pager; }
    const Pager &pager() const { return *cache_->pager; }
    KVPool &pool() { return *cache_->pool; }
    const KVPool &pool() const { return *cache_->pool; }

private:
    std::unique_ptr<PagedCache> cache_;
};

class SlidingRing final : public Memory {
public:
    // tokens: the ring's rows (the window plus the largest piece, rounded up to 256); window: the
    // model's n_swa; layer_bufts: one buffer type per ring layer (nullptr: backend's default).
    SlidingRing(ggml_backend_t backend, int32_t tokens, int32_t window, ggml_type type, int64_t n_embd_k,
                int64_t n_embd_v, const std::vector<ggml_backend_buffer_type_t> &layer_bufts);
    ~SlidingRing() override;
    SlidingRing(const SlidingRing &) = delete;
    SlidingRing &operator=(const SlidingRing &) = delete;

    const char *kind() const override { return "sliding-window ring"; }
    int64_t max_rewind() const override { return int64_t(tokens_) - window_; }
    std::string rewind_refusal(int64_t n) const override;
    void truncate(int64_t n) override;
    void reset() override;
    size_t device_bytes() const override;

    int32_t tokens() const { return tokens_; }
    int32_t window() const { return window_; }
    int32_t n_layers() const { return int32_t(k_.size()); }
    ggml_tensor *k(int32_t i) const { return k_[size_t(i)]; }
    ggml_tensor *v(int32_t i) const { return v_[size_t(i)]; }
    // The logical position each row holds (-1: none).
    const std::vector<int64_t> &positions() const { return pos_; }
    void set_positions(std::vector<int64_t> pos) { pos_ = std::move(pos); }
    // Positions [pos0, pos0 + n) take their rows: rows[i] gets each one's row, mask ([n][tokens])
    // what each of them sees (0: visible, -inf in f16: not).
    void place(int64_t pos0, int32_t n, int64_t *rows, uint16_t *mask);

private:
    int32_t tokens_, window_;
    std::vector<ggml_context *> ctxs_;        // one per buffer type holding ring layers
    std::vector<ggml_backend_buffer_t> bufs_;
    std::vector<ggml_tensor *> k_, v_;        // [n_embd, tokens] per ring layer
    std::vector<int64_t> pos_;
};

}  // namespace kvflash
