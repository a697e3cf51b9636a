#include "kvflash/kvflash.h"

#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "kvflash/model.h"

struct kvflash_model {
    std::shared_ptr<kvflash::Model> m;
};

struct kvflash_session {
    std::shared_ptr<kvflash::Model> m;
    std::unique_ptr<kvflash::Runtime> rt;
    std::string err;
};

static void put_err(char *err, size_t len, const char *msg) {
    if (err && len) {
        std::strncpy(err, msg, len - 1);
        err[len - 1] = '\0';
    }
}

// Runs f, turning exceptions into status codes and the session's message.
template <class F> static int guarded(kvflash_session *s, F f) {
    if (!s) return KVFLASH_EINVAL;
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
    }
}

extern "C" {

kvflash_params kvflash_default_params(void) {
    kvflash_params p;
    p.max_ctx = 4096;
    p.pool_tokens = 0;
    p.kv_type = "q8_0";
    p.chunk_tokens = 64;
    p.sink_chunks = 1;
    p.tail_window_chunks = 4;
    p.ubatch = 512;
    return p;
}

kvflash_model *kvflash_model_load(const char *path, int32_t n_threads, char *err, size_t err_len) {
    if (!path) {
        put_err(err, err_len, "path is NULL");
        return nullptr;
    }
    try {
        auto *h = new kvflash_model;
        h->m = kvflash::Model::load(path, n_threads);
        return h;
    } catch (const std::exception &e) {
        put_err(err, err_len, e.what());
        return nullptr;
    }
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
        kvflash::RuntimeConfig c;
        c.max_ctx = params->max_ctx;
        c.pool_tokens = params->pool_tokens;
        c.kv_type = params->kv_type ? params->kv_type : "q8_0";
        c.chunk_tokens = params->chunk_tokens;
        c.sink_chunks = params->sink_chunks;
        c.tail_window_chunks = params->tail_window_chunks;
        c.ubatch = params->ubatch;
        auto *s = new kvflash_session;
        s->m = model->m;
        try {
            s->rt = std::make_unique<kvflash::Runtime>(model->m, c);
        } catch (...) {
            delete s;
            throw;
        }
        return s;
    } catch (const std::exception &e) {
        put_err(err, err_len, e.what());
        return nullptr;
    }
}

void kvflash_session_free(kvflash_session *session) { delete session; }

int kvflash_eval(kvflash_session *s, const int32_t *tokens, int32_t n, float *logits) {
    return guarded(s, [&] {
        if (!tokens || n <= 0) throw std::invalid_argument("eval: tokens must be non-NULL and n > 0");
        if (logits) {
            s->rt->eval(tokens, n, false, logits);
        } else {
            std::unique_ptr<float[]> tmp(new float[s->m->hparams().n_vocab]);
            s->rt->eval(tokens, n, false, tmp.get());
        }
    });
}

int64_t kvflash_n_past(const kvflash_session *s) { return s ? s->rt->n_past() : 0; }

int kvflash_truncate(kvflash_session *s, int64_t n_past) { return guarded(s, [&] { s->rt->truncate(n_past); }); }

void kvflash_reset(kvflash_session *s) {
    if (s) s->rt->reset();
}

int kvflash_reselect(kvflash_session *s, const float *scores, int32_t n) {
    return guarded(s, [&] {
        if (!scores || n < 0) throw std::invalid_argument("reselect: scores must be non-NULL");
        s->rt->pager().reselect(scores, n);
    });
}

kvflash_stats kvflash_get_stats(const kvflash_session *s) {
    kvflash_stats out{};
    if (!s) return out;
    const kvflash::PagerStats p = s->rt->pager().stats();
    out.n_past = s->rt->n_past();
    out.page_outs = p.page_outs;
    out.page_ins = p.page_ins;
    out.bytes_out = p.bytes_out;
    out.bytes_in = p.bytes_in;
    out.resident_chunks = p.resident_chunks;
    out.host_chunks = p.host_chunks;
    out.resident_bytes = uint64_t(p.resident_bytes + s->rt->swa_bytes());
    out.host_bytes = uint64_t(p.host_bytes);
    return out;
}

const char *kvflash_last_error(const kvflash_session *s) { return s ? s->err.c_str() : "session is NULL"; }

}  // extern "C"
