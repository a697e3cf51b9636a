// The device KV pool: per paged layer, K and V tensors of pool_tokens rows,
// allocated in one ggml backend buffer at pool size (never at max context: the
// allocation delta is the saving).  It implements ChunkMover: a chunk is
// chunk_tokens consecutive rows, so paging one is one contiguous copy per layer
// and K/V, moving raw (possibly quantized) bytes: bit-exact both ways.
//
// Host layout of one chunk: for each layer il, K rows then V rows,
//   [il][K: chunk_tokens * row_bytes_k(il)][V: chunk_tokens * row_bytes_v(il)].
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "kvflash/pager.h"

namespace kvflash {

struct PoolLayerSpec {
    int32_t layer;       // model layer index (for naming; the pool is indexed 0..n-1)
    int32_t n_embd_k;    // head_dim_k * n_head_kv
    int32_t n_embd_v;
};

// Parse "f16" / "q8_0" / "q4_0" / "f32" (the KV types we page); throws invalid_argument.
ggml_type kv_type_from_name(const std::string &name);

class KVPool : public ChunkMover {
public:
    // backend: where the pool lives (the CPU or a GPU); must outlive the pool.  layer_bufts (empty, or one per
    // layer; nullptr: the backend's default) places a layer's K/V in another buffer type -- a remote
    // device's (ggml RPC): paging then reaches it through the same per-layer tensor get/set, and the
    // block numbering is the same on every device.
    KVPool(ggml_backend_t backend, std::vector<PoolLayerSpec> layers, ggml_type type_k, ggml_type type_v,
           int32_t pool_tokens, int32_t chunk_tokens, std::vector<ggml_backend_buffer_type_t> layer_bufts = {});
    ~KVPool() override;
    KVPool(const KVPool &) = delete;
    KVPool &operator=(const KVPool &) = delete;

    int32_t n_layers() const { return int32_t(layers_.size()); }
    const PoolLayerSpec &layer(int32_t i) const { return layers_[i]; }
    // k: [n_embd_k, pool_tokens], v: [n_embd_v, pool_tokens]
    ggml_tensor *k(int32_t i) const { return k_[i]; }
    ggml_tensor *v(int32_t i) const { return v_[i]; }
    int32_t pool_tokens() const { return pool_tokens_; }
    size_t bytes() const;                 // the pool's device bytes (all its buffers)
    bool host_accessible() const;         // tensor data can be read through ->data (every layer)
    bool layer_host_accessible(int32_t i) const;
    // Bytes one chunk of layer i moves (K and V rows) on a page event.
    size_t layer_chunk_bytes(int32_t i) const;

    size_t chunk_bytes() const override { return chunk_bytes_; }
    void page_out(int32_t block, uint8_t *dst) override;
    void page_in(int32_t block, const uint8_t *src) override;
    void fence() override;

    ggml_backend_t backend() const { return backend_; }
    int32_t chunk_tokens() const { return chunk_tokens_; }
    // One block's rows to / from host bytes in the chunk layout above: queued on `queue` with ggml's async
    // tensor copies (the caller orders and completes them), or synchronous when queue is null.
    void copy_out(int32_t block, uint8_t *dst, ggml_backend_t queue) const;
    void copy_in(int32_t block, const uint8_t *src, ggml_backend_t queue);
    // Hook for a device mover (a GPU pool's: async copies on its backend's queue, pool.cpp; or the CUDA
    // build's own copy engine when asked for): when set, page_out/page_in/fence delegate to it; when not
    // (the CPU path, an RPC pool), chunks move with synchronous ggml_backend_tensor_get/set.  The pool owns it
    // and drops it before its buffer.
    void set_mover(std::unique_ptr<ChunkMover> mover) { mover_ = std::move(mover); }
    ChunkMover *mover() const { return mover_.get(); }

private:
    std::unique_ptr<ChunkMover> mover_;
    ggml_backend_t backend_;
    std::vector<PoolLayerSpec> layers_;
    int32_t pool_tokens_, chunk_tokens_;
    size_t chunk_bytes_ = 0;
    std::vector<ggml_context *> ctxs_;          // one per buffer type the layers use
    std::vector<ggml_backend_buffer_t> bufs_;
    std::vector<ggml_tensor *> k_, v_;
};

// A pool and its pager, the unit a model (or a test) owns.
struct PagedCache {
    PagedCache(ggml_backend_t backend, std::vector<PoolLayerSpec> layers, ggml_type type_k, ggml_type type_v,
               PagerConfig cfg, HostStore::Backing backing = HostStore::Backing::RAM, std::string host_path = "",
               std::vector<ggml_backend_buffer_type_t> layer_bufts = {});
    // Fences the pool's mover first: no async copy may outlive the host store.
    ~PagedCache();
    std::unique_ptr<KVPool> pool;
    std::unique_ptr<Pager> pager;
};

}  // namespace kvflash
