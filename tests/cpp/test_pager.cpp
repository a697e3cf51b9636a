// Pager bookkeeping tests against a plain byte-array mover (no ggml needed).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvflash/limits.h"
#include "kvflash/pager.h"

using namespace kvflash;

static int g_fail = 0;
#define CHECK(cond)                                                               \
    do {                                                                          \
        if (!(cond)) {                                                            \
            std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
            ++g_fail;                                                             \
        }                                                                         \
    } while (0)

template <class E, class F> static bool throws(F f) {
    try { f(); } catch (const E &) { return true; } catch (...) { return false; }
    return false;
}

// Pool of n_blocks blocks, each chunk_bytes bytes.
struct ByteMover : ChunkMover {
    size_t cb;
    std::vector<uint8_t> pool;
    ByteMover(int32_t n_blocks, size_t cb) : cb(cb), pool(size_t(n_blocks) * cb) {}
    size_t chunk_bytes() const override { return cb; }
    void page_out(int32_t b, uint8_t *dst) override { std::memcpy(dst, &pool[size_t(b) * cb], cb); }
    void page_in(int32_t b, const uint8_t *src) override { std::memcpy(&pool[size_t(b) * cb], src, cb); }
};

static PagerConfig cfg(int32_t pool, int64_t max_ctx) {
    PagerConfig c;
    c.pool_tokens = pool;
    c.max_ctx = max_ctx;
    return c;
}

static void test_config() {
    PagerConfig c = cfg(512, 4096);
    CHECK(c.min_pool_tokens() == 512);
    c.validate();
    CHECK(c.pool_tokens == 512);
    PagerConfig d = cfg(448 + 64, 4096);  // 512: fine
    d.validate();
    PagerConfig e = cfg(576, 4096);       // 9 chunks -> rounded to 768
    e.validate();
    CHECK(e.pool_tokens == 768);
    CHECK(throws<std::invalid_argument>([] { PagerConfig x = cfg(256, 4096); x.validate(); }));
    CHECK(throws<std::invalid_argument>([] { PagerConfig x = cfg(0, 4096); x.validate(); }));
    CHECK(throws<std::invalid_argument>([] { PagerConfig x = cfg(530, 4096); x.validate(); }));
    CHECK(throws<std::invalid_argument>([] { PagerConfig x = cfg(512, 0); x.validate(); }));
}

// Fill each written position's bytes with a pattern derived from the position; verify after paging.
static void stamp(ByteMover &m, const Pager &p, int64_t pos) {
    const int32_t C = p.config().chunk_tokens;
    const int32_t b = p.block_of(int32_t(pos / C));
    const size_t per = m.cb / C;
    std::memset(&m.pool[size_t(b) * m.cb + size_t(pos % C) * per], int(pos * 7 + 3) & 0xff, per);
}
static bool verify(ByteMover &m, const Pager &p, int64_t pos) {
    const int32_t C = p.config().chunk_tokens;
    const int32_t b = p.block_of(int32_t(pos / C));
    if (b < 0) return false;
    const size_t per = m.cb / C;
    const uint8_t *q = &m.pool[size_t(b) * m.cb + size_t(pos % C) * per];
    for (size_t i = 0; i < per; ++i)
        if (q[i] != uint8_t((pos * 7 + 3) & 0xff)) return false;
    return true;
}

static void test_decode_eviction_roundtrip() {
    ByteMover m(8, 64 * 4);
    Pager p(cfg(512, 64 * 64), &m);
    CHECK(p.n_blocks() == 8);
    std::vector<int32_t> slots(1);
    for (int64_t pos = 0; pos < 64 * 20; ++pos) {
        CHECK(p.alloc_span(pos, 1, slots.data()) == AllocResult::OK);
        CHECK(slots[0] == p.block_of(int32_t(pos / 64)) * 64 + pos % 64);
        stamp(m, p, pos);
        p.check_invariants();
    }
    const PagerStats s = p.stats();
    CHECK(s.resident_chunks == 8);
    CHECK(s.host_chunks == 12);
    CHECK(s.page_outs == 12);
    CHECK(p.block_of(0) >= 0);                  // sink stays
    for (int c = 15; c < 20; ++c) CHECK(p.block_of(c) >= 0);  // tail window stays
    // Recall every evicted chunk and check its bytes.
    for (int c = 1; c < 15; ++c) {
        if (p.block_of(c) >= 0) continue;
        CHECK(p.recall(c) == AllocResult::OK);
        for (int64_t pos = c * 64; pos < (c + 1) * 64; ++pos) CHECK(verify(m, p, pos));
        p.check_invariants();
    }
    // Recalled chunks are clean: evicting them again copies nothing.
    const int64_t outs = p.stats().page_outs;
    for (int c = 1; c < 15; ++c)
        if (p.block_of(c) >= 0) { p.evict(c); break; }
    CHECK(p.stats().page_outs == outs);
    CHECK(p.stats().clean_skips >= 1);
    p.check_invariants();
}

