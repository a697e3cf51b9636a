// Model::load: a GGUF file checked key by key and tensor by tensor, then its
// weights placed on the backend (mapped on the CPU, uploaded into a GPU device's buffer type).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ggml-cpu.h"
#include "kvflash/arch.h"
#include "kvflash/limits.h"
#include "kvflash/model.h"
#include "kvflash/rpc.h"

namespace kvflash {

// ---------------------------------------------------------------- typed metadata

void GGUFKeys::bad(const std::string &k, const std::string &why) const {
    throw std::invalid_argument(file + ": metadata key '" + k + "' " + why);
}

int64_t GGUFKeys::need(const std::string &k, bool required) const {
    const int64_t id = find(k);
    if (id < 0 && required) bad(k, "is missing");
    return id;
}

int64_t GGUFKeys::get_int(const std::string &k, int64_t def, bool required) const {
    const int64_t id = need(k, required);
    if (id < 0) return def;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8: return gguf_get_val_u8(g, id);
        case GGUF_TYPE_INT8: return gguf_get_val_i8(g, id);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(g, id);
        case GGUF_TYPE_INT16: return gguf_get_val_i16(g, id);
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32: return gguf_get_val_i32(g, id);
        case GGUF_TYPE_UINT64: return int64_t(gguf_get_val_u64(g, id));
        case GGUF_TYPE_INT64: return gguf_get_val_i64(g, id);
        default: bad(k, "should be an integer");
    }
}

std::vector<int64_t> GGUFKeys::get_ints(const std::string &k, size_t max_n, bool required) const {
    const int64_t id = need(k, required);
    if (id < 0) return {};
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY) return {get_int(k, 0, true)};
    const gguf_type t = gguf_get_arr_type(g, id);
    const size_t n = gguf_get_arr_n(g, id);
    if (n > max_n) bad(k, "has " + std::to_string(n) + " values, at most " + std::to_string(max_n) + " expected");
    if (t == GGUF_TYPE_STRING || t == GGUF_TYPE_ARRAY || t == GGUF_TYPE_FLOAT32 || t == GGUF_TYPE_FLOAT64)
        bad(k, "should be an integer or an array of integers");
    const void *d = n ? gguf_get_arr_data(g, id) : nullptr;
    std::vector<int64_t> out(n);
    for (size_t i = 0; i < n; ++i) {
        switch (t) {
            case GGUF_TYPE_BOOL: out[i] = static_cast<const int8_t *>(d)[i] != 0; break;
            case GGUF_TYPE_UINT8: out[i] = static_cast<const uint8_t *>(d)[i]; break;
            case GGUF_TYPE_INT8: out[i] = static_cast<const int8_t *>(d)[i]; break;
            case GGUF_TYPE_UINT16: out[i] = static_cast<const uint16_t *>(d)[i]; break;
            case GGUF_TYPE_INT16: out[i] = static_cast<const int16_t *>(d)[i]; break;
            case GGUF_TYPE_UINT32: out[i] = static_cast<const uint32_t *>(d)[i]; break;
            case GGUF_TYPE_INT32: out[i] = static_cast<const int32_t *>(d)[i]; break;
            case GGUF_TYPE_INT64: out[i] = static_cast<const int64_t *>(d)[i]; break;
            case GGUF_TYPE_UINT64: {
                const uint64_t v = static_cast<const uint64_t *>(d)[i];
                if (v > uint64_t(std::numeric_limits<int64_t>::max())) bad(k, "has a value past 2^63");
                out[i] = int64_t(v);
                break;
            }
            default: bad(k, "should be an integer or an array of integers");
        }
    }
    return out;
}

double GGUFKeys::get_float(const std::string &k, double def, bool required) const {
    const int64_t id = need(k, required);
    if (id < 0) return def;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_FLOAT32: return gguf_get_val_f32(g, id);
        case GGUF_TYPE_FLOAT64: return gguf_get_val_f64(g, id);
        default: return double(get_int(k, 0, true));
    }
}

std::string GGUFKeys::get_str(const std::string &k, const std::string &def, bool required) const {
    const int64_t id = need(k, required);
    if (id < 0) return def;
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) bad(k, "should be a string");
    return gguf_get_val_str(g, id);
}

// The storage types a weight may have: vectors (norms, biases) are F32, as every
// converter writes them (the graph adds and multiplies them into F32 activations);
// matrices are F32, F16, BF16 or a quantized type ggml's CPU backend has a dot product
// for (what ggml_mul_mat and ggml_get_rows need).  Anything else (I8, I32, F64, ...)
// would load and then abort inside ggml on the first eval.
void check_weight_type(const std::string &file, const ggml_tensor *t, bool matrix) {
    const ggml_type ty = t->type;
    bool ok;
    if (!matrix) {
        ok = ty == GGML_TYPE_F32;
    } else {
        const auto *cpu = ggml_get_type_traits_cpu(ty);
        ok = (ty == GGML_TYPE_F32 || ty == GGML_TYPE_F16 || ty == GGML_TYPE_BF16 || ggml_is_quantized(ty)) && cpu &&
             cpu->vec_dot && t->ne[0] % ggml_blck_size(ty) == 0;
    }
    if (!ok)
        throw std::invalid_argument(file + ": tensor '" + ggml_get_name(t) + "' has type " + ggml_type_name(ty) +
                                    (matrix ? ", which is not a weight type kvflash computes with (F32, F16, BF16 or a "
                                              "ggml quantized type)"
                                            : "; norms and biases must be F32") + ": re-convert the model");
}

ggml_tensor *TensorLoader::get(const std::string &name, const std::vector<int64_t> &shape, bool required) const {
    ggml_tensor *t = ggml_get_tensor(meta, name.c_str());
    if (!t) {
        if (required) throw std::invalid_argument(file + ": missing tensor '" + name + "'");
        return nullptr;
    }
    bool ok = ggml_n_dims(t) <= int(shape.size());
    for (size_t d = 0; d < 4; ++d) ok = ok && t->ne[d] == (d < shape.size() ? shape[d] : 1);
    if (!ok) {
        std::string want, got;
        for (size_t d = 0; d < shape.size(); ++d) want += (d ? ", " : "") + std::to_string(shape[d]);
        for (int d = 0; d < ggml_n_dims(t); ++d) got += (d ? ", " : "") + std::to_string(t->ne[d]);
        throw std::invalid_argument(file + ": tensor '" + name + "' has shape [" + got + "], expected [" + want + "]");
    }
    check_weight_type(file, t, shape.size() >= 2);
    return t;
}

