#include "kvflash/pool.h"

#include <algorithm>

#include <stdexcept>

#ifdef KVFLASH_WITH_CUDA
#include "cuda/copy_engine.h"
#endif

namespace kvflash {

ggml_type kv_type_from_name(const std::string &name) {
    if (name == "f16") return GGML_TYPE_F16;
    if (name == "q8_0") return GGML_TYPE_Q8_0;
    if (name == "q4_0") return GGML_TYPE_Q4_0;
    if (name == "f32") return GGML_TYPE_F32;
    throw std::invalid_argument("unknown KV type '" + name + "': use one of f16, q8_0, q4_0, f32");
}

KVPool::KVPool(ggml_backend_t backend, std::vector<PoolLayerSpec> layers, ggml_type type_k, ggml_type type_v,
               int32_t pool_tokens, int32_t chunk_tokens, std::vector<ggml_backend_buffer_type_t> layer_bufts)
    : backend_(backend), layers_(std::move(layers)), pool_tokens_(pool_tokens), chunk_tokens_(chunk_tokens) {
    if (!backend_) throw std::invalid_argument("pool: no backend");
    if (layers_.empty()) throw std::invalid_argument("pool: at least one paged layer is required");
    if (pool_tokens_ <= 0 || chunk_tokens_ <= 0 || pool_tokens_ % chunk_tokens_ != 0)
        throw std::invalid_argument("pool: pool_tokens must be a positive multiple of chunk_tokens");
    for (const auto &l : layers_) {
        if (l.n_embd_k <= 0 || l.n_embd_v <= 0)
            throw std::invalid_argument("pool: layer " + std::to_string(l.layer) + " has a non-positive row width");
        if (l.n_embd_k % ggml_blck_size(type_k) != 0 || l.n_embd_v % ggml_blck_size(type_v) != 0)
            throw std::invalid_argument("pool: layer " + std::to_string(l.layer) + " row width " +
                                        std::to_string(l.n_embd_k) + " is not a multiple of the " +
                                        ggml_type_name(type_k) + " block size " + std::to_string(ggml_blck_size(type_k)));
    }
    if (!layer_bufts.empty() && layer_bufts.size() != layers_.size())
        throw std::invalid_argument("pool: " + std::to_string(layer_bufts.size()) + " buffer types for " +
                                    std::to_string(layers_.size()) + " layers");
    layer_bufts.resize(layers_.size(), nullptr);
    for (auto &b : layer_bufts)
        if (!b) b = ggml_backend_get_default_buffer_type(backend_);
    std::vector<ggml_backend_buffer_type_t> kinds;   // distinct, in layer order
    for (auto *b : layer_bufts)
        if (std::find(kinds.begin(), kinds.end(), b) == kinds.end()) kinds.push_back(b);
    k_.assign(layers_.size(), nullptr);
    v_.assign(layers_.size(), nullptr);
    try {
        for (ggml_backend_buffer_type_t buft : kinds) {
            ggml_init_params ip{ggml_tensor_overhead() * (2 * layers_.size() + 1), nullptr, true};
            ggml_context *ctx = ggml_init(ip);
            if (!ctx) throw std::runtime_error("pool: ggml_init failed");
            ctxs_.push_back(ctx);
            for (size_t i = 0; i < layers_.size(); ++i) {
                if (layer_bufts[i] != buft) continue;
                ggml_tensor *k = ggml_new_tensor_2d(ctx, type_k, layers_[i].n_embd_k, pool_tokens_);
                ggml_tensor *v = ggml_new_tensor_2d(ctx, type_v, layers_[i].n_embd_v, pool_tokens_);
                ggml_format_name(k, "pool_k_l%d", layers_[i].layer);
                ggml_format_name(v, "pool_v_l%d", layers_[i].layer);
                k_[i] = k;
                v_[i] = v;
            }
            ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
            if (!buf)
                throw std::runtime_error("pool: cannot allocate the KV pool on " + std::string(ggml_backend_buft_name(buft)) +
                                         " (" + std::to_string(pool_tokens_) + " tokens); use a smaller pool");
            bufs_.push_back(buf);
            ggml_backend_buffer_clear(buf, 0);
        }
    } catch (...) {
        for (auto *b : bufs_) ggml_backend_buffer_free(b);
        for (auto *c : ctxs_) ggml_free(c);
        throw;
    }
    for (size_t i = 0; i < layers_.size(); ++i) chunk_bytes_ += layer_chunk_bytes(int32_t(i));
}

KVPool::~KVPool() {
    mover_.reset();  // its destructor waits for queued copies into the buffers
    for (auto *b : bufs_) ggml_backend_buffer_free(b);
    for (auto *c : ctxs_) ggml_free(c);
}

size_t KVPool::bytes() const {
    size_t n = 0;
    for (auto *b : bufs_) n += ggml_backend_buffer_get_size(b);
    return n;
}

bool KVPool::host_accessible() const {
    for (auto *b : bufs_)
        if (!ggml_backend_buffer_is_host(b)) return false;
    return true;
}

bool KVPool::layer_host_accessible(int32_t i) const { return ggml_backend_buffer_is_host(k_[size_t(i)]->buffer); }

size_t KVPool::layer_chunk_bytes(int32_t i) const {
    return size_t(chunk_tokens_) * (k_[size_t(i)]->nb[1] + v_[size_t(i)]->nb[1]);
}

void KVPool::fence() {
    if (mover_) mover_->fence();
}

void KVPool::page_out(int32_t block, uint8_t *dst) {
    if (mover_) return mover_->page_out(block, dst);
    // precondition: 0 <= block < pool_tokens / chunk_tokens
    for (size_t i = 0; i < k_.size(); ++i) {
        const size_t nk = size_t(chunk_tokens_) * k_[i]->nb[1], nv = size_t(chunk_tokens_) * v_[i]->nb[1];
        ggml_backend_tensor_get(k_[i], dst, size_t(block) * nk, nk);
        dst += nk;
        ggml_backend_tensor_get(v_[i], dst, size_t(block) * nv, nv);
        dst += nv;
    }
}

void KVPool::page_in(int32_t block, const uint8_t *src) {
    if (mover_) return mover_->page_in(block, src);
    for (size_t i = 0; i < k_.size(); ++i) {
        const size_t nk = size_t(chunk_tokens_) * k_[i]->nb[1], nv = size_t(chunk_tokens_) * v_[i]->nb[1];
        ggml_backend_tensor_set(k_[i], src, size_t(block) * nk, nk);
        src += nk;
        ggml_backend_tensor_set(v_[i], src, size_t(block) * nv, nv);
        src += nv;
    }
}

PagedCache::PagedCache(ggml_backend_t backend, std::vector<PoolLayerSpec> layers, ggml_type type_k,
                       ggml_type type_v, PagerConfig cfg, HostStore::Backing backing, std::string host_path,
                       std::vector<ggml_backend_buffer_type_t> layer_bufts) {
    cfg.validate();  // rounds the pool before the tensors are sized
    pool = std::make_unique<KVPool>(backend, std::move(layers), type_k, type_v, cfg.pool_tokens, cfg.chunk_tokens,
                                    std::move(layer_bufts));
    HostAllocator host_alloc;  // default: plain aligned memory
#ifdef KVFLASH_WITH_CUDA
    // A pool in device memory pages through the async copy engine into a pinned slab.
    if (!pool->host_accessible()) {
        pool->set_mover(cuda::make_pool_mover(*pool));
        host_alloc = cuda::pinned_host_allocator();
    }
#endif
    pager = std::make_unique<Pager>(cfg, pool.get(), backing, std::move(host_path), host_alloc);
}

PagedCache::~PagedCache() {
    if (pool) pool->fence();
    pager.reset();  // frees the host store while the pool (and its mover) still exist
}

}  // namespace kvflash
