/* kvflash C API: a GGUF model decoding through a fixed-size, paged KV pool.
 *
 * For llama.cpp-style applications written in C or C++.  Handles are opaque;
 * a model (weights) is shared by any number of sessions (per-conversation
 * state).  Functions that can fail return 0 on success and a negative code
 * otherwise; the message is kept in the session (or written to err for the
 * constructors).  Nothing here aborts the process on bad input.
 *
 *   struct kvflash_params p = kvflash_default_params();
 *   p.max_ctx = 32768; p.pool_tokens = 2048;           // 0 = full cache
 *   kvflash_model   *m = kvflash_model_load("model.gguf", 0, err, sizeof err);
 *   kvflash_session *s = kvflash_session_new(m, &p, err, sizeof err);
 *   kvflash_eval(s, prompt, n_prompt, logits);          // logits: n_vocab floats
 */
#ifndef KVFLASH_H
#define KVFLASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvflash_model kvflash_model;
typedef struct kvflash_session kvflash_session;

enum kvflash_status {
    KVFLASH_OK = 0,
    KVFLASH_EINVAL = -1,   /* bad argument (message says which) */
    KVFLASH_ERANGE = -2,   /* position / token outside the allowed range */
    KVFLASH_ERUNTIME = -3, /* the backend failed (allocation, compute) */
};

struct kvflash_params {
    int64_t max_ctx;            /* logical context in tokens */
    int32_t pool_tokens;        /* resident pool (>= 512 with the defaults); 0 = full cache */
    const char *kv_type;        /* "q8_0" (default), "f16", "q4_0" */
    int32_t chunk_tokens;       /* paging granularity (64) */
    int32_t sink_chunks;        /* leading chunks never evicted (1) */
    int32_t tail_window_chunks; /* chunks before the append head never evicted (4) */
    int32_t ubatch;             /* prefill ubatch while the prompt fits the pool (512) */
};

struct kvflash_stats {
    int64_t n_past;
    int64_t page_outs, page_ins, bytes_out, bytes_in;
    int32_t resident_chunks, host_chunks;
    uint64_t resident_bytes; /* device KV bytes (the pool, plus sliding-window rings) */
    uint64_t host_bytes;     /* KV bytes paged out to the host store */
};

struct kvflash_params kvflash_default_params(void);

/* n_threads <= 0: all cores.  Returns NULL on failure with the reason in err. */
kvflash_model *kvflash_model_load(const char *path, int32_t n_threads, char *err, size_t err_len);
void kvflash_model_free(kvflash_model *model);
int32_t kvflash_model_n_vocab(const kvflash_model *model);
int64_t kvflash_model_n_ctx_train(const kvflash_model *model);

/* The session keeps the model alive until both are freed. */
kvflash_session *kvflash_session_new(kvflash_model *model, const struct kvflash_params *params, char *err,
                                     size_t err_len);
void kvflash_session_free(kvflash_session *session);

/* Append n tokens at position n_past; logits (n_vocab floats, last token) may be NULL. */
int kvflash_eval(kvflash_session *session, const int32_t *tokens, int32_t n, float *logits);
int64_t kvflash_n_past(const kvflash_session *session);
/* Forget positions >= n_past. */
int kvflash_truncate(kvflash_session *session, int64_t n_past);
void kvflash_reset(kvflash_session *session);
/* Repage the pool to the chunks with the highest scores (one per chunk, n <= chunks). */
int kvflash_reselect(kvflash_session *session, const float *scores, int32_t n);
struct kvflash_stats kvflash_get_stats(const kvflash_session *session);
/* The last error message of this session ("" if none). */
const char *kvflash_last_error(const kvflash_session *session);

#ifdef __cplusplus
}
#endif

#endif /* KVFLASH_H */
