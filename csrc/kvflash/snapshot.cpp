#include "kvflash/snapshot.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include <map>
#include <mutex>
#include <tuple>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf.h"
#include "kvflash/limits.h"

#ifndef KVFLASH_VERSION_STRING
#define KVFLASH_VERSION_STRING "unknown"
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "snapshots are written in host order: little-endian only");

namespace kvflash {

namespace {

constexpr char kMagic[8] = {'K', 'V', 'F', 'L', 'S', 'N', 'A', 'P'};
constexpr int kSections = 12;
constexpr const char *kTags[kSections] = {"HEAD", "PAGR", "POOL", "HOST", "RING", "QCAP",
                                          "SUMM", "TOKS", "LOGT", "SAMP", "APPS", "RECR"};
enum { HEAD, PAGR, POOL, HOST, RING, QCAP, SUMM, TOKS, LOGT, SAMP, APPS, RECR };
// A format's sections are a prefix of kTags: version 2 ends at APPS.
int sections_of(uint32_t version) { return version >= 3 ? kSections : RECR; }
constexpr size_t kPreamble = 16, kSectionHeader = 16;

std::string os_error(const std::string &what, int e) { return "snapshot: " + what + ": " + std::strerror(e); }

// Small sections are built in memory, then written whole.
struct Buf {
    std::vector<uint8_t> b;
    void bytes(const void *p, size_t n) {
        const auto *c = static_cast<const uint8_t *>(p);
        b.insert(b.end(), c, c + n);
    }
    template <class T> void put(T v) {
        static_assert(std::is_trivially_copyable<T>::value, "raw values only");
        bytes(&v, sizeof v);
    }
    void str(const std::string &s) {
        put<uint32_t>(uint32_t(s.size()));
        bytes(s.data(), s.size());
    }
    template <class T> void vec(const std::vector<T> &v) {
        put<uint64_t>(v.size());
        bytes(v.data(), v.size() * sizeof(T));
    }
};

// Reads one section's payload; every overrun is a SnapshotError naming the section.
struct Cursor {
    const uint8_t *p;
    size_t n, at = 0;
    const char *tag;
    const std::string *where = nullptr;  // "snapshot PATH"
    [[noreturn]] void bad(const std::string &why) const {
        throw SnapshotError((where ? *where : std::string("snapshot")) + ": section " + tag + " is malformed: " + why);
    }
    void need(size_t k) const {
        if (n - at < k) bad("it ends early");
    }
    template <class T> T get() {
        need(sizeof(T));
        T v;
        std::memcpy(&v, p + at, sizeof v);
        at += sizeof v;
        return v;
    }
    std::string str(size_t max) {
        const uint32_t len = get<uint32_t>();
        if (len > max) bad("a string of " + std::to_string(len) + " bytes");
        need(len);
        std::string s(reinterpret_cast<const char *>(p + at), len);
        at += len;
        return s;
    }
    template <class T> std::vector<T> vec() {
        const uint64_t k = get<uint64_t>();
        if (k > (n - at) / sizeof(T)) bad("an array longer than the section");
        std::vector<T> v(static_cast<size_t>(k));
        if (k > 0) std::memcpy(v.data(), p + at, size_t(k) * sizeof(T));  // (an empty vector's data() may be null)
        at += size_t(k) * sizeof(T);
        return v;
    }
    template <class T> std::vector<T> vec(size_t expect, const char *what) {
        std::vector<T> v = vec<T>();
        if (v.size() != expect) bad(std::string(what) + " has " + std::to_string(v.size()) + " entries, expected " +
                                    std::to_string(expect));
        return v;
    }
    const uint8_t *raw(size_t k) {
        need(k);
        const uint8_t *r = p + at;
        at += k;
        return r;
    }
    void done() const {
        if (at != n) bad(std::to_string(n - at) + " bytes past its end");
    }
};

// The temporary file a save writes, one section at a time: header, payload (streamed,
// checksummed as it goes), then the header's checksum and length patched in.
class FileOut {
public:
    FileOut(int fd, std::string name) : fd_(fd), name_(std::move(name)) {}
    void raw(const void *p, size_t n) {
        const auto *c = static_cast<const uint8_t *>(p);
        while (n > 0) {
            const ssize_t w = ::write(fd_, c, n);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) throw std::runtime_error(os_error("cannot write " + name_, w < 0 ? errno : EIO));
            c += w;
            n -= size_t(w);
            off_ += w;
        }
    }
    void begin(int section) {
        at_ = off_;
        uint8_t h[kSectionHeader] = {};
        std::memcpy(h, kTags[section], 4);
        raw(h, sizeof h);
        crc_ = 0;
        len_ = 0;
    }
    void put(const void *p, size_t n) {
        crc_ = crc32(static_cast<const uint8_t *>(p), n, crc_);
        len_ += n;
        raw(p, n);
    }
    void end() {
        uint8_t h[12];
        std::memcpy(h, &crc_, 4);
        std::memcpy(h + 4, &len_, 8);
        if (::pwrite(fd_, h, sizeof h, at_ + 4) != ssize_t(sizeof h))
            throw std::runtime_error(os_error("cannot write " + name_, errno ? errno : EIO));
    }
    void section(int s, const Buf &b) {
        begin(s);
        put(b.b.data(), b.b.size());
        end();
    }

private:
    int fd_;
    std::string name_;
    off_t off_ = 0, at_ = 0;
    uint32_t crc_ = 0;
    uint64_t len_ = 0;
};

uint64_t fnv1a(const uint8_t *p, size_t n, uint64_t h) {
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

// An open file, closed on every path out.
struct Fd {
    int fd = -1;
    explicit Fd(int f) : fd(f) {}
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
    Fd(const Fd &) = delete;
    Fd &operator=(const Fd &) = delete;
};

// Reads exactly n bytes at off; false when the file ends first (errno 0), or errno on a read error.
bool pread_all(int fd, void *dst, size_t n, uint64_t off, int *err) {
    auto *d = static_cast<uint8_t *>(dst);
    *err = 0;
    while (n > 0) {
        const ssize_t r = ::pread(fd, d, n, off_t(off));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) *err = errno;
        if (r <= 0) return false;
        d += r;
        n -= size_t(r);
        off += uint64_t(r);
    }
    return true;
}

struct FileId {
    std::string path;
    uint64_t dev, ino, size;
    int64_t mtime_s, mtime_ns;
    bool operator<(const FileId &o) const {
        return std::tie(path, dev, ino, size, mtime_s, mtime_ns) <
               std::tie(o.path, o.dev, o.ino, o.size, o.mtime_s, o.mtime_ns);
    }
};

uint64_t fingerprint_of(const std::string &path, uint64_t *bytes_out) {
    const Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (f.fd < 0) throw std::runtime_error(os_error("cannot read the model file " + path, errno));
    struct stat st {};
    if (::fstat(f.fd, &st) != 0) throw std::runtime_error(os_error("cannot stat " + path, errno));
    const uint64_t size = uint64_t(st.st_size);
    if (bytes_out) *bytes_out = size;
    // A file unchanged since it was fingerprinted (same inode, size and mtime) is not read again.
    static std::mutex mu;
    static std::map<FileId, uint64_t> known;
    const FileId id{path, uint64_t(st.st_dev), uint64_t(st.st_ino), size, int64_t(st.st_mtim.tv_sec),
                    int64_t(st.st_mtim.tv_nsec)};
    {
        std::lock_guard<std::mutex> lock(mu);
        auto it = known.find(id);
        if (it != known.end()) return it->second;
    }
    // Where the tensor data starts and where each tensor lies, from ggml's parser (metadata only).
    gguf_init_params gp{};
    gp.no_alloc = true;
    gp.ctx = nullptr;
    gguf_context *g = gguf_init_from_file(path.c_str(), gp);
    if (!g) throw std::invalid_argument("snapshot: cannot fingerprint " + path + ": ggml does not read it as a GGUF file");
    const uint64_t data = gguf_get_data_offset(g);
    std::vector<std::pair<uint64_t, uint64_t>> spans;  // (offset, length), in file order of the table
    spans.push_back({0, std::min(data, size)});        // header, metadata, tensor table, padding
    constexpr uint64_t K4 = 4096;
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        const uint64_t off = data + gguf_get_tensor_offset(g, i), n = gguf_get_tensor_size(g, i);
        if (off >= size) continue;
        const uint64_t len = std::min(n, size - off);
        if (len <= 3 * K4) {
            spans.push_back({off, len});
        } else {
            spans.push_back({off, K4});
            spans.push_back({off + len / 2 - K4 / 2, K4});
            spans.push_back({off + len - K4, K4});
        }
    }
    gguf_free(g);
    uint64_t h = fnv1a(reinterpret_cast<const uint8_t *>(&size), sizeof size, 0xcbf29ce484222325ull);
    constexpr uint64_t MiB = 1 << 20;
    std::vector<uint8_t> buf(MiB);
    for (auto [off, len] : spans) {
        h = fnv1a(reinterpret_cast<const uint8_t *>(&off), sizeof off, h);
        while (len > 0) {
            const size_t k = size_t(std::min<uint64_t>(len, MiB));
            int e = 0;
            if (!pread_all(f.fd, buf.data(), k, off, &e))
                throw std::runtime_error(os_error("cannot read the model file " + path, e ? e : EIO));
            h = fnv1a(buf.data(), k, h);
            off += k;
            len -= k;
        }
    }
    std::lock_guard<std::mutex> lock(mu);
    known[id] = h;
    return h;
}

