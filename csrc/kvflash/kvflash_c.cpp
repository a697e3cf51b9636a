#include "kvflash/kvflash.h"
#include "kvflash/pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kvflash/limits.h"  // kMaxContext
#include "kvflash/session.h"
#include "kvflash/session_file.h"
#include "kvflash/snapshot.h"
#include "kvflash/tokenizer.h"

#ifndef KVFLASH_VERSION_STRING
#define KVFLASH_VERSION_STRING "unknown"
#endif

struct kvflash_model {
    std::shared_ptr<kvflash::Model> m;
};

// A tokenizer handle: immutable, so no busy flag; the message of a failed call is the thread's.
struct kvflash_vocab {
    std::shared_ptr<const kvflash::Tokenizer> t;
};

// A session: the core session (csrc/kvflash/session.h: the schedule, the scorers, the history
// and the logits, shared with Python) behind the C API's error and threading conventions.
struct kvflash_session {
    std::unique_ptr<kvflash::Session> s;
    mutable std::string err;
    mutable std::atomic<bool> busy{false};     // guarded(): one call at a time
    mutable std::atomic<int32_t> readers{0};   // reading(): readers in progress; a call waits for them

    kvflash::Runtime &rt() { return s->runtime(); }
    const kvflash::Runtime &rt() const { return s->runtime(); }
    void copy_logits(float *out) const {
        if (out) std::memcpy(out, s->logits().data(), s->logits().size() * sizeof(float));
    }
};

namespace {

void put_err(char *err, size_t len, const char *msg) {
    if (err && len) {
        std::strncpy(err, msg, len - 1);
        err[len - 1] = '\0';
    }
}

// Runs f, turning every exception into a status code and the session's message.  One
// call at a time per session: an overlapping one returns KVFLASH_EBUSY at once, and
// leaves the session's message to the call in progress.
template <class S, class F> int guarded(S *s, F f) {
    if (!s) return KVFLASH_EINVAL;
    if (s->busy.exchange(true)) return KVFLASH_EBUSY;
    struct Release {
        std::atomic<bool> &b;
        ~Release() { b.store(false); }
    } release{s->busy};
    // A reader that came in before busy was set finishes first (a few loads; see reading()).
    while (s->readers.load() != 0) std::this_thread::yield();
    try {
        f();
        s->err.clear();
        return KVFLASH_OK;
    } catch (const std::out_of_range &e) {
        s->err = e.what();
        return KVFLASH_ERANGE;
    } catch (const std::invalid_argument &e) {
        s->err = e.what();
        return KVFLASH_EINVAL;
    } catch (const std::exception &e) {
        s->err = e.what();
        return KVFLASH_ERUNTIME;
    } catch (...) {
        s->err = "unknown error";
        return KVFLASH_ERUNTIME;
    }
}

// The readers (n_past, n_chunks, stats, logits, the message) read what a call writes.
// They neither fail a call nor wait for one: a reader announces itself, then looks at
// busy; while a call runs it answers busy at once (returns false, f not run), otherwise
// the call that starts next waits in guarded() until the reader is done.  Both sides
// use sequentially consistent atomics (the reader's increment before its load of busy,
// the call's exchange of busy before its load of readers), so at least one of them
// sees the other.  Readers never write the session; several may read at once.
template <class F> bool reading(const kvflash_session *s, F f) {
    s->readers.fetch_add(1);
    struct Leave {
        std::atomic<int32_t> &r;
        ~Leave() { r.fetch_sub(1); }
    } leave{s->readers};
    if (s->busy.load()) return false;
    try {
        f();   // plain reads; nothing may escape into C even so
    } catch (...) {
        return false;
    }
    return true;
}

const char *const kBusyMessage = "busy: another thread is in a call on this session (KVFLASH_EBUSY)";

kvflash::SamplerParams sampler_params(const kvflash_sampling *sp) {
    const kvflash_sampling d = kvflash_default_sampling();
    if (!sp) sp = &d;
    kvflash::SamplerParams p{sp->temperature, sp->top_k, sp->top_p, sp->min_p};
    p.validate();
    return p;
}

// The caller's params over the defaults: only the fields its struct_size covers.
kvflash_params read_params(const kvflash_params *in) {
    kvflash_params p = kvflash_default_params();
    const size_t v1 = offsetof(kvflash_params, ubatch) + sizeof(int32_t);
    if (in->struct_size < v1 || in->struct_size > (size_t(1) << 16))
        throw std::invalid_argument("params.struct_size is " + std::to_string(in->struct_size) +
                                    ": start from kvflash_default_params(), which sets it");
    std::memcpy(&p, in, std::min(in->struct_size, sizeof p));
    // a caller built against API version 1 has no policy field: it keeps the recency it had then
    if (in->struct_size < offsetof(kvflash_params, policy) + sizeof p.policy) p.policy = "lru";
    p.struct_size = sizeof p;
    return p;
}

// The session over model with sc, after what sc asks of the model's placement is checked.
std::unique_ptr<kvflash_session> new_session(kvflash_model *model, const kvflash::SessionConfig &sc) {
    if ((sc.exact || sc.exact_prefill || sc.prefill_reread) && !model->m->remote_layers().empty())
        throw std::invalid_argument("params.exact / exact_prefill / prefill_reread read the host store in place in "
                                    "one process; this model has layers on RPC servers");
    if ((sc.exact || sc.exact_prefill || sc.prefill_reread) && model->m->device().name().rfind("cpu", 0) != 0)
        throw std::invalid_argument("params.exact / exact_prefill / prefill_reread read the host store on the CPU "
                                    "backend");
    auto s = std::make_unique<kvflash_session>();
    s->s = std::make_unique<kvflash::Session>(model->m, sc);
    return s;
}

}  // namespace

