// libFuzzer target for the GGUF loader: each input is written to a file and loaded
// through the C API (kvflash_model_load: ggml's gguf parser, then kvflash's key,
// shape, type and extent checks); a file that loads gets a session and a 4-token eval.
// Any input may be refused with a message; none may crash, leak or trip ASan/UBSan.
// Built by bench/fuzz/CMakeLists.txt (clang), run by bench/fuzz.py --target gguf.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <unistd.h>

#include "ggml.h"
#include "kvflash/kvflash.h"

static std::string g_path;

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    // gguf_init logs every refusal; the fuzzer's output is its own.
    ggml_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    const char *dir = std::getenv("KVFLASH_FUZZ_DIR");
    g_path = std::string(dir ? dir : "/dev/shm") + "/kvflash-fuzz-" + std::to_string(::getpid()) + ".gguf";
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    FILE *f = std::fopen(g_path.c_str(), "wb");
    if (!f) std::abort();
    if (size && std::fwrite(data, 1, size, f) != size) std::abort();
    std::fclose(f);
    char err[512] = {0};
    kvflash_model *m = kvflash_model_load(g_path.c_str(), 1, err, sizeof err);
    if (!m) {
        if (!err[0]) std::abort();  // a refusal must say why
        return 0;
    }
    kvflash_params p = kvflash_default_params();
    p.max_ctx = 64;
    p.kv_type = "f16";
    kvflash_session *s = kvflash_session_new(m, &p, err, sizeof err);
    if (s) {
        const int32_t toks[4] = {0, 1, 2, 3};
        kvflash_eval(s, toks, 4, nullptr);  // may refuse (ids past a tiny vocabulary): a status, not a crash
        kvflash_session_free(s);
    }
    kvflash_model_free(m);
    return 0;
}
