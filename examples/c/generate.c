/* kvflash from C: load a GGUF, evaluate prompt token ids, greedy-decode N tokens
 * through the paged pool, print the ids and the pager's stats.
 *
 *   kvflash_generate MODEL.gguf [options] ID [ID ...]
 *   kvflash_generate MODEL.gguf [options] --ids-file FILE   (ids separated by spaces/newlines)
 *
 * options: -n N (tokens to generate, 32), --pool P (pool tokens, 512; 0 = full cache),
 *          --max-ctx M (4096), --kv-type q8_0|f16|q4_0, --policy lru|qk, -t THREADS
 *
 * stdout: "generated: ID ID ..." then "stats: key=value ..." (one line each).
 * Exit status 0 on success, 1 on a kvflash error (its message on stderr), 2 on bad usage.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvflash.h>

static int usage(const char *argv0, const char *why) {
    fprintf(stderr, "%s: %s\nusage: %s MODEL.gguf [-n N] [--pool P] [--max-ctx M] [--kv-type T] "
                    "[--policy lru|qk] [-t THREADS] (ID ... | --ids-file FILE)\n", argv0, why, argv0);
    return 2;
}

/* Parses a whole decimal integer into *out; 0 on success. */
static int parse_long(const char *s, long long *out) {
    char *end = NULL;
    errno = 0;
    *out = strtoll(s, &end, 10);
    return (errno != 0 || end == s || *end != '\0') ? -1 : 0;
}

/* Appends one id to a growing array; 0 on success. */
static int push_id(int32_t **ids, size_t *n, size_t *cap, long long v) {
    if (v < 0 || v > 0x7fffffffLL) return -1;
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 256;
        int32_t *p = (int32_t *)realloc(*ids, nc * sizeof **ids);
        if (!p) return -1;
        *ids = p;
        *cap = nc;
    }
    (*ids)[(*n)++] = (int32_t)v;
    return 0;
}

static int read_ids_file(const char *path, int32_t **ids, size_t *n, size_t *cap) {
    FILE *f = fopen(path, "r");
    long long v;
    int rc = 0;
    if (!f) return -1;
    while (fscanf(f, "%lld", &v) == 1) {
        if (push_id(ids, n, cap, v) != 0) { rc = -1; break; }
    }
    if (rc == 0 && !feof(f)) rc = -1; /* something that is not an integer */
    fclose(f);
    return rc;
}

/* One long main on purpose: the example reads top to bottom, the way an application calls the API. */
int main(int argc, char **argv) {
    struct kvflash_params p = kvflash_default_params();
    struct kvflash_sampling greedy = kvflash_default_sampling();
    const char *model_path = NULL, *ids_file = NULL;
    long long n_gen = 32, threads = 0, v = 0;
    int32_t *ids = NULL, tok = 0;
    size_t n_ids = 0, cap = 0;
    char err[1024] = {0};
    int i, rc = 1;
    kvflash_model *m = NULL;
    kvflash_session *s = NULL;
    int32_t *out = NULL;

    p.max_ctx = 4096;
    p.pool_tokens = 512;
    if (argc < 2) return usage(argv[0], "no model given");
    model_path = argv[1];
    for (i = 2; i < argc; ++i) {
        const char *a = argv[i];
        const int has_val = i + 1 < argc;
        if (!strcmp(a, "-n") && has_val) {
            if (parse_long(argv[++i], &n_gen) || n_gen < 0) return usage(argv[0], "-n needs a count >= 0");
        } else if (!strcmp(a, "--pool") && has_val) {
            if (parse_long(argv[++i], &v) || v < 0 || v > 0x7fffffffLL) return usage(argv[0], "--pool needs a token count");
            p.pool_tokens = (int32_t)v;
        } else if (!strcmp(a, "--max-ctx") && has_val) {
            if (parse_long(argv[++i], &v)) return usage(argv[0], "--max-ctx needs an integer");
            p.max_ctx = v; /* the library checks the range */
        } else if (!strcmp(a, "--kv-type") && has_val) {
            p.kv_type = argv[++i];
        } else if (!strcmp(a, "--policy") && has_val) {
            p.policy = argv[++i];
        } else if (!strcmp(a, "-t") && has_val) {
            if (parse_long(argv[++i], &threads)) return usage(argv[0], "-t needs an integer");
        } else if (!strcmp(a, "--ids-file") && has_val) {
            ids_file = argv[++i];
        } else if (a[0] == '-' && a[1] != '\0' && (a[1] < '0' || a[1] > '9')) {
            return usage(argv[0], "unknown option");
        } else {
            if (parse_long(a, &v) || push_id(&ids, &n_ids, &cap, v)) return usage(argv[0], "token ids are integers >= 0");
        }
    }
    if (ids_file && read_ids_file(ids_file, &ids, &n_ids, &cap) != 0) {
        fprintf(stderr, "%s: cannot read token ids from %s\n", argv[0], ids_file);
        free(ids);
        return 2;
    }
    if (n_ids == 0) {
        free(ids);
        return usage(argv[0], "no prompt token ids");
    }

    m = kvflash_model_load(model_path, (int32_t)threads, err, sizeof err);
    if (!m) { fprintf(stderr, "kvflash: %s\n", err); goto done; }
    s = kvflash_session_new(m, &p, err, sizeof err);
    if (!s) { fprintf(stderr, "kvflash: %s\n", err); goto done; }
    if (kvflash_eval(s, ids, (int32_t)n_ids, NULL) != KVFLASH_OK) goto fail;
    out = (int32_t *)malloc((size_t)(n_gen ? n_gen : 1) * sizeof *out);
    if (!out) { fprintf(stderr, "out of memory\n"); goto done; }
    if (n_gen > 0 && kvflash_sample(s, NULL, &greedy, &tok) != KVFLASH_OK) goto fail;
    for (i = 0; i < n_gen; ++i) {
        out[i] = tok;
        if (i + 1 == n_gen) break; /* the last token is printed, not evaluated */
        if (kvflash_decode(s, tok, &greedy, &tok) != KVFLASH_OK) goto fail;
    }
    printf("generated:");
    for (i = 0; i < n_gen; ++i) printf(" %d", (int)out[i]);
    printf("\n");
    {
        struct kvflash_stats st = kvflash_get_stats(s);
        printf("stats: n_past=%lld pool_tokens=%d n_chunks=%d resident_chunks=%d host_chunks=%d page_outs=%lld "
               "page_ins=%lld bytes_out=%lld bytes_in=%lld resident_bytes=%llu host_bytes=%llu rescores=%lld\n",
               (long long)st.n_past, (int)st.pool_tokens, (int)st.n_chunks, (int)st.resident_chunks,
               (int)st.host_chunks, (long long)st.page_outs, (long long)st.page_ins, (long long)st.bytes_out,
               (long long)st.bytes_in, (unsigned long long)st.resident_bytes, (unsigned long long)st.host_bytes,
               (long long)st.rescores);
    }
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "kvflash: %s\n", kvflash_last_error(s));
done:
    free(out);
    free(ids);
    kvflash_session_free(s);
    kvflash_model_free(m);
    return rc;
}