std::string human(uint64_t fp) {
    char s[17];
    std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(fp));
    return s;
}

constexpr uint64_t kMaxHeadBytes = 4ull << 20;  // HEAD: 65536 paged and ring layers, at most
constexpr uint32_t kMaxLayers = 65536;
constexpr uint64_t kMaxRowBytes = 1ull << 30;    // one token's K (or V) row of one layer
constexpr uint64_t kMaxRingBytes = 1ull << 40;   // one sliding-window layer's K (or V)

// HEAD's payload.
Buf head_payload(const SnapshotHeader &h) {
    Buf b;
    b.put(h.fingerprint); b.put(h.model_bytes);
    b.str(h.kvflash_version); b.str(h.arch); b.str(h.kv_type);
    for (int32_t v : {h.n_layer, h.eval_layers, h.chunk_tokens, h.pool_tokens, h.sink_chunks, h.tail_window_chunks,
                      h.swa_tokens, h.n_swa_layers, h.capture_queries})
        b.put(v);
    b.put(h.max_ctx); b.put(h.n_past); b.put(h.chunk_bytes); b.put(h.full_cache); b.put(h.summaries);
    b.put(h.n_vocab); b.put(h.query_floats); b.put(h.summary_floats);
    b.put<uint32_t>(uint32_t(h.paged_layers.size()));
    for (size_t i = 0; i < h.paged_layers.size(); ++i) {
        b.put(h.paged_layers[i]); b.put(h.row_bytes_k[i]); b.put(h.row_bytes_v[i]);
    }
    b.put<uint32_t>(uint32_t(h.ring_bytes_k.size()));
    for (size_t i = 0; i < h.ring_bytes_k.size(); ++i) {
        b.put(h.ring_bytes_k[i]); b.put(h.ring_bytes_v[i]);
    }
    if (h.version >= 3) {
        b.put(h.recurrent_layers); b.put(h.recurrent_floats); b.put(h.recurrent_checkpoints);
    }
    return b;
}

// HEAD parsed, and every field held to its range and to the others (a header that passes
// names sizes that fit 64 bits; section_limits computes with them).
SnapshotHeader parse_head(Cursor c, uint32_t version) {
    SnapshotHeader h;
    h.version = version;
    h.fingerprint = c.get<uint64_t>();
    h.model_bytes = c.get<uint64_t>();
    h.kvflash_version = c.str(64);
    h.arch = c.str(64);
    h.kv_type = c.str(16);
    for (int32_t *v : {&h.n_layer, &h.eval_layers, &h.chunk_tokens, &h.pool_tokens, &h.sink_chunks,
                       &h.tail_window_chunks, &h.swa_tokens, &h.n_swa_layers, &h.capture_queries})
        *v = c.get<int32_t>();
    h.max_ctx = c.get<int64_t>();
    h.n_past = c.get<int64_t>();
    h.chunk_bytes = c.get<uint64_t>();
    h.full_cache = c.get<uint8_t>();
    h.summaries = c.get<uint8_t>();
    h.n_vocab = c.get<int32_t>();
    h.query_floats = c.get<uint64_t>();
    h.summary_floats = c.get<uint64_t>();
    const uint32_t nl = c.get<uint32_t>();
    if (nl == 0 || nl > kMaxLayers) c.bad(std::to_string(nl) + " paged layers");
    for (uint32_t i = 0; i < nl; ++i) {
        h.paged_layers.push_back(c.get<int32_t>());
        h.row_bytes_k.push_back(c.get<uint64_t>());
        h.row_bytes_v.push_back(c.get<uint64_t>());
    }
    const uint32_t nr = c.get<uint32_t>();
    if (int64_t(nr) != int64_t(h.n_swa_layers)) c.bad("ring layers disagree with the header");
    for (uint32_t i = 0; i < nr; ++i) {
        h.ring_bytes_k.push_back(c.get<uint64_t>());
        h.ring_bytes_v.push_back(c.get<uint64_t>());
    }
    if (version >= 3) {
        h.recurrent_layers = c.get<int32_t>();
        h.recurrent_floats = c.get<uint64_t>();
        h.recurrent_checkpoints = c.get<int32_t>();
    }
    c.done();
    if (h.chunk_tokens <= 0 || h.chunk_tokens > 4096) c.bad("chunk_tokens " + std::to_string(h.chunk_tokens));
    if (h.pool_tokens <= 0 || h.pool_tokens % h.chunk_tokens != 0) c.bad("pool_tokens " + std::to_string(h.pool_tokens));
    if (h.max_ctx < 1 || h.max_ctx > kMaxContext) c.bad("max_ctx " + std::to_string(h.max_ctx));
    if (h.n_past < 0 || h.n_past > h.max_ctx) c.bad("n_past " + std::to_string(h.n_past));
    if (h.sink_chunks < 0 || h.tail_window_chunks < 0 || h.swa_tokens < 0 || h.n_swa_layers < 0 || h.eval_layers < 0)
        c.bad("a negative count");
    if (h.n_layer <= 0 || h.n_layer > int32_t(kMaxLayers)) c.bad("n_layer " + std::to_string(h.n_layer));
    if (h.capture_queries < 0 || h.capture_queries > 4096) c.bad("capture_queries " + std::to_string(h.capture_queries));
    if (h.full_cache > 1 || h.summaries > 1) c.bad("a flag that is not 0 or 1");
    if (h.n_vocab <= 0) c.bad("n_vocab " + std::to_string(h.n_vocab));
    if (h.swa_tokens > (1 << 30)) c.bad("swa_tokens " + std::to_string(h.swa_tokens));
    if (h.query_floats > (uint64_t(1) << 32) || h.summary_floats > (uint64_t(1) << 32)) c.bad("a row of over 2^32 floats");
    uint64_t row = 0;  // one token's K and V over every paged layer
    for (uint32_t i = 0; i < nl; ++i) {
        if (h.paged_layers[i] < 0 || h.paged_layers[i] >= h.n_layer) c.bad("a paged layer outside the model");
        if (h.row_bytes_k[i] == 0 || h.row_bytes_k[i] > kMaxRowBytes || h.row_bytes_v[i] == 0 ||
            h.row_bytes_v[i] > kMaxRowBytes)
            c.bad("a paged layer's row of " + std::to_string(h.row_bytes_k[i]) + " / " + std::to_string(h.row_bytes_v[i]) +
                  " bytes");
        row += h.row_bytes_k[i] + h.row_bytes_v[i];  // < 2^48: no overflow
    }
    if (row * uint64_t(h.chunk_tokens) != h.chunk_bytes) c.bad("chunk_bytes disagrees with its row sizes");
    for (uint32_t i = 0; i < nr; ++i)
        if (h.ring_bytes_k[i] > kMaxRingBytes || h.ring_bytes_v[i] > kMaxRingBytes) c.bad("a ring layer over 2^40 bytes");
    if (h.recurrent_layers < 0 || h.recurrent_layers > h.n_layer)
        c.bad(std::to_string(h.recurrent_layers) + " recurrent layers");
    if ((h.recurrent_layers == 0) != (h.recurrent_floats == 0) || h.recurrent_floats > (uint64_t(1) << 36))
        c.bad("a recurrent state of " + std::to_string(h.recurrent_floats) + " floats");
    if (h.recurrent_checkpoints < 0 || h.recurrent_checkpoints > 4096)
        c.bad(std::to_string(h.recurrent_checkpoints) + " recurrent checkpoints");
    return h;
}

