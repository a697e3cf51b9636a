// CUDA chunk paging: see copy_engine.h for the ordering contract.
#include "cuda/copy_engine.h"

#include <cstdio>
#include <stdexcept>
#include <string>

#ifndef KVFLASH_CUDA_STANDALONE
#include "ggml-backend.h"
#include "ggml-backend-impl.h"  // struct ggml_backend_event { device; context (a cudaEvent_t for CUDA) }
#include "ggml-cuda.h"
#include "kvflash/pool.h"
#endif

namespace kvflash {
namespace cuda {

void check(cudaError_t err, const char *what) {
    if (err != cudaSuccess)
        throw std::runtime_error(std::string("kvflash cuda: ") + what + ": " + cudaGetErrorName(err) + ": " +
                                 cudaGetErrorString(err));
}

namespace {
// Makes `device` current for the scope, restoring the previous one.
struct DeviceGuard {
    int prev = -1;
    explicit DeviceGuard(int device) {
        check(cudaGetDevice(&prev), "cudaGetDevice");
        if (prev != device) check(cudaSetDevice(device), "cudaSetDevice");
    }
    ~DeviceGuard() {
        int cur = -1;
        if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
    }
};

void *pinned_alloc(size_t bytes) {
    void *p = nullptr;
    // Portable: usable from every context/device; the store is shared by whoever pages.
    if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();  // clear the (non-sticky) error so later calls do not report it
        return nullptr;
    }
    return p;
}

void pinned_free(void *p) {
    if (p) cudaFreeHost(p);
}
}  // namespace

HostAllocator pinned_host_allocator() {
    HostAllocator a;
    a.alloc = pinned_alloc;
    a.free = pinned_free;
    return a;
}

bool device_available() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return n > 0;
}

// ------------------------------------------------------------------ StreamLink

StreamLink::StreamLink(cudaStream_t compute) : compute_(compute) {
    check(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), "cudaEventCreate (compute link)");
}

StreamLink::~StreamLink() {
    if (ev_) cudaEventDestroy(ev_);
}

void StreamLink::copy_waits_for_compute(cudaStream_t copy) {
    check(cudaEventRecord(ev_, compute_), "cudaEventRecord (compute)");
    check(cudaStreamWaitEvent(copy, ev_, 0), "cudaStreamWaitEvent (copy waits for compute)");
}

void StreamLink::compute_waits_for(cudaEvent_t done) {
    check(cudaStreamWaitEvent(compute_, done, 0), "cudaStreamWaitEvent (compute waits for copy)");
}

// ------------------------------------------------------------------ CopyEngine

CopyEngine::CopyEngine(std::vector<Segment> segments, int32_t n_blocks, int device)
    : seg_(std::move(segments)), n_blocks_(n_blocks), device_(device) {
    if (seg_.empty()) throw std::invalid_argument("copy engine: at least one segment is required");
    if (n_blocks_ <= 0) throw std::invalid_argument("copy engine: n_blocks must be > 0");
    for (const auto &s : seg_) {
        if (!s.base || s.block_bytes == 0)
            throw std::invalid_argument("copy engine: a segment has no base pointer or zero block bytes");
        chunk_bytes_ += s.block_bytes;
    }
    if (device_ < 0) check(cudaGetDevice(&device_), "cudaGetDevice");
    DeviceGuard g(device_);
    // Non-blocking: no implicit synchronization with the legacy default stream;
    // all ordering is the explicit events of the contract.
    check(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking), "cudaStreamCreate (copy)");
    check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate (copy done)");
    link_ = std::make_unique<StreamLink>(cudaStream_t(0));
}

CopyEngine::~CopyEngine() {
    // Never throw from a destructor: report and carry on releasing.
    if (copy_) {
        cudaError_t e = cudaStreamSynchronize(copy_);
        if (e != cudaSuccess) std::fprintf(stderr, "kvflash cuda: copy stream sync at teardown: %s\n", cudaGetErrorString(e));
    }
    link_.reset();
    for (auto &kv : host_ev_)
        if (kv.second.ev) cudaEventDestroy(kv.second.ev);
    if (done_) cudaEventDestroy(done_);
    if (copy_) cudaStreamDestroy(copy_);
}

