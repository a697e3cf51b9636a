// llama_logits: evaluate a token list with llama.cpp and write the logits of every token.
//
// The reference side of kvflash's tests (tests/llama_ref.py builds and runs it as a subprocess,
// so llama.cpp's ggml never shares a process with kvflash's own, and an abort here is an error
// message in the test, not a dead pytest).
//
//   llama_logits --model M.gguf --tokens T.i32 --out L.f32 --mode batch|single --threads N
//                [--n-ctx N] [--flash-attn on|off] [--dump NAME]... [--dump-out D.bin]
//
// --tokens: raw little-endian int32 token ids.  --out: raw little-endian float32 [n_tokens, n_vocab].
// --mode batch: one llama_decode of all tokens (n_batch = n_ubatch = n_tokens, one graph);
// --mode single: one llama_decode per token.  Every token is an output in both modes.
// --dump NAME: also record every graph tensor named NAME or NAME-<layer> (llama.cpp's callback
// names, e.g. ffn_moe_logits-3) as llama.cpp computed it, into --dump-out (format below).
//
// Context: CPU only (no device is offered to the model), weights mmap'd, f16 K and V cache,
// flash attention off.  Why off: with it off, llama.cpp's attention is the same two products
// (K^T Q, then V softmax) whatever the number of queries, accumulated in f32 (ggml rounds Q and
// the softmax weights to f16 to multiply them with the f16 cache); ggml's CPU flash attention
// instead switches by query count between a tiled all-f32 kernel and a one-query-chunk kernel
// whose output accumulator is an f16 vector, so the batched and the one-token-at-a-time runs
// would differ by that kernel's f16 rounding (~1e-3 relative in a tiny model's logits) rather
// than by the model.  --flash-attn on asks for it anyway: the peer of kvflash's own
// ggml_flash_attn_ext path, which takes the same kernels by the same rule.
//
// Exit status: 0 on success; 2 bad arguments or input; 3 llama.cpp refused the model or context;
// 4 llama_decode failed.  Messages go to stderr, with llama.cpp's log.
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"

#include <cerrno>
#include <cinttypes>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

[[noreturn]] void fail(int code, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::fputs("llama_logits: ", stderr);
    std::vfprintf(stderr, fmt, ap);
    std::fputc('\n', stderr);
    va_end(ap);
    std::exit(code);
}

void log_cb(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_DEBUG) {
        return;
    }
    std::fputs(text, stderr);
}

struct Dumper {
    std::vector<std::string> names;
    FILE * out = nullptr;
    uint32_t step = 0;  // which llama_decode call is running
    size_t n_records = 0;
    std::string error;

    bool wanted(const char * name) const {
        for (const auto & n : names) {
            const size_t len = n.size();
            if (std::strncmp(name, n.c_str(), len) == 0 && (name[len] == '\0' || name[len] == '-')) {
                return true;
            }
        }
        return false;
    }
};

float element_f32(const ggml_tensor * t, const char * p) {
    switch (t->type) {
        case GGML_TYPE_F32: { float v; std::memcpy(&v, p, sizeof v); return v; }
        case GGML_TYPE_F16: { ggml_fp16_t v; std::memcpy(&v, p, sizeof v); return ggml_fp16_to_fp32(v); }
        case GGML_TYPE_I32: { int32_t v; std::memcpy(&v, p, sizeof v); return (float) v; }
        default: return 0.0f;  // not reached: record() refuses other types
    }
}

