// Host-side backing store for paged-out chunks.
//
// A slab of equal-sized chunk buffers carved out of a few large regions: the
// store grows by whole regions (each at least as large as everything before it),
// never per chunk, and freed buffers are reused.  Two backings:
//   - RAM: plain aligned memory, or pinned memory when an allocator hook is set
//     (a pool in device memory installs its device's host buffer type, ggml's pinned
//     memory, so async copies work: pool.cpp);
//   - FILE: a memory-mapped file, so a machine can hold a context larger than RAM.
//     The file is created exclusively (an existing path is an error: two stores never
//     share one), unlinked at once (the store is the only name for it, so a crash
//     leaves nothing of the prompt-derived KV behind), and every region is allocated
//     on disk (posix_fallocate) before it is mapped: a full disk is an error from
//     acquire(), never a SIGBUS on a later write.  Regions are whole pages
//     (sysconf(_SC_PAGESIZE)), so map offsets stay aligned on 64 KiB-page kernels.
// Buffer addresses are stable until release_memory() (regions never move).
// max_bytes > 0 caps reserved_bytes(): acquire() past it throws HostStoreFull.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvflash {

struct HostAllocator {
    std::function<void *(size_t bytes)> alloc;  // empty: aligned operator new
    std::function<void(void *ptr)> free;
};

class HostStore {
public:
    enum class Backing { RAM, FILE };

    // chunk_bytes > 0.  path: file to create for Backing::FILE (must not exist), ignored
    // for RAM.  first_region_chunks: buffers in the first region.  max_bytes: the cap
    // (0: none).  page_bytes: region granularity (0: the kernel's page size).
    HostStore(size_t chunk_bytes, Backing backing = Backing::RAM, std::string path = "",
              int32_t first_region_chunks = 16, HostAllocator allocator = {}, size_t max_bytes = 0,
              size_t page_bytes = 0);
    ~HostStore();
    HostStore(const HostStore &) = delete;
    HostStore &operator=(const HostStore &) = delete;

    // A free buffer index, growing the slab by one region if none is free.
    // Throws std::bad_alloc / std::runtime_error when the OS refuses memory (or disk),
    // HostStoreFull past max_bytes.  Nothing changes when it throws.
    int32_t acquire();
    // Grow now (or throw, as acquire) so that n more acquire() calls cannot fail.
    void reserve(int32_t n);
    // clear(), then hand every region back to the OS (file: truncated to 0).
    void release_memory();
    // h was returned by acquire() and not yet released.
    void release(int32_t h);
    // Release everything; regions are kept for reuse.
    void clear();

    uint8_t *ptr(int32_t h);
    const uint8_t *ptr(int32_t h) const;

    size_t chunk_bytes() const { return chunk_bytes_; }
    int32_t capacity() const { return capacity_; }       // buffers allocated
    int32_t in_use() const { return in_use_; }           // buffers acquired
    size_t reserved_bytes() const { return region_bytes_; }
    size_t used_bytes() const { return size_t(in_use_) * chunk_bytes_; }
    int32_t n_regions() const { return int32_t(regions_.size()); }
    size_t max_bytes() const { return max_bytes_; }
    size_t page_bytes() const { return page_bytes_; }
    // Byte offset of region i in the file (FILE backing): a multiple of page_bytes().
    size_t region_offset(int32_t i) const { return regions_[i].offset; }
    Backing backing() const { return backing_; }
    bool is_acquired(int32_t h) const { return h >= 0 && h < capacity_ && acquired_[h]; }

private:
    struct Region { uint8_t *base; int32_t first; int32_t count; size_t bytes; size_t offset; };
    void grow(int32_t at_least);
    void free_regions();

    size_t chunk_bytes_;
    Backing backing_;
    std::string path_;
    int fd_ = -1;
    size_t file_bytes_ = 0;
    int32_t next_region_chunks_;
    HostAllocator allocator_;
    std::vector<Region> regions_;
    std::vector<int32_t> free_;       // stack of free buffer indices
    std::vector<uint8_t> acquired_;   // per buffer: 1 if handed out
    int32_t capacity_ = 0;
    int32_t in_use_ = 0;
    int32_t first_region_chunks_;
    size_t max_bytes_ = 0, page_bytes_ = 4096;
    size_t region_bytes_ = 0;          // what the regions hold (the cap counts these)
};

// acquire() past the store's max_bytes cap.
struct HostStoreFull : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The backing a host string names: "ram", or "file" (alias "mmap"), which needs path.
// Throws std::invalid_argument otherwise; every entry point parses host here.
HostStore::Backing parse_host_backing(const std::string &host, const std::string &path);

}  // namespace kvflash
