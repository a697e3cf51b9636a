#include "kvflash/host_store.h"

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace kvflash {

static constexpr size_t kAlign = 256;  // row-copy friendly; also fits CUDA's needs

HostStore::HostStore(size_t chunk_bytes, Backing backing, std::string path, int32_t first_region_chunks,
                     HostAllocator allocator, size_t max_bytes, size_t page_bytes)
    : chunk_bytes_((chunk_bytes + kAlign - 1) / kAlign * kAlign), backing_(backing),
      path_(std::move(path)), next_region_chunks_(first_region_chunks > 0 ? first_region_chunks : 16),
      allocator_(allocator), first_region_chunks_(next_region_chunks_), max_bytes_(max_bytes) {
    if (chunk_bytes == 0) throw std::invalid_argument("host store: chunk_bytes must be > 0");
    const long sys_page = ::sysconf(_SC_PAGESIZE);
    page_bytes_ = page_bytes ? page_bytes : (sys_page > 0 ? size_t(sys_page) : size_t(4096));
    if (page_bytes_ % kAlign != 0 || (page_bytes_ & (page_bytes_ - 1)) != 0)
        throw std::invalid_argument("host store: page_bytes must be a power of two multiple of 256");
    if (backing_ == Backing::FILE) {
        if (path_.empty()) throw std::invalid_argument("host store: a file backing needs a path");
        // Exclusive: an existing file is never truncated or shared (another store may be
        // using it, or it is not ours to overwrite).
        fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd_ < 0) {
            const int e = errno;
            if (e == EEXIST)
                throw std::invalid_argument("host store: " + path_ + " already exists; host_path must name a file "
                                            "kvflash creates (it is never overwritten or shared): remove it or "
                                            "choose another path");
            throw std::runtime_error("host store: cannot create " + path_ + ": " + std::strerror(e));
        }
        // The open descriptor is the file's only name from now on: nothing is left
        // behind when the process ends, however it ends.
        ::unlink(path_.c_str());
    }
}

HostStore::~HostStore() {
    free_regions();
    if (fd_ >= 0) ::close(fd_);
}

void HostStore::free_regions() {
    for (auto &r : regions_) {
        if (backing_ == Backing::FILE) ::munmap(r.base, r.bytes);
        else if (allocator_.free) allocator_.free(r.base);
        else ::operator delete(r.base, std::align_val_t(kAlign));
    }
    regions_.clear();
}