extern "C" {

const char *kvflash_version(void) { return KVFLASH_VERSION_STRING; }

int64_t kvflash_max_context(void) { return kvflash::kMaxContext; }

kvflash_params kvflash_default_params(void) {
    kvflash_params p;
    std::memset(&p, 0, sizeof p);
    p.struct_size = sizeof p;
    p.max_ctx = 4096;
    p.pool_tokens = 0;
    p.kv_type = "q8_0";
    p.chunk_tokens = 64;
    p.sink_chunks = 1;
    p.tail_window_chunks = 4;
    p.ubatch = 512;
    p.policy = "qk";   // Session's default since API version 14 (was "lru"; see read_params)
    p.tau = 64;
    const kvflash::PeakScoring qk;   // the core's qk defaults (QKPolicy() in Python reads the same)
    p.qk_queries = qk.n_queries;
    p.reeval_tokens = 64;
    p.seed = 0;
    p.qk_contrast = qk.contrast;
    p.qk_spread = qk.spread;
    p.qk_layers = -1;
    p.qk_carry = qk.carry;
    p.qk_windows = qk.windows;
    p.qk_aggregate = "peak";
    p.qk_smooth_width = 5;
    p.drafter = nullptr;
    p.drafter_layers = 0;
    p.drafter_pool = 1024;
    p.drafter_queries = 16;
    p.prefill_rescore = 0;
    p.prefill_reread = 0;
    p.exact = 0;
    p.exact_prefill = 0;
    p.exact_draft = -1;
    return p;
}

kvflash_sampling kvflash_default_sampling(void) {
    kvflash_sampling s;
    s.temperature = 0.f;
    s.top_k = 0;
    s.top_p = 1.f;
    s.min_p = 0.f;
    return s;
}

// Model::load behind the C API's error convention: the reason in err, NULL, nothing left allocated.
static kvflash_model *load_model(const std::function<std::shared_ptr<kvflash::Model>()> &load, char *err,
                                 size_t err_len) {
    try {
        auto h = std::make_unique<kvflash_model>();
        h->m = load();
        return h.release();
    } catch (const std::exception &e) {
        put_err(err, err_len, e.what());
    } catch (...) {
        put_err(err, err_len, "unknown error while loading the model");
    }
    return nullptr;
}

kvflash_model *kvflash_model_load(const char *path, int32_t n_threads, char *err, size_t err_len) {
    if (!path) {
        put_err(err, err_len, "path is NULL");
        return nullptr;
    }
    return load_model([&] { return kvflash::Model::load(path, n_threads); }, err, err_len);
}

kvflash_model *kvflash_model_load_rpc(const char *path, int32_t n_threads, const char *rpc, const float *tensor_split,
                                      size_t n_split, char *err, size_t err_len) {
    if (!path || !rpc) {
        put_err(err, err_len, "path and rpc are required");
        return nullptr;
    }
    if (n_split > 0 && !tensor_split) {
        put_err(err, err_len, "tensor_split is NULL but n_split > 0");
        return nullptr;
    }
    return load_model([&] {
        std::vector<std::string> eps;
        std::string cur;
        for (const char *c = rpc;; ++c) {
            if (*c == ',' || *c == '\0') {
                if (!cur.empty()) eps.push_back(cur);
                cur.clear();
                if (*c == '\0') break;
            } else {
                cur += *c;
            }
        }
        if (eps.empty()) throw std::invalid_argument("rpc names no endpoint (\"host:port,host:port\")");
        return kvflash::Model::load(path, n_threads, "cpu", eps, std::vector<float>(tensor_split, tensor_split + n_split));
    }, err, err_len);
}

void kvflash_model_free(kvflash_model *model) { delete model; }

int32_t kvflash_model_n_vocab(const kvflash_model *model) { return model ? model->m->hparams().n_vocab : 0; }

int64_t kvflash_model_n_ctx_train(const kvflash_model *model) { return model ? model->m->hparams().n_ctx_train : 0; }

kvflash_session *kvflash_session_new(kvflash_model *model, const kvflash_params *params, char *err, size_t err_len) {
    if (!model || !params) {
        put_err(err, err_len, "model and params are required");
        return nullptr;
    }
    try {
        const kvflash_params p = read_params(params);  // max_ctx: the Runtime checks it (limits.h)
        const std::string policy = p.policy ? p.policy : "lru";
        if (policy != "lru" && policy != "qk" && policy != "qk-bound" && policy != "qk-mean" && policy != "drafter")
            throw std::invalid_argument("params.policy must be \"lru\" or \"qk\" (or its variants \"qk-bound\", "
                                        "\"qk-mean\") or \"drafter\", got \"" + policy + "\"");
        if (p.tau < 1) throw std::invalid_argument("params.tau must be >= 1, got " + std::to_string(p.tau));
        if (p.qk_queries < 1 || p.qk_queries > 256)
            throw std::invalid_argument("params.qk_queries must be in [1, 256], got " + std::to_string(p.qk_queries));
        if (p.qk_contrast < 0 || p.qk_contrast > 256)
            throw std::invalid_argument("params.qk_contrast must be in [0, 256], got " + std::to_string(p.qk_contrast));
        if (p.qk_spread < 0 || p.qk_spread > 256)
            throw std::invalid_argument("params.qk_spread must be in [0, 256], got " + std::to_string(p.qk_spread));
        if (p.qk_carry < 0 || p.qk_carry > 256)
            throw std::invalid_argument("params.qk_carry must be in [0, 256], got " + std::to_string(p.qk_carry));
        if (p.qk_windows < 1 || p.qk_windows > 16)
            throw std::invalid_argument("params.qk_windows must be in [1, 16], got " + std::to_string(p.qk_windows));
        if (p.qk_layers < -1)
            throw std::invalid_argument("params.qk_layers must be -1 (auto), 0 (all) or a layer count, got " +
                                        std::to_string(p.qk_layers));
        if (p.reeval_tokens < 1)
            throw std::invalid_argument("params.reeval_tokens must be >= 1, got " + std::to_string(p.reeval_tokens));
        if (p.pool_tokens < 0) throw std::invalid_argument("params.pool_tokens must be >= 0 (0: full cache)");
        kvflash::SessionConfig sc;
        kvflash::RuntimeConfig &c = sc.runtime;
        c.max_ctx = p.max_ctx;
        c.pool_tokens = p.pool_tokens;
        c.kv_type = p.kv_type ? p.kv_type : "q8_0";
        c.sink_chunks = p.sink_chunks;
        c.tail_window_chunks = p.tail_window_chunks;
        if (p.chunk_tokens < 0)
            throw std::invalid_argument("params.chunk_tokens must be 0 (auto: by the pool's size) or a chunk size, got " +
                                        std::to_string(p.chunk_tokens));
        if (p.chunk_tokens == 0) {   // auto (API version 13): the core's rule for this pool
            const kvflash::ChunkGeometry g = kvflash::auto_chunk_geometry(p.pool_tokens, p.sink_chunks,
                                                                          p.tail_window_chunks);
            c.chunk_tokens = g.chunk_tokens;
            c.prefill_piece = g.prefill_piece;
        } else {
            c.chunk_tokens = p.chunk_tokens;
        }
        c.ubatch = p.ubatch;
        if (p.max_host_bytes < 0)
            throw std::invalid_argument("params.max_host_bytes must be >= 0 (0: no cap), got " +
                                        std::to_string(p.max_host_bytes));
        c.max_host_bytes = p.max_host_bytes;
        if (policy == "drafter") {
            if (!p.drafter) throw std::invalid_argument("params.policy \"drafter\" needs params.drafter (a model)");
            kvflash::DrafterSettings ds;
            ds.n_queries = p.drafter_queries;
            ds.layers = p.drafter_layers;
            ds.pool = p.drafter_pool;
            sc.scorer = kvflash::Scorer::Drafter;
            sc.drafter = std::make_shared<kvflash::DrafterScorer>(
                p.drafter->m, ds, c.max_ctx, model->m->n_threads(), kvflash::tokenizer_vocab(model->m->tokenizer()),
                kvflash::tokenizer_vocab(p.drafter->m->tokenizer()));
            c.capture_queries = std::max(c.capture_queries, ds.n_queries);   // as Python's: a snapshot's header holds it
        } else if (policy != "lru") {
            const std::string agg = p.qk_aggregate ? p.qk_aggregate : "peak";
            if (agg != "peak" && agg != "chunk" && agg != "token")
                throw std::invalid_argument("params.qk_aggregate must be \"peak\", \"chunk\" or \"token\", got \"" +
                                            agg + "\"");
            if (p.qk_smooth_width < 0 || p.qk_smooth_width > 4096)
                throw std::invalid_argument("params.qk_smooth_width must be in [0, 4096], got " +
                                            std::to_string(p.qk_smooth_width));
            sc.scorer = kvflash::Scorer::Qk;
            if (policy == "qk") {
                sc.qk = kvflash::QkScoring::defaults("keys", agg);
                sc.qk.n_queries = p.qk_queries;
                sc.qk.n_layers = p.qk_layers < 0 ? -1 : p.qk_layers;
                if (sc.qk.aggregate == kvflash::QkAggregate::Peak) {   // the others take no contrast, spread, carry
                    sc.qk.contrast = p.qk_contrast;
                    sc.qk.spread = p.qk_spread;
                    sc.qk.carry = p.qk_carry;
                    sc.qk.windows = p.qk_windows;
                }
            } else {   // the summary modes score the last query alone
                sc.qk = kvflash::QkScoring::defaults(policy.substr(3));
            }
            sc.qk.smooth_width = p.qk_smooth_width;
        }
        sc.tau = p.tau;
        sc.reeval_tokens = p.reeval_tokens;
        if (p.prefill_rescore < 0)
            throw std::invalid_argument("params.prefill_rescore must be >= 0 (pooled prefill pieces between rescores; "
                                        "0: off), got " + std::to_string(p.prefill_rescore));
        sc.prefill_rescore = p.prefill_rescore;
        if (p.prefill_reread != 0 && p.prefill_reread != 1)
            throw std::invalid_argument("params.prefill_reread must be 0 or 1, got " + std::to_string(p.prefill_reread));
        sc.prefill_reread = p.prefill_reread != 0;
        sc.seed = p.seed;
        if (p.exact != 0 && p.exact != 1) throw std::invalid_argument("params.exact must be 0 or 1");
        if (p.exact_prefill < 0 || p.exact_prefill > 2)
            throw std::invalid_argument("params.exact_prefill must be 0 (off), 1 (on) or 2 (auto: on where the model's "
                                        "paged layers are few, up to the position the core gives), got " +
                                        std::to_string(p.exact_prefill));
        if (p.exact_draft < -1 || p.exact_draft > kvflash::kMaxDraft)
            throw std::invalid_argument("params.exact_draft must be -1 (adaptive) or in [0, " +
                                        std::to_string(kvflash::kMaxDraft) + "], got " + std::to_string(p.exact_draft));
        sc.exact = p.exact != 0;
        sc.exact_prefill = p.exact_prefill == 1;
        if (p.exact_prefill == 2 && !sc.exact) {
            sc.exact_prefill_until = kvflash::auto_exact_prefill_until(*model->m);
            sc.exact_prefill = sc.exact_prefill_until > 0;
        }
        sc.exact_draft = p.exact_draft;
        sc.allow_long_ctx = c.max_ctx > model->m->hparams().n_ctx_train;   // the C API has always allowed it
        return new_session(model, sc).release();
    } catch (const std::exception &e) {
        put_err(err, err_len, e.what());
    } catch (...) {
        put_err(err, err_len, "unknown error while creating the session");
    }
    return nullptr;
}

void kvflash_session_free(kvflash_session *session) { delete session; }

int kvflash_eval(kvflash_session *s, const int32_t *tokens, int32_t n, float *logits) {
    return guarded(s, [&] {
        if (!tokens || n <= 0) throw std::invalid_argument("eval: tokens must be non-NULL and n > 0");
        s->s->prefill(tokens, n);
        s->copy_logits(logits);
    });
}

int kvflash_continue(kvflash_session *s, const int32_t *tokens, int32_t n, int64_t *reused, float *logits) {
    return guarded(s, [&] {
        if (!tokens || n <= 0) throw std::invalid_argument("continue: tokens must be non-NULL and n > 0");
        const int64_t r = s->s->continue_to(tokens, n);
        if (reused) *reused = r;
        s->copy_logits(logits);
    });
}

int kvflash_decode(kvflash_session *s, int32_t token, const kvflash_sampling *sp, int32_t *next) {
    return guarded(s, [&] {
        if (!next) throw std::invalid_argument("decode: next must be non-NULL");
        *next = s->s->advance(token, sampler_params(sp));
    });
}

int kvflash_sample(kvflash_session *s, const float *logits, const kvflash_sampling *sp, int32_t *token) {
    return guarded(s, [&] {
        if (!token) throw std::invalid_argument("sample: token must be non-NULL");
        const kvflash::SamplerParams p = sampler_params(sp);
        if (!logits) {
            if (!s->s->has_logits()) throw std::invalid_argument("sample: no logits yet: evaluate a prompt first");
            *token = s->s->sample(p);
        } else {
            *token = s->s->sampler().sample(logits, s->s->model().hparams().n_vocab, p);
        }
    });
}

int kvflash_set_seed(kvflash_session *s, uint64_t seed) {
    return guarded(s, [&] { s->s->sampler().seed(seed); });
}

const float *kvflash_get_logits(const kvflash_session *s) {
    const float *out = nullptr;
    if (s) reading(s, [&] { out = s->s->has_logits() ? s->s->logits().data() : nullptr; });
    return out;
}

int64_t kvflash_n_past(const kvflash_session *s) {
    if (!s) return 0;
    int64_t n = KVFLASH_EBUSY;
    reading(s, [&] { n = s->s->n_past(); });
    return n;
}

int kvflash_truncate(kvflash_session *s, int64_t n_past) {
    return guarded(s, [&] { s->s->truncate_cache(n_past); });   // the logits go with the forgotten tail
}

int kvflash_rewind(kvflash_session *s, int64_t n_past) {
    return guarded(s, [&] { s->s->truncate(n_past); });
}

int kvflash_settle(kvflash_session *s) {
    return guarded(s, [&] { s->s->settle(); });
}

kvflash_session *kvflash_session_load(kvflash_model *model, const char *path, uint64_t max_bytes, char *err,
                                      size_t err_len) {
    if (!model || !path) {
        put_err(err, err_len, "model and path are required");
        return nullptr;
    }
    try {
        const std::string p = path;
        const std::string where = "snapshot " + p;
        // the header and the session state alone (small reads), checked before anything is built
        const kvflash::SnapshotPeek peek = kvflash::Snapshot::peek(p, nullptr, nullptr, max_bytes);
        const std::string &mp = model->m->path();
        const uint64_t fp = kvflash::model_fingerprint(mp), size = uint64_t(std::filesystem::file_size(mp));
        if (fp != peek.header.fingerprint || size != peek.header.model_bytes)
            throw kvflash::SnapshotError("snapshot does not fit this model: it was taken with another model file");
        const kvflash::SessionApp app = kvflash::parse_session_app(peek.app, peek.header, where);
        if (app.drafter)
            throw std::invalid_argument(where + " was taken with the drafter policy: make the session with "
                                        "kvflash_session_new (params.policy \"drafter\", params.drafter) and "
                                        "kvflash_restore the file into it");
        if (!app.builtin)
            throw std::invalid_argument(where + " was taken with the policy '" + app.policy +
                                        "', which a C session cannot run (its policies: lru, qk, qk-bound, qk-mean, "
                                        "drafter)");
        auto s = new_session(model, app.config);
        s->s->restore(p, max_bytes, where);   // the same file, read whole and checked again
        return s.release();
    } catch (const std::exception &e) {
        put_err(err, err_len, e.what());
    } catch (...) {
        put_err(err, err_len, "unknown error while loading the snapshot");
    }
    return nullptr;
}

int kvflash_save(kvflash_session *s, const char *path) {
    return guarded(s, [&] {
        if (!path || !*path) throw std::invalid_argument("save: path must be a non-empty string");
        s->s->settle();   // exact mode: drafts not handed out leave the cache first
        s->s->save(path);
    });
}

int kvflash_restore(kvflash_session *s, const char *path, uint64_t max_bytes) {
    return guarded(s, [&] {
        if (!path || !*path) throw std::invalid_argument("restore: path must be a non-empty string");
        s->s->restore(path, max_bytes);
    });
}

int kvflash_reset(kvflash_session *s) {
    return guarded(s, [&] { s->s->reset(); });
}

int kvflash_rescore(kvflash_session *s, int32_t *moved) {
    return guarded(s, [&] {
        const int32_t m = s->s->rescore();
        if (moved) *moved = m;
    });
}

int kvflash_reselect(kvflash_session *s, const float *scores, int32_t n) {
    return guarded(s, [&] { s->s->reselect(scores, n); });
}

int32_t kvflash_n_chunks(const kvflash_session *s) {
    if (!s) return 0;
    int32_t n = KVFLASH_EBUSY;
    reading(s, [&] { n = s->s->n_chunks(); });
    return n;
}

int kvflash_chunk_flags(const kvflash_session *s, uint8_t *flags, int32_t n) {
    return guarded(s, [&] {
        if (!flags || n < 0) throw std::invalid_argument("chunk_flags: flags must be non-NULL and n >= 0");
        if (n > s->s->n_chunks())
            throw std::out_of_range("chunk_flags: n " + std::to_string(n) + " above the " +
                                    std::to_string(s->s->n_chunks()) + " chunks materialised");
        const kvflash::Pager &pg = s->rt().pager();
        for (int32_t c = 0; c < n; ++c)
            flags[c] = uint8_t((pg.block_of(c) >= 0 ? KVFLASH_CHUNK_RESIDENT : 0) |
                               (pg.host_of(c) >= 0 ? KVFLASH_CHUNK_ON_HOST : 0) |
                               (pg.is_protected(c) ? KVFLASH_CHUNK_PROTECTED : 0));
    });
}

kvflash_stats kvflash_get_stats(const kvflash_session *s) {
    kvflash_stats out;
    std::memset(&out, 0, sizeof out);
    if (!s) return out;
    const bool read = reading(s, [&] {
        const kvflash::PagerStats p = s->rt().pager().stats();  // plain reads: nothing here throws
        out.n_past = s->rt().n_past();
        out.page_outs = p.page_outs;
        out.page_ins = p.page_ins;
        out.bytes_out = p.bytes_out;
        out.bytes_in = p.bytes_in;
        out.resident_chunks = p.resident_chunks;
        out.host_chunks = p.host_chunks;
        out.resident_bytes = uint64_t(p.resident_bytes + s->rt().swa_bytes());
        out.host_bytes = uint64_t(p.host_bytes);
        out.pool_tokens = s->rt().pager().config().pool_tokens;
        out.n_chunks = s->s->n_chunks();
        out.rescores = s->s->rescores();
    });
    if (!read) out.n_past = KVFLASH_EBUSY;
    return out;
}

const char *kvflash_last_error(const kvflash_session *s) {
    if (!s) return "session is NULL";
    const char *msg = kBusyMessage;
    reading(s, [&] { msg = s->err.c_str(); });
    return msg;
}

}  // extern "C"