// ---------------------------------------------------------------- hyper-parameters

namespace {

void check_positive(const std::string &file, const char *what, int64_t v, int64_t limit = int64_t(1) << 30) {
    if (v <= 0 || v > limit)
        throw std::invalid_argument(file + ": " + what + " = " + std::to_string(v) + " is out of range");
}

[[maybe_unused]] std::string mib(size_t bytes) { return std::to_string((bytes + (1u << 19)) >> 20) + " MiB"; }

// Which tensors a weight_placement line covers: "layers 0-14, 20-29, output" (blk.N.* as layer ranges,
// the others by name without ".weight").
[[maybe_unused]] std::string tensors_span(const std::vector<std::string> &names) {
    std::vector<int> layers;
    std::vector<std::string> other;
    for (const std::string &n : names) {
        int il = -1;
        if (std::sscanf(n.c_str(), "blk.%d.", &il) == 1 && il >= 0) {
            layers.push_back(il);
            continue;
        }
        std::string base = n.substr(0, n.rfind(".weight") == n.size() - 7 && n.size() > 7 ? n.size() - 7 : n.size());
        if (std::find(other.begin(), other.end(), base) == other.end()) other.push_back(base);
    }
    std::sort(layers.begin(), layers.end());
    layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
    std::string out;
    for (size_t i = 0; i < layers.size();) {
        size_t j = i;
        while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
        out += (out.empty() ? "layers " : ", ") + std::to_string(layers[i]) +
               (j > i ? "-" + std::to_string(layers[j]) : std::string());
        i = j + 1;
    }
    for (const std::string &o : other) out += (out.empty() ? "" : ", ") + o;
    return out.empty() ? "no tensors" : out;
}

// The matrix kernels ggml-cpu runs for weights in a buffer type, as weight_placement names them.
[[maybe_unused]] std::string kernels_of(const char *buft) {
    if (std::strcmp(buft, "CPU_REPACK") == 0) return "repacked interleaves: ggml-cpu's repack kernels";
    if (std::strcmp(buft, "AMX") == 0) return "AMX tiles";
    return std::string(buft) + " kernels";
}

// A positive count, checked as read (64 bits) before it is narrowed to 32.
int32_t positive_key(const GGUFKeys &kv, const char *suffix, int64_t limit, int64_t def = 0, bool required = true) {
    const int64_t v = kv.a(suffix, def, required);
    check_positive(kv.file, suffix, v, limit);
    return int32_t(v);
}

// A count for every layer: one value, or one per layer (an array, as llama.cpp reads it), each in (0, limit];
// n_layer values.  Not required: def when absent (or an empty array).
std::vector<int32_t> per_layer_key(const GGUFKeys &kv, const char *suffix, int32_t n_layer, int64_t limit,
                                   int64_t def = 0, bool required = true) {
    std::vector<int64_t> v = kv.get_ints(kv.arch + "." + suffix, size_t(n_layer), required);
    if (v.empty() && !required) v = {def};
    if (v.size() != 1 && v.size() != size_t(n_layer))
        throw std::invalid_argument(kv.file + ": " + suffix + " has " + std::to_string(v.size()) + " values for " +
                                    std::to_string(n_layer) + " layers");
    for (int64_t x : v) check_positive(kv.file, suffix, x, limit);
    std::vector<int32_t> out(static_cast<size_t>(n_layer), static_cast<int32_t>(v[0]));
    if (v.size() > 1) std::copy(v.begin(), v.end(), out.begin());
    return out;
}

// A float key that must be finite (and > 0 when positive is set).
float finite_key(const GGUFKeys &kv, const char *suffix, double def, bool positive) {
    const double v = kv.f(suffix, def);
    if (!std::isfinite(v) || (positive && !(v > 0)) || std::fabs(v) > 3.0e38)
        throw std::invalid_argument(kv.file + ": " + kv.arch + "." + suffix + " = " + std::to_string(v) +
                                    (positive ? " must be a finite number > 0" : " must be finite"));
    return float(v);
}

}  // namespace

float GGUFKeys::finite(const char *suffix, double def, bool positive) const { return finite_key(*this, suffix, def, positive); }

