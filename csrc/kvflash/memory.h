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
//   RecurrentState  the recurrent layers' state (qwen35's Gated DeltaNet: conv inputs and the SSM
//                 state, f32, never paged): a ring of the last states, so it rewinds a few tokens
//                 (snapshots), and host checkpoints for a rollback past them.
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

// The recurrent layers' state.  Per layer two rings on the backend, each with one more row that stays
// zero (the state before position 0):
//   conv  [channels, conv_rows + 1]: the conv's input row of each recent position (position p in row
//         p mod conv_rows); a layer's conv state before position p is the rows of p-(d_conv-1) .. p-1;
//   ssm   [state, snapshots + 1]: the SSM state after each recent position (p in row p mod
//         (snapshots + 1)), from ggml_gated_delta_net's snapshots.
// A piece of n tokens at pos0 reads the state before pos0 and writes the rows of its last positions
// (at most snapshots SSM states and snapshots + d_conv - 2 conv rows), after its reads.  A piece no
// longer than that writes none of the rows it reads, so one that fails leaves the state before it
// intact; for longer evals the runtime keeps a HostCheckpoint of the state before them.  A truncate to n needs the SSM state after n - 1
// and the conv rows before n still held: max_rewind() says how far back that is (snapshots - 1 after
// a long enough run); further back, a HostCheckpoint taken there restores it.
class RecurrentState final : public Memory {
public:
    // layers: the recurrent layers; channels: conv channels; d_conv: the conv kernel width; state: the
    // SSM state's floats per layer; snapshots >= 1: SSM states kept (rewinds of up to snapshots - 1).
    RecurrentState(ggml_backend_t backend, int32_t layers, int64_t channels, int32_t d_conv, int64_t state,
                   int32_t snapshots);
    ~RecurrentState() override;
    RecurrentState(const RecurrentState &) = delete;
    RecurrentState &operator=(const RecurrentState &) = delete;

    const char *kind() const override { return "recurrent state"; }
    int64_t max_rewind() const override;
    std::string rewind_refusal(int64_t n) const override;
    void truncate(int64_t n) override;
    void reset() override;
    size_t device_bytes() const override;

    int32_t n_layers() const { return int32_t(conv_.size()); }
    int32_t snapshots() const { return snapshots_; }
    int32_t d_conv() const { return d_conv_; }
    ggml_tensor *conv(int32_t i) const { return conv_[size_t(i)]; }
    ggml_tensor *ssm(int32_t i) const { return ssm_[size_t(i)]; }
    // Rows a piece of n tokens writes: conv inputs and SSM snapshots (graph shapes).
    int32_t conv_written(int32_t n) const { return std::min(n, snapshots_ + d_conv_ - 2 > 0 ? snapshots_ + d_conv_ - 2 : 1); }
    int32_t ssm_written(int32_t n) const { return std::min(n, snapshots_); }
    // A piece at [pos0, pos0 + n): the rows it reads (conv_in [d_conv - 1], ssm_in [1]) and writes
    // (conv_out [conv_written(n)] for its last positions, ssm_out [ssm_written(n)] for its last
    // positions, newest first, as ggml_gated_delta_net orders its snapshots).  pos0 must be the
    // state's end; the rows written are marked as holding their positions.
    void place(int64_t pos0, int32_t n, int32_t *conv_in, int64_t *conv_out, int32_t *ssm_in, int64_t *ssm_out);
    int64_t end() const { return end_; }

    // The state at a position (the SSM state after pos - 1 and the conv rows before pos) in host RAM.
    struct HostCheckpoint {
        int64_t pos = -1;
        std::vector<float> data;   // per layer: conv rows (d_conv - 1) x channels, then the SSM state
    };
    // The state at the end now, or at pos where the rings still hold it (can_checkpoint); restore()
    // makes it the state again (positions past it forgotten).
    HostCheckpoint checkpoint() const { return checkpoint(end_); }
    HostCheckpoint checkpoint(int64_t pos) const;
    bool can_checkpoint(int64_t pos) const;
    void restore(const HostCheckpoint &c);
    size_t checkpoint_floats() const { return size_t(n_layers()) * (size_t(d_conv_ - 1) * channels_ + state_); }
    // What a state of this geometry takes before one exists (auto pool sizing): its buffers on the
    // device (the conv and SSM rings, as the constructor allocates them) and one host checkpoint.
    static size_t device_bytes_for(int32_t layers, int64_t channels, int32_t d_conv, int64_t state, int32_t snapshots);
    static size_t checkpoint_bytes_for(int32_t layers, int64_t channels, int32_t d_conv, int64_t state) {
        return size_t(layers) * (size_t(d_conv - 1) * size_t(channels) + size_t(state)) * sizeof(float);
    }

private:
    bool holds_conv(int64_t p) const { return p < 0 || conv_pos_[size_t(p % conv_rows_)] == p; }
    bool holds_ssm(int64_t p) const { return p < 0 || ssm_pos_[size_t(p % (snapshots_ + 1))] == p; }
    int64_t channels_, state_;
    int32_t d_conv_, snapshots_, conv_rows_;
    int64_t end_ = 0;
    ggml_context *ctx_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
    std::vector<ggml_tensor *> conv_, ssm_;
    std::vector<int64_t> conv_pos_, ssm_pos_;   // the position each ring row holds (-1: none)
};

}  // namespace kvflash