static void test_protection_and_errors() {
    ByteMover m(8, 64);
    Pager p(cfg(512, 64 * 32), &m);
    std::vector<int32_t> s(64);
    CHECK(p.alloc_span(0, 64, s.data()) == AllocResult::OK);
    CHECK(throws<std::invalid_argument>([&] { p.evict(0); }));        // sink
    CHECK(throws<std::invalid_argument>([&] { p.evict(5); }));        // not resident
    CHECK(throws<std::out_of_range>([&] { p.evict(99); }));
    CHECK(throws<std::out_of_range>([&] { p.alloc_span(-1, 1, s.data()); }));
    CHECK(throws<std::out_of_range>([&] { p.alloc_span(64 * 32, 1, s.data()); }));
    CHECK(throws<std::invalid_argument>([&] { p.alloc_span(0, 0, s.data()); }));
    // A span wider than the pool cannot fit: NO_ROOM and nothing changes.
    const int64_t epoch = p.epoch();
    std::vector<int32_t> big(64 * 9);
    CHECK(p.alloc_span(64, 64 * 9, big.data()) == AllocResult::NO_ROOM);
    CHECK(p.epoch() == epoch);
    CHECK(p.stats().materialised_chunks == 1);
    p.check_invariants();
}

static void test_mask() {
    ByteMover m(8, 64);
    Pager p(cfg(512, 4096), &m);
    std::vector<int32_t> s(100);
    CHECK(p.alloc_span(0, 100, s.data()) == AllocResult::OK);
    std::vector<uint16_t> mask(2 * 512);
    const int64_t q[2] = {99, 40};
    p.fill_mask(q, 2, mask.data(), 512);
    int vis0 = 0, vis1 = 0;
    for (int i = 0; i < 512; ++i) { vis0 += mask[i] == 0; vis1 += mask[512 + i] == 0; }
    CHECK(vis0 == 100);   // unwritten slots of the head chunk stay masked
    CHECK(vis1 == 41);    // causal
    std::vector<uint16_t> w(512);
    const int64_t q2 = 99;
    p.fill_mask(&q2, 1, w.data(), 512, 10);
    int visw = 0;
    for (int i = 0; i < 512; ++i) visw += w[i] == 0;
    CHECK(visw == 10);
}

static void test_reselect() {
    ByteMover m(8, 64);
    Pager p(cfg(512, 64 * 64), &m);
    std::vector<int32_t> s(64 * 30);
    for (int64_t pos = 0; pos < 64 * 30; pos += 64) CHECK(p.alloc_span(pos, 64, s.data()) == AllocResult::OK);
    std::vector<float> scores(30, 0.f);
    scores[3] = 9.f; scores[7] = 8.f; scores[11] = 1.f;
    p.reselect(scores.data(), 30);
    p.check_invariants();
    // 8 blocks: sink 0 + tail 25..29 = 6 protected, 2 by score: 3 and 7.
    CHECK(p.block_of(3) >= 0);
    CHECK(p.block_of(7) >= 0);
    CHECK(p.block_of(11) < 0);
    // Victims now follow scores: appending a new chunk evicts the lowest-scored resident.
    CHECK(p.alloc_span(64 * 30, 1, s.data()) == AllocResult::OK);
    p.check_invariants();
    CHECK(p.block_of(3) >= 0);
    p.reset();
    p.check_invariants();
    CHECK(!p.has_scores());
    CHECK(p.stats().materialised_chunks == 0);
    CHECK(p.host_store().in_use() == 0);
}

static void test_truncate() {
    ByteMover m(8, 64);
    Pager p(cfg(512, 64 * 64), &m);
    std::vector<int32_t> s(1);
    for (int64_t pos = 0; pos < 64 * 20; ++pos) p.alloc_span(pos, 1, s.data());
    p.truncate(64 * 6 + 10);
    p.check_invariants();
    CHECK(p.head_chunk() == 6);
    for (int c = 2; c <= 6; ++c) CHECK(p.block_of(c) >= 0);
    CHECK(p.slot_of(64 * 6 + 10) == -1);
    CHECK(p.slot_of(64 * 6 + 9) >= 0);
}

