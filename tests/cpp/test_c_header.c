/* Proves kvflash.h compiles as C and that errors come back as values, not aborts.
 * With KVFLASH_TEST_MODEL=/path/to/model.gguf it also decodes a few tokens. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvflash/kvflash.h"

int main(void) {
    char err[512] = {0};
    struct kvflash_params p = kvflash_default_params();
    if (p.chunk_tokens != 64 || p.pool_tokens != 0 || strcmp(p.kv_type, "q8_0") != 0) {
        fprintf(stderr, "unexpected defaults\n");
        return 1;
    }
    if (kvflash_model_load("/nonexistent/model.gguf", 1, err, sizeof err) != NULL || strstr(err, "no such file") == NULL) {
        fprintf(stderr, "missing file not reported: '%s'\n", err);
        return 1;
    }
    const char *path = getenv("KVFLASH_TEST_MODEL");
    if (!path) {
        printf("test_c_header: header and error paths ok (set KVFLASH_TEST_MODEL to decode)\n");
        return 0;
    }
    kvflash_model *m = kvflash_model_load(path, 1, err, sizeof err);
    if (!m) { fprintf(stderr, "load failed: %s\n", err); return 1; }
    p.max_ctx = 2048;
    p.pool_tokens = 256; /* below the minimum: must fail cleanly */
    if (kvflash_session_new(m, &p, err, sizeof err) != NULL || strstr(err, "minimum") == NULL) {
        fprintf(stderr, "small pool not rejected: '%s'\n", err);
        return 1;
    }
    p.pool_tokens = 512;
    kvflash_session *s = kvflash_session_new(m, &p, err, sizeof err);
    if (!s) { fprintf(stderr, "session failed: %s\n", err); return 1; }
    int32_t toks[3] = {1, 2, 3};
    float *logits = malloc(sizeof(float) * (size_t)kvflash_model_n_vocab(m));
    if (kvflash_eval(s, toks, 3, logits) != KVFLASH_OK) { fprintf(stderr, "eval: %s\n", kvflash_last_error(s)); return 1; }
    int32_t bad = -5;
    if (kvflash_eval(s, &bad, 1, logits) != KVFLASH_EINVAL) { fprintf(stderr, "bad token accepted\n"); return 1; }
    struct kvflash_stats st = kvflash_get_stats(s);
    printf("test_c_header: n_past=%lld resident=%llu bytes\n", (long long)st.n_past, (unsigned long long)st.resident_bytes);
    free(logits);
    kvflash_session_free(s);
    kvflash_model_free(m);
    return st.n_past == 3 ? 0 : 1;
}
