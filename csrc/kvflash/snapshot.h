// Session snapshots: a runtime's whole cache state in one versioned, checksummed file,
// so a long context survives a restart without being prefilled again.
//
// A snapshot holds the chunk table (the pager's arrays, its free list and counters),
// the occupied prefix of the pool's rows, the host store's copy of every chunk that
// has one, the sliding-window ring (gemma3), the captured queries, the chunk summaries
// (qk-bound / qk-mean), the recurrent layers' state and its host checkpoints (qwen35), and beside them what the caller adds (SnapshotSession: the
// token history, the last logits, the sampler's generator, an opaque blob for the
// caller's own state).  KV bytes are copied raw: bit-exact both ways.
//
// File (all integers little-endian):
//   preamble  "KVFLSNAP" | u32 format version | u32 section count
//   sections  in a fixed order, each tag[4] | u32 crc32 of the payload | u64 length | payload
//     HEAD  model fingerprint, the kvflash version that wrote it, architecture, KV type, chunk
//           geometry, max_ctx, n_past, and the size of every per-token, per-query and per-layer row
//     PAGR  chunk table          POOL  pool rows       HOST  host-held chunks
//     RING  sliding-window ring  QCAP  captured queries SUMM  chunk summaries
//     TOKS  token history        LOGT  last logits      SAMP  sampler state    APPS  caller's blob
//     RECR  recurrent state (version 3): u32 count, then count x (i64 position, the state's floats):
//           the runtime's host checkpoints, positions ascending, then the state at n_past
// HEAD names the size of everything else, so every section has a largest length its header allows.
//
// Reading is two-phase: read() parses and checks the whole file (magic,
// version, lengths, checksums, internal consistency) into memory; check() compares it
// with a runtime and names the first thing that differs; apply() checks again and only
// then replaces the runtime's state.  Before anything the size of the file is allocated,
// read() walks the preamble and the section table with small reads, holds the file's size
// to a cap (what the session's geometry can need, or the caller's), reads HEAD (a few KiB),
// holds every section's length to what that header allows and compares the header with
// the runtime it is for (when given one); only then is the file read.  Every refusal is a SnapshotError (a std::invalid_argument: ValueError in
// Python) and changes nothing.
//
// Writing is atomic: a temporary file in the destination's directory, written, fsynced,
// then renamed over the destination (and the directory fsynced); on any failure the
// temporary file is removed and the destination is as it was.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvflash/runtime.h"
#include "kvflash/sampling.h"
#include "kvflash/scoring.h"