namespace {

// The keys every family shares; the family's read_hparams runs after.
Hparams read_common_hparams(const GGUFKeys &kv) {
    Hparams hp;
    hp.arch = kv.arch;
    hp.n_layer = positive_key(kv, "block_count", 4096);
    hp.n_embd = positive_key(kv, "embedding_length", int64_t(1) << 30);
    // experts (llama.cpp reads them for every family; a family without a MoE graph refuses them)
    const int64_t n_expert = kv.a("expert_count", 0, false), n_used = kv.a("expert_used_count", 0, false);
    if (n_expert > 1) {
        // llama.cpp's limit on experts (LLAMA_MAX_EXPERTS)
        check_positive(kv.file, "expert_count", n_expert, 512);
        check_positive(kv.file, "expert_used_count", n_used, n_expert);
        if (kv.a("expert_group_count", 0, false) > 1)
            throw std::invalid_argument(kv.file + ": grouped expert selection (expert_group_count > 1) is not supported");
        hp.n_expert = int32_t(n_expert);
        hp.n_expert_used = int32_t(n_used);
    } else if (n_expert < 0 || n_used < 0 || (n_expert <= 1 && n_used > 1)) {
        throw std::invalid_argument(kv.file + ": expert_count " + std::to_string(n_expert) + " / expert_used_count " +
                                    std::to_string(n_used) + " are not a mixture of experts");
    }
    // a MoE file may leave the dense width out (its experts have their own); one width, or one per layer (an
    // array, as llama.cpp reads it: Model::read_header checks what the family takes of it)
    if (hp.n_expert > 0 && !kv.has("feed_forward_length")) {
        hp.n_ff = 0;
    } else {
        hp.n_ff_l = per_layer_key(kv, "feed_forward_length", hp.n_layer, int64_t(1) << 30);
        hp.n_ff = hp.n_ff_l[0];
    }
    // Query heads: one count, or one per layer (an array, as llama.cpp reads it); the first layer's sizes
    // the default head dim, as there.  Model::read_header checks what the family takes of an array.
    hp.n_head_l = per_layer_key(kv, "attention.head_count", hp.n_layer, 4096);
    hp.n_head = hp.n_head_l[0];
    // K/V heads: one count (default: the query heads), or one per layer
    hp.n_head_kv_l = per_layer_key(kv, "attention.head_count_kv", hp.n_layer, 4096, hp.n_head, false);
    hp.n_head_kv = hp.n_head_kv_l[0];
    for (int32_t il = 0; il < hp.n_layer; ++il) {
        const int32_t h = hp.n_head_l[size_t(il)], g = hp.n_head_kv_l[size_t(il)];
        if (h % g != 0)
            throw std::invalid_argument(kv.file + ": head_count " + std::to_string(h) +
                                        " is not a multiple of head_count_kv " + std::to_string(g));
    }
    if (hp.n_embd % hp.n_head != 0 && !kv.has("attention.key_length"))
        throw std::invalid_argument(kv.file + ": embedding_length not divisible by head_count and no key_length");
    hp.head_dim_k = positive_key(kv, "attention.key_length", 1024, hp.n_embd / hp.n_head, false);
    hp.head_dim_v = positive_key(kv, "attention.value_length", 1024, hp.head_dim_k, false);
    if (hp.head_dim_k != hp.head_dim_v)
        throw std::invalid_argument(kv.file + ": key_length != value_length is not supported");
    // RoPE over the first n_rot dims of a head (partial where the family allows it: full_rope)
    const int64_t n_rot = kv.a("rope.dimension_count", hp.head_dim_k, false);
    if (n_rot <= 0 || n_rot > hp.head_dim_k || n_rot % 2)
        throw std::invalid_argument(kv.file + ": rope.dimension_count " + std::to_string(n_rot) +
                                    " must be even and in [2, head dim " + std::to_string(hp.head_dim_k) + "]");
    hp.n_rot = int32_t(n_rot);
    hp.n_rot_swa = hp.n_rot;
    hp.head_dim_swa = hp.head_dim_k;
    hp.n_head_kv_swa = hp.n_head_kv;
    hp.n_ctx_train = kv.a("context_length", 4096, false);
    check_positive(kv.file, "context_length", hp.n_ctx_train, std::numeric_limits<int64_t>::max());
    if (hp.n_ctx_train > kMaxContext) {
        // The trained context becomes the default max_ctx: clamp it, loudly, to what kvflash addresses.
        std::fprintf(stderr, "[kvflash] %s: context_length %lld is above the largest context kvflash addresses; "
                     "using %lld\n", kv.file.c_str(), (long long)hp.n_ctx_train, (long long)kMaxContext);
        hp.n_ctx_train = kMaxContext;
    }
    hp.rms_eps = float(kv.f("attention.layer_norm_rms_epsilon", 1e-5, true));
    if (!(hp.rms_eps > 0.f) || hp.rms_eps > 1.f)
        throw std::invalid_argument(kv.file + ": layer_norm_rms_epsilon out of range");
    hp.rope_base = finite_key(kv, "rope.freq_base", 10000.0, true);
    hp.rope_n_ctx_orig = hp.n_ctx_train;
    const std::string scaling = kv.get_str(kv.arch + ".rope.scaling.type", "none", false);
    if (scaling == "linear") {
        const double factor = finite_key(kv, "rope.scaling.factor", 1.0, true);
        hp.rope_scale = float(1.0 / factor);
    } else if (scaling == "yarn") {
        // As llama.cpp (llama-model.cpp load_hparams, llama-context.cpp): frequencies scaled by 1 / factor
        // (a factor of 0 or none: unscaled), the ramp on (ext_factor 1, beta_fast 32, beta_slow 1: the
        // rope.scaling.yarn_* keys are not read there, so not here), the magnitude factor llama.cpp
        // derives, which cancels the one ggml's rope applies itself, in float as there; the ramp's
        // dimensions from original_context_length.  Only families whose graph takes YaRN accept it
        // (ArchOps::yarn, checked after the family's keys).
        const float factor = finite_key(kv, "rope.scaling.factor", 0.0, false);
        if (factor < 0.f) throw std::invalid_argument(kv.file + ": rope.scaling.factor must be >= 0");
        hp.rope_scale = factor == 0.f ? 1.0f : 1.0f / factor;
        hp.rope_ext_factor = 1.0f;
        const float f = 1.0f / hp.rope_scale;
        float mscale = f <= 1.0f ? 1.0f : 0.1f * logf(f) + 1.0f;
        mscale *= 1.0f / (1.0f + 0.1f * logf(f));
        hp.rope_attn_factor = mscale;
        const int64_t orig = kv.a("rope.scaling.original_context_length", hp.n_ctx_train, false);
        check_positive(kv.file, "rope.scaling.original_context_length", orig, kMaxContext);
        hp.rope_n_ctx_orig = orig;
    } else if (scaling != "none" && !scaling.empty()) {
        throw std::invalid_argument(kv.file + ": rope scaling '" + scaling + "' is not supported (none, linear, yarn)");
    }
    // every family's rope magnitude times rope.scaling.attn_factor, as llama.cpp (1 when absent)
    hp.rope_attn_factor *= finite_key(kv, "rope.scaling.attn_factor", 1.0, true);
    hp.is_swa.assign(hp.n_layer, 0);
    hp.is_recr.assign(hp.n_layer, 0);
    hp.attn_scale = 1.0f / std::sqrt(float(hp.head_dim_k));
    return hp;
}

}  // namespace

// ---------------------------------------------------------------- loading

namespace {

// ggml's log, captured while gguf_init_from_file runs: its first error line becomes
// the exception's reason.  One load at a time captures (the logger is process-wide);
// the previous logger is restored after.
class GGUFLogCapture {
public:
    GGUFLogCapture() : lock_(mu()) {
        ggml_log_get(&prev_, &prev_ud_);
        ggml_log_set(&GGUFLogCapture::sink, this);
    }
    ~GGUFLogCapture() { ggml_log_set(prev_, prev_ud_); }
    std::string first_error() const {
        std::string line = text_.substr(0, text_.find('\n'));
        const size_t colon = line.find(": ");  // "gguf_init_from_reader: ..." -> "..."
        if (colon != std::string::npos && line.compare(0, 5, "gguf_") == 0) line = line.substr(colon + 2);
        return line;
    }

private:
    static std::mutex &mu() {
        static std::mutex m;
        return m;
    }
    static void sink(ggml_log_level level, const char *text, void *ud) {
        auto *self = static_cast<GGUFLogCapture *>(ud);
        if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_CONT) {
            if (self->text_.size() < 4096) self->text_ += text;
        }
    }
    std::lock_guard<std::mutex> lock_;
    ggml_log_callback prev_ = nullptr;
    void *prev_ud_ = nullptr;
    std::string text_;
};

}  // namespace