void CopyEngine::set_compute_stream(cudaStream_t s) {
    DeviceGuard g(device_);
    link_ = std::make_unique<StreamLink>(s);
}

void CopyEngine::set_compute_link(std::unique_ptr<ComputeLink> link) {
    if (!link) throw std::invalid_argument("copy engine: null compute link");
    link_ = std::move(link);
}

void CopyEngine::check_block(int32_t block, const char *what) const {
    if (block < 0 || block >= n_blocks_)
        throw std::out_of_range(std::string("copy engine: ") + what + ": block " + std::to_string(block) +
                                " outside [0, " + std::to_string(n_blocks_) + ")");
}

void CopyEngine::before_copy() {
    // (1) compute -> copy
    if (!unsafe_) link_->copy_waits_for_compute(copy_);
}

void CopyEngine::after_copy() {
    pending_ = true;
    if (!deferred_) order_compute();
}

void CopyEngine::order_compute() {
    if (!pending_) return;
    pending_ = false;
    if (unsafe_) return;
    DeviceGuard g(device_);
    // (2) copy -> compute.  done_ may be re-recorded: a wait captures the
    // event's most recent record at the time cudaStreamWaitEvent is called.
    check(cudaEventRecord(done_, copy_), "cudaEventRecord (copy done)");
    link_->compute_waits_for(done_);
    stats_.compute_waits++;
}

void CopyEngine::page_out(int32_t block, uint8_t *dst) {
    check_block(block, "page_out");
    if (!dst) throw std::invalid_argument("copy engine: page_out to a null host buffer");
    DeviceGuard g(device_);
    before_copy();
    uint8_t *p = dst;
    for (const auto &s : seg_) {
        const uint8_t *src = static_cast<const uint8_t *>(s.base) + size_t(block) * s.block_bytes;
        check(cudaMemcpyAsync(p, src, s.block_bytes, cudaMemcpyDeviceToHost, copy_), "cudaMemcpyAsync (page out)");
        p += s.block_bytes;
        stats_.copies++;
    }
    // (3) the host buffer is complete when this event is.
    HostEvent &h = host_ev_[dst];
    if (!h.ev) check(cudaEventCreateWithFlags(&h.ev, cudaEventDisableTiming), "cudaEventCreate (host buffer)");
    check(cudaEventRecord(h.ev, copy_), "cudaEventRecord (host buffer)");
    h.pending = true;
    stats_.page_outs++;
    stats_.bytes_out += int64_t(chunk_bytes_);
    after_copy();
}

void CopyEngine::page_in(int32_t block, const uint8_t *src) {
    check_block(block, "page_in");
    if (!src) throw std::invalid_argument("copy engine: page_in from a null host buffer");
    DeviceGuard g(device_);
    // A pending page-out into src is earlier on this same stream: already ordered.
    before_copy();
    const uint8_t *p = src;
    for (const auto &s : seg_) {
        uint8_t *d = static_cast<uint8_t *>(s.base) + size_t(block) * s.block_bytes;
        check(cudaMemcpyAsync(d, p, s.block_bytes, cudaMemcpyHostToDevice, copy_), "cudaMemcpyAsync (page in)");
        p += s.block_bytes;
        stats_.copies++;
    }
    stats_.page_ins++;
    stats_.bytes_in += int64_t(chunk_bytes_);
    after_copy();
}

void CopyEngine::wait_host(const uint8_t *buf) {
    auto it = host_ev_.find(buf);
    if (it == host_ev_.end() || !it->second.pending) return;
    check(cudaEventSynchronize(it->second.ev), "cudaEventSynchronize (host buffer)");
    it->second.pending = false;
    stats_.host_waits++;
}