namespace kvflash {

// 2: HEAD records the kvflash version and every row size; the model fingerprint covers the whole
// GGUF header and tensor table.  Version 1 files are refused (their fingerprints cannot be compared).
// 3: a twelfth section, RECR, carries the recurrent layers' state and host checkpoints; HEAD ends
// with their geometry.  Version 2 files (the first eleven sections, no recurrent state) still load
// into a session without recurrent layers and are refused, saying why, by one with them.
constexpr uint32_t kSnapshotVersion = 3;
constexpr uint32_t kSnapshotOldestVersion = 2;
// The largest caller's blob (APPS) and sampler state (SAMP) a snapshot holds: what a file may
// have beyond its geometry's KV and tables.
constexpr uint64_t kSnapshotMaxAppBytes = 16ull << 20;
constexpr uint64_t kSnapshotMaxSamplerBytes = 1ull << 20;

// A file that is not a snapshot this build reads, or one that does not fit the runtime.
struct SnapshotError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// CRC-32 (IEEE 802.3, zlib's crc32) of n bytes, continuing from crc.
uint32_t crc32(const uint8_t *data, size_t n, uint32_t crc = 0);

// 64-bit fingerprint (FNV-1a) of a GGUF file, cheap at any size: its byte size, every byte
// before the tensor data (the GGUF header, all metadata, the whole tensor table: names,
// shapes, types, offsets), and of each tensor's data 4 KiB at its start, middle and end (the
// whole tensor below 12 KiB).  Remembered per file (device, inode, size, mtime) for the
// process.  std::runtime_error if it cannot be read, std::invalid_argument if ggml's parser
// does not read it as a GGUF.
uint64_t model_fingerprint(const std::string &path);

// What the caller keeps beside the runtime.
struct SnapshotSession {
    std::vector<int32_t> tokens;  // the history: tokens.size() == n_past
    std::vector<float> logits;    // after the last token (empty: none)
    Sampler sampler;              // the seeded generator, as it stands
    std::string app;              // opaque to the core (the Python session's JSON)
};

// The geometry a runtime's state depends on (HEAD).  A snapshot fits a runtime when every
// field but n_past agrees.
struct SnapshotHeader {
    uint64_t fingerprint = 0, model_bytes = 0;
    std::string kvflash_version;  // the kvflash that wrote the file (not compared)
    std::string arch, kv_type;
    int32_t n_layer = 0, eval_layers = 0, chunk_tokens = 0, pool_tokens = 0, sink_chunks = 0, tail_window_chunks = 0;
    int32_t swa_tokens = 0, n_swa_layers = 0, capture_queries = 0;
    int64_t max_ctx = 0, n_past = 0;
    uint64_t chunk_bytes = 0;
    uint8_t full_cache = 0, summaries = 0;
    std::vector<int32_t> paged_layers;             // model layer of each pool layer
    std::vector<uint64_t> row_bytes_k, row_bytes_v;  // per pool layer
    int32_t n_vocab = 0;                           // the logits' length
    uint64_t query_floats = 0;                     // one captured query over every paged layer
    uint64_t summary_floats = 0;                   // one chunk's summary row over every paged layer
    std::vector<uint64_t> ring_bytes_k, ring_bytes_v;  // per sliding-window layer
    uint32_t version = kSnapshotVersion;           // the file's format (not compared)
    int32_t recurrent_layers = 0;                  // layers with a recurrent state (0: none, or a version 2 file)
    uint64_t recurrent_floats = 0;                 // one checkpoint of that state: every recurrent layer's floats
    int32_t recurrent_checkpoints = 0;             // host checkpoints the writer kept at most (not compared)
};

// What Snapshot::peek reads: the header and the caller's blob, with the file's structure checked.
struct SnapshotPeek {
    SnapshotHeader header;
    std::string app;
    uint64_t file_bytes = 0;
};

class Snapshot {
public:
    // The header rt would write (summaries: its observer, or nullptr); reads the model
    // file for the fingerprint.
    static SnapshotHeader header_of(const Runtime &rt, const ChunkSummaries *summaries);
    // Write rt's state and s to path, atomically.  std::runtime_error naming the OS error
    // (path is left as it was), std::invalid_argument when s.tokens disagrees with n_past.
    static void save(const Runtime &rt, const ChunkSummaries *summaries, const SnapshotSession &s,
                     const std::string &path);
    // Reads and checks the whole file; SnapshotError for anything wrong with it
    // (std::runtime_error when it cannot be opened or read).  fit (with summaries, its
    // observer or nullptr): the runtime the file is for; the file is held to the largest
    // snapshot of its geometry (max_file_bytes), and its header compared with the runtime's
    // (check's header fields).  max_bytes > 0: a cap of the caller's as well (the error says
    // which cap).  All before the file's size is allocated.
    static Snapshot read(const std::string &path, const Runtime *fit = nullptr,
                         const ChunkSummaries *summaries = nullptr, uint64_t max_bytes = 0);
    // The header and the caller's blob alone (a few small reads: the structure, the caps and
    // the section lengths are checked as read() checks them, the KV sections are not read): what
    // a caller needs to build the session a file fits.  fit is not compared here: only its
    // geometry caps the file.
    static SnapshotPeek peek(const std::string &path, const Runtime *fit = nullptr,
                             const ChunkSummaries *summaries = nullptr, uint64_t max_bytes = 0);
    // The largest file a snapshot with h's geometry can be (any n_past up to max_ctx, with the
    // largest sampler state and caller's blob); SnapshotError if that does not fit 64 bits.
    static uint64_t max_file_bytes(const SnapshotHeader &h);

    const SnapshotHeader &header() const { return head_; }
    const SnapshotSession &session() const { return sess_; }
    // SnapshotError naming the first field where the snapshot and rt (with summaries,
    // its observer or nullptr) differ.
    void check(const Runtime &rt, const ChunkSummaries *summaries) const;
    // check(), reserve the host buffers (HostStoreFull / bad_alloc: nothing changed),
    // then replace rt's cache state with the snapshot's.
    void apply(Runtime &rt, ChunkSummaries *summaries) const;

    struct Body;

private:
    SnapshotHeader head_;
    SnapshotSession sess_;
    std::shared_ptr<const Body> body_;
};

}  // namespace kvflash
