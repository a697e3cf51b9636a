#include "kvflash/pool.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "ggml-cpu.h"

#ifdef KVFLASH_WITH_CUDA
#include "cuda/copy_engine.h"
#include "ggml-cuda.h"
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

void KVPool::copy_out(int32_t block, uint8_t *dst, ggml_backend_t queue) const {
    // precondition: 0 <= block < pool_tokens / chunk_tokens
    for (size_t i = 0; i < k_.size(); ++i)
        for (ggml_tensor *t : {k_[i], v_[i]}) {
            const size_t n = size_t(chunk_tokens_) * t->nb[1];
            if (queue) ggml_backend_tensor_get_async(queue, t, dst, size_t(block) * n, n);
            else ggml_backend_tensor_get(t, dst, size_t(block) * n, n);
            dst += n;
        }
}

void KVPool::copy_in(int32_t block, const uint8_t *src, ggml_backend_t queue) {
    for (size_t i = 0; i < k_.size(); ++i)
        for (ggml_tensor *t : {k_[i], v_[i]}) {
            const size_t n = size_t(chunk_tokens_) * t->nb[1];
            if (queue) ggml_backend_tensor_set_async(queue, t, src, size_t(block) * n, n);
            else ggml_backend_tensor_set(t, src, size_t(block) * n, n);
            src += n;
        }
}

void KVPool::page_out(int32_t block, uint8_t *dst) {
    if (mover_) return mover_->page_out(block, dst);
    copy_out(block, dst, nullptr);
}

void KVPool::page_in(int32_t block, const uint8_t *src) {
    if (mover_) return mover_->page_in(block, src);
    copy_in(block, src, nullptr);
}

namespace {

// A pool in a GPU's memory pages through ggml's async tensor copies queued on the pool's own backend.
// One backend runs its async copies and its graphs in the order they were issued (ggml's backend contract:
// the CUDA stream, the Vulkan queue), so a page-out reads its block before any later kernel writes a new
// chunk's K/V there, and a page-in lands before any later kernel attends the chunk, with no host wait.
// fence() (ggml_backend_synchronize) completes them: every page-out's host bytes are then whole, and no
// page-in still reads its source.  The runtime fences after each graph and before any host read
// (Runtime::sync_for_host_read); the pager before it hands host memory back.
//
// Each page event ends with an event recorded on the backend, which hands its copies to the queue at once
// instead of leaving them in a command buffer still being recorded.  ggml-vulkan records async copies into
// an open command buffer and submits it only when something asks (a graph, an event, a synchronize), and a
// synchronous transfer made meanwhile (the runtime writes its graph inputs with ggml_backend_tensor_set)
// may reset the compute queue's command pool once enough buffers are in use
// (ggml_vk_queue_command_pools_cleanup), open buffer included.  A device without events synchronizes
// instead (correct, with a host wait).
class BackendMover final : public ChunkMover {
public:
    explicit BackendMover(KVPool &pool) : pool_(pool) {
        ggml_backend_dev_t dev = ggml_backend_get_device(pool_.backend());
        if (dev) {
            ggml_backend_dev_props props;
            ggml_backend_dev_get_props(dev, &props);
            if (props.caps.events) submitted_ = ggml_backend_event_new(dev);
        }
    }
    ~BackendMover() override {
        fence();
        if (submitted_) ggml_backend_event_free(submitted_);
    }
    size_t chunk_bytes() const override { return pool_.chunk_bytes(); }
    void page_out(int32_t block, uint8_t *dst) override {
        pool_.copy_out(block, dst, pool_.backend());
        submit();
    }
    void page_in(int32_t block, const uint8_t *src) override {
        pool_.copy_in(block, src, pool_.backend());
        submit();
    }
    void fence() override {
        if (submitted_) ggml_backend_event_synchronize(submitted_);  // also recycles the driver's events
        ggml_backend_synchronize(pool_.backend());
    }

private:
    void submit() {
        if (submitted_) ggml_backend_event_record(submitted_, pool_.backend());
        else ggml_backend_synchronize(pool_.backend());
    }
    KVPool &pool_;
    ggml_backend_event_t submitted_ = nullptr;
};

// The host store in the device's host buffer type (pinned memory, so the async copies are real DMA, not
// a staged copy and a wait): one ggml buffer per region, found again by its base address when freed.
HostAllocator host_buffer_allocator(ggml_backend_buffer_type_t buft) {
    struct Buffers {
        std::mutex mu;
        std::unordered_map<void *, ggml_backend_buffer_t> of;
    };
    auto bufs = std::make_shared<Buffers>();
    HostAllocator a;
    a.alloc = [buft, bufs](size_t bytes) -> void * {
        ggml_backend_buffer_t b = ggml_backend_buft_alloc_buffer(buft, bytes);
        if (!b) return nullptr;
        void *p = ggml_backend_buffer_get_base(b);
        std::lock_guard<std::mutex> lock(bufs->mu);
        bufs->of[p] = b;
        return p;
    };
    a.free = [bufs](void *p) {
        std::lock_guard<std::mutex> lock(bufs->mu);
        auto it = bufs->of.find(p);
        if (it == bufs->of.end()) return;
        ggml_backend_buffer_free(it->second);
        bufs->of.erase(it);
    };
    return a;
}

}  // namespace

PagedCache::PagedCache(ggml_backend_t backend, std::vector<PoolLayerSpec> layers, ggml_type type_k,
                       ggml_type type_v, PagerConfig cfg, HostStore::Backing backing, std::string host_path,
                       std::vector<ggml_backend_buffer_type_t> layer_bufts) {
    cfg.validate();  // rounds the pool before the tensors are sized
    pool = std::make_unique<KVPool>(backend, std::move(layers), type_k, type_v, cfg.pool_tokens, cfg.chunk_tokens,
                                    std::move(layer_bufts));
    HostAllocator host_alloc;  // default: plain aligned memory
    if (!ggml_backend_is_cpu(backend)) {
        // A pool in a GPU's memory (any of ggml's GPU backends) pages through async copies on the
        // backend's queue into the device's pinned host buffers, where it has a host buffer type.
        ggml_backend_dev_t dev = ggml_backend_get_device(backend);
        ggml_backend_buffer_type_t host_buft = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
        if (host_buft) host_alloc = host_buffer_allocator(host_buft);
#ifdef KVFLASH_WITH_CUDA
        // kvflash's own CUDA copy engine (a copy stream beside ggml's, events between them), kept for a lent
        // GPU to measure against the backend path: KVFLASH_CUDA_COPY_ENGINE=1.
        const char *eng = std::getenv("KVFLASH_CUDA_COPY_ENGINE");
        if (eng && *eng && std::strcmp(eng, "0") != 0 && ggml_backend_is_cuda(backend)) {
            pool->set_mover(cuda::make_pool_mover(*pool));
            host_alloc = cuda::pinned_host_allocator();
        } else
#endif
            pool->set_mover(std::make_unique<BackendMover>(*pool));
    }
    pager = std::make_unique<Pager>(cfg, pool.get(), backing, std::move(host_path), host_alloc);
}

PagedCache::~PagedCache() {
    if (pool) pool->fence();
    pager.reset();  // frees the host store while the pool (and its mover) still exist
}

}  // namespace kvflash
