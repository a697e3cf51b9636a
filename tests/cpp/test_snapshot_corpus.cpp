// Corrupt and crafted snapshot files against tiny runtimes (built under ASan/UBSan in CI):
//   test_snapshot_corpus MODELS_DIR WORK_DIR [REGRESSIONS_DIR]
// MODELS_DIR: tests/snapshot_models.py's models.  For each runtime of snapshot_rig.h and each of three
// states (empty, inside the first chunk, past the pool with chunks on the host), a snapshot is saved;
// it must restore (the next token's logits bit for bit), and every corruption of it must be refused with
// a SnapshotError that leaves the runtime as it was (a snapshot taken before and after is the same file):
// truncation anywhere a section starts or ends, a flipped byte in every section, the preamble's magic,
// version and count, trailing bytes, section lengths past the file, and, with the checksums redone, a
// header out of range or of another geometry, a broken chunk table, sections longer than the header
// allows, a sampler state that does not parse, a file over the geometry's cap.  Files whose checksums are
// redone over KV bytes of any value are the runtime's to accept: they must apply and evaluate without a
// fault.  REGRESSIONS_DIR: every file in it (the fuzz target's findings, bench/fuzz/regressions/snapshot)
// is read against both runtimes, any outcome but a fault.  Exit status: the number of wrong outcomes.
// KVFLASH_CORPUS_VERBOSE=1 prints every refusal's message.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "ggml.h"
#include "snapshot_rig.h"

using Bytes = std::vector<uint8_t>;