// The most bytes each section's payload can hold for h's geometry, and that TOKS holds exactly.
// n_past: the history's length (max_ctx for the largest file of the geometry).
struct Limits {
    uint64_t max[kSections];
};

Limits section_limits(const SnapshotHeader &h, int64_t n_past) {
    using u128 = unsigned __int128;
    const u128 C = u128(h.chunk_tokens), nc = (u128(h.max_ctx) + C - 1) / C, nb = u128(h.pool_tokens) / C;
    const u128 words = (C + 63) / 64, row = u128(h.chunk_bytes) / C;
    u128 m[kSections];
    m[HEAD] = head_payload(h).b.size();
    // n_chunks .. has_scores, six counters, then nine arrays each with its u64 length (free list: up to nb)
    m[PAGR] = 29 + 48 + 9 * 8 + nc * (4 + 1 + 4 + 1 + 8 + 4) + nc * words * 8 + nb * 4 + nb * 4;
    m[POOL] = 4 + nb * C * row;
    m[HOST] = nc * u128(h.chunk_bytes);
    u128 ring = 4 + 8 + (h.n_swa_layers ? u128(h.swa_tokens) * 8 : 0);
    for (size_t i = 0; i < h.ring_bytes_k.size(); ++i) ring += 16 + u128(h.ring_bytes_k[i]) + h.ring_bytes_v[i];
    m[RING] = ring;
    m[QCAP] = 4 + 8 + u128(h.capture_queries) * h.query_floats * 4;
    m[SUMM] = 1 + (h.summaries ? 4 * 8 + nc + 3 * nc * u128(h.summary_floats) * 4 : 0);
    m[TOKS] = 8 + u128(n_past) * 4;
    m[LOGT] = 8 + u128(h.n_vocab) * 4;
    m[SAMP] = 4 + kSnapshotMaxSamplerBytes;
    m[APPS] = kSnapshotMaxAppBytes;
    // the host checkpoints and the state at n_past, each a position and the state's floats
    m[RECR] = h.version >= 3 ? 4 + (u128(h.recurrent_layers ? h.recurrent_checkpoints : 0) + 1) *
                                       (8 + u128(h.recurrent_floats) * 4)
                             : 0;
    Limits l;
    for (int i = 0; i < kSections; ++i) {
        if (m[i] > (u128(1) << 62))
            throw SnapshotError(std::string("snapshot: its header's geometry is too large for a file (section ") +
                                kTags[i] + ")");
        l.max[i] = uint64_t(m[i]);
    }
    return l;
}

// Every section's length within what the header allows (before any of them is read).
void check_limits(const SnapshotHeader &h, const uint64_t *len, const std::string &where) {
    const Limits l = section_limits(h, h.n_past);
    for (int i = 0; i < sections_of(h.version); ++i) {
        const bool exact = i == TOKS;
        if (exact ? len[i] != l.max[i] : len[i] > l.max[i])
            throw SnapshotError(where + ": section " + kTags[i] + " holds " + std::to_string(len[i]) + " bytes; its header's "
                                "geometry allows " + (exact ? "exactly " : "at most ") + std::to_string(l.max[i]));
    }
}

// The file, open, and its preamble and section table (small reads only).
struct Table {
    uint64_t size = 0, off[kSections] = {}, len[kSections] = {};
    uint32_t crc[kSections] = {};
    uint32_t version = 0;
    int n_sec = 0;
};

Table scan(int fd, uint64_t size, const std::string &where) {
    Table t;
    t.size = size;
    uint8_t pre[kPreamble];
    const size_t np = size_t(std::min<uint64_t>(size, kPreamble));
    int e = 0;
    if (!pread_all(fd, pre, np, 0, &e)) {
        if (e) throw std::runtime_error(os_error("cannot read " + where.substr(9), e));
        throw SnapshotError(where + " is truncated: it ended while it was read");
    }
    if (np < sizeof kMagic || std::memcmp(pre, kMagic, sizeof kMagic) != 0)
        throw SnapshotError(where + " is not a kvflash snapshot (no KVFLSNAP magic)");
    if (np < kPreamble) throw SnapshotError(where + " is truncated: " + std::to_string(size) + " bytes");
    uint32_t version = 0, n_sec = 0;
    std::memcpy(&version, pre + 8, 4);
    std::memcpy(&n_sec, pre + 12, 4);
    if (version < kSnapshotOldestVersion || version > kSnapshotVersion)
        throw SnapshotError(where + " has format version " + std::to_string(version) + "; this kvflash reads versions " +
                            std::to_string(kSnapshotOldestVersion) + " to " + std::to_string(kSnapshotVersion) +
                            " (it is kvflash " KVFLASH_VERSION_STRING "; " +
                            (version < kSnapshotOldestVersion
                                 ? std::string("an older kvflash wrote the file, with another model fingerprint: take "
                                               "the snapshot again with this one)")
                                 : std::string("a newer kvflash wrote the file)")));
    const int want_sec = sections_of(version);
    if (n_sec != uint32_t(want_sec))
        throw SnapshotError(where + " has " + std::to_string(n_sec) + " sections; format version " +
                            std::to_string(version) + " has " + std::to_string(want_sec));
    t.version = version;
    t.n_sec = want_sec;
    uint64_t at = kPreamble;
    for (int i = 0; i < want_sec; ++i) {
        uint8_t sh[kSectionHeader];
        if (size - at < kSectionHeader)
            throw SnapshotError(where + " is truncated: it ends at byte " + std::to_string(size) + ", before section " +
                                kTags[i]);
        if (!pread_all(fd, sh, sizeof sh, at, &e)) {
            if (e) throw std::runtime_error(os_error("cannot read " + where.substr(9), e));
            throw SnapshotError(where + " is truncated: it ended while it was read");
        }
        if (std::memcmp(sh, kTags[i], 4) != 0)
            throw SnapshotError(where + " is corrupted: section " + std::to_string(i) + " should be " + kTags[i]);
        uint64_t n = 0;
        std::memcpy(&t.crc[i], sh + 4, 4);
        std::memcpy(&n, sh + 8, 8);
        at += kSectionHeader;
        if (n > size - at)
            throw SnapshotError(where + " is truncated: section " + kTags[i] + " holds " + std::to_string(n) +
                                " bytes, the file has " + std::to_string(size - at) + " left");
        t.off[i] = at;
        t.len[i] = n;
        at += n;
    }
    if (at != size) throw SnapshotError(where + " has " + std::to_string(size - at) + " bytes after its last section");
    if (t.len[HEAD] > kMaxHeadBytes)
        throw SnapshotError(where + ": section HEAD holds " + std::to_string(t.len[HEAD]) + " bytes, more than a header "
                            "can (" + std::to_string(kMaxHeadBytes) + ")");
    return t;
}