void CopyEngine::fence() {
    DeviceGuard g(device_);
    check(cudaStreamSynchronize(copy_), "cudaStreamSynchronize (copy)");
    for (auto &kv : host_ev_) kv.second.pending = false;
    stats_.fences++;
}

// ------------------------------------------------------------------ ggml adapter
#ifndef KVFLASH_CUDA_STANDALONE
namespace {

// Links to ggml-cuda's compute stream through the public event API.  Reading
// event->context (the cudaEvent_t) needs ggml-backend-impl.h; the CUDA backend
// records/waits on its current stream (ctx->stream()), the one graphs run on.
class GgmlEventLink : public ComputeLink {
public:
    GgmlEventLink(ggml_backend_t backend, ggml_backend_event_t ev) : backend_(backend), ev_(ev) {}
    ~GgmlEventLink() override { ggml_backend_event_free(ev_); }
    void copy_waits_for_compute(cudaStream_t copy) override {
        ggml_backend_event_record(ev_, backend_);
        check(cudaStreamWaitEvent(copy, static_cast<cudaEvent_t>(ev_->context), 0),
              "cudaStreamWaitEvent (copy waits for ggml compute)");
    }
    void compute_waits_for(cudaEvent_t done) override {
        // A borrowed wrapper: the CUDA backend only reads ->context.
        ggml_backend_event tmp{ev_->device, static_cast<void *>(done)};
        ggml_backend_event_wait(backend_, &tmp);
    }
private:
    ggml_backend_t backend_;
    ggml_backend_event_t ev_;
};

// Fallback when ggml cannot give events: host synchronization both ways.
class HostSyncLink : public ComputeLink {
public:
    explicit HostSyncLink(ggml_backend_t backend) : backend_(backend) {}
    void copy_waits_for_compute(cudaStream_t) override { ggml_backend_synchronize(backend_); }
    void compute_waits_for(cudaEvent_t done) override { check(cudaEventSynchronize(done), "cudaEventSynchronize"); }
private:
    ggml_backend_t backend_;
};

}  // namespace

std::unique_ptr<ChunkMover> make_pool_mover(KVPool &pool) {
    if (pool.host_accessible())
        throw std::invalid_argument("cuda mover: the pool lives in host memory; use the pool's own copies");
    std::vector<Segment> segs;
    for (int32_t i = 0; i < pool.n_layers(); ++i) {
        ggml_tensor *k = pool.k(i), *v = pool.v(i);
        segs.push_back({k->data, size_t(pool.chunk_tokens()) * k->nb[1]});
        segs.push_back({v->data, size_t(pool.chunk_tokens()) * v->nb[1]});
    }
    cudaPointerAttributes attr{};
    check(cudaPointerGetAttributes(&attr, segs[0].base), "cudaPointerGetAttributes (pool)");
    if (attr.type != cudaMemoryTypeDevice)
        throw std::invalid_argument("cuda mover: the pool's tensors are not in CUDA device memory");
    auto eng = std::make_unique<CopyEngine>(std::move(segs), pool.pool_tokens() / pool.chunk_tokens(), attr.device);

    ggml_backend_t backend = pool.backend();
    ggml_backend_event_t ev = nullptr;
    if (ggml_backend_is_cuda(backend)) ev = ggml_backend_event_new(ggml_backend_get_device(backend));
    if (ev) {
        eng->set_compute_link(std::make_unique<GgmlEventLink>(backend, ev));
    } else {
        std::fprintf(stderr, "[kvflash] cuda: no ggml events on backend %s; paging falls back to host syncs\n",
                     ggml_backend_name(backend));
        eng->set_compute_link(std::make_unique<HostSyncLink>(backend));
    }
    return std::make_unique<CudaChunkMover>(std::move(eng));
}
#endif  // KVFLASH_CUDA_STANDALONE

}  // namespace cuda
}  // namespace kvflash
