/* kvflash C API: a GGUF model decoding through a fixed-size, paged KV pool.
 *
 * For llama.cpp-style applications written in C or C++.  Handles are opaque;
 * a model (weights) is shared by any number of sessions (per-conversation
 * state).  Functions that can fail return KVFLASH_OK (0) or a negative status;
 * the message is kept in the session (kvflash_last_error) or written to err
 * for the constructors.  Nothing here aborts the process on bad input, and no
 * C++ exception crosses this interface.
 *
 *   struct kvflash_params p = kvflash_default_params();
 *   p.max_ctx = 32768; p.pool_tokens = 2048; p.policy = "qk";   // pool 0 = full cache
 *   kvflash_model   *m = kvflash_model_load("model.gguf", 0, err, sizeof err);
 *   kvflash_session *s = kvflash_session_new(m, &p, err, sizeof err);
 *   struct kvflash_sampling g = kvflash_default_sampling();       // greedy
 *   int32_t tok;
 *   kvflash_eval(s, prompt, n_prompt, NULL);                      // the prompt
 *   kvflash_sample(s, NULL, &g, &tok);                            // first token
 *   for (int i = 0; i < n; ++i) kvflash_decode(s, tok, &g, &tok); // one token a call
 *
 * Threads: a model and every session over it share one ggml backend (its worker
 * threads and scratch buffer); the core serializes their graph computes with a
 * lock per model, so different sessions, over one model or not, may be used from
 * different threads at once.  One session serves one call at a time: a call
 * that overlaps another on the same session returns KVFLASH_EBUSY and does
 * nothing (serialize calls on a session yourself).  The readers (kvflash_n_past,
 * kvflash_n_chunks, kvflash_get_stats, kvflash_get_logits, kvflash_last_error)
 * never make a call fail and never wait: while a call runs on the session they
 * answer busy (since API version 6; see each), otherwise the call that starts
 * next waits the few loads they take.  kvflash_default_params,
 * kvflash_default_sampling and kvflash_version are safe from any thread, and so is every
 * kvflash_vocab function (a vocabulary never changes after it is loaded).
 *
 * Compatibility: KVFLASH_API_VERSION counts C API revisions.  struct
 * kvflash_params begins with its own size: a program compiled against an older
 * header passes its smaller struct_size and the library reads only the fields
 * it has, using defaults for the rest.
 *
 * Build: find_package(kvflash CONFIG) and link kvflash::kvflash, with
 * -Dkvflash_DIR="$(python -m kvflash --cmake-dir)" for a pip-installed kvflash;
 * or pkg-config (PKG_CONFIG_PATH="$(python -m kvflash --pkgconfig-dir)").
 */
#ifndef KVFLASH_H
#define KVFLASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVFLASH_API_VERSION 15

typedef struct kvflash_model kvflash_model;
typedef struct kvflash_session kvflash_session;

enum kvflash_status {
    KVFLASH_OK = 0,
    KVFLASH_EINVAL = -1,   /* bad argument (the message says which) */
    KVFLASH_ERANGE = -2,   /* position / token / chunk outside the allowed range */
    KVFLASH_ERUNTIME = -3, /* the backend failed (allocation, compute, I/O) */
    KVFLASH_EBUSY = -4,    /* since API version 4: another thread is in a call on this session; nothing done */
    KVFLASH_ESIZE = -5,    /* since API version 9: the output buffer is too small; *n_out has the size needed */
};