// ---------------------------------------------------------------- the tokenizer (API version 9)

namespace {

thread_local std::string t_vocab_err;

// f's exceptions as statuses and this thread's message, as guarded() does for a session.
template <class F> int vocab_call(const kvflash_vocab *v, F f) {
    try {
        if (!v) throw std::invalid_argument("vocab is NULL");
        const int rc = f(*v->t);
        if (rc == KVFLASH_OK) t_vocab_err.clear();
        return rc;
    } catch (const std::out_of_range &e) {
        t_vocab_err = e.what();
        return KVFLASH_ERANGE;
    } catch (const std::invalid_argument &e) {
        t_vocab_err = e.what();
        return KVFLASH_EINVAL;
    } catch (const std::bad_alloc &) {
        t_vocab_err = "out of memory";
        return KVFLASH_ERUNTIME;
    } catch (const std::exception &e) {
        t_vocab_err = e.what();
        return KVFLASH_ERUNTIME;
    } catch (...) {
        t_vocab_err = "unknown error";
        return KVFLASH_ERUNTIME;
    }
}

// n bytes or ids ready in `have`: into out when they fit (n_max of them), the size in *n_out either way.
template <class T> int hand_out(const T *have, size_t n, T *out, int32_t n_max, int32_t *n_out) {
    if (n > size_t(INT32_MAX)) throw std::invalid_argument("the result is longer than 2^31-1");
    *n_out = int32_t(n);
    if (int64_t(n) > int64_t(n_max)) {
        t_vocab_err = "the output buffer holds " + std::to_string(n_max) + ", " + std::to_string(n) + " needed";
        return KVFLASH_ESIZE;
    }
    if (n) std::memcpy(out, have, n * sizeof(T));
    return KVFLASH_OK;
}

void check_out(const void *buf, int32_t n_max, const int32_t *n_out) {
    if (!n_out) throw std::invalid_argument("n_out is NULL");
    if (n_max < 0) throw std::invalid_argument("the output buffer's length is negative");
    if (n_max > 0 && !buf) throw std::invalid_argument("the output buffer is NULL with a length above 0");
}

kvflash_vocab *make_vocab(char *err, size_t err_len, const std::function<std::shared_ptr<const kvflash::Tokenizer>()> &f) {
    try {
        auto t = f();
        return new kvflash_vocab{std::move(t)};
    } catch (const std::exception &e) {
        put_err(err, err_len, e.what());
    } catch (...) {
        put_err(err, err_len, "unknown error");
    }
    return nullptr;
}

}  // namespace