namespace {

struct Sec {
    std::string tag;
    size_t hdr, at, len;  // the section header's offset, the payload's, its length
};

std::vector<Sec> sections(const Bytes &b) {
    std::vector<Sec> out;
    size_t at = 16;
    uint32_t n_sec = 0;   // the preamble's count (a version 3 file: 12, RECR last)
    std::memcpy(&n_sec, b.data() + 12, 4);
    for (uint32_t i = 0; i < n_sec && at + 16 <= b.size(); ++i) {
        uint64_t n = 0;
        std::memcpy(&n, b.data() + at + 8, 8);
        out.push_back({std::string(reinterpret_cast<const char *>(b.data() + at), 4), at, at + 16, size_t(n)});
        at += 16 + size_t(n);
    }
    return out;
}

const Sec &sec(const std::vector<Sec> &ss, const char *tag) {
    for (const Sec &s : ss)
        if (s.tag == tag) return s;
    throw std::logic_error(std::string("no section ") + tag);
}

// The section's checksum made to match its payload again.
void redo(Bytes &b, const Sec &s) {
    const uint32_t c = kvflash::crc32(b.data() + s.at, s.len);
    std::memcpy(b.data() + s.hdr + 4, &c, 4);
}

template <class T> void put(Bytes &b, size_t at, T v) { std::memcpy(b.data() + at, &v, sizeof v); }
template <class T> T get(const Bytes &b, size_t at) {
    T v;
    std::memcpy(&v, b.data() + at, sizeof v);
    return v;
}

// A section's payload replaced, its length and checksum made to match.
Bytes replace(const Bytes &b, const char *tag, const Bytes &payload) {
    const auto ss = sections(b);
    const Sec &s = sec(ss, tag);
    Bytes out(b.begin(), b.begin() + long(s.hdr));
    out.insert(out.end(), b.begin() + long(s.hdr), b.begin() + long(s.hdr) + 4);
    const uint32_t c = kvflash::crc32(payload.data(), payload.size());
    const uint64_t n = payload.size();
    out.insert(out.end(), reinterpret_cast<const uint8_t *>(&c), reinterpret_cast<const uint8_t *>(&c) + 4);
    out.insert(out.end(), reinterpret_cast<const uint8_t *>(&n), reinterpret_cast<const uint8_t *>(&n) + 8);
    out.insert(out.end(), payload.begin(), payload.end());
    out.insert(out.end(), b.begin() + long(s.at + s.len), b.end());
    return out;
}

Bytes payload(const Bytes &b, const char *tag) {
    const auto ss = sections(b);
    const Sec &s = sec(ss, tag);
    return Bytes(b.begin() + long(s.at), b.begin() + long(s.at + s.len));
}

// Offsets of HEAD's fixed fields (format version 2; version 3 appends its recurrent fields), after its three strings.
struct HeadAt {
    size_t n_layer, chunk_tokens, pool_tokens, n_swa_layers, capture, max_ctx, n_past, chunk_bytes, full_cache, n_vocab,
        query_floats, n_paged, row_k0, version_len;
};

HeadAt head_at(const Bytes &h) {
    HeadAt a{};
    size_t at = 16;
    a.version_len = at;
    for (int i = 0; i < 3; ++i) at += 4 + get<uint32_t>(h, at);
    a.n_layer = at;
    a.chunk_tokens = at + 8;
    a.pool_tokens = at + 12;
    a.n_swa_layers = at + 28;
    a.capture = at + 32;
    a.max_ctx = at + 36;
    a.n_past = at + 44;
    a.chunk_bytes = at + 52;
    a.full_cache = at + 60;
    a.n_vocab = at + 62;
    a.query_floats = at + 66;
    a.n_paged = at + 82;
    a.row_k0 = at + 86 + 4;
    return a;
}

struct Case {
    std::string name;
    Bytes bytes;
    bool must_refuse = true;  // false: the runtime's to accept (opaque KV bytes); no fault either way
};

std::vector<Case> corruptions(const Bytes &good) {
    std::vector<Case> cs;
    auto add = [&](std::string n, Bytes b, bool refuse = true) { cs.push_back({std::move(n), std::move(b), refuse}); };
    const auto ss = sections(good);
    // truncations
    std::vector<size_t> cuts = {0, 5, 8, 12, 15, 16, 20, good.size() - 1};
    for (const Sec &s : ss) {
        for (size_t c : {s.hdr, s.hdr + 4, s.hdr + 15, s.at + 1, s.at + s.len / 2, s.at + s.len - 1})
            if (c < good.size() && c > 0) cuts.push_back(c);
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (size_t c : cuts) add("cut at " + std::to_string(c), Bytes(good.begin(), good.begin() + long(c)));
    // a flipped byte, its checksum not redone; a bad tag; a length one off
    for (const Sec &s : ss) {
        if (s.len > 0) {
            Bytes b = good;
            b[s.at + s.len / 2] ^= 0x40;
            add("flip in " + s.tag, b);
        }
        Bytes t = good;
        t[s.hdr] ^= 0x20;
        add("tag of " + s.tag, t);
        for (int64_t d : {-1, 1, 1 << 20}) {
            Bytes l = good;
            put<uint64_t>(l, s.hdr + 8, uint64_t(int64_t(s.len) + d));
            add("length of " + s.tag + " " + std::to_string(d), l);
        }
        Bytes h = good;
        put<uint64_t>(h, s.hdr + 8, uint64_t(1) << 62);
        add("length of " + s.tag + " 2^62", h);
    }
    // the preamble, trailing bytes
    {
        Bytes b = good;
        b[3] ^= 1;
        add("magic", b);
        for (uint32_t v : {0u, 1u, 2u, 4u, 0xffffffffu}) {  // 2: a version 3 file's 12 sections
            Bytes w = good;
            put<uint32_t>(w, 8, v);
            add("version " + std::to_string(v), w);
        }
        for (uint32_t n : {0u, 11u, 13u}) {
            Bytes w = good;
            put<uint32_t>(w, 12, n);
            add("sections " + std::to_string(n), w);
        }
        {
            // version 2's preamble on a version 3 file: its HEAD carries the recurrent fields version 2 lacks
            Bytes w = good;
            put<uint32_t>(w, 8, 2u);
            put<uint32_t>(w, 12, 11u);
            add("version 2, 11 sections", w);
        }
        Bytes t = good;
        t.insert(t.end(), {0, 0, 0});
        add("trailing bytes", t);
    }
    // crafted headers, checksums redone
    const Bytes head = payload(good, "HEAD");
    const HeadAt a = head_at(head);
    auto with_head = [&](const char *n, const std::function<void(Bytes &)> &f) {
        Bytes h = head;
        f(h);
        add(std::string("HEAD: ") + n, replace(good, "HEAD", h));
    };
    const int64_t max_ctx = get<int64_t>(head, a.max_ctx), n_past = get<int64_t>(head, a.n_past);
    with_head("fingerprint", [](Bytes &h) { h[0] ^= 1; });
    with_head("n_past > max_ctx", [&](Bytes &h) { put<int64_t>(h, a.n_past, max_ctx + 1); });
    with_head("n_past + 1", [&](Bytes &h) { put<int64_t>(h, a.n_past, n_past + 1); });
    with_head("n_past - 1", [&](Bytes &h) { put<int64_t>(h, a.n_past, n_past - 1); });
    with_head("n_layer 0", [&](Bytes &h) { put<int32_t>(h, a.n_layer, 0); });
    with_head("chunk_tokens 0", [&](Bytes &h) { put<int32_t>(h, a.chunk_tokens, 0); });
    with_head("chunk_tokens 32", [&](Bytes &h) { put<int32_t>(h, a.chunk_tokens, 32); });
    with_head("pool_tokens 512", [&](Bytes &h) { put<int32_t>(h, a.pool_tokens, 512); });
    with_head("pool_tokens -16", [&](Bytes &h) { put<int32_t>(h, a.pool_tokens, -16); });
    with_head("max_ctx 2^40", [&](Bytes &h) { put<int64_t>(h, a.max_ctx, int64_t(1) << 40); });
    with_head("max_ctx 2^31 - 256", [&](Bytes &h) { put<int64_t>(h, a.max_ctx, kvflash::kMaxContext); });
    with_head("capture_queries 5000", [&](Bytes &h) { put<int32_t>(h, a.capture, 5000); });
    with_head("full_cache 2", [&](Bytes &h) { h[a.full_cache] = 2; });
    with_head("n_vocab 0", [&](Bytes &h) { put<int32_t>(h, a.n_vocab, 0); });
    with_head("n_vocab 2^31 - 1", [&](Bytes &h) { put<int32_t>(h, a.n_vocab, 0x7fffffff); });
    with_head("query_floats 2^40", [&](Bytes &h) { put<uint64_t>(h, a.query_floats, uint64_t(1) << 40); });
    with_head("chunk_bytes + 1", [&](Bytes &h) { put<uint64_t>(h, a.chunk_bytes, get<uint64_t>(h, a.chunk_bytes) + 1); });
    with_head("row bytes 0", [&](Bytes &h) { put<uint64_t>(h, a.row_k0, 0); });
    with_head("row bytes 2^40", [&](Bytes &h) { put<uint64_t>(h, a.row_k0, uint64_t(1) << 40); });
    with_head("paged layers 0", [&](Bytes &h) { put<uint32_t>(h, a.n_paged, 0); });
    with_head("paged layers 70000", [&](Bytes &h) { put<uint32_t>(h, a.n_paged, 70000); });
    with_head("ring layers + 1", [&](Bytes &h) { put<int32_t>(h, a.n_swa_layers, get<int32_t>(h, a.n_swa_layers) + 1); });
    with_head("a version string past the section", [&](Bytes &h) { put<uint32_t>(h, a.version_len, 1u << 30); });
    with_head("one byte more", [&](Bytes &h) { h.push_back(0); });
    // the chunk table (PAGR: 5 counts, 6 counters, then block_of, on_host, n_written, ... each with a u64 length)
    const Bytes pagr = payload(good, "PAGR");
    const int32_t nc = get<int32_t>(pagr, 0);
    const size_t block_of = 77 + 8, on_host = block_of + 4 * size_t(nc) + 8, n_written = on_host + size_t(nc) + 8;
    auto with_pagr = [&](const char *n, const std::function<void(Bytes &)> &f) {
        Bytes p = pagr;
        f(p);
        add(std::string("PAGR: ") + n, replace(good, "PAGR", p));
    };
    with_pagr("block 9999", [&](Bytes &p) { put<int32_t>(p, block_of + 3 * 4, 9999); });
    with_pagr("on_host 7", [&](Bytes &p) { p[on_host + 1] = 7; });
    with_pagr("n_written + 1", [&](Bytes &p) { put<int32_t>(p, n_written, get<int32_t>(p, n_written) + 1); });
    with_pagr("head + 5", [&](Bytes &p) { put<int64_t>(p, 12, get<int64_t>(p, 12) + 5); });
    with_pagr("n_chunks + 1", [&](Bytes &p) { put<int32_t>(p, 0, nc + 1); });
    // the clock and the counters the pager goes on from (the fuzz target's first finding: epoch + 1 overflowed)
    with_pagr("clock 2^64 - 1", [&](Bytes &p) { put<uint64_t>(p, 20, ~uint64_t(0)); });
    with_pagr("epoch 2^63 - 1", [&](Bytes &p) { put<int64_t>(p, 29 + 5 * 8, INT64_MAX); });
    with_pagr("page_outs -1", [&](Bytes &p) { put<int64_t>(p, 29, -1); });
    with_pagr("an array longer than the section", [&](Bytes &p) { put<uint64_t>(p, block_of - 8, uint64_t(1) << 40); });
    with_pagr("one byte less", [&](Bytes &p) { p.pop_back(); });
    // sections longer than the header allows, or not parsing
    {
        Bytes l = payload(good, "LOGT");
        const uint64_t n = get<uint64_t>(l, 0);
        put<uint64_t>(l, 0, n + 1);
        l.insert(l.end(), 4, 0);
        add("LOGT: one logit more", replace(good, "LOGT", l));
        Bytes t = payload(good, "TOKS");
        put<uint64_t>(t, 0, get<uint64_t>(t, 0) + 1);
        t.insert(t.end(), 4, 0);
        add("TOKS: one token more", replace(good, "TOKS", t));
        Bytes s = payload(good, "SAMP");
        if (s.size() > 8) s[s.size() / 2] = '!';
        add("SAMP: a state that does not parse", replace(good, "SAMP", s));
        Bytes q = payload(good, "QCAP");
        put<int32_t>(q, 0, get<int32_t>(q, 0) + 1);
        add("QCAP: one query more than saved", replace(good, "QCAP", q));
        Bytes u = payload(good, "SUMM");
        u[0] ^= 1;
        add("SUMM: summaries flag flipped", replace(good, "SUMM", u));
        Bytes r = payload(good, "RING");
        put<uint32_t>(r, 0, get<uint32_t>(r, 0) + 1);
        add("RING: one layer more", replace(good, "RING", r));
        Bytes pl = payload(good, "POOL");
        put<uint32_t>(pl, 0, get<uint32_t>(pl, 0) + 1);
        add("POOL: one block more than saved", replace(good, "POOL", pl));
        Bytes big(size_t(kvflash::kSnapshotMaxAppBytes) + 1, ' ');
        add("APPS: past the cap", replace(good, "APPS", big));
    }
    // the recurrent state (RECR: u32 count, then per state an i64 position and HEAD's recurrent_floats
    // floats; HEAD ends with i32 recurrent_layers, u64 recurrent_floats, i32 recurrent_checkpoints)
    if (get<int32_t>(head, head.size() - 16) > 0) {
        const Bytes recr = payload(good, "RECR");
        const size_t floats = size_t(get<uint64_t>(head, head.size() - 12)), state = 8 + 4 * floats;
        auto with_recr = [&](const std::string &n, const std::function<void(Bytes &)> &f, bool refuse = true) {
            Bytes r = recr;
            f(r);
            add("RECR: " + n, replace(good, "RECR", r), refuse);
        };
        with_recr("no state", [&](Bytes &r) { put<uint32_t>(r, 0, 0); });
        with_recr("one state more", [&](Bytes &r) { put<uint32_t>(r, 0, get<uint32_t>(r, 0) + 1); });
        with_recr("2^32 - 1 states", [&](Bytes &r) { put<uint32_t>(r, 0, ~0u); });
        with_recr("the last position - 1", [&](Bytes &r) {
            const size_t at = r.size() - state;
            put<int64_t>(r, at, get<int64_t>(r, at) - 1);
        });
        with_recr("a NaN", [&](Bytes &r) { put<uint32_t>(r, r.size() - 4, 0x7fc00000u); });
        with_recr("an infinity", [&](Bytes &r) { put<uint32_t>(r, 4 + 8, 0x7f800000u); });
        with_recr("one byte less", [&](Bytes &r) { r.pop_back(); });
        with_recr("one byte more", [&](Bytes &r) { r.push_back(0); });
        if (get<uint32_t>(recr, 0) > 1)
            with_recr("a checkpoint off a chunk boundary", [&](Bytes &r) { put<int64_t>(r, 4, get<int64_t>(r, 4) + 1); });
        with_recr("every float 0", [&](Bytes &r) {
            for (size_t at = 4; at + state <= r.size(); at += state) std::fill(r.begin() + long(at + 8), r.begin() + long(at + state), 0);
        }, false);
        with_head("recurrent_layers + 1", [&](Bytes &h) { put<int32_t>(h, h.size() - 16, get<int32_t>(h, h.size() - 16) + 1); });
        with_head("recurrent_floats + 1", [&](Bytes &h) { put<uint64_t>(h, h.size() - 12, floats + 1); });
        with_head("recurrent_floats 2^62", [&](Bytes &h) { put<uint64_t>(h, h.size() - 12, uint64_t(1) << 62); });
        with_head("recurrent_checkpoints 2^31 - 1", [&](Bytes &h) { put<int32_t>(h, h.size() - 4, 0x7fffffff); });
        with_head("recurrent_checkpoints -1", [&](Bytes &h) { put<int32_t>(h, h.size() - 4, -1); });
    }
    // KV bytes of any value, checksums redone: opaque to the reader
    for (const char *tag : {"POOL", "HOST"}) {
        Bytes p = payload(good, tag);
        const size_t skip = std::string(tag) == "POOL" ? 4 : 0;  // POOL: its block count first
        if (skip >= p.size()) continue;
        std::fill(p.begin() + long(skip), p.end(), uint8_t(0xff));
        add(std::string(tag) + ": every KV byte 0xff", replace(good, tag, p), false);
    }
    {
        // RING: layer count, positions (u64 count, i64 each), then per layer K and V, each u64 bytes + bytes
        Bytes p = payload(good, "RING");
        if (get<uint32_t>(p, 0) > 0) {
            size_t at = 12 + 8 * size_t(get<uint64_t>(p, 4));
            for (uint32_t i = 0; i < 2 * get<uint32_t>(p, 0); ++i) {
                const size_t n = size_t(get<uint64_t>(p, at));
                std::fill(p.begin() + long(at + 8), p.begin() + long(at + 8 + n), uint8_t(0xff));
                at += 8 + n;
            }
            add("RING: every KV byte 0xff", replace(good, "RING", p), false);
        }
    }
    return cs;
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: %s MODELS_DIR WORK_DIR [REGRESSIONS_DIR]\n", argv[0]);
        return 2;
    }
    ggml_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    const std::string models = argv[1], work = argv[2];
    const bool verbose = std::getenv("KVFLASH_CORPUS_VERBOSE") != nullptr;  // every refusal's message
    std::filesystem::create_directories(work);
    const std::string base = work + "/base.kvsnap", bad = work + "/bad.kvsnap", before = work + "/before.kvsnap",
                      after = work + "/after.kvsnap";
    std::vector<snaprig::Rig> rigs = snaprig::make_rigs(models);
    int wrong = 0, refused = 0, applied = 0, regressions = 0;
    std::vector<Bytes> bases(rigs.size());
    for (size_t i = 0; i < rigs.size(); ++i) {
        snaprig::Rig &r = rigs[i];
        for (int32_t n : {0, 7, 600}) {
            const std::string state = r.name + " n_past " + std::to_string(n);
            snaprig::fill(r, n, 17u + uint32_t(n));
            snaprig::save(r, base);
            const Bytes good = snaprig::slurp(base);
            bases[i] = good;
            // The next token after the saved state, as try_restore evaluates it.
            snaprig::extend(r, 1, uint32_t(n));
            const std::vector<float> want = r.logits;
            snaprig::fill(r, 300, 5u);
            try {
                if (snaprig::try_restore(r, base) != snaprig::Outcome::Applied ||
                    std::memcmp(r.logits.data(), want.data(), want.size() * sizeof(float)) != 0) {
                    std::fprintf(stderr, "%s: the good file did not restore to the saved state\n", state.c_str());
                    ++wrong;
                }
            } catch (const std::exception &e) {
                std::fprintf(stderr, "%s: the good file: %s\n", state.c_str(), e.what());
                ++wrong;
            }
            for (const Case &c : corruptions(good)) {
                snaprig::spill(bad, c.bytes);
                snaprig::save(r, before);
                std::string why;
                try {
                    const snaprig::Outcome o = snaprig::try_restore(r, bad, &why);
                    if (o == snaprig::Outcome::Refused) {
                        ++refused;
                        if (verbose) std::printf("%s, %s: %s\n", state.c_str(), c.name.c_str(), why.c_str());
                        snaprig::save(r, after);
                        if (snaprig::slurp(after) != snaprig::slurp(before)) {
                            std::fprintf(stderr, "%s, %s: refused (%s) but the runtime changed\n", state.c_str(),
                                         c.name.c_str(), why.c_str());
                            ++wrong;
                        }
                    } else {
                        ++applied;
                        if (c.must_refuse) {
                            std::fprintf(stderr, "%s, %s: applied\n", state.c_str(), c.name.c_str());
                            ++wrong;
                        }
                    }
                } catch (const std::exception &e) {
                    std::fprintf(stderr, "%s, %s: %s (not a SnapshotError)\n", state.c_str(), c.name.c_str(), e.what());
                    ++wrong;
                }
            }
        }
    }
    // Each runtime's snapshot against every other runtime.
    for (size_t i = 0; i < rigs.size(); ++i) {
        for (size_t j = 0; j < rigs.size(); ++j) {
            if (j == i) continue;
            snaprig::spill(bad, bases[j]);
            std::string why;
            if (snaprig::try_restore(rigs[i], bad, &why) != snaprig::Outcome::Refused) {
                std::fprintf(stderr, "%s took %s's snapshot\n", rigs[i].name.c_str(), rigs[j].name.c_str());
                ++wrong;
            } else {
                ++refused;
            }
        }
    }
    if (argc > 3 && std::filesystem::is_directory(argv[3])) {
        std::vector<std::filesystem::path> files;
        for (const auto &e : std::filesystem::directory_iterator(argv[3]))
            if (e.is_regular_file() && e.path().filename().string()[0] != '.') files.push_back(e.path());
        std::sort(files.begin(), files.end());
        for (const auto &p : files) {
            ++regressions;
            Bytes b = snaprig::slurp(p.string());
            snaprig::redo_checksums(b);  // as the fuzz target wrote it
            snaprig::spill(bad, b);
            for (snaprig::Rig &r : rigs) {
                try {
                    snaprig::try_restore(r, bad);
                } catch (const std::exception &e) {
                    std::fprintf(stderr, "regression %s on %s: %s\n", p.filename().c_str(), r.name.c_str(), e.what());
                    ++wrong;
                }
            }
        }
    }
    for (const std::string &f : {base, bad, before, after}) std::filesystem::remove(f);
    std::printf("snapshot corpus: %d refused, %d applied (opaque KV bytes), %d regression inputs replayed, %d wrong\n",
                refused, applied, regressions, wrong);
    return refused < 300 ? 1 : wrong;
}