struct kvflash_params {
    size_t struct_size;         /* sizeof(struct kvflash_params): set by kvflash_default_params() */
    int64_t max_ctx;            /* logical context in tokens, 1 .. kvflash_max_context() */
    int32_t pool_tokens;        /* resident pool (>= 512 with the defaults); 0 = full cache */
    const char *kv_type;        /* "q8_0" (default), "f16", "q4_0" */
    int32_t chunk_tokens;       /* paging granularity (64); 0 (since API version 13): auto, by the pool's size:
                                   the largest of 64, 32, 16 that leaves >= 24 chunks free of the sink and
                                   tail window (a 512-token pool: 16), prompts still read in 64-token pieces */
    int32_t sink_chunks;        /* leading chunks never evicted (1) */
    int32_t tail_window_chunks; /* chunks before the append head never evicted (4) */
    int32_t ubatch;             /* prefill ubatch while the prompt fits the pool (512) */
    /* -- since API version 2 -- */
    const char *policy;         /* "qk" (the model's own queries score chunks; the default since API version
                                   14, as Python's Session: it was "lru", which a caller built against API
                                   version 1, without this field, still gets) or "lru" (recency);
                                   since API version 9 also "qk-bound" / "qk-mean" (the last query against
                                   the sealed chunks' key summaries; the qk_* fields but qk_smooth_width unused)
                                   and "drafter" (a second model scores them: params.drafter) */
    int32_t tau;                /* qk: rescore every max(tau, n_past / 45) decoded tokens (64) */
    int32_t qk_queries;         /* qk: how many of the latest queries score a rescore (8) */
    int32_t reeval_tokens;      /* qk: prompt tokens re-read after a prompt rescore moved chunks (64) */
    uint64_t seed;              /* sampler seed (0) */
    /* -- since API version 3: qk scores tokens, then each chunk takes its peak token -- */
    int32_t qk_contrast;        /* minus the attention of the queries this many tokens earlier (64; 0: off) */
    int32_t qk_spread;          /* each token takes the peak of this many tokens either side (8) */
    int32_t qk_layers;          /* the first N paged layers score (-1: a quarter, at least 8; 0: all) */
    /* -- since API version 4 -- */
    int64_t max_host_bytes;     /* cap on the host store of paged-out chunks (0: none); a call that would
                                   page out past it returns KVFLASH_ERUNTIME ("host store full") and
                                   leaves the session as it was */
    /* -- since API version 5 -- */
    int32_t qk_carry;           /* qk: each token also takes, a hair lower, the scores of this many tokens
                                   before it, so a value's chunk ranks behind its key's (16; 0: off) */
    /* -- since API version 8 -- */
    int32_t exact;              /* 1: exact mode, the full cache's tokens from the paged session (0) */
    int32_t exact_prefill;      /* 1: prompts attend the whole context, decode reads the pool (0: off, the
                                   default); 2 (since API version 12): auto, on the CPU backend up to position
                                   16384 where the model's paged layers are at most a quarter of its layers, up
                                   to 4096 elsewhere, pieces past it read over the pool */
    int32_t exact_draft;        /* exact mode: drafts per round, 0 .. 16 (-1: adaptive, the default) */
    /* -- since API version 9 -- */
    const char *qk_aggregate;   /* "qk": token scores to chunk scores: "peak" (default: qk_contrast, qk_spread,
                                   qk_carry apply), "chunk" (each chunk's attention mass), "token" (token scores
                                   smoothed over qk_smooth_width, a chunk's mean); the latter two ignore contrast,
                                   spread and carry */
    int32_t qk_smooth_width;    /* "token": the moving average's width (5) */
    kvflash_model *drafter;     /* policy "drafter": the drafter model (a handle of its own, or the target's;
                                   kept alive by the session), whose attention over the history scores the
                                   chunks; a vocabulary unlike the target's goes through the byte-span bridge */
    int32_t drafter_layers;     /* the drafter's first N layers evaluate (0: a quarter, at least 8, through its
                                   first full-attention layer) */
    int32_t drafter_pool;       /* the drafter's own pool in tokens (1024; 0: a full cache) */
    int32_t drafter_queries;    /* the drafter's latest queries that score (16) */
    /* -- since API version 10 -- */
    int32_t prefill_rescore;    /* qk policies: rescore every N pooled pieces while a prompt is read, so
                                   later pieces attend the best-ranked chunks beside the recent half of the
                                   pool (0: off, the default; ignored with exact_prefill) */
    /* -- since API version 11 -- */
    int32_t prefill_reread;     /* 1: a scored session whose prompt outgrew the pool reads the chunks its settle
                                   chose again in place with exact attention over the whole context (CPU
                                   backend; 0: off, the default; ignored with exact_prefill) */
    /* -- since API version 15 -- */
    int32_t qk_windows;         /* qk "peak": the last qk_windows * qk_queries queries score as that many windows
                                   of qk_queries, each against its own contrast; a chunk ranks by its best rank
                                   in any window, so a prompt ending in format tokens still scores with the
                                   question's queries (1 .. 16; 3, the default, reads the last 24 queries) */
};

/* Sampling: temperature <= 0 is greedy (argmax, lowest id on ties); otherwise
 * top_k (<= 0: all), then top_p (nucleus mass in (0, 1]), min_p (drop tokens
 * below min_p * p(max), in [0, 1)), drawn with the session's seeded generator. */
struct kvflash_sampling {
    float temperature;
    int32_t top_k;
    float top_p;
    float min_p;
};