kvflash_vocab *kvflash_vocab_load(const char *path, char *err, size_t err_len) {
    return make_vocab(err, err_len, [&] {
        if (!path) throw std::invalid_argument("path is NULL");
        return kvflash::Tokenizer::load(path);
    });
}

kvflash_vocab *kvflash_model_vocab(const kvflash_model *model, char *err, size_t err_len) {
    return make_vocab(err, err_len, [&] {
        if (!model) throw std::invalid_argument("model is NULL");
        return model->m->tokenizer();
    });
}

void kvflash_vocab_free(kvflash_vocab *vocab) { delete vocab; }

int32_t kvflash_vocab_n_tokens(const kvflash_vocab *v) { return v ? v->t->n_vocab() : 0; }
int32_t kvflash_vocab_bos(const kvflash_vocab *v) { return v ? v->t->bos() : -1; }
int32_t kvflash_vocab_eos(const kvflash_vocab *v) { return v ? v->t->eos() : -1; }
int32_t kvflash_vocab_eot(const kvflash_vocab *v) { return v ? v->t->eot() : -1; }
int kvflash_vocab_add_bos(const kvflash_vocab *v) { return v && v->t->add_bos() ? 1 : 0; }
int kvflash_vocab_add_eos(const kvflash_vocab *v) { return v && v->t->add_eos() ? 1 : 0; }

