// CUDA chunk paging: async device<->pinned-host copies of pool blocks on a
// dedicated copy stream, ordered against the compute stream with CUDA events.
//
// Layers of this file:
//   CopyEngine        the core: raw device pointers + sizes, a copy stream, events.
//                     No ggml.  Compiled in every CUDA build, including the
//                     compile-only CI check (-DKVFLASH_CUDA_STANDALONE).
//   CudaChunkMover    kvflash::ChunkMover over a CopyEngine (pager.h has no ggml
//                     dependency, so this is standalone too; the self-test drives a
//                     real Pager through it).
//   pinned_host_allocator()  HostAllocator for the HostStore slab (cudaHostAlloc).
//   make_pool_mover() the ggml adapter: a CudaChunkMover over a KVPool whose tensors
//                     live in a ggml-cuda buffer, linked to ggml's compute stream
//                     through the ggml event API.  Only without KVFLASH_CUDA_STANDALONE.
//
// Ordering contract (the race the reference has, and how it is closed here):
//   (1) compute -> copy.  Every page_out/page_in first makes the copy stream wait
//       (cudaStreamWaitEvent, GPU-side) on an event recorded on the compute stream,
//       so a page-out reads the block only after all compute writes queued before it,
//       and a page-in overwrites a block only after all compute reads queued before it.
//   (2) copy -> compute.  After the copies, an event is recorded on the copy stream
//       and the compute stream waits on it (GPU-side).  So a block freed by a queued
//       page-out cannot be written by a later kernel (the new chunk's K/V writes)
//       before the copy has read it, and a recalled chunk cannot be attended before
//       its page-in landed.  In deferred mode the caller issues this wait once per
//       graph with order_compute() instead of once per copy.
//   (3) host buffers.  A page-out's host bytes are complete only when its copy is:
//       readers on the copy stream (a later page_in of the same buffer, a reuse of
//       the buffer for another page-out) are ordered by the stream itself; CPU readers
//       must call wait_host(buf) (one event per host buffer) or fence() first.
//   (4) fence() synchronizes the copy stream on the host: every queued copy is done.
// Anything else that touches the pool outside the compute stream (e.g.
// ggml_backend_tensor_get/set, which ggml-cuda runs on cudaStreamPerThread) must
// call fence() first and must not run concurrently with compute.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include <cuda_runtime_api.h>

#include "kvflash/pager.h"

namespace kvflash {
#ifndef KVFLASH_CUDA_STANDALONE
class KVPool;
#endif

namespace cuda {

// Throws std::runtime_error("<what>: <cuda error string>") unless err == cudaSuccess.
void check(cudaError_t err, const char *what);

// One contiguous device region per (layer, K/V): block b occupies
// [base + b*block_bytes, base + (b+1)*block_bytes).  With chunk_tokens rows per
// block and contiguous rows, block_bytes = chunk_tokens * row_bytes.
struct Segment {
    void *base = nullptr;     // device pointer (tensor->data of a CUDA buffer)
    size_t block_bytes = 0;
};

// How the copy stream and the compute side are linked.  The default links to a
// cudaStream_t (set_compute_stream); the ggml adapter supplies one that goes
// through ggml's event API, so ggml's private stream handle is never needed.
class ComputeLink {
public:
    virtual ~ComputeLink() = default;
    // Make `copy` wait (GPU-side) for all work queued so far on the compute side.
    virtual void copy_waits_for_compute(cudaStream_t copy) = 0;
    // Make compute work queued from now on wait (GPU-side) for `done`, an event
    // just recorded on the copy stream.
    virtual void compute_waits_for(cudaEvent_t done) = 0;
};

// The ComputeLink over a plain stream.  stream 0 is the legacy default stream:
// it does NOT implicitly synchronize with non-blocking streams (ggml-cuda's
// are non-blocking), which is why the events are always explicit.
class StreamLink : public ComputeLink {
public:
    explicit StreamLink(cudaStream_t compute);
    ~StreamLink() override;
    void copy_waits_for_compute(cudaStream_t copy) override;
    void compute_waits_for(cudaEvent_t done) override;
    cudaStream_t stream() const { return compute_; }
private:
    cudaStream_t compute_;
    cudaEvent_t ev_ = nullptr;   // re-recorded each time; a wait captures its state at call time
};

struct CopyStats {
    int64_t page_outs = 0, page_ins = 0, copies = 0;   // copies: cudaMemcpyAsync calls
    int64_t bytes_out = 0, bytes_in = 0;
    int64_t compute_waits = 0;    // GPU-side waits inserted on the compute stream
    int64_t host_waits = 0;       // wait_host() calls that had to block
    int64_t fences = 0;
};

// The core engine: raw device pointers, no ggml.  Host layout of one chunk is
// the segments' block bytes back to back, in segment order (for KVPool:
// [layer][K rows][V rows], as pool.h documents).  Not thread-safe: one caller.
class CopyEngine {
public:
    // segments: at least one, each block_bytes > 0; n_blocks > 0.  device: the
    // CUDA device the pointers belong to (-1: the current one).  Creates a
    // non-blocking copy stream; the compute link defaults to the legacy stream 0.
    CopyEngine(std::vector<Segment> segments, int32_t n_blocks, int device = -1);
    // Synchronizes the copy stream, then destroys stream and events.
    ~CopyEngine();
    CopyEngine(const CopyEngine &) = delete;
    CopyEngine &operator=(const CopyEngine &) = delete;