struct kvflash_stats {
    int64_t n_past;
    int64_t page_outs, page_ins, bytes_out, bytes_in;
    int32_t resident_chunks, host_chunks;
    uint64_t resident_bytes; /* device KV bytes (the pool, plus sliding-window rings) */
    uint64_t host_bytes;     /* KV bytes paged out to the host store */
    int32_t pool_tokens;     /* the pool's size in tokens (max_ctx rounded up for the full cache) */
    int32_t n_chunks;        /* chunks materialised: ceil(n_past / chunk_tokens) */
    int64_t rescores;        /* policy rescores run (qk), over the session's life */
};

/* Per-chunk state bits (kvflash_chunk_flags). */
enum kvflash_chunk_flag {
    KVFLASH_CHUNK_RESIDENT = 1,  /* holds a pool block: attention sees it */
    KVFLASH_CHUNK_ON_HOST = 2,   /* a copy is in the host store (the only one when not resident) */
    KVFLASH_CHUNK_PROTECTED = 4, /* sink or tail window: never evicted */
};

/* "0.1.0" etc.; and the largest max_ctx the library addresses. */
const char *kvflash_version(void);
int64_t kvflash_max_context(void);

struct kvflash_params kvflash_default_params(void);
struct kvflash_sampling kvflash_default_sampling(void);

/* n_threads <= 0: the machine's cores.  Returns NULL on failure with the reason in err;
 * nothing is left allocated then. */
kvflash_model *kvflash_model_load(const char *path, int32_t n_threads, char *err, size_t err_len);
/* Since API version 7: the same with contiguous layer ranges on `kvflash rpc-server` processes (ggml's
 * RPC protocol: no authentication, trusted networks only).  rpc: comma-separated "host:port" endpoints;
 * tensor_split (NULL: equal shares, none local): n_split weights, one per endpoint and optionally one more
 * for this process's share (the last layers).  The embedding and output head stay here; sessions over the
 * model keep those layers' pool slices on their servers.  A server that does not answer is an error in
 * err, never an abort; a server that goes away while the model is loaded is (ggml's client aborts). */
kvflash_model *kvflash_model_load_rpc(const char *path, int32_t n_threads, const char *rpc, const float *tensor_split,
                                      size_t n_split, char *err, size_t err_len);
void kvflash_model_free(kvflash_model *model);
int32_t kvflash_model_n_vocab(const kvflash_model *model);
int64_t kvflash_model_n_ctx_train(const kvflash_model *model);

/* The session keeps the model alive until both are freed (free them in any order).
 * Returns NULL on failure with the reason in err (a bad field of params, a pool
 * below the minimum, a max_ctx above kvflash_max_context(), no memory). */
kvflash_session *kvflash_session_new(kvflash_model *model, const struct kvflash_params *params, char *err,
                                     size_t err_len);
void kvflash_session_free(kvflash_session *session);

/* Append n tokens (a prompt) at position n_past.  With policy "qk", once the
 * context has outgrown the pool the policy picks the residents against the
 * prompt's tail and the last reeval_tokens tokens are read again, so the next
 * token already attends to the chosen chunks.  logits (n_vocab floats, after the
 * last token) may be NULL; the session keeps them either way. */
int kvflash_eval(kvflash_session *session, const int32_t *tokens, int32_t n, float *logits);
/* One generation step: append token, let the policy rescore on its schedule, and
 * sample the next token into *next with sp (NULL: greedy). */
int kvflash_decode(kvflash_session *session, int32_t token, const struct kvflash_sampling *sp, int32_t *next);
/* Sample from logits (n_vocab floats; NULL: the session's last logits) into *token. */
int kvflash_sample(kvflash_session *session, const float *logits, const struct kvflash_sampling *sp, int32_t *token);
int kvflash_set_seed(kvflash_session *session, uint64_t seed);
/* The last logits (n_vocab floats), or NULL before any eval and while another thread is
 * in a call on the session.  Valid until the next call on the session. */
const float *kvflash_get_logits(const kvflash_session *session);

/* Tokens in the context; KVFLASH_EBUSY while another thread is in a call on the session. */
int64_t kvflash_n_past(const kvflash_session *session);
/* Forget positions >= n_past.  With "qk", the queries the policy scores with (the last
 * qk_queries + qk_contrast evaluated) go with the forgotten positions: evaluate again the
 * last of the kept tokens (or a prompt of that many) before the next rescore, or it scores
 * with fewer; kvflash_rewind does that itself. */