std::vector<RemoteLayers> split_layers(int32_t n_layer, const std::vector<std::string> &endpoints,
                                       const std::vector<float> &split) {
    if (endpoints.empty()) {
        if (!split.empty()) throw std::invalid_argument("tensor_split needs rpc endpoints to split the layers over");
        return {};
    }
    for (size_t i = 0; i < endpoints.size(); ++i) {
        check_rpc_endpoint(endpoints[i]);
        for (size_t j = 0; j < i; ++j)
            if (endpoints[j] == endpoints[i])
                throw std::invalid_argument("rpc endpoint " + endpoints[i] + " is named twice; give each server once "
                                            "(its share is one contiguous range of layers)");
    }
    const size_t ne = endpoints.size();
    std::vector<double> w(ne, 1.0);
    if (!split.empty()) {
        if (split.size() != ne && split.size() != ne + 1)
            throw std::invalid_argument("tensor_split has " + std::to_string(split.size()) + " weights for " +
                                        std::to_string(ne) + " rpc endpoints; give " + std::to_string(ne) +
                                        " (every layer remote) or " + std::to_string(ne + 1) +
                                        " (the last weight for this process's own share)");
        w.assign(split.begin(), split.end());
    }
    double total = 0;
    for (double x : w) {
        if (!std::isfinite(x) || x < 0)
            throw std::invalid_argument("tensor_split weights must be finite and >= 0, got " + std::to_string(x));
        total += x;
    }
    if (total <= 0) throw std::invalid_argument("tensor_split weights sum to zero: give some device a share of the layers");
    std::vector<RemoteLayers> out;
    double cum = 0;
    int32_t prev = 0;
    for (size_t i = 0; i < ne; ++i) {
        cum += w[i];
        const int32_t edge = std::min(n_layer, int32_t(std::lround(double(n_layer) * cum / total)));
        if (edge > prev) out.push_back({endpoints[i], prev, edge});
        prev = std::max(prev, edge);
    }
    return out;
}

std::shared_ptr<Model> Model::load(const std::string &path, int32_t n_threads, const std::string &device,
                                   const std::vector<std::string> &rpc, const std::vector<float> &tensor_split,
                                   bool repack) {
    // The device first: a bad device string fails before any file work.
    const Device dev = parse_device(device);
    check_device_visible(dev, device);
    if (!rpc.empty() && dev.kind != Device::Kind::CPU)
        throw std::invalid_argument("rpc: layers on RPC servers need the client on the CPU device (device='cpu'), "
                                    "got " + device);
    std::shared_ptr<Model> m(new Model());
    m->path_ = path;
    m->device_ = dev;
    m->repack_ = repack;
    m->read_header(path);
    m->remote_ = split_layers(m->hp_.n_layer, rpc, tensor_split);   // before the tensors: a bad split fails fast
    m->read_tensors();
    const int32_t hw = int32_t(std::min<unsigned>(std::max(1u, std::thread::hardware_concurrency()), GGML_MAX_N_THREADS));
    if (n_threads > GGML_MAX_N_THREADS)  // before any file work, as the device
        throw std::invalid_argument("n_threads " + std::to_string(n_threads) + " is above ggml's limit of " +
                                    std::to_string(GGML_MAX_N_THREADS) + " threads; use at most the machine's cores");
    m->place_weights(n_threads > 0 ? n_threads : hw);
    return m;
}

void Model::read_header(const std::string &path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) throw std::invalid_argument(path + ": no such file");
    if (!S_ISREG(st.st_mode)) throw std::invalid_argument(path + ": not a regular file");
    {
        // Check the magic ourselves: gguf_init_from_file only logs on failure.
        char magic[4] = {0, 0, 0, 0};
        FILE *f = std::fopen(path.c_str(), "rb");
        if (!f) throw std::invalid_argument(path + ": cannot open");
        const size_t got = std::fread(magic, 1, 4, f);
        std::fclose(f);
        if (got != 4 || std::memcmp(magic, "GGUF", 4) != 0) throw std::invalid_argument(path + ": not a GGUF file");
    }
    gguf_init_params gp{true, &meta_};
    std::string why;
    {
        GGUFLogCapture capture;  // ggml's parser says what is wrong only in its log
        gguf_ = gguf_init_from_file(path.c_str(), gp);
        why = capture.first_error();
    }
    if (!gguf_)
        throw std::invalid_argument(path + ": corrupt or truncated GGUF header" + (why.empty() ? "" : ": " + why));
    map_bytes_ = size_t(st.st_size);

    // Every tensor's bytes must lie inside the file (the sums checked for wrapping).
    const size_t data_off = gguf_get_data_offset(gguf_);
    for (int64_t i = 0; i < gguf_get_n_tensors(gguf_); ++i) {
        const char *name = gguf_get_tensor_name(gguf_, i);
        const ggml_tensor *t = ggml_get_tensor(meta_, name);
        if (!t) throw std::invalid_argument(path + ": corrupt GGUF: tensor '" + name + "' has no metadata");
        size_t end = 0;
        if (__builtin_add_overflow(data_off, gguf_get_tensor_offset(gguf_, i), &end) ||
            __builtin_add_overflow(end, ggml_nbytes(t), &end))
            throw std::invalid_argument(path + ": corrupt GGUF: tensor '" + name + "' has an offset past any file");
        if (end > size_t(st.st_size))
            throw std::invalid_argument(path + ": truncated: tensor '" + name + "' ends at byte " + std::to_string(end) +
                                        " but the file has " + std::to_string(st.st_size));
    }

    GGUFKeys kv{gguf_, path, ""};
    kv.arch = kv.get_str("general.architecture", "", true);
    arch_ = find_arch(kv.arch);
    if (!arch_)
        throw std::invalid_argument(path + ": unsupported architecture '" + kv.arch + "' (supported: " + arch_list() + ")");
    hp_ = read_common_hparams(kv);
    arch_->read_hparams(kv, hp_);
    // Per-layer query heads: every paged (global) layer's count is one (the pool kernel's captured
    // queries, the scorers and snapshots are sized by hp.n_head); other counts only where the family
    // builds them (ArchOps::per_layer_heads: its sliding layers).
    int32_t global_heads = -1;
    for (int32_t il = 0; il < hp_.n_layer; ++il) {
        const int32_t h = hp_.n_head_l[size_t(il)];
        if (!arch_->per_layer_heads && h != hp_.n_head)
            throw std::invalid_argument(path + ": attention.head_count varies by layer (" + std::to_string(hp_.n_head) +
                                        " at layer 0, " + std::to_string(h) + " at layer " + std::to_string(il) +
                                        "); " + kv.arch + " takes one count");
        if (hp_.is_swa[size_t(il)] || hp_.is_recr[size_t(il)]) continue;
        if (global_heads >= 0 && h != global_heads)
            throw std::invalid_argument(path + ": the global layers' attention.head_count differ (" +
                                        std::to_string(global_heads) + " and " + std::to_string(h) + " at layer " +
                                        std::to_string(il) + "); kvflash pages global layers of one query geometry");
        global_heads = h;
    }
    if (global_heads > 0) hp_.n_head = global_heads;
    // Per-layer K/V heads and FFN widths: only where the family builds them (ArchOps::per_layer_kv: gemma4,
    // whose read_hparams resolves them into the global and sliding geometries)
    if (!arch_->per_layer_kv) {
        for (int32_t il = 0; il < hp_.n_layer; ++il) {
            if (hp_.n_head_kv_l[size_t(il)] != hp_.n_head_kv)
                throw std::invalid_argument(path + ": attention.head_count_kv varies by layer (" +
                                            std::to_string(hp_.n_head_kv) + " at layer 0, " +
                                            std::to_string(hp_.n_head_kv_l[size_t(il)]) + " at layer " +
                                            std::to_string(il) + "); " + kv.arch + " takes one count");
            if (!hp_.n_ff_l.empty() && hp_.n_ff_l[size_t(il)] != hp_.n_ff)
                throw std::invalid_argument(path + ": feed_forward_length varies by layer (" + std::to_string(hp_.n_ff) +
                                            " at layer 0, " + std::to_string(hp_.n_ff_l[size_t(il)]) + " at layer " +
                                            std::to_string(il) + "); " + kv.arch + " takes one width");
        }
    }
    if (hp_.rope_ext_factor != 0.f && !arch_->yarn)
        throw std::invalid_argument(path + ": rope scaling 'yarn' is not supported for " + kv.arch + " (none, linear)");
}