// One section's payload read and its checksum checked (its length already held to a limit).
std::vector<uint8_t> read_section(int fd, const Table &t, int i, const std::string &where) {
    std::vector<uint8_t> p(size_t(t.len[i]));
    int e = 0;
    if (!pread_all(fd, p.data(), p.size(), t.off[i], &e)) {
        if (e) throw std::runtime_error(os_error("cannot read " + where.substr(9), e));
        throw SnapshotError(where + " is truncated: it ended while it was read");
    }
    if (crc32(p.data(), p.size()) != t.crc[i])
        throw SnapshotError(where + " is corrupted: the checksum of section " + kTags[i] + " does not match");
    return p;
}

// The file opened for reading: a regular file, its size.
int open_snapshot(const std::string &path, uint64_t *size) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error(os_error("cannot open " + path, errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        throw SnapshotError("snapshot: " + path + " is not a regular file");
    }
    *size = uint64_t(st.st_size);
    return fd;
}

// SnapshotError naming the first header field where the file (h) and the runtime (want) differ.
void compare_headers(const SnapshotHeader &h, const SnapshotHeader &want, const std::string &model_path) {
    auto differ = [](const std::string &what, const std::string &file, const std::string &here) {
        throw SnapshotError("snapshot does not fit this session: " + what + " differs (the file has " + file +
                            ", this session " + here + ")");
    };
    auto num = [&](const char *what, int64_t file, int64_t here) {
        if (file != here) differ(what, std::to_string(file), std::to_string(here));
    };
    if (h.arch != want.arch) differ("the architecture", h.arch, want.arch);
    if (h.fingerprint != want.fingerprint || h.model_bytes != want.model_bytes)
        throw SnapshotError("snapshot does not fit this session: it was taken with another model file (fingerprint " +
                            human(h.fingerprint) + ", " + std::to_string(h.model_bytes) + " bytes; " + model_path +
                            " is " + human(want.fingerprint) + ", " + std::to_string(want.model_bytes) + " bytes)");
    if (h.kv_type != want.kv_type) differ("kv_type", h.kv_type, want.kv_type);
    num("n_layer", h.n_layer, want.n_layer);
    num("eval_layers", h.eval_layers, want.eval_layers);
    num("chunk_tokens", h.chunk_tokens, want.chunk_tokens);
    num("the pool size (pool_tokens)", h.pool_tokens, want.pool_tokens);
    num("full_cache", h.full_cache, want.full_cache);
    num("sink_chunks", h.sink_chunks, want.sink_chunks);
    num("tail_window_chunks", h.tail_window_chunks, want.tail_window_chunks);
    num("max_ctx", h.max_ctx, want.max_ctx);
    num("the sliding-window ring (swa_tokens)", h.swa_tokens, want.swa_tokens);
    num("the sliding-window layers", h.n_swa_layers, want.n_swa_layers);
    num("capture_queries (the policy's query window)", h.capture_queries, want.capture_queries);
    num("chunk summaries (policy qk-bound / qk-mean)", h.summaries, want.summaries);
    num("the paged layers", int64_t(h.paged_layers.size()), int64_t(want.paged_layers.size()));
    for (size_t i = 0; i < h.paged_layers.size(); ++i) {
        num("a paged layer's index", h.paged_layers[i], want.paged_layers[i]);
        num("a paged layer's K row bytes", int64_t(h.row_bytes_k[i]), int64_t(want.row_bytes_k[i]));
        num("a paged layer's V row bytes", int64_t(h.row_bytes_v[i]), int64_t(want.row_bytes_v[i]));
    }
    num("chunk_bytes", int64_t(h.chunk_bytes), int64_t(want.chunk_bytes));
    for (size_t i = 0; i < h.ring_bytes_k.size(); ++i) {
        num("a ring layer's K bytes", int64_t(h.ring_bytes_k[i]), int64_t(want.ring_bytes_k[i]));
        num("a ring layer's V bytes", int64_t(h.ring_bytes_v[i]), int64_t(want.ring_bytes_v[i]));
    }
    if (h.recurrent_layers != want.recurrent_layers && h.version < 3)
        throw SnapshotError("snapshot does not fit this session: the file is format version " + std::to_string(h.version) +
                            ", which does not carry a recurrent state, and this model has " +
                            std::to_string(want.recurrent_layers) + " recurrent layers: take the snapshot again with "
                            "this kvflash");
    num("the recurrent layers", h.recurrent_layers, want.recurrent_layers);
    num("the recurrent state's size (floats)", int64_t(h.recurrent_floats), int64_t(want.recurrent_floats));
    num("the vocabulary (n_vocab)", h.n_vocab, want.n_vocab);
    num("a captured query's size", int64_t(h.query_floats), int64_t(want.query_floats));
    num("a chunk summary's size", int64_t(h.summary_floats), int64_t(want.summary_floats));
}

}  // namespace