int kvflash_truncate(kvflash_session *session, int64_t n_past);
/* Since API version 8: the context becomes tokens[0 .. n).  The longest common prefix with
 * what the session holds is kept, the rest forgotten, the new part evaluated as kvflash_eval
 * evaluates a prompt (at least the last token is read again, for fresh logits; with "qk" enough
 * of the kept prefix is read again that the policy's queries are whole).  *reused (may be NULL)
 * gets the tokens kept; logits as kvflash_eval's.  A multi-turn chat sends the whole
 * conversation each turn and pays only for what is new. */
int kvflash_continue(kvflash_session *session, const int32_t *tokens, int32_t n, int64_t *reused, float *logits);
/* Since API version 8: rewind to the first n_past tokens and read the last kept ones again
 * (with "qk", the policy's queries), so kvflash_sample / kvflash_decode continue from fresh
 * logits, as kvflash.Session.truncate does.  The tokens come from the session's own history.
 * KVFLASH_EINVAL when gemma3's sliding-window ring no longer reaches that far back. */
int kvflash_rewind(kvflash_session *session, int64_t n_past);
/* Since API version 8, exact mode (params.exact): kvflash_decode verifies drafts in rounds, so the
 * cache may hold up to 16 verified tokens past the one it returned (kvflash_n_past counts them; the
 * next calls hand them out).  kvflash_settle drops those not taken yet; kvflash_eval, kvflash_continue
 * and kvflash_rewind settle first.  Without exact mode it does nothing. */
int kvflash_settle(kvflash_session *session);
/* Since API version 9, snapshots: the whole session (the cache's rows and chunk table, the host store's
 * chunks, the history, the last logits, the sampler, the settings and the policy's schedule) in one
 * versioned, checksummed file, the same format kvflash.Session.save writes: a file saved here loads in
 * Python and the reverse.  kvflash_save writes atomically (a temporary file beside path, fsynced, renamed;
 * on failure path is as it was; exact mode settles first).  kvflash_restore replaces the session's context
 * with the file's when it fits (the same model file, geometry and policy; this session's own schedule
 * settings stay); anything else (a truncated, corrupted or crafted file, another model, a file over
 * max_bytes when max_bytes > 0) is KVFLASH_EINVAL with the reason, and the session is as it was.
 * kvflash_session_load builds a new session over model with the file's settings (NULL and err on refusal;
 * a snapshot of a policy written in Python is refused: load it in Python; one of the drafter policy needs
 * its drafter: kvflash_session_new with params.policy "drafter" and params.drafter, then kvflash_restore). */
int kvflash_save(kvflash_session *session, const char *path);
int kvflash_restore(kvflash_session *session, const char *path, uint64_t max_bytes);
kvflash_session *kvflash_session_load(kvflash_model *model, const char *path, uint64_t max_bytes, char *err,
                                      size_t err_len);

/* Back to an empty context; policy state (scores, the rescore schedule) included. */
int kvflash_reset(kvflash_session *session);

/* Run the session's policy now and repage the pool (qk); *moved (may be NULL) gets
 * the chunks paged in or out.  With "lru" nothing is scored and *moved is 0. */
int kvflash_rescore(kvflash_session *session, int32_t *moved);
/* Bring your own scores: repage the pool to the chunks with the highest scores
 * (n scores, one per chunk, n <= kvflash_n_chunks(); no NaN). */
int kvflash_reselect(kvflash_session *session, const float *scores, int32_t n);
/* Chunks materialised so far: ceil(n_past / chunk_tokens); KVFLASH_EBUSY while another
 * thread is in a call on the session. */
int32_t kvflash_n_chunks(const kvflash_session *session);
/* flags[c] for chunks 0 .. n-1 (n <= kvflash_n_chunks()): KVFLASH_CHUNK_* bits. */
int kvflash_chunk_flags(const kvflash_session *session, uint8_t *flags, int32_t n);

/* While another thread is in a call on the session: all zero but n_past, which is KVFLASH_EBUSY. */
struct kvflash_stats kvflash_get_stats(const kvflash_session *session);
/* The last error message of this session ("" if none); while another thread is in a call
 * on it, a fixed message saying so.  Valid until the next call on it. */
const char *kvflash_last_error(const kvflash_session *session);