void Model::read_tensors() {
    const TensorLoader t{path_, meta_};
    Hparams &hp = hp_;
    const int64_t E = hp.n_embd, nq = int64_t(hp.head_dim_k) * hp.n_head, nk = hp.n_embd_k(), nv = hp.n_embd_v();
    tok_embd = ggml_get_tensor(meta_, "token_embd.weight");
    if (!tok_embd) throw std::invalid_argument(path_ + ": missing tensor 'token_embd.weight'");
    if (tok_embd->ne[0] != E || ggml_n_dims(tok_embd) != 2)
        throw std::invalid_argument(path_ + ": tensor 'token_embd.weight' must be [n_embd=" + std::to_string(E) + ", n_vocab]");
    check_weight_type(path_, tok_embd, true);
    if (tok_embd->ne[1] <= 0 || tok_embd->ne[1] > std::numeric_limits<int32_t>::max())
        throw std::invalid_argument(path_ + ": token_embd.weight has " + std::to_string(tok_embd->ne[1]) +
                                    " rows; the vocabulary must have 1 .. 2^31-1 tokens (token ids are int32)");
    hp.n_vocab = int32_t(tok_embd->ne[1]);
    const int64_t V = hp.n_vocab;
    const int64_t vocab_kv = GGUFKeys{gguf_, path_, hp.arch}.a("vocab_size", V, false);
    if (vocab_kv != V)
        throw std::invalid_argument(path_ + ": vocab_size " + std::to_string(vocab_kv) + " disagrees with token_embd (" +
                                    std::to_string(V) + ")");
    output_norm = t.get("output_norm.weight", {E});
    output = t.get("output.weight", {E, V}, false);
    if (!output) output = tok_embd;
    if (arch_->load_model) arch_->load_model(t, hp, *this);   // the family's model-wide tensors
    layers.resize(hp.n_layer);
    for (int32_t il = 0; il < hp.n_layer; ++il) {
        auto w = [&](const char *s) { return TensorLoader::weight(il, s); };
        LayerWeights &L = layers[il];
        if (arch_->whole_layers) {  // a family whose layers differ from the shared block loads them itself
            arch_->load_layer(t, hp, il, L);
            continue;
        }
        L.attn_norm = t.get(w("attn_norm"), {E});
        L.wq = t.get(w("attn_q"), {E, nq});
        L.wk = t.get(w("attn_k"), {E, nk});
        L.wv = t.get(w("attn_v"), {E, nv});
        L.wo = t.get(w("attn_output"), {nq, E});
        L.ffn_norm = t.get(w("ffn_norm"), {E});
        load_ffn(t, hp, il, L);
        arch_->load_layer(t, hp, il, L);
    }
}

// The CPU device's extra buffer types (a null-terminated list), or nullptr when there are none, the
// model was loaded with repack = false, or KVFLASH_NO_REPACK asks for every weight to stay mapped.
static ggml_backend_buffer_type_t *cpu_extra_bufts(ggml_backend_dev_t dev, bool repack) {
    const char *off = std::getenv("KVFLASH_NO_REPACK");
    if (!repack || (off && *off && std::strcmp(off, "0") != 0) || !dev) return nullptr;
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto get = reg ? reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
                         ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts"))
                   : nullptr;
    return get ? get(dev) : nullptr;
}