uint32_t crc32(const uint8_t *data, size_t n, uint32_t crc) {
    // CRC-32 (reflected, 0xEDB88320) eight bytes a step: table k holds the CRC of a byte followed by k
    // zero bytes, so the eight lookups of one 64-bit word combine by xor (the byte-at-a-time loop was
    // half of a restore's time).
    static const auto tables = [] {
        std::vector<uint32_t> t(8 * 256);
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            t[i] = c;
        }
        for (uint32_t i = 0; i < 256; ++i)
            for (int k = 1; k < 8; ++k) t[k * 256 + i] = t[(k - 1) * 256 + i] >> 8 ^ t[t[(k - 1) * 256 + i] & 0xFF];
        return t;
    }();
    const uint32_t *T = tables.data();
    crc = ~crc;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint32_t lo, hi;
        std::memcpy(&lo, data + i, 4);   // little-endian words (the format's byte order)
        std::memcpy(&hi, data + i + 4, 4);
        lo ^= crc;
        crc = T[7 * 256 + (lo & 0xFF)] ^ T[6 * 256 + ((lo >> 8) & 0xFF)] ^ T[5 * 256 + ((lo >> 16) & 0xFF)] ^
              T[4 * 256 + (lo >> 24)] ^ T[3 * 256 + (hi & 0xFF)] ^ T[2 * 256 + ((hi >> 8) & 0xFF)] ^
              T[1 * 256 + ((hi >> 16) & 0xFF)] ^ T[hi >> 24];
    }
    for (; i < n; ++i) crc = T[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

uint64_t model_fingerprint(const std::string &path) { return fingerprint_of(path, nullptr); }

// What the sections beyond HEAD hold, parsed; the KV bytes stay in the file's buffer.
struct Snapshot::Body {
    std::vector<uint8_t> file;
    // PAGR
    int32_t n_chunks = 0, n_blocks = 0, words = 0;
    int64_t head = -1;
    uint64_t tick = 0;
    uint8_t has_scores = 0;
    int64_t page_outs = 0, page_ins = 0, clean_skips = 0, bytes_out = 0, bytes_in = 0, epoch = 0;
    std::vector<int32_t> block_of, n_written, chunk_of, free_blocks;
    std::vector<uint8_t> on_host, dirty;
    std::vector<uint64_t> last_use, written;
    std::vector<float> score;
    int32_t n_host = 0;
    // POOL, HOST, RING: offsets into file
    int32_t pool_blocks = 0;
    size_t pool_at = 0, host_at = 0;
    std::vector<int64_t> swa_pos;
    std::vector<uint64_t> ring_k_bytes, ring_v_bytes;
    std::vector<size_t> ring_at;  // per ring layer: K at ring_at[i], V right after
    // QCAP, SUMM
    int32_t n_captured = 0;
    std::vector<float> captured;
    uint8_t has_summ = 0;
    std::vector<uint8_t> ready;
    std::vector<float> smin, smax, smean;
    // RECR: the host checkpoints (ascending), then the state at n_past; none without recurrent layers
    std::vector<RecurrentState::HostCheckpoint> recr;
};

SnapshotHeader Snapshot::header_of(const Runtime &rt, const ChunkSummaries *summaries) {
    const Hparams &hp = rt.model().hparams();
    const RuntimeConfig &c = rt.config();
    const KVPool &pool = rt.pool();
    SnapshotHeader h;
    h.fingerprint = fingerprint_of(rt.model().path(), &h.model_bytes);
    h.arch = hp.arch;
    h.kv_type = c.kv_type;
    h.n_layer = hp.n_layer;
    h.eval_layers = c.eval_layers;
    h.chunk_tokens = rt.pager().config().chunk_tokens;
    h.pool_tokens = pool.pool_tokens();
    h.sink_chunks = rt.pager().config().sink_chunks;
    h.tail_window_chunks = rt.pager().config().tail_window_chunks;
    h.swa_tokens = (rt.ring() ? rt.ring()->tokens() : 0);
    h.n_swa_layers = (rt.ring() ? rt.ring()->n_layers() : 0);
    h.capture_queries = c.capture_queries;
    h.max_ctx = c.max_ctx;
    h.n_past = rt.n_past();
    h.chunk_bytes = pool.chunk_bytes();
    h.full_cache = rt.full_cache();
    h.summaries = summaries != nullptr;
    for (int32_t i = 0; i < pool.n_layers(); ++i) {
        h.paged_layers.push_back(pool.layer(i).layer);
        h.row_bytes_k.push_back(pool.k(i)->nb[1]);
        h.row_bytes_v.push_back(pool.v(i)->nb[1]);
    }
    h.kvflash_version = KVFLASH_VERSION_STRING;
    h.n_vocab = hp.n_vocab;
    h.query_floats = uint64_t(pool.n_layers()) * uint64_t(hp.n_head) * uint64_t(hp.head_dim_k);
    h.summary_floats = uint64_t(pool.n_layers()) * uint64_t(hp.n_embd_k());
    for (int32_t i = 0; rt.ring() && i < rt.ring()->n_layers(); ++i) {
        h.ring_bytes_k.push_back(ggml_nbytes(rt.ring()->k(int32_t(i))));
        h.ring_bytes_v.push_back(ggml_nbytes(rt.ring()->v(int32_t(i))));
    }
    if (const RecurrentState *r = rt.recurrent_state()) {
        h.recurrent_layers = r->n_layers();
        h.recurrent_floats = r->checkpoint_floats();
        h.recurrent_checkpoints = std::max<int32_t>(0, c.recurrent_checkpoints);
    }
    return h;
}

uint64_t Snapshot::max_file_bytes(const SnapshotHeader &h) {
    const Limits l = section_limits(h, h.max_ctx);
    const int n_sec = sections_of(h.version);
    uint64_t n = kPreamble + uint64_t(n_sec) * kSectionHeader;
    for (int i = 0; i < n_sec; ++i) n += l.max[i];  // each < 2^62: no overflow
    return n;
}

void Snapshot::save(const Runtime &rt, const ChunkSummaries *summaries, const SnapshotSession &s,
                    const std::string &path) {
    if (int64_t(s.tokens.size()) != rt.n_past())
        throw std::invalid_argument("snapshot: the token history has " + std::to_string(s.tokens.size()) +
                                    " tokens, the cache " + std::to_string(rt.n_past()));
    if (path.empty()) throw std::invalid_argument("snapshot: an empty path");
    if (s.app.size() > kSnapshotMaxAppBytes)
        throw std::invalid_argument("snapshot: the caller's state is " + std::to_string(s.app.size()) +
                                    " bytes; a snapshot holds at most " + std::to_string(kSnapshotMaxAppBytes));
    const std::string sampler_state = s.sampler.state();
    if (sampler_state.size() > kSnapshotMaxSamplerBytes)
        throw std::invalid_argument("snapshot: the sampler's state is " + std::to_string(sampler_state.size()) + " bytes");
    const SnapshotHeader h = header_of(rt, summaries);
    const Pager &pg = rt.pager();
    const KVPool &pool = rt.pool();
    rt.sync_for_host_read();  // queued page copies and kernels are done before the bytes are read

    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
    const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
    if (base.empty()) throw std::invalid_argument("snapshot: " + path + " names a directory, not a file");
    std::string tmp = dir + "." + base + ".tmp.XXXXXX";
    const int fd = ::mkstemp(tmp.data());
    if (fd < 0) throw std::runtime_error(os_error("cannot create a temporary file beside " + path, errno));
    bool fd_open = true;
    try {
        FileOut out(fd, tmp);
        Buf pre;
        pre.bytes(kMagic, sizeof kMagic);
        pre.put<uint32_t>(kSnapshotVersion);
        pre.put<uint32_t>(kSections);
        out.raw(pre.b.data(), pre.b.size());

        out.section(HEAD, head_payload(h));
        Buf b;

        b = Buf();
        b.put(pg.n_chunks_); b.put(pg.n_blocks_); b.put(pg.words_); b.put(pg.head_); b.put(pg.tick_);
        b.put<uint8_t>(pg.has_scores_);
        for (int64_t v : {pg.stats_.page_outs, pg.stats_.page_ins, pg.stats_.clean_skips, pg.stats_.bytes_out,
                          pg.stats_.bytes_in, pg.stats_.epoch})
            b.put(v);
        std::vector<uint8_t> on_host(size_t(pg.n_chunks_));
        for (int32_t c = 0; c < pg.n_chunks_; ++c) on_host[c] = pg.host_of_[c] >= 0;
        b.vec(pg.block_of_); b.vec(on_host); b.vec(pg.n_written_); b.vec(pg.dirty_); b.vec(pg.last_use_);
        b.vec(pg.score_); b.vec(pg.written_); b.vec(pg.chunk_of_); b.vec(pg.free_blocks_);
        out.section(PAGR, b);

        // The pool's rows up to what attention reads now (the occupied prefix, rounded to 256 slots).
        const int32_t C = h.chunk_tokens, P = pool.pool_tokens();
        const int32_t n_kv = std::min(P, std::max(256, (pg.used_extent() + 255) / 256 * 256));
        const uint32_t nb = uint32_t((n_kv + C - 1) / C);
        out.begin(POOL);
        out.put(&nb, sizeof nb);
        std::vector<uint8_t> rows;
        for (int32_t i = 0; i < pool.n_layers(); ++i)
            for (ggml_tensor *t : {pool.k(i), pool.v(i)}) {
                rows.resize(size_t(nb) * C * t->nb[1]);
                ggml_backend_tensor_get(t, rows.data(), 0, rows.size());
                out.put(rows.data(), rows.size());
            }
        out.end();

        out.begin(HOST);  // chunks with a host copy, ascending; a copy is chunk_bytes raw bytes
        for (int32_t c = 0; c < pg.n_chunks_; ++c)
            if (pg.host_of_[c] >= 0) out.put(pg.host_->ptr(pg.host_of_[c]), pool.chunk_bytes());
        out.end();

        out.begin(RING);
        const uint32_t rl = uint32_t(rt.ring() ? rt.ring()->n_layers() : 0);
        out.put(&rl, sizeof rl);
        const uint64_t np = rt.ring() ? rt.ring()->positions().size() : 0;
        out.put(&np, sizeof np);
        if (np) out.put(rt.ring()->positions().data(), np * sizeof(int64_t));
        for (uint32_t i = 0; i < rl; ++i)
            for (ggml_tensor *t : {rt.ring()->k(int32_t(i)), rt.ring()->v(int32_t(i))}) {
                const uint64_t n = ggml_nbytes(t);
                out.put(&n, sizeof n);
                rows.resize(size_t(n));
                ggml_backend_tensor_get(t, rows.data(), 0, rows.size());
                out.put(rows.data(), rows.size());
            }
        out.end();

        b = Buf();
        b.put(rt.n_captured_);
        b.vec(rt.captured_q_);
        out.section(QCAP, b);

        b = Buf();
        b.put<uint8_t>(summaries != nullptr);
        if (summaries) {
            b.vec(summaries->ready_); b.vec(summaries->min_); b.vec(summaries->max_); b.vec(summaries->mean_);
        }
        out.section(SUMM, b);

        b = Buf(); b.vec(s.tokens); out.section(TOKS, b);
        b = Buf(); b.vec(s.logits); out.section(LOGT, b);
        b = Buf(); b.str(sampler_state); out.section(SAMP, b);
        b = Buf(); b.bytes(s.app.data(), s.app.size()); out.section(APPS, b);

        out.begin(RECR);   // the host checkpoints the runtime keeps, then the state at n_past
        const RecurrentState *r = rt.recurrent_state();
        const uint32_t nr = r ? uint32_t(rt.checkpoints_.size() + 1) : 0;
        out.put(&nr, sizeof nr);
        if (r) {
            auto put_ck = [&](const RecurrentState::HostCheckpoint &ck) {
                out.put(&ck.pos, sizeof ck.pos);
                out.put(ck.data.data(), ck.data.size() * sizeof(float));
            };
            for (const auto &ck : rt.checkpoints_) put_ck(ck);
            put_ck(r->checkpoint());
        }
        out.end();

        if (::fsync(fd) != 0) throw std::runtime_error(os_error("cannot sync " + tmp, errno));
        fd_open = false;
        if (::close(fd) != 0) throw std::runtime_error(os_error("cannot close " + tmp, errno));
        if (::rename(tmp.c_str(), path.c_str()) != 0)
            throw std::runtime_error(os_error("cannot rename " + tmp + " to " + path, errno));
    } catch (...) {
        if (fd_open) ::close(fd);
        ::unlink(tmp.c_str());
        throw;
    }
    // The rename itself is durable once the directory is.
    const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        if (::fsync(dfd) != 0) { /* some filesystems refuse a directory fsync: the file is written */ }
        ::close(dfd);
    }
}