static void test_random_ops() {
    std::mt19937 rng(1234);
    ByteMover m(8, 64 * 2);
    Pager p(cfg(512, 64 * 40), &m);
    std::vector<int32_t> s(256);
    int64_t next = 0;
    for (int step = 0; step < 20000; ++step) {
        const int op = rng() % 10;
        if (op < 5 && next < 64 * 40) {
            const int32_t n = std::min<int64_t>(1 + rng() % 80, 64 * 40 - next);
            if (p.alloc_span(next, n, s.data()) == AllocResult::OK) {
                for (int32_t k = 0; k < n; ++k) stamp(m, p, next + k);
                next += n;
            }
        } else if (op == 5) {
            const int32_t c = rng() % p.n_chunks();
            if (p.block_of(c) >= 0 && !p.is_protected(c)) p.evict(c);
        } else if (op == 6) {
            const int32_t c = rng() % p.n_chunks();
            if (p.block_of(c) < 0 && p.host_of(c) >= 0) p.recall(c);
        } else if (op == 7) {
            std::vector<float> sc(p.n_chunks());
            for (auto &x : sc) x = float(rng() % 100);
            p.reselect(sc.data(), int32_t(sc.size()));
        } else if (op == 8 && rng() % 50 == 0) {
            p.reset();
            next = 0;
        } else if (op == 9 && rng() % 20 == 0 && next > 0) {
            next = rng() % next;
            p.truncate(next);
        }
        p.check_invariants();
        // Every resident written position still carries its stamp.
        for (int64_t pos = 0; pos < next; pos += 17)
            if (p.block_of(int32_t(pos / 64)) >= 0) CHECK(verify(m, p, pos));
        if (g_fail) return;
    }
}

// One guard for sizes: a max_ctx the core cannot address is refused before any
// table is sized (2^38 + 1920 used to truncate to 32 bits and write out of bounds),
// and no span arithmetic overflows, whatever the positions.
static void test_size_guard() {
    ByteMover m(8, 64);
    CHECK(throws<std::invalid_argument>([&] { Pager p(cfg(512, (int64_t(1) << 38) + 1920), &m); }));
    CHECK(throws<std::invalid_argument>([] { PagerConfig x = cfg(512, kMaxContext + 1); x.validate(); }));
    CHECK(throws<std::invalid_argument>([] { PagerConfig x = cfg(512, INT64_MAX); x.validate(); }));
    PagerConfig ok = cfg(512, kMaxContext);
    ok.validate();  // the largest context is legal (not allocated here: its tables take ~1 GiB)
    CHECK(kMaxContext + 255 <= INT32_MAX);  // a full-cache pool of kMaxContext fits an int32 after rounding
    Pager p(cfg(512, 4096), &m);
    std::vector<int32_t> s(64);
    CHECK(throws<std::out_of_range>([&] { p.alloc_span(INT64_MAX - 10, 64, s.data()); }));
    CHECK(throws<std::out_of_range>([&] { p.alloc_span(4000, 200, s.data()); }));
    CHECK(throws<std::out_of_range>([&] { p.truncate(INT64_MAX); }));
    CHECK(p.slot_of(INT64_MAX) == -1);
    p.check_invariants();
}

// File regions are mapped at multiples of the page size whatever the chunk size: with
// 64 KiB pages, 16 chunks of 768 bytes (12 KiB) put the second region at an offset
// mmap refuses.  The store also caps itself (HostStoreFull, nothing handed out) and
// gives its memory back.
static void test_host_store_pages() {
    const std::string path = "/tmp/kvflash-test-host-store-" + std::to_string(::getpid());
    {
        HostStore h(768, HostStore::Backing::FILE, path, 16, {}, 0, 65536);
        CHECK(::access(path.c_str(), F_OK) != 0);  // unlinked at once
        std::vector<int32_t> got;
        for (int i = 0; i < 300; ++i) got.push_back(h.acquire());
        CHECK(h.n_regions() >= 2);
        for (int32_t r = 0; r < h.n_regions(); ++r) CHECK(h.region_offset(r) % 65536 == 0);
        for (int32_t x : got) {
            std::memset(h.ptr(x), x & 0xff, 768);
            CHECK(h.ptr(x)[767] == uint8_t(x & 0xff));
        }
        h.release_memory();
        CHECK(h.capacity() == 0 && h.reserved_bytes() == 0);
        CHECK(h.acquire() == 0);
    }
    {
        HostStore h(256, HostStore::Backing::RAM, "", 16, {}, 16 * 256, 4096);
        for (int i = 0; i < 16; ++i) h.acquire();
        CHECK(throws<HostStoreFull>([&] { h.acquire(); }));
        CHECK(h.in_use() == 16 && h.capacity() == 16);
        CHECK(throws<HostStoreFull>([&] { h.reserve(1); }));
    }
}

int main() {
    test_config();
    test_host_store_pages();
    test_size_guard();
    test_decode_eviction_roundtrip();
    test_protection_and_errors();
    test_mask();
    test_reselect();
    test_truncate();
    test_random_ops();
    if (g_fail) {
        std::fprintf(stderr, "%d checks failed\n", g_fail);
        return 1;
    }
    std::printf("test_pager: all checks passed\n");
    return 0;
}
