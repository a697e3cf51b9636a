// Tiny runtimes to read snapshot files against, shared by the snapshot corpus test
// (tests/cpp/test_snapshot_corpus.cpp, ctest under ASan/UBSan) and the snapshot fuzz target
// (bench/fuzz/fuzz_snapshot.cpp).  The models are tests/snapshot_models.py's.
//
//   llama   one layer, pool 256 of max_ctx 1024, 16-token chunks, q8_0, 4 captured queries and
//           chunk summaries (the qk-bound / qk-mean policies' state): every section but RING
//   gemma3  a sliding-window layer (a 32-token ring) and a global one, pool 256 of 1024, f16
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvflash/limits.h"
#include "kvflash/model.h"
#include "kvflash/runtime.h"
#include "kvflash/scoring.h"
#include "kvflash/snapshot.h"

namespace snaprig {

struct Rig {
    std::string name;
    std::shared_ptr<kvflash::Model> model;
    std::unique_ptr<kvflash::Runtime> rt;
    std::shared_ptr<kvflash::ChunkSummaries> summaries;  // nullptr: none
    std::vector<int32_t> tokens;                         // the history, as the runtime holds it
    std::vector<float> logits;                           // after the last token
};

inline Rig make_rig(const std::string &dir, const std::string &name) {
    Rig r;
    r.name = name;
    r.model = kvflash::Model::load(dir + "/" + name + ".gguf", 1);
    kvflash::RuntimeConfig c;
    c.max_ctx = 1024;
    c.pool_tokens = 256;
    c.chunk_tokens = 16;
    c.ubatch = 64;
    const bool llama = name == "llama";
    c.kv_type = llama ? "q8_0" : "f16";
    c.capture_queries = llama ? 4 : 1;
    r.rt = std::make_unique<kvflash::Runtime>(r.model, c);
    if (llama) {
        r.summaries = std::make_shared<kvflash::ChunkSummaries>();
        r.rt->set_observer(r.summaries);
    }
    return r;
}

inline std::vector<Rig> make_rigs(const std::string &dir) {
    std::vector<Rig> rigs;
    rigs.push_back(make_rig(dir, "llama"));
    rigs.push_back(make_rig(dir, "gemma3"));
    rigs.push_back(make_rig(dir, "qwen35"));   // a recurrent layer: RECR carries its state
    return rigs;
}

inline int32_t n_vocab(const Rig &r) { return r.model->hparams().n_vocab; }

// Appends n pseudo-random tokens (an LCG from seed) to the history.
inline void extend(Rig &r, int32_t n, uint32_t seed) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
        seed = seed * 1664525u + 1013904223u;
        t[size_t(i)] = int32_t((seed >> 8) % uint32_t(n_vocab(r)));
    }
    if (n == 0) return;
    r.logits.assign(size_t(n_vocab(r)), 0.f);
    r.rt->eval(t.data(), n, false, r.logits.data());
    r.tokens.insert(r.tokens.end(), t.begin(), t.end());
}

inline void fill(Rig &r, int32_t n, uint32_t seed) {
    r.rt->reset();
    r.tokens.clear();
    r.logits.clear();
    extend(r, n, seed);
}

inline void save(const Rig &r, const std::string &path) {
    kvflash::SnapshotSession s;
    s.tokens = r.tokens;
    s.logits = r.logits;
    s.app = "{\"rig\": \"" + r.name + "\"}";
    kvflash::Snapshot::save(*r.rt, r.summaries.get(), s, path);
}

inline std::vector<uint8_t> slurp(const std::string &path) {
    std::vector<uint8_t> b;
    FILE *f = std::fopen(path.c_str(), "rb");
    if (!f) throw std::runtime_error("cannot read " + path);
    uint8_t buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) b.insert(b.end(), buf, buf + n);
    std::fclose(f);
    return b;
}

inline void spill(const std::string &path, const std::vector<uint8_t> &b) {
    FILE *f = std::fopen(path.c_str(), "wb");
    if (!f) throw std::runtime_error("cannot write " + path);
    if (!b.empty() && std::fwrite(b.data(), 1, b.size(), f) != b.size()) throw std::runtime_error("short write " + path);
    std::fclose(f);
}

// Every section's checksum made to match its payload, as far as the section table can be walked (a
// fuzzer's mutations then reach the parsers behind the checksums; the fuzz target writes its inputs so,
// and the corpus test replays the regression inputs so).
inline void redo_checksums(std::vector<uint8_t> &b) {
    if (b.size() < 16 || std::memcmp(b.data(), "KVFLSNAP", 8) != 0) return;
    size_t at = 16;
    while (b.size() - at >= 16) {
        uint64_t n = 0;
        std::memcpy(&n, b.data() + at + 8, 8);
        if (n > b.size() - at - 16) return;
        const uint32_t c = kvflash::crc32(b.data() + at + 16, size_t(n));
        std::memcpy(b.data() + at + 4, &c, 4);
        at += 16 + size_t(n);
    }
}

enum class Outcome { Applied, Refused };

// path as a snapshot for r: peek, read against r's runtime, apply.  Refused: a SnapshotError (its
// message in *why), r unchanged.  Applied: r holds the file's state, which must be sound: the pager's
// invariants hold and one more token evaluates.  Anything else escapes (a finding).
inline Outcome try_restore(Rig &r, const std::string &path, std::string *why = nullptr) {
    try {
        kvflash::Snapshot::peek(path, r.rt.get(), r.summaries.get());
        const kvflash::Snapshot s = kvflash::Snapshot::read(path, r.rt.get(), r.summaries.get());
        s.apply(*r.rt, r.summaries.get());
        r.tokens = s.session().tokens;
        r.logits = s.session().logits;
    } catch (const kvflash::SnapshotError &e) {
        if (why) *why = e.what();
        return Outcome::Refused;
    }
    r.rt->pager().check_invariants();
    if (r.rt->n_past() < r.rt->config().max_ctx) extend(r, 1, uint32_t(r.tokens.size()));
    return Outcome::Applied;
}

}  // namespace snaprig