namespace {

// What peek and read do before anything the size of the file is allocated: the preamble and the
// section table (small reads), the file's size against the caps (the largest snapshot of fit's
// geometry, the caller's max_bytes), the header (a few KiB) and what it allows each section.
struct Opened {
    uint64_t size = 0;
    Table t;
    SnapshotHeader head;
};

Opened open_checked(int fd, uint64_t size, const std::string &where, const Runtime *fit,
                    const ChunkSummaries *summaries, uint64_t max_bytes) {
    Opened o;
    o.size = size;
    o.t = scan(fd, size, where);
    uint64_t cap = 0;
    std::string cap_is;
    if (fit) {
        cap = Snapshot::max_file_bytes(Snapshot::header_of(*fit, summaries));
        cap_is = "the largest snapshot of this session's geometry (" + std::to_string(cap) + " bytes: its pool, " +
                 "host store, ring and tables at max_ctx, with " + std::to_string(kSnapshotMaxAppBytes >> 20) +
                 " MiB for the caller's state and " + std::to_string(kSnapshotMaxSamplerBytes >> 20) +
                 " MiB for the sampler's)";
    }
    if (max_bytes > 0 && (cap == 0 || max_bytes < cap)) {
        cap = max_bytes;
        cap_is = "the cap of " + std::to_string(max_bytes) + " bytes (max_bytes)";
    }
    if (cap > 0 && size > cap) throw SnapshotError(where + " is " + std::to_string(size) + " bytes: more than " + cap_is);
    const std::vector<uint8_t> head = read_section(fd, o.t, HEAD, where);
    o.head = parse_head(Cursor{head.data(), head.size(), 0, kTags[HEAD], &where}, o.t.version);
    check_limits(o.head, o.t.len, where);
    return o;
}

}  // namespace

SnapshotPeek Snapshot::peek(const std::string &path, const Runtime *fit, const ChunkSummaries *summaries,
                            uint64_t max_bytes) {
    const std::string where = "snapshot " + path;
    uint64_t size = 0;
    const Fd f(open_snapshot(path, &size));
    Opened o = open_checked(f.fd, size, where, fit, summaries, max_bytes);
    SnapshotPeek p;
    p.header = std::move(o.head);
    const std::vector<uint8_t> app = read_section(f.fd, o.t, APPS, where);  // at most kSnapshotMaxAppBytes
    p.app.assign(app.begin(), app.end());
    p.file_bytes = size;
    return p;
}

