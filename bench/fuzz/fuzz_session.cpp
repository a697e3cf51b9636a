// libFuzzer target for the session's JSON inside a snapshot (csrc/kvflash/session_file.h, json.h):
// each input is checked as a snapshot's session state against a fixed header, as Session::restore,
// kvflash_restore and kvflash_session_load check it.  It is refused (a SnapshotError with a message)
// or accepted; nothing may crash, leak, trip ASan/UBSan or throw anything else.  Every input the JSON
// parser reads must also write back to text that reads as the same value (dump(parse(dump(v)))).
//   KVFLASH_FUZZ_WRITE_SEEDS=DIR  write seed documents (each policy form, valid) to DIR and exit
// Built by bench/fuzz/CMakeLists.txt (clang), run by bench/fuzz.py.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "kvflash/json.h"
#include "kvflash/session_file.h"

namespace {

kvflash::SnapshotHeader header() {
    kvflash::SnapshotHeader h;
    h.max_ctx = 2048;
    h.chunk_tokens = 64;
    h.pool_tokens = 512;
    h.sink_chunks = 1;
    h.tail_window_chunks = 4;
    h.kv_type = "q8_0";
    h.capture_queries = 40;
    return h;
}

const char *const kSeeds[] = {
    R"({"kvflash_session":2,"config":{"max_ctx":2048,"kvflash":512,"tau":64,"kv_type":"q8_0","chunk_tokens":64,)"
    R"("sink_chunks":1,"tail_window_chunks":4,"ubatch":512,"reeval_tokens":64,"seed":null,"allow_long_ctx":false,)"
    R"("exact":false,"exact_draft":null,"exact_prefill":false},"policy":{"name":"lru"},)"
    R"("state":{"since_rescore":3,"rescores":0,"last_scores":null}})",
    R"({"kvflash_session":2,"config":{"max_ctx":2048,"kvflash":512,"tau":16,"kv_type":"q8_0","chunk_tokens":64,)"
    R"("sink_chunks":1,"tail_window_chunks":4,"ubatch":512,"reeval_tokens":64,"seed":18446744073709551615,)"
    R"("allow_long_ctx":true,"exact":true,"exact_draft":4,"exact_prefill":true},"policy":{"name":"qk","qk":)"
    R"({"mode":"keys","n_queries":8,"smooth_width":5,"aggregate":"peak","contrast":32,"spread":4,"layers":"auto",)"
    R"("carry":16}},"state":{"since_rescore":0,"rescores":7,"last_scores":[1.5,-0.25,Infinity,1e-05]}})",
    R"({"kvflash_session":2,"config":{"max_ctx":2048,"kvflash":512,"tau":64,"kv_type":"q8_0","chunk_tokens":64,)"
    R"("sink_chunks":1,"tail_window_chunks":4,"ubatch":512,"reeval_tokens":64,"seed":0,"allow_long_ctx":false,)"
    R"("exact":false,"exact_draft":null,"exact_prefill":false},"policy":{"name":"qk-bound","qk":{"mode":"bound",)"
    R"("n_queries":1,"smooth_width":5,"aggregate":"chunk","contrast":0,"spread":0,"layers":null,"carry":0}},)"
    R"("state":{"since_rescore":0,"rescores":1,"last_scores":[]}})",
    R"({"kvflash_session":2,"config":{"max_ctx":2048,"kvflash":512,"tau":64,"kv_type":"q8_0","chunk_tokens":64,)"
    R"("sink_chunks":1,"tail_window_chunks":4,"ubatch":512,"reeval_tokens":64,"seed":1,"allow_long_ctx":false,)"
    R"("exact":false,"exact_draft":0,"exact_prefill":false},"policy":{"name":"drafter","drafter":{"n_queries":16,)"
    R"("smooth_width":5,"kv_type":"q8_0","layers":null,"pool":1024,"aggregate":"max","contrast":32,"spread":4}},)"
    R"("state":{"since_rescore":0,"rescores":2,"last_scores":[0.5]}})",
    R"({"kvflash_session":2,"config":{"max_ctx":2048,"kvflash":512,"tau":64,"kv_type":"q8_0","chunk_tokens":64,)"
    R"("sink_chunks":1,"tail_window_chunks":4,"ubatch":512,"reeval_tokens":64,"seed":null,"allow_long_ctx":false,)"
    R"("exact":false,"exact_draft":null,"exact_prefill":false},"policy":{"name":"keep\u00e9\"s","settings":{"k":[1,)"
    R"({"x":null}]}},"state":{"since_rescore":0,"rescores":0,"last_scores":null}})",
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    if (const char *seeds = std::getenv("KVFLASH_FUZZ_WRITE_SEEDS")) {
        int k = 0;
        for (const char *s : kSeeds) {
            std::ofstream(std::string(seeds) + "/seed-" + std::to_string(k++) + ".json", std::ios::binary) << s;
            kvflash::parse_session_app(s, header(), "seed");   // a seed that does not pass is a bug here
        }
        std::printf("%d seeds in %s\n", k, seeds);
        std::exit(0);
    }
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const std::string text(reinterpret_cast<const char *>(data), size);
    try {
        const kvflash::json::Value v = kvflash::json::parse(text);
        const std::string once = v.dump();
        if (kvflash::json::parse(once).dump() != once) std::abort();   // what it writes reads back the same
        (void)v.repr();
    } catch (const kvflash::json::JsonError &e) {
        if (!*e.what()) std::abort();
    }
    try {
        kvflash::parse_session_app(text, header(), "fuzz");
    } catch (const kvflash::SnapshotError &e) {
        if (!*e.what()) std::abort();   // a refusal says why
    }
    return 0;
}