void HostStore::grow(int32_t at_least) {
    int32_t count = std::max(next_region_chunks_, std::max(at_least, 1));
    size_t bytes = (size_t(count) * chunk_bytes_ + page_bytes_ - 1) / page_bytes_ * page_bytes_;
    if (max_bytes_ > 0 && region_bytes_ + bytes > max_bytes_) {
        // The cap: a smaller region if enough of one fits, else the store is full.
        const size_t room = max_bytes_ > region_bytes_ ? (max_bytes_ - region_bytes_) / page_bytes_ * page_bytes_ : 0;
        if (room / chunk_bytes_ < size_t(std::max(at_least, 1)))
            throw HostStoreFull("host store full: max_host_bytes=" + std::to_string(max_bytes_) + " holds " +
                                std::to_string(capacity_) + " paged-out chunks of " + std::to_string(chunk_bytes_) +
                                " bytes; raise max_host_bytes, use a larger pool or a shorter context");
        bytes = room;
    }
    count = int32_t(bytes / chunk_bytes_);  // the page rounding's slack holds whole chunks too
    uint8_t *base = nullptr;
    if (backing_ == Backing::FILE) {
        // Blocks on disk first: a full disk is ENOSPC here, not SIGBUS on a later write
        // through the mapping.  Offsets are multiples of the page size (mmap needs them).
        const int e = ::posix_fallocate(fd_, off_t(file_bytes_), off_t(bytes));
        if (e != 0) {
            if (::ftruncate(fd_, off_t(file_bytes_)) != 0) { /* the size is only a hint now */ }
            throw std::runtime_error("host store: cannot grow " + path_ + " by " + std::to_string(bytes) +
                                     " bytes: " + std::strerror(e));
        }
        void *p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, off_t(file_bytes_));
        if (p == MAP_FAILED) {
            const int me = errno;
            if (::ftruncate(fd_, off_t(file_bytes_)) != 0) { /* as above */ }
            throw std::runtime_error("host store: mmap of " + path_ + " failed: " + std::strerror(me));
        }
        base = static_cast<uint8_t *>(p);
    } else if (allocator_.alloc) {
        base = static_cast<uint8_t *>(allocator_.alloc(bytes));
        if (!base) throw std::bad_alloc();
    } else {
        base = static_cast<uint8_t *>(::operator new(bytes, std::align_val_t(kAlign)));
    }
    try {
        regions_.push_back({base, capacity_, count, bytes, file_bytes_});
        acquired_.resize(size_t(capacity_ + count), 0);
        free_.reserve(free_.size() + size_t(count));
    } catch (...) {
        if (!regions_.empty() && regions_.back().base == base) regions_.pop_back();
        if (backing_ == Backing::FILE) ::munmap(base, bytes);
        else if (allocator_.free) allocator_.free(base);
        else ::operator delete(base, std::align_val_t(kAlign));
        throw;
    }
    if (backing_ == Backing::FILE) file_bytes_ += bytes;
    region_bytes_ += bytes;
    // Below the buffers already free (those go first, as if the region were made when
    // the store ran out), in reverse so the new ones are handed out in ascending order.
    std::vector<int32_t> fresh(static_cast<size_t>(count));
    for (int32_t i = 0; i < count; ++i) fresh[size_t(i)] = capacity_ + count - 1 - i;
    free_.insert(free_.begin(), fresh.begin(), fresh.end());
    capacity_ += count;
    next_region_chunks_ = capacity_;  // geometric growth: few regions
}

int32_t HostStore::acquire() {
    if (free_.empty()) grow(1);
    const int32_t h = free_.back();
    free_.pop_back();
    acquired_[h] = 1;
    ++in_use_;
    return h;
}

void HostStore::reserve(int32_t n) {
    if (n > int32_t(free_.size())) grow(n - int32_t(free_.size()));
}

void HostStore::release(int32_t h) {
    // precondition: h is acquired
    assert(is_acquired(h));
    acquired_[h] = 0;
    free_.push_back(h);
    --in_use_;
}

void HostStore::clear() {
    free_.clear();
    for (int32_t i = capacity_ - 1; i >= 0; --i) free_.push_back(i);
    std::fill(acquired_.begin(), acquired_.end(), 0);
    in_use_ = 0;
}

void HostStore::release_memory() {
    free_regions();
    free_.clear();
    acquired_.clear();
    capacity_ = 0;
    in_use_ = 0;
    region_bytes_ = 0;
    next_region_chunks_ = first_region_chunks_;
    if (fd_ >= 0 && file_bytes_ > 0) {
        if (::ftruncate(fd_, 0) != 0) { /* the blocks stay allocated until close */ }
    }
    file_bytes_ = 0;
}

uint8_t *HostStore::ptr(int32_t h) {
    assert(h >= 0 && h < capacity_);
    // Regions are few (geometric growth), so a linear scan is cheap.
    for (auto &r : regions_)
        if (h < r.first + r.count) return r.base + size_t(h - r.first) * chunk_bytes_;
    return nullptr;
}

const uint8_t *HostStore::ptr(int32_t h) const { return const_cast<HostStore *>(this)->ptr(h); }

HostStore::Backing parse_host_backing(const std::string &host, const std::string &path) {
    if (host == "ram") return HostStore::Backing::RAM;
    if (host == "file" || host == "mmap") {
        if (path.empty()) throw std::invalid_argument("host='file' needs host_path= (a file to create for the store)");
        return HostStore::Backing::FILE;
    }
    throw std::invalid_argument("host must be 'ram' or 'file', got '" + host + "'");
}

}  // namespace kvflash