/* -- Tokenizer, since API version 9 ---------------------------------------------------------
 * llama.cpp's own (its vocabulary code from the sdist kvflash is built against), so the ids are
 * llama_tokenize's and the text llama_token_to_piece's / llama_detokenize's; kvflash.Tokenizer
 * (Python) encodes through the same code.  Vocabularies: tokenizer.ggml.model "llama", "gpt2" or
 * "gemma4" with every pre-tokenizer llama.cpp knows.
 *
 *   kvflash_vocab *v = kvflash_model_vocab(m, err, sizeof err);   // or kvflash_vocab_load(path, ...)
 *   int32_t ids[4096], n;
 *   if (kvflash_tokenize(v, text, strlen(text), ids, 4096, 1, 1, &n) == KVFLASH_ESIZE) ... // n: needed
 *   char piece[256]; int32_t len;
 *   kvflash_token_to_piece(v, ids[0], piece, sizeof piece, 0, &len);                        // no NUL
 *   kvflash_vocab_free(v);
 *
 * A vocabulary is immutable: every function here may be called from any thread at once.  Bad input
 * (text that is not UTF-8, an id outside [0, n_tokens), a NULL pointer, lengths past 2^31-1) returns a
 * status, never aborts; the message of the calling thread's last failed call is
 * kvflash_vocab_last_error(). */
typedef struct kvflash_vocab kvflash_vocab;

/* The tokenizer of a GGUF file, from its metadata alone (no weights are read: a vocab-only file such
 * as llama.cpp's models/ggml-vocab-*.gguf will do).  NULL with the reason in err on failure (not a
 * GGUF, no tokenizer, an unsupported model or pre-tokenizer). */
kvflash_vocab *kvflash_vocab_load(const char *path, char *err, size_t err_len);
/* The model's tokenizer (built from its metadata on the first call, shared after).  The handle keeps
 * what it needs alive: free it with kvflash_vocab_free, before or after the model. */
kvflash_vocab *kvflash_model_vocab(const kvflash_model *model, char *err, size_t err_len);
void kvflash_vocab_free(kvflash_vocab *vocab);

int32_t kvflash_vocab_n_tokens(const kvflash_vocab *vocab);     /* 0 for NULL */
/* Special ids, -1 when the vocabulary has none. */
int32_t kvflash_vocab_bos(const kvflash_vocab *vocab);
int32_t kvflash_vocab_eos(const kvflash_vocab *vocab);
int32_t kvflash_vocab_eot(const kvflash_vocab *vocab);
/* 1 when kvflash_tokenize(add_special = 1) puts BOS first (EOS last), else 0. */
int kvflash_vocab_add_bos(const kvflash_vocab *vocab);
int kvflash_vocab_add_eos(const kvflash_vocab *vocab);
/* is_eog: 1 when token ends generation (eos, eot, eom and the end-of-turn tokens llama.cpp knows by
 * text); is_control: 1 for a control token (what special = 0 renders as nothing).  0 otherwise, and
 * for an id out of range. */
int kvflash_vocab_is_eog(const kvflash_vocab *vocab, int32_t token);
int kvflash_vocab_is_control(const kvflash_vocab *vocab, int32_t token);

/* text[0 .. text_len) (UTF-8, need not be NUL-terminated) to ids.  add_special: BOS / EOS as the
 * vocabulary asks; parse_special: control tokens written in the text become their ids.  *n_out gets
 * the number of ids; when that is more than n_max, nothing is written and KVFLASH_ESIZE returned
 * (tokens may be NULL with n_max 0 to ask the size).  KVFLASH_EINVAL for text that is not UTF-8. */
int kvflash_tokenize(const kvflash_vocab *vocab, const char *text, size_t text_len, int32_t *tokens, int32_t n_max,
                     int add_special, int parse_special, int32_t *n_out);
/* The bytes of one token into buf (no NUL).  special = 0 renders control tokens as nothing.  *n_out:
 * the piece's length; KVFLASH_ESIZE when it is more than buf_len (nothing written); KVFLASH_ERANGE
 * for an id out of range.  A piece may be part of a UTF-8 character: join the bytes of several. */
int kvflash_token_to_piece(const kvflash_vocab *vocab, int32_t token, char *buf, int32_t buf_len, int special,
                           int32_t *n_out);
/* The text of n ids into text (no NUL), as llama_detokenize: remove_special drops the BOS / EOS that
 * add_special puts, unparse_special renders control tokens.  *n_out and KVFLASH_ESIZE as above. */
int kvflash_detokenize(const kvflash_vocab *vocab, const int32_t *tokens, int32_t n, char *text, int32_t text_max,
                       int remove_special, int unparse_special, int32_t *n_out);
/* The message of this thread's last failed kvflash_vocab call ("" if none).  Valid until the thread's
 * next vocab call. */
const char *kvflash_vocab_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* KVFLASH_H */