void Model::place_weights(int32_t threads) {
    // Map the file; the CPU backend points the tensors into it (no copy),
    // a GPU backend uploads them into one device buffer and drops the mapping.
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::invalid_argument(path_ + ": cannot open");
    map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (map_ == MAP_FAILED) {
        map_ = nullptr;
        throw std::runtime_error(path_ + ": mmap failed");
    }
    const size_t data_off = gguf_get_data_offset(gguf_);
    const int64_t n_tensors = gguf_get_n_tensors(gguf_);
    auto nth = [&](int64_t i) { return ggml_get_tensor(meta_, gguf_get_tensor_name(gguf_, i)); };
    auto file_bytes = [&](int64_t i) { return static_cast<char *>(map_) + data_off + gguf_get_tensor_offset(gguf_, i); };
    if (device_.gpu()) {
        // Any GPU backend ggml has, through its device registry: the weights in the device's buffer type.
        ggml_backend_dev_t dev = ggml_device(device_);
        backend_ = ggml_backend_dev_init(dev, nullptr);
        if (!backend_) throw std::runtime_error("cannot initialise ggml's " + std::string(ggml_backend_dev_name(dev)) +
                                                " backend for " + device_.name());
        set_n_threads(threads);
        size_t need = 0;
        for (int64_t i = 0; i < n_tensors; ++i) need += ggml_nbytes(nth(i));
        buf_ = ggml_backend_alloc_ctx_tensors_from_buft(meta_, ggml_backend_dev_buffer_type(dev));
        if (!buf_) {
            const auto mem = device_memory();
            throw std::runtime_error(path_ + ": cannot allocate " + mib(need) + " of weights on " + device_.name() + " (" +
                                     mib(mem.first) + " free of " + mib(mem.second) + ")");
        }
        ggml_backend_buffer_set_usage(buf_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ::madvise(map_, map_bytes_, MADV_SEQUENTIAL);
        for (int64_t i = 0; i < n_tensors; ++i) {
            ggml_backend_tensor_set(nth(i), file_bytes(i), 0, ggml_nbytes(nth(i)));  // synchronous
            weight_bytes_ += ggml_nbytes(nth(i));
        }
        repacked_.push_back(device_.name() + " " + ggml_backend_dev_description(dev) + " (" +
                            ggml_backend_buft_name(ggml_backend_dev_buffer_type(dev)) + ", the backend's kernels), every tensor: " +
                            mib(weight_bytes_));
        ::munmap(map_, map_bytes_);
        map_ = nullptr;
        map_bytes_ = 0;
        return;
    }
    backend_ = ggml_backend_cpu_init();
    if (!backend_) throw std::runtime_error("cannot initialise the ggml CPU backend");
    set_n_threads(threads);
    // Matrix weights go to the CPU backend's extra buffer types where one takes them (AMX tiles, the
    // repacked interleaves: ggml's faster matmul kernels for this CPU), as llama.cpp places them; their
    // bytes are converted on upload and leave the mapping.  Everything else (embeddings, norms, a tied
    // output head that get_rows also reads) stays mapped.  KVFLASH_NO_REPACK=1 maps everything.
    // ggml's repackers log every tensor at debug level: keep warnings and errors only while they run
    struct QuietLog {
        ggml_log_callback prev = nullptr;
        void *prev_ud = nullptr;
        QuietLog() {
            ggml_log_get(&prev, &prev_ud);
            ggml_log_set(&QuietLog::sink, this);
        }
        ~QuietLog() { ggml_log_set(prev, prev_ud); }
        static void sink(ggml_log_level level, const char *text, void *ud) {
            auto *self = static_cast<QuietLog *>(ud);
            if ((level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) && self->prev) self->prev(level, text, self->prev_ud);
        }
    } quiet;
    std::vector<ggml_backend_buffer_type_t> where = extra_placement();
    const std::vector<int32_t> remote_of = tensor_remote();
    for (size_t i = 0; i < where.size(); ++i)
        if (remote_of[i] >= 0) where[i] = nullptr;   // a remote layer's weights go to its server as they are
    buf_ = ggml_backend_cpu_buffer_from_ptr(map_, map_bytes_);
    ggml_backend_buffer_set_usage(buf_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    std::vector<ggml_backend_buffer_type_t> bufts;
    for (auto *b : where)
        if (b && std::find(bufts.begin(), bufts.end(), b) == bufts.end()) bufts.push_back(b);
    for (ggml_backend_buffer_type_t buft : bufts) {
        const size_t align = ggml_backend_buft_get_alignment(buft);
        auto up = [align](size_t x) { return (x + align - 1) / align * align; };
        size_t need = 0;
        for (int64_t i = 0; i < n_tensors; ++i)
            if (where[size_t(i)] == buft) need += up(ggml_backend_buft_get_alloc_size(buft, nth(i)));
        ggml_backend_buffer_t b = ggml_backend_buft_alloc_buffer(buft, need);
        if (!b) throw std::runtime_error(path_ + ": cannot allocate " + mib(need) + " for weights in " + ggml_backend_buft_name(buft));
        extra_bufs_.push_back(b);
        ggml_backend_buffer_set_usage(b, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        char *base = static_cast<char *>(ggml_backend_buffer_get_base(b));
        size_t off = 0;
        for (int64_t i = 0; i < n_tensors; ++i) {
            if (where[size_t(i)] != buft) continue;
            ggml_tensor *t = nth(i);
            if (ggml_backend_tensor_alloc(b, t, base + off) != GGML_STATUS_SUCCESS)
                throw std::runtime_error(path_ + ": cannot place tensor " + ggml_get_name(t));
            ggml_backend_tensor_set(t, file_bytes(i), 0, ggml_nbytes(t));   // converted here
            off += up(ggml_backend_buft_get_alloc_size(buft, t));
            // the mapped pages of this tensor are not read again: give them back
            const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE)), lo = uintptr_t(file_bytes(i)),
                            hi = lo + ggml_nbytes(t), a0 = (lo + page - 1) / page * page, a1 = hi / page * page;
            if (a1 > a0) ::madvise(reinterpret_cast<void *>(a0), a1 - a0, MADV_DONTNEED);
        }
        weight_bytes_ += need;
        std::vector<std::string> names;
        for (int64_t i = 0; i < n_tensors; ++i)
            if (where[size_t(i)] == buft) names.push_back(gguf_get_tensor_name(gguf_, i));
        repacked_.push_back(std::string(ggml_backend_buft_name(buft)) + " (" + kernels_of(ggml_backend_buft_name(buft)) +
                            "), " + tensors_span(names) + ": " + mib(need));
    }
    // Remote layers: one buffer per server, the weights uploaded from the mapping (ggml's client sends a
    // large tensor by hash first where the server keeps a cache).
    for (size_t r = 0; r < remote_.size(); ++r) {
        const RemoteLayers &R = remote_[r];
        ggml_backend_t rb = rpc_backend(R.endpoint);
        ggml_backend_buffer_type_t buft = rpc_buffer_type(R.endpoint);
        const size_t align = ggml_backend_buft_get_alignment(buft);
        auto up = [align](size_t x) { return (x + align - 1) / align * align; };
        size_t need = 0;
        for (int64_t i = 0; i < n_tensors; ++i)
            if (remote_of[size_t(i)] == int32_t(r)) need += up(ggml_backend_buft_get_alloc_size(buft, nth(i)));
        ggml_backend_buffer_t b = ggml_backend_buft_alloc_buffer(buft, need);
        if (!b) {
            const auto mem = rpc_device_memory(R.endpoint);
            throw std::runtime_error(path_ + ": the RPC server at " + R.endpoint + " could not allocate " + mib(need) +
                                     " for layers " + std::to_string(R.first) + "-" + std::to_string(R.last - 1) +
                                     " (" + mib(mem.first) + " free of " + mib(mem.second) + ")");
        }
        remote_bufs_.push_back(b);
        ggml_backend_buffer_set_usage(b, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        char *base = static_cast<char *>(ggml_backend_buffer_get_base(b));
        size_t off = 0;
        for (int64_t i = 0; i < n_tensors; ++i) {
            if (remote_of[size_t(i)] != int32_t(r)) continue;
            ggml_tensor *t = nth(i);
            if (ggml_backend_tensor_alloc(b, t, base + off) != GGML_STATUS_SUCCESS)
                throw std::runtime_error(path_ + ": cannot place tensor " + ggml_get_name(t) + " on " + R.endpoint);
            ggml_backend_tensor_set(t, file_bytes(i), 0, ggml_nbytes(t));
            off += up(ggml_backend_buft_get_alloc_size(buft, t));
        }
        remote_backends_.push_back(rb);
        remote_bufts_.push_back(buft);
        remote_bytes_.push_back(need);
        repacked_.push_back("RPC " + R.endpoint + ", layers " + std::to_string(R.first) + "-" + std::to_string(R.last - 1) +
                            " (mapped there: the server's plain CPU kernels): " + mib(need));
    }
    std::vector<std::string> mapped;
    size_t mapped_bytes = 0;
    for (int64_t i = 0; i < n_tensors; ++i) {
        if (where[size_t(i)] || remote_of[size_t(i)] >= 0) continue;
        if (ggml_backend_tensor_alloc(buf_, nth(i), file_bytes(i)) != GGML_STATUS_SUCCESS)
            throw std::runtime_error(path_ + ": cannot place tensor " + ggml_get_name(nth(i)));
        weight_bytes_ += ggml_nbytes(nth(i));
        mapped_bytes += ggml_nbytes(nth(i));
        mapped.push_back(gguf_get_tensor_name(gguf_, i));
    }
    if (!mapped.empty())
        repacked_.insert(repacked_.begin(), "CPU mapped (ggml-cpu's plain kernels), " + tensors_span(mapped) + ": " +
                                                mib(mapped_bytes));
    ::madvise(map_, map_bytes_, MADV_WILLNEED);
    place_decode_copies(where);
}

void Model::place_decode_copies(const std::vector<ggml_backend_buffer_type_t> &where) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend_);
    ggml_backend_buffer_type_t amx = nullptr;
    for (ggml_backend_buffer_type_t *b = cpu_extra_bufts(dev, repack_); b && *b; ++b)
        if (std::strcmp(ggml_backend_buft_name(*b), "AMX") == 0) amx = *b;
    if (!amx) return;
    // the mapped matrix weights AMX takes for a one-row product (a tied head included: its copy is
    // only multiplied by, the mapped original serves get_rows)
    std::vector<ggml_tensor *> cand;
    auto consider = [&](ggml_tensor *w) {
        if (!w || w->buffer != buf_ || std::find(cand.begin(), cand.end(), w) != cand.end()) return;   // mapped only
        for (int64_t i = 0; i < gguf_get_n_tensors(gguf_); ++i)
            if (ggml_get_tensor(meta_, gguf_get_tensor_name(gguf_, i)) == w && where[size_t(i)]) return;   // moved already
        ggml_init_params ip{8 * ggml_tensor_overhead(), nullptr, true};
        ggml_context *ctx = ggml_init(ip);
        if (!ctx) return;
        ggml_tensor *probe = ggml_dup_tensor(ctx, w);   // w itself stays in the mapping
        ggml_tensor *x = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, w->ne[0], 1, w->ne[2], w->ne[3]);
        ggml_tensor *op = ggml_mul_mat(ctx, probe, x);
        ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(amx, 0);
        probe->buffer = dummy;
        if (dummy && ggml_backend_dev_supports_op(dev, op)) cand.push_back(w);
        if (dummy) ggml_backend_buffer_free(dummy);
        ggml_free(ctx);
    };
    for (const LayerWeights &L : layers)
        for (ggml_tensor *t : {L.wq, L.wk, L.wv, L.wo, L.ffn_gate, L.ffn_up, L.ffn_down}) consider(t);
    consider(output);
    if (cand.empty()) return;
    ggml_init_params ip{(cand.size() + 1) * ggml_tensor_overhead(), nullptr, true};
    decode_meta_ = ggml_init(ip);
    if (!decode_meta_) return;
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> copies;
    for (ggml_tensor *w : cand) {
        ggml_tensor *c = ggml_dup_tensor(decode_meta_, w);
        ggml_format_name(c, "%s (1-row)", ggml_get_name(w));
        copies.emplace_back(w, c);
    }
    ggml_backend_buffer_t b = ggml_backend_alloc_ctx_tensors_from_buft(decode_meta_, amx);
    if (!b) {   // no room for the copies: decode keeps the mapped weights
        ggml_free(decode_meta_);
        decode_meta_ = nullptr;
        return;
    }
    extra_bufs_.push_back(b);
    ggml_backend_buffer_set_usage(b, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (auto &wc : copies) ggml_backend_tensor_set(wc.second, wc.first->data, 0, ggml_nbytes(wc.first));
    auto copy_of = [&](ggml_tensor *w) {
        for (auto &wc : copies)
            if (wc.first == w) return wc.second;
        return w;
    };
    decode_layers_ = layers;
    for (LayerWeights &L : decode_layers_)
        for (ggml_tensor **t : {&L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_gate, &L.ffn_up, &L.ffn_down}) *t = copy_of(*t);
    decode_output_ = copy_of(output) == output ? nullptr : copy_of(output);
    const size_t bytes = ggml_backend_buffer_get_size(b);
    weight_bytes_ += bytes;
    std::vector<std::string> names;
    for (auto &wc : copies) names.push_back(ggml_get_name(wc.first));
    repacked_.push_back("AMX one-token copies (AMX tiles for one-token graphs; batches use the weights above), " +
                        tensors_span(names) + ": " + mib(bytes));
}