// Record format, repeated to the end of the file (all little-endian):
//   u32 name length, name bytes, u32 decode step, u32 ggml type of the tensor (F32 0, F16 1,
//   I32 26: the values are written as float32 whatever it was), i64 ne[4], then
//   ne0*ne1*ne2*ne3 float32 values, ne0 fastest.
bool eval_cb(ggml_tensor * t, bool ask, void * user_data) {
    auto * d = static_cast<Dumper *>(user_data);
    if (!d->wanted(t->name)) {
        return ask ? false : true;
    }
    if (ask) {
        return true;
    }
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16 && t->type != GGML_TYPE_I32) {
        d->error = std::string("cannot dump ") + t->name + " of type " + ggml_type_name(t->type);
        return false;
    }
    std::vector<char> host;
    const char * base = nullptr;
    if (t->buffer && ggml_backend_buffer_is_host(t->buffer)) {
        base = static_cast<const char *>(t->data);
    } else if (ggml_is_contiguous(t)) {
        host.resize(ggml_nbytes(t));
        ggml_backend_tensor_get(t, host.data(), 0, host.size());
        base = host.data();
    } else {
        d->error = std::string("cannot dump ") + t->name + ": not in host memory and not contiguous";
        return false;
    }
    const uint32_t len = (uint32_t) std::strlen(t->name);
    const uint32_t type = (uint32_t) t->type;
    const int64_t ne[4] = { t->ne[0], t->ne[1], t->ne[2], t->ne[3] };
    std::vector<float> vals;
    vals.reserve((size_t) ggml_nelements(t));
    for (int64_t i3 = 0; i3 < ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < ne[1]; i1++) {
                for (int64_t i0 = 0; i0 < ne[0]; i0++) {
                    vals.push_back(element_f32(t, base + i0*t->nb[0] + i1*t->nb[1] + i2*t->nb[2] + i3*t->nb[3]));
                }
            }
        }
    }
    bool ok = std::fwrite(&len, sizeof len, 1, d->out) == 1 &&
              std::fwrite(t->name, 1, len, d->out) == len &&
              std::fwrite(&d->step, sizeof d->step, 1, d->out) == 1 &&
              std::fwrite(&type, sizeof type, 1, d->out) == 1 &&
              std::fwrite(ne, sizeof ne[0], 4, d->out) == 4 &&
              std::fwrite(vals.data(), sizeof(float), vals.size(), d->out) == vals.size();
    if (!ok) {
        d->error = std::string("writing the dump failed: ") + std::strerror(errno);
        return false;
    }
    d->n_records++;
    return true;
}

long parse_long(const char * flag, const char * s, long lo, long hi) {
    char * end = nullptr;
    errno = 0;
    const long v = std::strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) {
        fail(2, "%s wants an integer in [%ld, %ld], got '%s'", flag, lo, hi, s);
    }
    return v;
}

}  // namespace