    size_t chunk_bytes() const { return chunk_bytes_; }
    int32_t n_blocks() const { return n_blocks_; }
    int device() const { return device_; }
    cudaStream_t copy_stream() const { return copy_; }

    // Link to the stream that runs compute (replaces the current link).
    void set_compute_stream(cudaStream_t s);
    void set_compute_link(std::unique_ptr<ComputeLink> link);

    // Deferred mode: page_out/page_in do not insert the copy -> compute wait;
    // the caller must call order_compute() before launching compute that may
    // touch a paged block (once per graph is enough).  Default: off (a wait per call).
    void set_deferred_compute_wait(bool on) { deferred_ = on; }
    // Compute work queued from now on waits (GPU-side) for every copy queued so far.
    void order_compute();

    // Queue block -> dst (pinned host memory for a truly async copy; pageable works
    // but the driver then copies synchronously).  One cudaMemcpyAsync per segment.
    void page_out(int32_t block, uint8_t *dst);
    // Queue src -> block.  src must stay valid until the copy is done (the pager's
    // host buffers are: a released buffer is only reused through this engine).
    void page_in(int32_t block, const uint8_t *src);

    // Block on the host until the last page-out into host buffer `buf` is done
    // (no-op if none is pending).  Use before the CPU reads a host copy.
    void wait_host(const uint8_t *buf);
    // Block on the host until every queued copy is done.
    void fence();

    const CopyStats &stats() const { return stats_; }

    // TEST ONLY: skip the ordering events (1) and (2), reproducing the
    // reference's race, so the self-test can show that it detects it.
    void set_unsafe_skip_ordering(bool on) { unsafe_ = on; }

private:
    void before_copy();
    void after_copy();
    void check_block(int32_t block, const char *what) const;

    std::vector<Segment> seg_;
    int32_t n_blocks_;
    int device_;
    size_t chunk_bytes_ = 0;
    cudaStream_t copy_ = nullptr;
    std::unique_ptr<ComputeLink> link_;
    cudaEvent_t done_ = nullptr;                 // copy -> compute
    bool deferred_ = false, pending_ = false, unsafe_ = false;
    // host buffer -> event recorded after its last page-out (created on first use,
    // one per distinct buffer: bounded by the host store's capacity)
    struct HostEvent { cudaEvent_t ev = nullptr; bool pending = false; };
    std::unordered_map<const uint8_t *, HostEvent> host_ev_;
    CopyStats stats_;
};

// kvflash::ChunkMover over a CopyEngine.  fence() synchronizes the copy stream.
class CudaChunkMover : public ChunkMover {
public:
    explicit CudaChunkMover(std::unique_ptr<CopyEngine> engine) : eng_(std::move(engine)) {}
    size_t chunk_bytes() const override { return eng_->chunk_bytes(); }
    void page_out(int32_t block, uint8_t *dst) override { eng_->page_out(block, dst); }
    void page_in(int32_t block, const uint8_t *src) override { eng_->page_in(block, src); }
    void fence() override { eng_->fence(); }
    CopyEngine &engine() { return *eng_; }
private:
    std::unique_ptr<CopyEngine> eng_;
};

// Pinned host memory for HostStore regions: cudaHostAlloc(Portable) / cudaFreeHost.
// alloc returns nullptr on failure (HostStore then throws bad_alloc).  Regions
// must not be freed with copies in flight: fence() the mover first (PagedCache does).
HostAllocator pinned_host_allocator();

// Is a CUDA device usable from this process (driver present, >= 1 device)?
bool device_available();

#ifndef KVFLASH_CUDA_STANDALONE
// The ggml adapter: a mover for `pool`, whose tensors must live in a ggml-cuda
// buffer (not host-accessible).  Segments are each layer's K then V tensor data.
// The compute link goes through ggml_backend_event_record/_wait on the pool's
// backend (ggml's own compute stream, whatever it is).  If the backend is not a
// CUDA backend or cannot create events (GGML_CUDA_NO_PEER_COPY), it falls back
// to host synchronization: ggml_backend_synchronize before each copy and a copy
// stream sync after it (correct, slower; logged once to stderr).
std::unique_ptr<ChunkMover> make_pool_mover(KVPool &pool);
#endif

}  // namespace cuda
}  // namespace kvflash