std::vector<ggml_backend_buffer_type_t> Model::extra_placement() const {
    const int64_t n_tensors = gguf_get_n_tensors(gguf_);
    std::vector<ggml_backend_buffer_type_t> where(size_t(n_tensors), nullptr);
    ggml_backend_dev_t dev = ggml_backend_get_device(backend_);
    ggml_backend_buffer_type_t *extra = cpu_extra_bufts(dev, repack_);
    if (!extra || !*extra) return where;
    // the tensors that only feed matrix products (a tied head also feeds get_rows: it stays)
    std::vector<const ggml_tensor *> mm, experts;
    for (const LayerWeights &L : layers) {
        for (const ggml_tensor *t : {L.wq, L.wk, L.wv, L.wo, L.ffn_gate, L.ffn_up, L.ffn_down, L.ffn_gate_inp,
                                     L.ffn_gate_shexp, L.ffn_up_shexp, L.ffn_down_shexp, L.wqkv, L.wqkv_gate, L.attn_gate,
                                     L.ssm_beta, L.ssm_alpha, L.ssm_out, L.per_layer_inp_gate, L.per_layer_proj})
            if (t) mm.push_back(t);
        for (const ggml_tensor *t : {L.ffn_gate_exps, L.ffn_up_exps, L.ffn_gate_up_exps, L.ffn_down_exps})
            if (t) experts.push_back(t);
    }
    if (output && output != tok_embd) mm.push_back(output);
    if (per_layer_model_proj) mm.push_back(per_layer_model_proj);
    ggml_init_params ip{8 * ggml_tensor_overhead(), nullptr, true};
    for (int64_t i = 0; i < n_tensors; ++i) {
        ggml_tensor *w = ggml_get_tensor(meta_, gguf_get_tensor_name(gguf_, i));
        const bool expert = std::find(experts.begin(), experts.end(), w) != experts.end();
        if (!expert && std::find(mm.begin(), mm.end(), w) == mm.end()) continue;
        for (ggml_backend_buffer_type_t *b = extra; *b; ++b) {
            // ggml's AMX buffer only for the one-token copies (place_decode_copies): its mul_mat for
            // several rows crashed here, llama-bench's too (issue 21's note)
            if (std::strcmp(ggml_backend_buft_name(*b), "AMX") == 0) continue;
            // does the device run a product with w held in this buffer type?  (as llama.cpp asks it)
            ggml_context *ctx = ggml_init(ip);
            if (!ctx) break;
            ggml_tensor *op;
            if (expert) {  // the routed product: every token to n_expert_used of the experts
                const int64_t k = hp_.n_expert_used;
                ggml_tensor *x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w->ne[0], k, 512);
                op = ggml_mul_mat_id(ctx, w, x, ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, 512));
            } else {
                ggml_tensor *x = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, w->ne[0], 512, w->ne[2], w->ne[3]);
                op = ggml_mul_mat(ctx, w, x);
            }
            ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(*b, 0);
            w->buffer = dummy;
            const bool ok = dummy && ggml_backend_dev_supports_op(dev, op);
            w->buffer = nullptr;
            if (dummy) ggml_backend_buffer_free(dummy);
            ggml_free(ctx);
            if (ok) {
                where[size_t(i)] = *b;
                break;
            }
        }
    }
    return where;
}