int kvflash_vocab_is_eog(const kvflash_vocab *v, int32_t token) {
    return v && token >= 0 && token < v->t->n_vocab() && v->t->is_eog(token) ? 1 : 0;
}

int kvflash_vocab_is_control(const kvflash_vocab *v, int32_t token) {
    return v && token >= 0 && token < v->t->n_vocab() && v->t->is_control(token) ? 1 : 0;
}

int kvflash_tokenize(const kvflash_vocab *vocab, const char *text, size_t text_len, int32_t *tokens, int32_t n_max,
                     int add_special, int parse_special, int32_t *n_out) {
    return vocab_call(vocab, [&](const kvflash::Tokenizer &t) {
        check_out(tokens, n_max, n_out);
        if (!text && text_len) throw std::invalid_argument("text is NULL with a length above 0");
        const auto ids = t.encode(std::string_view(text ? text : "", text_len), add_special != 0, parse_special != 0);
        return hand_out(ids.data(), ids.size(), tokens, n_max, n_out);
    });
}

int kvflash_token_to_piece(const kvflash_vocab *vocab, int32_t token, char *buf, int32_t buf_len, int special,
                           int32_t *n_out) {
    return vocab_call(vocab, [&](const kvflash::Tokenizer &t) {
        check_out(buf, buf_len, n_out);
        const std::string p = t.token_to_piece(token, special != 0);
        return hand_out(p.data(), p.size(), buf, buf_len, n_out);
    });
}

int kvflash_detokenize(const kvflash_vocab *vocab, const int32_t *tokens, int32_t n, char *text, int32_t text_max,
                       int remove_special, int unparse_special, int32_t *n_out) {
    return vocab_call(vocab, [&](const kvflash::Tokenizer &t) {
        check_out(text, text_max, n_out);
        if (n < 0) throw std::invalid_argument("n is negative");
        if (n > 0 && !tokens) throw std::invalid_argument("tokens is NULL with n above 0");
        const std::string s = t.decode(tokens, size_t(n), remove_special != 0, unparse_special != 0);
        return hand_out(s.data(), s.size(), text, text_max, n_out);
    });
}

const char *kvflash_vocab_last_error(void) { return t_vocab_err.c_str(); }
