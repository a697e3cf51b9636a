#include "kvflash/host_store.h"

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

HostStore::HostStore(size_t chunk_bytes, Backing backing, std::string path,
                     int32_t first_region_chunks, HostAllocator allocator)
    : chunk_bytes_((chunk_bytes + kAlign - 1) / kAlign * kAlign), backing_(backing),
      path_(std::move(path)), next_region_chunks_(first_region_chunks > 0 ? first_region_chunks : 16),
      allocator_(allocator) {
    if (chunk_bytes == 0) throw std::invalid_argument("host store: chunk_bytes must be > 0");
    if (backing_ == Backing::FILE) {
        if (path_.empty()) throw std::invalid_argument("host store: a file backing needs a path");
        fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd_ < 0)
            throw std::runtime_error("host store: cannot create " + path_ + ": " + std::strerror(errno));
    }
}

HostStore::~HostStore() {
    for (auto &r : regions_) {
        if (backing_ == Backing::FILE) ::munmap(r.base, r.bytes);
        else if (allocator_.free) allocator_.free(r.base);
        else ::operator delete(r.base, std::align_val_t(kAlign));
    }
    if (fd_ >= 0) {
        ::close(fd_);
        ::unlink(path_.c_str());
    }
}

void HostStore::grow() {
    const int32_t count = next_region_chunks_;
    const size_t bytes = size_t(count) * chunk_bytes_;
    uint8_t *base = nullptr;
    if (backing_ == Backing::FILE) {
        if (::ftruncate(fd_, off_t(file_bytes_ + bytes)) != 0)
            throw std::runtime_error("host store: cannot grow " + path_ + ": " + std::strerror(errno));
        void *p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, off_t(file_bytes_));
        if (p == MAP_FAILED)
            throw std::runtime_error("host store: mmap of " + path_ + " failed: " + std::strerror(errno));
        base = static_cast<uint8_t *>(p);
        file_bytes_ += bytes;
    } else if (allocator_.alloc) {
        base = static_cast<uint8_t *>(allocator_.alloc(bytes));
        if (!base) throw std::bad_alloc();
    } else {
        base = static_cast<uint8_t *>(::operator new(bytes, std::align_val_t(kAlign)));
    }
    regions_.push_back({base, capacity_, count, bytes});
    acquired_.resize(size_t(capacity_ + count), 0);
    // Push in reverse so buffers are handed out in ascending order.
    for (int32_t i = count - 1; i >= 0; --i) free_.push_back(capacity_ + i);
    capacity_ += count;
    next_region_chunks_ = capacity_;  // geometric growth: few regions
}

int32_t HostStore::acquire() {
    if (free_.empty()) grow();
    const int32_t h = free_.back();
    free_.pop_back();
    acquired_[h] = 1;
    ++in_use_;
    return h;
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
