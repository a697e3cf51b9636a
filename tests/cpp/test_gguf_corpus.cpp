// The corrupt-GGUF corpus through the C API (built under ASan/UBSan in CI):
//   test_gguf_corpus DIR   -- DIR written by tests/gguf_corpus.py
// Every bad-*.gguf must give NULL and a message from kvflash_model_load; ok.gguf must
// load, open a session and evaluate a few tokens.  Exit status: the number of files
// that did otherwise (a crash is the sanitizer's report).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "kvflash/kvflash.h"

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
        return 2;
    }
    std::vector<std::filesystem::path> files;
    for (const auto &e : std::filesystem::directory_iterator(argv[1]))
        if (e.path().extension() == ".gguf") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    int wrong = 0, bad = 0, good = 0;
    for (const auto &p : files) {
        const std::string name = p.filename().string();
        char err[512] = {0};
        kvflash_model *m = kvflash_model_load(p.c_str(), 1, err, sizeof err);
        if (name.rfind("bad-", 0) == 0) {
            ++bad;
            if (m || !err[0]) {
                std::fprintf(stderr, "%s: %s\n", name.c_str(), m ? "loaded" : "NULL without a message");
                ++wrong;
            }
            if (m) kvflash_model_free(m);
            continue;
        }
        ++good;
        if (!m) {
            std::fprintf(stderr, "%s: did not load: %s\n", name.c_str(), err);
            ++wrong;
            continue;
        }
        kvflash_params prm = kvflash_default_params();
        prm.max_ctx = 64;
        kvflash_session *s = kvflash_session_new(m, &prm, err, sizeof err);
        const int32_t toks[4] = {1, 2, 3, 4};
        if (!s || kvflash_eval(s, toks, 4, nullptr) != KVFLASH_OK) {
            std::fprintf(stderr, "%s: session or eval failed: %s\n", name.c_str(), s ? kvflash_last_error(s) : err);
            ++wrong;
        }
        if (s) kvflash_session_free(s);
        kvflash_model_free(m);
    }
    std::printf("gguf corpus: %d corrupt files refused, %d good loaded, %d wrong\n", bad - wrong, good, wrong);
    return (bad < 40 || good < 1) ? 1 : wrong;
}