Snapshot Snapshot::read(const std::string &path, const Runtime *fit, const ChunkSummaries *summaries,
                        uint64_t max_bytes) {
    const std::string where = "snapshot " + path;
    auto body = std::make_shared<Body>();
    Body &B = *body;
    uint32_t first_version = 0;
    {
        uint64_t size = 0;
        const Fd f(open_snapshot(path, &size));
        const Opened o = open_checked(f.fd, size, where, fit, summaries, max_bytes);
        first_version = o.t.version;
        if (fit) compare_headers(o.head, header_of(*fit, summaries), fit->model().path());
        // Everything below is checked again on the bytes read: the file may have changed since.
        B.file.resize(size_t(size));
        int e = 0;
        if (!pread_all(f.fd, B.file.data(), B.file.size(), 0, &e)) {
            if (e) throw std::runtime_error(os_error("cannot read " + path, e));
            throw SnapshotError(where + " is truncated: it ended while it was read");
        }
    }
    const std::vector<uint8_t> &f = B.file;
    if (f.size() < kPreamble || std::memcmp(f.data(), kMagic, sizeof kMagic) != 0)
        throw SnapshotError(where + " changed while it was read");
    uint32_t version = 0, n_sec = 0;
    std::memcpy(&version, f.data() + 8, 4);
    std::memcpy(&n_sec, f.data() + 12, 4);
    if (version != first_version || n_sec != uint32_t(sections_of(version)))
        throw SnapshotError(where + " changed while it was read");
    const int N = int(n_sec);
    size_t at = kPreamble;
    size_t off[kSections] = {}, len[kSections] = {};
    uint64_t len64[kSections] = {};
    for (int i = 0; i < N; ++i) {
        if (f.size() - at < kSectionHeader)
            throw SnapshotError(where + " is truncated: it ends at byte " + std::to_string(f.size()) + ", before section " +
                                kTags[i]);
        if (std::memcmp(f.data() + at, kTags[i], 4) != 0)
            throw SnapshotError(where + " is corrupted: section " + std::to_string(i) + " should be " + kTags[i]);
        uint32_t crc = 0;
        uint64_t n = 0;
        std::memcpy(&crc, f.data() + at + 4, 4);
        std::memcpy(&n, f.data() + at + 8, 8);
        at += kSectionHeader;
        if (n > f.size() - at)
            throw SnapshotError(where + " is truncated: section " + kTags[i] + " holds " + std::to_string(n) +
                                " bytes, the file has " + std::to_string(f.size() - at) + " left");
        if (crc32(f.data() + at, size_t(n)) != crc)
            throw SnapshotError(where + " is corrupted: the checksum of section " + kTags[i] + " does not match");
        off[i] = at;
        len[i] = size_t(n);
        len64[i] = n;
        at += size_t(n);
    }
    if (at != f.size())
        throw SnapshotError(where + " has " + std::to_string(f.size() - at) + " bytes after its last section");
    auto cur = [&](int i) { return Cursor{f.data() + off[i], len[i], 0, kTags[i], &where}; };

    Snapshot s;
    SnapshotHeader &h = s.head_;
    h = parse_head(cur(HEAD), version);
    check_limits(h, len64, where);
    if (fit) compare_headers(h, header_of(*fit, summaries), fit->model().path());
    const int32_t C = h.chunk_tokens;
    {
        Cursor c = cur(PAGR);
        B.n_chunks = c.get<int32_t>();
        B.n_blocks = c.get<int32_t>();
        B.words = c.get<int32_t>();
        B.head = c.get<int64_t>();
        B.tick = c.get<uint64_t>();
        B.has_scores = c.get<uint8_t>();
        for (int64_t *v : {&B.page_outs, &B.page_ins, &B.clean_skips, &B.bytes_out, &B.bytes_in, &B.epoch})
            *v = c.get<int64_t>();
        // The pager counts on from these (++tick, epoch + 1, bytes added): far from any overflow.
        constexpr uint64_t kMaxCount = uint64_t(1) << 62;
        if (B.tick > kMaxCount) c.bad("the pager's clock at " + std::to_string(B.tick));
        for (int64_t v : {B.page_outs, B.page_ins, B.clean_skips, B.bytes_out, B.bytes_in, B.epoch})
            if (v < 0 || uint64_t(v) > kMaxCount) c.bad("a counter at " + std::to_string(v));
        if (B.n_chunks != int32_t((h.max_ctx + C - 1) / C) || B.n_blocks != h.pool_tokens / C ||
            B.words != (C + 63) / 64)
            c.bad("its geometry disagrees with the header");
        const size_t nc = size_t(B.n_chunks), nb = size_t(B.n_blocks);
        B.block_of = c.vec<int32_t>(nc, "block_of");
        B.on_host = c.vec<uint8_t>(nc, "on_host");
        B.n_written = c.vec<int32_t>(nc, "n_written");
        B.dirty = c.vec<uint8_t>(nc, "dirty");
        B.last_use = c.vec<uint64_t>(nc, "last_use");
        B.score = c.vec<float>(nc, "score");
        B.written = c.vec<uint64_t>(nc * size_t(B.words), "written");
        B.chunk_of = c.vec<int32_t>(nb, "chunk_of");
        B.free_blocks = c.vec<int32_t>();
        c.done();
        // The pager's invariants (Pager::check_invariants), on the file's arrays: a file that
        // passes its checksums but not these is refused, never installed.
        std::vector<uint8_t> is_free(nb, 0);
        for (int32_t b : B.free_blocks) {
            if (b < 0 || b >= B.n_blocks || is_free[b]) c.bad("a bad free list");
            is_free[b] = 1;
        }
        for (size_t b = 0; b < nb; ++b) {
            const int32_t ch = B.chunk_of[b];
            if (ch < -1 || ch >= B.n_chunks || (ch < 0) != bool(is_free[b]) || (ch >= 0 && B.block_of[ch] != int32_t(b)))
                c.bad("block " + std::to_string(b) + " and its chunk disagree");
        }
        int64_t last = -1;
        for (int32_t ch = 0; ch < B.n_chunks; ++ch) {
            const int32_t b = B.block_of[ch];
            if (b < -1 || b >= B.n_blocks || (b >= 0 && B.chunk_of[b] != ch))
                c.bad("chunk " + std::to_string(ch) + " and its block disagree");
            int32_t pc = 0;
            for (int32_t w = 0; w < B.words; ++w) {
                const uint64_t bits = B.written[size_t(ch) * B.words + w];
                const int32_t valid = std::min(64, C - 64 * w);
                if (valid < 64 && (bits >> valid) != 0) c.bad("written bits past the chunk");
                pc += __builtin_popcountll(bits);
            }
            if (pc != B.n_written[ch]) c.bad("chunk " + std::to_string(ch) + " written count disagrees with its bitmap");
            if (B.dirty[ch] > 1 || B.on_host[ch] > 1) c.bad("a flag that is not 0 or 1");
            if (std::isnan(B.score[ch])) c.bad("a NaN score");
            if (B.last_use[ch] > B.tick) c.bad("a use after the pager's clock");
            B.n_host += B.on_host[ch];
            if (pc == 0) {
                if (b >= 0 || B.on_host[ch]) c.bad("empty chunk " + std::to_string(ch) + " holds a block or a host copy");
                continue;
            }
            last = ch;
            for (int32_t i = 0; i < C; ++i)
                if (((B.written[size_t(ch) * B.words + i / 64] >> (i % 64)) & 1) && int64_t(ch) * C + i >= h.n_past)
                    c.bad("position " + std::to_string(int64_t(ch) * C + i) + " written past n_past");
            if (b < 0 && !B.on_host[ch]) c.bad("chunk " + std::to_string(ch) + " is neither resident nor on the host");
            if (b >= 0 && !B.dirty[ch] && !B.on_host[ch]) c.bad("clean chunk " + std::to_string(ch) + " has no host copy");
        }
        if (B.head != last) c.bad("head chunk " + std::to_string(B.head) + " but the last written is " + std::to_string(last));
        for (int32_t ch = 0; ch < B.n_chunks; ++ch) {
            const bool prot = ch < h.sink_chunks || (B.head >= 0 && ch <= B.head && ch >= B.head - h.tail_window_chunks);
            if (prot && B.n_written[ch] > 0 && B.block_of[ch] < 0)
                c.bad("protected chunk " + std::to_string(ch) + " is not resident");
        }
    }
    const size_t row_bytes = size_t(h.chunk_bytes) / size_t(C);  // one token's K and V over every paged layer
    {
        Cursor c = cur(POOL);
        B.pool_blocks = int32_t(c.get<uint32_t>());
        if (B.pool_blocks < 0 || B.pool_blocks > B.n_blocks) c.bad(std::to_string(B.pool_blocks) + " pool blocks");
        B.pool_at = off[POOL] + c.at;
        c.raw(size_t(B.pool_blocks) * size_t(C) * row_bytes);
        c.done();
        for (int32_t ch = 0; ch < B.n_chunks; ++ch)
            if (B.block_of[ch] >= B.pool_blocks) c.bad("resident chunk " + std::to_string(ch) + " has no rows saved");
    }
    {
        Cursor c = cur(HOST);
        B.host_at = off[HOST];
        c.raw(size_t(B.n_host) * size_t(h.chunk_bytes));
        c.done();
    }
    {
        Cursor c = cur(RING);
        const uint32_t rl = c.get<uint32_t>();
        if (int64_t(rl) != h.n_swa_layers) c.bad("ring layers disagree with the header");
        B.swa_pos = c.vec<int64_t>(size_t(rl ? h.swa_tokens : 0), "swa_pos");
        for (int64_t p : B.swa_pos)
            if (p < -1 || p >= h.n_past) c.bad("a ring position outside the history");
        for (uint32_t i = 0; i < rl; ++i) {
            B.ring_k_bytes.push_back(c.get<uint64_t>());
            B.ring_at.push_back(off[RING] + c.at);
            c.raw(size_t(B.ring_k_bytes.back()));
            B.ring_v_bytes.push_back(c.get<uint64_t>());
            c.raw(size_t(B.ring_v_bytes.back()));
            if (B.ring_k_bytes[i] != h.ring_bytes_k[i] || B.ring_v_bytes[i] != h.ring_bytes_v[i])
                c.bad("a ring layer's size disagrees with the header");
        }
        c.done();
    }
    {
        Cursor c = cur(QCAP);
        B.n_captured = c.get<int32_t>();
        B.captured = c.vec<float>();
        c.done();
        if (B.n_captured < 0 || B.n_captured > h.capture_queries || B.n_captured > h.n_past)
            c.bad(std::to_string(B.n_captured) + " captured queries");
        if (uint64_t(B.captured.size()) != uint64_t(B.n_captured) * h.query_floats)
            c.bad("the captured queries' size disagrees with the header");
    }
    {
        Cursor c = cur(SUMM);
        B.has_summ = c.get<uint8_t>();
        if (B.has_summ != h.summaries) c.bad("it disagrees with the header");
        if (B.has_summ) {
            B.ready = c.vec<uint8_t>();
            B.smin = c.vec<float>();
            B.smax = c.vec<float>();
            B.smean = c.vec<float>();
            if (!B.ready.empty() && B.ready.size() != size_t(B.n_chunks)) c.bad("summaries for a different chunk count");
            if (B.smin.size() != B.smax.size() || B.smin.size() != B.smean.size()) c.bad("summary arrays of unequal size");
            if (uint64_t(B.smin.size()) != uint64_t(B.ready.size()) * h.summary_floats)
                c.bad("the summaries' size disagrees with the header");
        }
        c.done();
    }
    {
        Cursor c = cur(TOKS);
        s.sess_.tokens = c.vec<int32_t>(size_t(h.n_past), "the token history");
        c.done();
    }
    {
        Cursor c = cur(LOGT);
        s.sess_.logits = c.vec<float>();
        c.done();
        if (!s.sess_.logits.empty() && s.sess_.logits.size() != size_t(h.n_vocab))
            c.bad("logits for another vocabulary size");
    }
    {
        Cursor c = cur(SAMP);
        const std::string st = c.str(size_t(kSnapshotMaxSamplerBytes));
        c.done();
        try {
            s.sess_.sampler.set_state(st);
        } catch (const std::invalid_argument &) {
            c.bad("the sampler's state does not parse");
        }
    }
    s.sess_.app.assign(reinterpret_cast<const char *>(f.data() + off[APPS]), len[APPS]);
    if (N > RECR) {
        Cursor c = cur(RECR);
        const uint32_t n = c.get<uint32_t>();
        if (h.recurrent_layers == 0 ? n != 0 : n < 1 || n > uint32_t(h.recurrent_checkpoints) + 1)
            c.bad(std::to_string(n) + " states for " + std::to_string(h.recurrent_layers) + " recurrent layers and " +
                  std::to_string(h.recurrent_checkpoints) + " checkpoints");
        const size_t floats = size_t(h.recurrent_floats);
        for (uint32_t i = 0; i < n; ++i) {
            RecurrentState::HostCheckpoint ck;
            ck.pos = c.get<int64_t>();
            const bool last = i + 1 == n;
            if (last ? ck.pos != h.n_past : ck.pos <= 0 || ck.pos > h.n_past || ck.pos % C != 0)
                c.bad("a state at position " + std::to_string(ck.pos) + " (n_past " + std::to_string(h.n_past) + ")");
            if (!last && !B.recr.empty() && ck.pos <= B.recr.back().pos) c.bad("checkpoints out of order");
            ck.data.resize(floats);
            std::memcpy(ck.data.data(), c.raw(floats * sizeof(float)), floats * sizeof(float));
            for (float v : ck.data)
                if (!std::isfinite(v)) c.bad("a recurrent state that is not finite");
            B.recr.push_back(std::move(ck));
        }
        c.done();
    }
    s.body_ = std::move(body);
    return s;
}