int main(int argc, char ** argv) {
    std::string model_path, tokens_path, out_path, mode, dump_path;
    long threads = 1, n_ctx_arg = 0;
    bool flash_attn = false;
    Dumper dumper;
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        if (i + 1 >= argc) {
            fail(2, "%s needs a value (usage: see the top of llama_logits.cpp)", a.c_str());
        }
        const char * v = argv[++i];
        if (a == "--model") model_path = v;
        else if (a == "--tokens") tokens_path = v;
        else if (a == "--out") out_path = v;
        else if (a == "--mode") mode = v;
        else if (a == "--threads") threads = parse_long("--threads", v, 1, 512);
        else if (a == "--n-ctx") n_ctx_arg = parse_long("--n-ctx", v, 1, 1L << 24);
        else if (a == "--flash-attn") {
            if (std::strcmp(v, "on") != 0 && std::strcmp(v, "off") != 0) fail(2, "--flash-attn must be on or off, got %s", v);
            flash_attn = std::strcmp(v, "on") == 0;
        }
        else if (a == "--dump") dumper.names.emplace_back(v);
        else if (a == "--dump-out") dump_path = v;
        else fail(2, "unknown argument %s", a.c_str());
    }
    if (model_path.empty() || tokens_path.empty() || out_path.empty()) {
        fail(2, "--model, --tokens and --out are required");
    }
    if (mode != "batch" && mode != "single") {
        fail(2, "--mode must be 'batch' or 'single', got '%s'", mode.c_str());
    }
    if (!dumper.names.empty() && dump_path.empty()) {
        fail(2, "--dump needs --dump-out");
    }

    std::vector<llama_token> tokens;
    {
        FILE * f = std::fopen(tokens_path.c_str(), "rb");
        if (!f) fail(2, "cannot open %s: %s", tokens_path.c_str(), std::strerror(errno));
        int32_t t;
        while (std::fread(&t, sizeof t, 1, f) == 1) tokens.push_back(t);
        const bool partial = std::fgetc(f) != EOF || std::ferror(f);
        std::fclose(f);
        if (partial) fail(2, "%s is not a whole number of int32 token ids", tokens_path.c_str());
    }
    if (tokens.empty()) fail(2, "no tokens in %s", tokens_path.c_str());
    const int32_t n_tokens = (int32_t) tokens.size();

    llama_log_set(log_cb, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    static ggml_backend_dev_t no_devices[1] = { nullptr };
    mparams.devices = no_devices;          // the CPU only (it is not an offload device)
    mparams.n_gpu_layers = 0;
    mparams.load_mode = LLAMA_LOAD_MODE_MMAP;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mparams);
    if (!model) fail(3, "llama.cpp could not load %s (its log above says why)", model_path.c_str());

    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    for (int32_t i = 0; i < n_tokens; i++) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            fail(2, "token %d (at %d) is outside the vocabulary [0, %d)", tokens[i], i, n_vocab);
        }
    }

    const bool batched = mode == "batch";
    const uint32_t n_ctx = n_ctx_arg > 0 ? (uint32_t) n_ctx_arg : (uint32_t) ((n_tokens + 255) / 256 * 256);
    if (n_ctx < (uint32_t) n_tokens) fail(2, "--n-ctx %u is smaller than the %d tokens", n_ctx, n_tokens);

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = n_ctx;
    cparams.n_batch = batched ? (uint32_t) n_tokens : 1;
    cparams.n_ubatch = cparams.n_batch;
    cparams.n_seq_max = 1;
    cparams.n_threads = (int32_t) threads;
    cparams.n_threads_batch = (int32_t) threads;
    cparams.type_k = GGML_TYPE_F16;
    cparams.type_v = GGML_TYPE_F16;
    cparams.flash_attn_type = flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;  // see the top
    cparams.offload_kqv = false;
    cparams.op_offload = false;
    cparams.no_perf = true;
    cparams.embeddings = false;
    if (!dumper.names.empty()) {
        dumper.out = std::fopen(dump_path.c_str(), "wb");
        if (!dumper.out) fail(2, "cannot create %s: %s", dump_path.c_str(), std::strerror(errno));
        cparams.cb_eval = eval_cb;
        cparams.cb_eval_user_data = &dumper;
    }
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) fail(3, "llama.cpp could not create a context for %s (its log above says why)", model_path.c_str());

    FILE * out = std::fopen(out_path.c_str(), "wb");
    if (!out) fail(2, "cannot create %s: %s", out_path.c_str(), std::strerror(errno));

    const int32_t per_call = batched ? n_tokens : 1;
    llama_batch batch = llama_batch_init(per_call, 0, 1);
    for (int32_t start = 0; start < n_tokens; start += per_call) {
        batch.n_tokens = per_call;
        for (int32_t j = 0; j < per_call; j++) {
            batch.token[j] = tokens[start + j];
            batch.pos[j] = start + j;
            batch.n_seq_id[j] = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j] = 1;
        }
        const int32_t rc = llama_decode(ctx, batch);
        if (!dumper.error.empty()) fail(4, "%s", dumper.error.c_str());
        if (rc != 0) fail(4, "llama_decode returned %d at token %d", rc, start);
        for (int32_t j = 0; j < per_call; j++) {
            const float * row = llama_get_logits_ith(ctx, j);
            if (!row) fail(4, "no logits for token %d", start + j);
            if (std::fwrite(row, sizeof(float), (size_t) n_vocab, out) != (size_t) n_vocab) {
                fail(2, "writing %s failed: %s", out_path.c_str(), std::strerror(errno));
            }
        }
        dumper.step++;
    }
    llama_batch_free(batch);
    if (std::fclose(out) != 0) fail(2, "closing %s failed: %s", out_path.c_str(), std::strerror(errno));
    if (dumper.out) {
        if (std::fclose(dumper.out) != 0) fail(2, "closing %s failed", dump_path.c_str());
        if (dumper.n_records == 0) fail(4, "no graph tensor matched any --dump name");
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