std::vector<int32_t> Model::tensor_remote() const {
    const int64_t n_tensors = gguf_get_n_tensors(gguf_);
    std::vector<int32_t> out(size_t(n_tensors), -1);
    for (int64_t i = 0; i < n_tensors && !remote_.empty(); ++i) {
        int il = -1, used = 0;
        if (std::sscanf(gguf_get_tensor_name(gguf_, i), "blk.%d.%n", &il, &used) == 1 && used > 0) out[size_t(i)] = layer_remote(il);
    }
    return out;
}

int32_t Model::layer_remote(int32_t il) const {
    for (size_t r = 0; r < remote_.size(); ++r)
        if (il >= remote_[r].first && il < remote_[r].last) return int32_t(r);
    return -1;
}

ggml_backend_buffer_type_t Model::layer_buft(int32_t il) const {
    const int32_t r = layer_remote(il);
    return r >= 0 && size_t(r) < remote_bufts_.size() ? remote_bufts_[size_t(r)] : nullptr;
}

Model::~Model() {
    // A server that went away makes ggml's client abort on these frees (rpc.h's known limit).
    for (ggml_backend_buffer_t b : remote_bufs_) ggml_backend_buffer_free(b);
    for (ggml_backend_buffer_t b : extra_bufs_) ggml_backend_buffer_free(b);
    if (decode_meta_) ggml_free(decode_meta_);
    if (buf_) ggml_backend_buffer_free(buf_);
    if (backend_) ggml_backend_free(backend_);
    if (meta_) ggml_free(meta_);
    if (gguf_) gguf_free(gguf_);
    if (map_) ::munmap(map_, map_bytes_);
}

std::shared_ptr<const Tokenizer> Model::tokenizer() const {
    std::lock_guard<std::mutex> lk(tokenizer_mu_);
    if (!tokenizer_) tokenizer_ = Tokenizer::from_gguf(gguf_, path_);
    return tokenizer_;
}

void Model::set_n_threads(int32_t n) {
    if (n <= 0) throw std::invalid_argument("n_threads must be >= 1");
    if (n > GGML_MAX_N_THREADS)
        throw std::invalid_argument("n_threads " + std::to_string(n) + " is above ggml's limit of " +
                                    std::to_string(GGML_MAX_N_THREADS) + " threads; use at most the machine's cores");
    std::lock_guard<std::mutex> lock(compute_mu_);
    n_threads_ = n;
    if (backend_ && ggml_backend_is_cpu(backend_)) ggml_backend_cpu_set_n_threads(backend_, n);
}

std::pair<size_t, size_t> Model::device_memory() const {
    size_t free = 0, total = 0;
    ggml_backend_dev_t d = backend_ ? ggml_backend_get_device(backend_) : nullptr;
    if (d) ggml_backend_dev_memory(d, &free, &total);
    return {free, total};
}

std::vector<int32_t> Model::global_layers() const {
    std::vector<int32_t> out;
    for (int32_t il = 0; il < hp_.n_layer; ++il)
        if (!hp_.is_swa[il] && !hp_.is_recr[il] && hp_.kv_source(il) < 0) out.push_back(il);
    return out;
}

}  // namespace kvflash