void Snapshot::check(const Runtime &rt, const ChunkSummaries *summaries) const {
    const SnapshotHeader want = header_of(rt, summaries), &h = head_;
    const Body &B = *body_;
    compare_headers(h, want, rt.model().path());
    auto num = [&](const char *what, int64_t file, int64_t here) {
        if (file != here)
            throw SnapshotError("snapshot does not fit this session: " + std::string(what) + " differs (the file has " +
                                std::to_string(file) + ", this session " + std::to_string(here) + ")");
    };
    for (size_t i = 0; i < B.ring_at.size(); ++i) {
        num("a ring layer's K bytes", int64_t(B.ring_k_bytes[i]), int64_t(ggml_nbytes(rt.ring()->k(int32_t(i)))));
        num("a ring layer's V bytes", int64_t(B.ring_v_bytes[i]), int64_t(ggml_nbytes(rt.ring()->v(int32_t(i)))));
    }
    const Hparams &hp = rt.model().hparams();
    const size_t q_per = size_t(rt.pool().n_layers()) * hp.n_head * hp.head_dim_k;
    num("the captured queries' size", int64_t(B.captured.size()), int64_t(size_t(B.n_captured) * q_per));
    if (B.has_summ) {
        const size_t per = size_t(rt.pool().n_layers()) * hp.n_embd_k() * B.ready.size();
        num("the chunk summaries' size", int64_t(B.smin.size()), int64_t(per));
    }
    if (!sess_.logits.empty()) num("the logits' size (n_vocab)", int64_t(sess_.logits.size()), hp.n_vocab);
    for (int32_t t : sess_.tokens)
        if (t < 0 || t >= hp.n_vocab)
            throw SnapshotError("snapshot does not fit this session: token id " + std::to_string(t) + " outside [0, " +
                                std::to_string(hp.n_vocab) + ")");
}

void Snapshot::apply(Runtime &rt, ChunkSummaries *summaries) const {
    check(rt, summaries);
    const Body &B = *body_;
    const SnapshotHeader &h = head_;
    Pager &pg = rt.pager();
    HostStore &hs = *pg.host_;
    KVPool &pool = rt.pool();
    rt.sync_for_host_read();
    // The only step that can fail for want of memory (or the max_host_bytes cap) comes first.
    if (B.n_host > hs.in_use()) hs.reserve(B.n_host - hs.in_use());

    // Commit.
    const int32_t C = h.chunk_tokens;
    const uint8_t *f = B.file.data();
    hs.clear();
    pg.block_of_ = B.block_of;
    pg.n_written_ = B.n_written;
    pg.dirty_ = B.dirty;
    pg.last_use_ = B.last_use;
    pg.score_ = B.score;
    pg.written_ = B.written;
    pg.chunk_of_ = B.chunk_of;
    pg.free_blocks_ = B.free_blocks;
    const uint8_t *host = f + B.host_at;
    for (int32_t c = 0; c < B.n_chunks; ++c) {
        pg.host_of_[c] = -1;
        if (!B.on_host[c]) continue;
        pg.host_of_[c] = hs.acquire();
        std::memcpy(hs.ptr(pg.host_of_[c]), host, size_t(h.chunk_bytes));
        host += h.chunk_bytes;
    }
    std::fill(pg.slot_pos_.begin(), pg.slot_pos_.end(), -1);
    for (int32_t b = 0; b < B.n_blocks; ++b) {
        const int32_t c = B.chunk_of[b];
        if (c < 0) continue;
        for (int32_t i = 0; i < C; ++i)
            if (pg.written(c, i)) pg.slot_pos_[size_t(b) * C + i] = int64_t(c) * C + i;
    }
    pg.head_ = B.head;
    pg.tick_ = B.tick;
    pg.has_scores_ = B.has_scores != 0;
    const int64_t epoch = std::max(pg.stats_.epoch, B.epoch) + 1;  // cached masks never match
    pg.stats_ = PagerStats{};
    pg.stats_.page_outs = B.page_outs;
    pg.stats_.page_ins = B.page_ins;
    pg.stats_.clean_skips = B.clean_skips;
    pg.stats_.bytes_out = B.bytes_out;
    pg.stats_.bytes_in = B.bytes_in;
    pg.stats_.epoch = epoch;

    const uint8_t *rows = f + B.pool_at;
    for (int32_t i = 0; i < pool.n_layers(); ++i)
        for (ggml_tensor *t : {pool.k(i), pool.v(i)}) {
            const size_t n = size_t(B.pool_blocks) * C * t->nb[1];
            if (n > 0) ggml_backend_tensor_set(t, rows, 0, n);
            if (ggml_nbytes(t) > n) ggml_backend_tensor_memset(t, 0, n, ggml_nbytes(t) - n);
            rows += n;
        }
    for (size_t i = 0; i < B.ring_at.size(); ++i) {
        ggml_backend_tensor_set(rt.ring()->k(int32_t(i)), f + B.ring_at[i], 0, size_t(B.ring_k_bytes[i]));
        ggml_backend_tensor_set(rt.ring()->v(int32_t(i)), f + B.ring_at[i] + B.ring_k_bytes[i] + sizeof(uint64_t), 0,
                                size_t(B.ring_v_bytes[i]));
    }
    if (!B.ring_at.empty()) rt.ring()->set_positions(B.swa_pos);
    if (rt.recr_) {   // the state at n_past, and the checkpoints (the newest the runtime's limit keeps)
        rt.recr_->restore(B.recr.back());
        const size_t n_ck = B.recr.size() - 1,
                     keep = std::min(n_ck, size_t(std::max<int32_t>(0, rt.cfg_.recurrent_checkpoints)));
        rt.checkpoints_.assign(B.recr.begin() + std::ptrdiff_t(n_ck - keep), B.recr.begin() + std::ptrdiff_t(n_ck));
    }
    rt.n_past_ = h.n_past;
    rt.captured_q_ = B.captured;
    rt.n_captured_ = B.n_captured;
    rt.decode_mask_epoch_ = -1;
    if (summaries) {
        summaries->ready_ = B.ready;
        summaries->min_ = B.smin;
        summaries->max_ = B.smax;
        summaries->mean_ = B.smean;
    }
    rt.sync_for_host_read();
}

}  // namespace kvflash
