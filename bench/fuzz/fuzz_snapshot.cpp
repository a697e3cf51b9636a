// libFuzzer target for snapshot files: each input, its section checksums redone where its section table
// can be walked (so mutations reach the parsers behind them; the checksum refusals themselves are the
// corpus test's), is written to a file and read as a snapshot against each tiny runtime of
// tests/cpp/snapshot_rig.h: Snapshot::peek, Snapshot::read against the runtime, apply.  A file may be
// refused (a SnapshotError) or applied, and an applied one must be sound (the pager's invariants hold,
// one more token evaluates); nothing may crash, leak, trip ASan/UBSan or throw anything else.
//   KVFLASH_FUZZ_MODELS=DIR  tests/snapshot_models.py's models (required)
//   KVFLASH_FUZZ_DIR=DIR     where the input file is written (default /dev/shm)
//   KVFLASH_FUZZ_WRITE_SEEDS=DIR  write seed snapshots (each runtime at a few states) to DIR and exit
// Built by bench/fuzz/CMakeLists.txt (clang), run by bench/fuzz.py.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <unistd.h>

#include "ggml.h"
#include "snapshot_rig.h"

static std::vector<snaprig::Rig> *g_rigs = nullptr;
static std::string g_path;
static long g_inputs = 0, g_applied = 0;  // applied: against any of the runtimes

static void report() {
    std::fprintf(stderr, "fuzz_snapshot: %ld inputs, %ld applied to a runtime, the rest refused\n", g_inputs, g_applied);
}

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    ggml_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    const char *models = std::getenv("KVFLASH_FUZZ_MODELS");
    if (!models) {
        std::fprintf(stderr, "fuzz_snapshot: set KVFLASH_FUZZ_MODELS to tests/snapshot_models.py's output\n");
        std::exit(2);
    }
    g_rigs = new std::vector<snaprig::Rig>(snaprig::make_rigs(models));
    const char *dir = std::getenv("KVFLASH_FUZZ_DIR");
    g_path = std::string(dir ? dir : "/dev/shm") + "/kvflash-fuzz-" + std::to_string(::getpid()) + ".kvsnap";
    if (const char *seeds = std::getenv("KVFLASH_FUZZ_WRITE_SEEDS")) {
        int k = 0;
        for (snaprig::Rig &r : *g_rigs)
            for (int32_t n : {0, 7, 40, 300, 600}) {
                snaprig::fill(r, n, uint32_t(n) + 1);
                snaprig::save(r, std::string(seeds) + "/" + r.name + "-" + std::to_string(n) + ".kvsnap");
                ++k;
            }
        std::printf("%d seeds in %s\n", k, seeds);
        std::exit(0);
    }
    for (snaprig::Rig &r : *g_rigs) snaprig::fill(r, 300, 3);  // a live state to restore over
    std::atexit(report);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    std::vector<uint8_t> b(data, data + size);
    snaprig::redo_checksums(b);
    snaprig::spill(g_path, b);
    ++g_inputs;
    bool applied = false;
    for (snaprig::Rig &r : *g_rigs) {
        const int64_t n_past = r.rt->n_past();
        std::string why;
        if (snaprig::try_restore(r, g_path, &why) == snaprig::Outcome::Refused) {
            if (why.empty() || r.rt->n_past() != n_past) std::abort();  // a refusal says why, and changes nothing
        } else {
            applied = true;
        }
    }
    g_applied += applied;
    return 0;
}
