#include "kvflash/model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ggml-cpu.h"
#include "kvflash/attn_cpu.h"
#include "kvflash/limits.h"
#ifdef KVFLASH_WITH_CUDA
#include "ggml-cuda.h"
#endif

namespace kvflash {

using clk = std::chrono::steady_clock;
static double ms_since(clk::time_point t) { return std::chrono::duration<double, std::milli>(clk::now() - t).count(); }

const char *arch_name(Arch a) {
    switch (a) {
        case Arch::LLAMA: return "llama";
        case Arch::QWEN2: return "qwen2";
        case Arch::QWEN3: return "qwen3";
        case Arch::GEMMA3: return "gemma3";
    }
    return "?";
}

// ---------------------------------------------------------------- devices

static const char *const kDeviceForms = "'cpu', 'cuda' or 'cuda:N' (N: a CUDA device index)";

std::string Device::name() const { return kind == Kind::CPU ? std::string("cpu") : "cuda:" + std::to_string(index); }

Device parse_device(const std::string &s) {
    Device d;
    if (s == "cpu") return d;
    if (s == "cuda" || s.rfind("cuda:", 0) == 0) {
        d.kind = Device::Kind::CUDA;
        if (s.size() > 4) {
            const std::string n = s.substr(5);
            if (n.empty() || n.size() > 4 || n.find_first_not_of("0123456789") != std::string::npos)
                throw std::invalid_argument("device '" + s + "': the CUDA device index must be a non-negative integer; use " +
                                            kDeviceForms);
            d.index = std::stoi(n);
        }
#ifndef KVFLASH_WITH_CUDA
        throw std::invalid_argument(
            "device '" + s + "': kvflash was built without CUDA. Rebuild it with the CUDA backend: "
            "pip install . -Ccmake.define.KVFLASH_CUDA=ON -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=<your GPU's, e.g. 86, 89 "
            "or 90> (or KVFLASH_CUDA=ON pip install .; needs the CUDA toolkit with cuBLAS, see the README), "
            "or use device='cpu'");
#endif
        return d;
    }
    throw std::invalid_argument("unknown device '" + s + "': use " + kDeviceForms);
}

bool cuda_compiled() {
#ifdef KVFLASH_WITH_CUDA
    return true;
#else
    return false;
#endif
}

int32_t cuda_device_count() {
#ifdef KVFLASH_WITH_CUDA
    return int32_t(ggml_backend_cuda_get_device_count());
#else
    return 0;
#endif
}

[[maybe_unused]] static std::string mib(size_t bytes) { return std::to_string((bytes + (1u << 19)) >> 20) + " MiB"; }

// ---------------------------------------------------------------- GGUF reading

namespace {

struct KV {
    gguf_context *g;
    std::string file, arch;
    int64_t find(const std::string &k) const { return gguf_find_key(g, k.c_str()); }
    [[noreturn]] void bad(const std::string &k, const std::string &why) const {
        throw std::invalid_argument(file + ": metadata key '" + k + "' " + why);
    }
    int64_t get_int(const std::string &k, int64_t def, bool required) const {
        const int64_t id = find(k);
        if (id < 0) {
            if (required) bad(k, "is missing");
            return def;
        }
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
    double get_float(const std::string &k, double def, bool required) const {
        const int64_t id = find(k);
        if (id < 0) {
            if (required) bad(k, "is missing");
            return def;
        }
        switch (gguf_get_kv_type(g, id)) {
            case GGUF_TYPE_FLOAT32: return gguf_get_val_f32(g, id);
            case GGUF_TYPE_FLOAT64: return gguf_get_val_f64(g, id);
            default: return double(get_int(k, 0, true));
        }
    }
    std::string get_str(const std::string &k, const std::string &def, bool required) const {
        const int64_t id = find(k);
        if (id < 0) {
            if (required) bad(k, "is missing");
            return def;
        }
        if (gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) bad(k, "should be a string");
        return gguf_get_val_str(g, id);
    }
    int64_t a(const char *suffix, int64_t def = 0, bool req = true) const { return get_int(arch + "." + suffix, def, req); }
    double f(const char *suffix, double def = 0, bool req = false) const { return get_float(arch + "." + suffix, def, req); }
};

void check_positive(const std::string &file, const char *what, int64_t v, int64_t limit = int64_t(1) << 30) {
    if (v <= 0 || v > limit)
        throw std::invalid_argument(file + ": " + what + " = " + std::to_string(v) + " is out of range");
}

}  // namespace

static Hparams read_hparams(const KV &kv) {
    Hparams hp;
    const std::string &a = kv.arch;
    if (a == "llama") hp.arch = Arch::LLAMA;
    else if (a == "qwen2") hp.arch = Arch::QWEN2;
    else if (a == "qwen3") hp.arch = Arch::QWEN3;
    else if (a == "gemma3") hp.arch = Arch::GEMMA3;
    else
        throw std::invalid_argument(kv.file + ": unsupported architecture '" + a +
                                    "' (supported: llama, qwen2, qwen3, gemma3)");
    hp.n_layer = int32_t(kv.a("block_count"));
    hp.n_embd = int32_t(kv.a("embedding_length"));
    hp.n_ff = int32_t(kv.a("feed_forward_length"));
    hp.n_head = int32_t(kv.a("attention.head_count"));
    hp.n_head_kv = int32_t(kv.a("attention.head_count_kv", hp.n_head, false));
    check_positive(kv.file, "block_count", hp.n_layer, 4096);
    check_positive(kv.file, "embedding_length", hp.n_embd);
    check_positive(kv.file, "feed_forward_length", hp.n_ff);
    check_positive(kv.file, "attention.head_count", hp.n_head, 4096);
    check_positive(kv.file, "attention.head_count_kv", hp.n_head_kv, 4096);
    if (hp.n_head % hp.n_head_kv != 0)
        throw std::invalid_argument(kv.file + ": head_count " + std::to_string(hp.n_head) +
                                    " is not a multiple of head_count_kv " + std::to_string(hp.n_head_kv));
    if (hp.n_embd % hp.n_head != 0 && kv.find(a + ".attention.key_length") < 0)
        throw std::invalid_argument(kv.file + ": embedding_length not divisible by head_count and no key_length");
    hp.head_dim_k = int32_t(kv.a("attention.key_length", hp.n_embd / hp.n_head, false));
    hp.head_dim_v = int32_t(kv.a("attention.value_length", hp.head_dim_k, false));
    check_positive(kv.file, "attention.key_length", hp.head_dim_k, 1024);
    check_positive(kv.file, "attention.value_length", hp.head_dim_v, 1024);
    if (hp.head_dim_k != hp.head_dim_v)
        throw std::invalid_argument(kv.file + ": key_length != value_length is not supported");
    hp.n_rot = int32_t(kv.a("rope.dimension_count", hp.head_dim_k, false));
    if (hp.n_rot != hp.head_dim_k)
        throw std::invalid_argument(kv.file + ": partial RoPE (rope.dimension_count " + std::to_string(hp.n_rot) +
                                    " != head dim " + std::to_string(hp.head_dim_k) + ") is not supported");
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
    hp.rope_base = float(kv.f("rope.freq_base", 10000.0));
    const std::string scaling = kv.get_str(a + ".rope.scaling.type", "none", false);
    if (scaling == "linear") {
        const double factor = kv.f("rope.scaling.factor", 1.0);
        if (!(factor > 0)) throw std::invalid_argument(kv.file + ": rope.scaling.factor must be > 0");
        hp.rope_scale = float(1.0 / factor);
    } else if (scaling != "none" && !scaling.empty()) {
        throw std::invalid_argument(kv.file + ": rope scaling '" + scaling + "' is not supported (none, linear)");
    }
    hp.rope_mode = hp.arch == Arch::LLAMA ? 0 : GGML_ROPE_TYPE_NEOX;
    hp.is_swa.assign(hp.n_layer, 0);
    hp.attn_scale = 1.0f / std::sqrt(float(hp.head_dim_k));
    if (hp.arch == Arch::GEMMA3) {
        hp.n_swa = int32_t(kv.a("attention.sliding_window", 0, false));
        if (hp.n_swa < 0) throw std::invalid_argument(kv.file + ": attention.sliding_window must be >= 0");
        if (hp.n_swa > 0) {
            const int64_t pattern = kv.a("attention.sliding_window_pattern", 6, false);
            if (pattern <= 0) throw std::invalid_argument(kv.file + ": sliding_window_pattern must be > 0");
            for (int32_t il = 0; il < hp.n_layer; ++il) hp.is_swa[il] = (il % pattern) < pattern - 1;
        }
        hp.rope_base_swa = float(kv.f("rope.freq_base_swa", 10000.0));
        hp.rope_scale_swa = 1.f;
        // gemma3 27B scales by n_embd / n_head, the others by the head dim.
        hp.attn_scale = hp.n_layer == 62 ? 1.0f / std::sqrt(float(hp.n_embd / hp.n_head))
                                         : 1.0f / std::sqrt(float(hp.head_dim_k));
        hp.final_softcap = float(kv.f("final_logit_softcapping", 0.0));
    }
    return hp;
}

std::shared_ptr<Model> Model::load(const std::string &path, int32_t n_threads, const std::string &device) {
    // The device first: a bad device string fails before any file work.
    const Device dev = parse_device(device);
#ifdef KVFLASH_WITH_CUDA
    if (dev.kind == Device::Kind::CUDA) {
        const int32_t n_dev = cuda_device_count();
        if (n_dev == 0)
            throw std::invalid_argument("device '" + device + "': kvflash was built with CUDA but no CUDA device is visible "
                                        "(no driver, or CUDA_VISIBLE_DEVICES hides them); use device='cpu'");
        if (dev.index >= n_dev)
            throw std::invalid_argument("device '" + device + "': " + std::to_string(n_dev) +
                                        " CUDA device(s) visible (cuda:0 .. cuda:" + std::to_string(n_dev - 1) + ")");
    }
#endif
    std::shared_ptr<Model> m(new Model());
    m->path_ = path;
    m->device_ = dev;
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
    gguf_init_params gp{true, &m->meta_};
    m->gguf_ = gguf_init_from_file(path.c_str(), gp);
    if (!m->gguf_) throw std::invalid_argument(path + ": corrupt or truncated GGUF header");

    // Every tensor's bytes must lie inside the file.
    const size_t data_off = gguf_get_data_offset(m->gguf_);
    const int64_t n_tensors = gguf_get_n_tensors(m->gguf_);
    for (int64_t i = 0; i < n_tensors; ++i) {
        const char *name = gguf_get_tensor_name(m->gguf_, i);
        ggml_tensor *t = ggml_get_tensor(m->meta_, name);
        const size_t end = data_off + gguf_get_tensor_offset(m->gguf_, i) + ggml_nbytes(t);
        if (end > size_t(st.st_size))
            throw std::invalid_argument(path + ": truncated: tensor '" + name + "' ends at byte " + std::to_string(end) +
                                        " but the file has " + std::to_string(st.st_size));
    }

    KV kv{m->gguf_, path, ""};
    kv.arch = kv.get_str("general.architecture", "", true);
    m->hp_ = read_hparams(kv);
    Hparams &hp = m->hp_;

    // Tensors, each with its expected shape.
    auto tensor = [&](const std::string &name, std::vector<int64_t> shape, bool required = true) -> ggml_tensor * {
        ggml_tensor *t = ggml_get_tensor(m->meta_, name.c_str());
        if (!t) {
            if (required) throw std::invalid_argument(path + ": missing tensor '" + name + "'");
            return nullptr;
        }
        bool ok = ggml_n_dims(t) <= int(shape.size());
        for (size_t d = 0; d < 4; ++d) ok = ok && t->ne[d] == (d < shape.size() ? shape[d] : 1);
        if (!ok) {
            std::string want, got;
            for (size_t d = 0; d < shape.size(); ++d) want += (d ? ", " : "") + std::to_string(shape[d]);
            for (int d = 0; d < ggml_n_dims(t); ++d) got += (d ? ", " : "") + std::to_string(t->ne[d]);
            throw std::invalid_argument(path + ": tensor '" + name + "' has shape [" + got + "], expected [" + want + "]");
        }
        return t;
    };
    const int64_t E = hp.n_embd, nq = int64_t(hp.head_dim_k) * hp.n_head, nk = hp.n_embd_k(), nv = hp.n_embd_v();
    {
        ggml_tensor *t = ggml_get_tensor(m->meta_, "token_embd.weight");
        if (!t) throw std::invalid_argument(path + ": missing tensor 'token_embd.weight'");
        if (t->ne[0] != E || ggml_n_dims(t) != 2)
            throw std::invalid_argument(path + ": tensor 'token_embd.weight' must be [n_embd=" + std::to_string(E) + ", n_vocab]");
        hp.n_vocab = int32_t(t->ne[1]);
        m->tok_embd = t;
    }
    const int64_t V = hp.n_vocab;
    const int64_t vocab_kv = kv.a("vocab_size", V, false);
    if (vocab_kv != V)
        throw std::invalid_argument(path + ": vocab_size " + std::to_string(vocab_kv) + " disagrees with token_embd (" +
                                    std::to_string(V) + ")");
    m->output_norm = tensor("output_norm.weight", {E});
    m->output = tensor("output.weight", {E, V}, false);
    if (!m->output) m->output = m->tok_embd;
    m->layers.resize(hp.n_layer);
    for (int32_t il = 0; il < hp.n_layer; ++il) {
        auto n = [&](const char *s) { return "blk." + std::to_string(il) + "." + s + ".weight"; };
        auto b = [&](const char *s) { return "blk." + std::to_string(il) + "." + s + ".bias"; };
        LayerWeights &L = m->layers[il];
        L.attn_norm = tensor(n("attn_norm"), {E});
        L.wq = tensor(n("attn_q"), {E, nq});
        L.wk = tensor(n("attn_k"), {E, nk});
        L.wv = tensor(n("attn_v"), {E, nv});
        L.wo = tensor(n("attn_output"), {nq, E});
        L.ffn_norm = tensor(n("ffn_norm"), {E});
        L.ffn_gate = tensor(n("ffn_gate"), {E, hp.n_ff});
        L.ffn_up = tensor(n("ffn_up"), {E, hp.n_ff});
        L.ffn_down = tensor(n("ffn_down"), {hp.n_ff, E});
        if (hp.arch == Arch::QWEN2) {
            L.bq = tensor(b("attn_q"), {nq});
            L.bk = tensor(b("attn_k"), {nk});
            L.bv = tensor(b("attn_v"), {nv});
        }
        if (hp.arch == Arch::QWEN3 || hp.arch == Arch::GEMMA3) {
            L.q_norm = tensor(n("attn_q_norm"), {hp.head_dim_k});
            L.k_norm = tensor(n("attn_k_norm"), {hp.head_dim_k});
        }
        if (hp.arch == Arch::GEMMA3) {
            L.attn_post_norm = tensor(n("post_attention_norm"), {E});
            L.ffn_post_norm = tensor(n("post_ffw_norm"), {E});
        }
    }

    // Weights: map the file; the CPU backend points the tensors into it (no copy),
    // CUDA uploads them into one device buffer and drops the mapping.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::invalid_argument(path + ": cannot open");
    m->map_bytes_ = size_t(st.st_size);
    m->map_ = ::mmap(nullptr, m->map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (m->map_ == MAP_FAILED) {
        m->map_ = nullptr;
        throw std::runtime_error(path + ": mmap failed");
    }
    const int32_t threads = n_threads > 0 ? n_threads : int32_t(std::max(1u, std::thread::hardware_concurrency()));
    if (dev.kind == Device::Kind::CUDA) {
#ifdef KVFLASH_WITH_CUDA
        m->backend_ = ggml_backend_cuda_init(dev.index);
        if (!m->backend_) throw std::runtime_error("cannot initialise the ggml CUDA backend on " + dev.name());
        m->set_n_threads(threads);
        size_t need = 0;
        for (int64_t i = 0; i < n_tensors; ++i) need += ggml_nbytes(ggml_get_tensor(m->meta_, gguf_get_tensor_name(m->gguf_, i)));
        m->buf_ = ggml_backend_alloc_ctx_tensors(m->meta_, m->backend_);
        if (!m->buf_) {
            const auto mem = m->device_memory();
            throw std::runtime_error(path + ": cannot allocate " + mib(need) + " of weights on " + dev.name() + " (" +
                                     mib(mem.first) + " free of " + mib(mem.second) + ")");
        }
        ggml_backend_buffer_set_usage(m->buf_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ::madvise(m->map_, m->map_bytes_, MADV_SEQUENTIAL);
        for (int64_t i = 0; i < n_tensors; ++i) {
            ggml_tensor *t = ggml_get_tensor(m->meta_, gguf_get_tensor_name(m->gguf_, i));
            const char *addr = static_cast<const char *>(m->map_) + data_off + gguf_get_tensor_offset(m->gguf_, i);
            ggml_backend_tensor_set(t, addr, 0, ggml_nbytes(t));  // synchronous (ggml-cuda syncs its copy stream)
            m->weight_bytes_ += ggml_nbytes(t);
        }
        ::munmap(m->map_, m->map_bytes_);
        m->map_ = nullptr;
        m->map_bytes_ = 0;
        return m;
#endif
    }
    m->backend_ = ggml_backend_cpu_init();
    if (!m->backend_) throw std::runtime_error("cannot initialise the ggml CPU backend");
    m->set_n_threads(threads);
    m->buf_ = ggml_backend_cpu_buffer_from_ptr(m->map_, m->map_bytes_);
    ggml_backend_buffer_set_usage(m->buf_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (int64_t i = 0; i < n_tensors; ++i) {
        ggml_tensor *t = ggml_get_tensor(m->meta_, gguf_get_tensor_name(m->gguf_, i));
        char *addr = static_cast<char *>(m->map_) + data_off + gguf_get_tensor_offset(m->gguf_, i);
        if (ggml_backend_tensor_alloc(m->buf_, t, addr) != GGML_STATUS_SUCCESS)
            throw std::runtime_error(path + ": cannot place tensor " + ggml_get_name(t));
        m->weight_bytes_ += ggml_nbytes(t);
    }
    ::madvise(m->map_, m->map_bytes_, MADV_WILLNEED);
    return m;
}

Model::~Model() {
    if (buf_) ggml_backend_buffer_free(buf_);
    if (backend_) ggml_backend_free(backend_);
    if (meta_) ggml_free(meta_);
    if (gguf_) gguf_free(gguf_);
    if (map_) ::munmap(map_, map_bytes_);
}

void Model::set_n_threads(int32_t n) {
    if (n <= 0) throw std::invalid_argument("n_threads must be >= 1");
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
        if (!hp_.is_swa[il]) out.push_back(il);
    return out;
}

// ---------------------------------------------------------------- runtime

struct Runtime::Graph {
    int32_t n = 0, n_kv = 0;
    bool all_logits = false;
    ggml_context *ctx = nullptr;
    ggml_cgraph *gf = nullptr;
    ggml_gallocr_t alloc = nullptr;
    ggml_tensor *tokens = nullptr, *pos = nullptr, *slots = nullptr, *mask = nullptr;
    ggml_tensor *swa_slots = nullptr, *swa_mask = nullptr, *logits = nullptr;
    std::vector<ggml_tensor *> q_out;  // per paged layer: [D, H, n_capture]
    int32_t n_capture = 0;
    PoolAttnParams attn, attn_swa;   // stable addresses for the custom attention ops
    std::vector<uint8_t> meta;
    ~Graph() {
        if (alloc) ggml_gallocr_free(alloc);
        if (ctx) ggml_free(ctx);
    }
};

Runtime::Runtime(std::shared_ptr<Model> model, RuntimeConfig cfg) : model_(std::move(model)), cfg_(std::move(cfg)) {
    const Hparams &hp = model_->hparams();
    check_max_ctx(cfg_.max_ctx);
    if (cfg_.ubatch <= 0) throw std::invalid_argument("ubatch must be > 0");
    const ggml_type kvt = kv_type_from_name(cfg_.kv_type);
    if (cfg_.attn != "auto" && cfg_.attn != "ggml" && cfg_.attn != "pool")
        throw std::invalid_argument("attn must be 'auto', 'ggml' or 'pool', got '" + cfg_.attn + "'");
    if (cfg_.attn == "pool" && !ggml_backend_is_cpu(model_->backend()))
        throw std::invalid_argument("attn='pool' is kvflash's CPU attention kernel; the model is on " +
                                    model_->device().name() + ": use attn='auto' or 'ggml' (ggml_flash_attn_ext)");
    if (kvt == GGML_TYPE_F32) throw std::invalid_argument("kv_type f32 is not supported by the attention kernels; use f16, q8_0 or q4_0");
    if (hp.head_dim_k % ggml_blck_size(kvt) != 0)
        throw std::invalid_argument(std::string("kv_type ") + cfg_.kv_type + " needs a head dim that is a multiple of " +
                                    std::to_string(ggml_blck_size(kvt)));
    if (cfg_.eval_layers < 0 || cfg_.eval_layers > hp.n_layer)
        throw std::invalid_argument("eval_layers must be in [0, " + std::to_string(hp.n_layer) +
                                    "] (0: all layers), got " + std::to_string(cfg_.eval_layers));
    n_eval_layers_ = cfg_.eval_layers > 0 ? cfg_.eval_layers : hp.n_layer;
    full_cache_ = cfg_.pool_tokens <= 0;
    PagerConfig pc;
    pc.chunk_tokens = cfg_.chunk_tokens;
    pc.sink_chunks = cfg_.sink_chunks;
    pc.tail_window_chunks = cfg_.tail_window_chunks;
    pc.max_ctx = cfg_.max_ctx;
    if (full_cache_) {
        // The baseline: every position has its own slot, nothing is ever evicted.
        pc.pool_tokens = int32_t(std::max<int64_t>((cfg_.max_ctx + 255) / 256 * 256, pc.min_pool_tokens()));
    } else {
        pc.pool_tokens = cfg_.pool_tokens;
    }
    std::vector<PoolLayerSpec> specs;
    paged_index_.assign(hp.n_layer, -1);
    for (int32_t il : model_->global_layers()) {
        if (il >= n_eval_layers_) break;
        paged_index_[il] = int32_t(specs.size());
        specs.push_back({il, hp.n_embd_k(), hp.n_embd_v()});
    }
    HostStore::Backing backing = HostStore::Backing::RAM;
    if (cfg_.host == "file") backing = HostStore::Backing::FILE;
    else if (cfg_.host != "ram") throw std::invalid_argument("host must be 'ram' or 'file'");
    cache_ = std::make_unique<PagedCache>(model_->backend(), specs, kvt, kvt, pc, backing, cfg_.host_path);

    // On CUDA the pool is in device memory: PagedCache has installed the async copy
    // engine (cuda::make_pool_mover, ordered against ggml's compute stream by events)
    // and a pinned host slab.
    // Sliding-window layers keep a ring of their window (plus one ubatch of new keys),
    // on the model's backend like the pool.
    const int32_t n_swa_layers = n_eval_layers_ - int32_t(specs.size());
    if (n_swa_layers > 0) {
        // A piece never exceeds max(ubatch, chunk_tokens): the ring must hold the window
        // before the piece's first query plus the piece itself.
        const int64_t piece = std::max({cfg_.ubatch, cfg_.chunk_tokens, cfg_.prefill_piece});
        swa_tokens_ = int32_t(std::min<int64_t>((int64_t(hp.n_swa) + piece + 255) / 256 * 256,
                                                (cfg_.max_ctx + 255) / 256 * 256));
        swa_tokens_ = std::max(swa_tokens_, 256);
        ggml_init_params ip{ggml_tensor_overhead() * size_t(2 * n_swa_layers + 1), nullptr, true};
        swa_ctx_ = ggml_init(ip);
        for (int32_t il = 0; il < n_eval_layers_; ++il) {
            if (paged_index_[il] >= 0) continue;
            paged_index_[il] = -2 - int32_t(swa_k_.size());  // -2 - ring index
            swa_k_.push_back(ggml_new_tensor_2d(swa_ctx_, kvt, hp.n_embd_k(), swa_tokens_));
            swa_v_.push_back(ggml_new_tensor_2d(swa_ctx_, kvt, hp.n_embd_v(), swa_tokens_));
        }
        swa_buf_ = ggml_backend_alloc_ctx_tensors(swa_ctx_, model_->backend());
        if (!swa_buf_) throw std::runtime_error("cannot allocate the sliding-window cache");
        ggml_backend_buffer_clear(swa_buf_, 0);
        swa_pos_.assign(swa_tokens_, -1);
    }
}

Runtime::~Runtime() {
    decode_graph_.reset();
    batch_graph_.reset();
    cache_.reset();
    if (swa_buf_) ggml_backend_buffer_free(swa_buf_);
    if (swa_ctx_) ggml_free(swa_ctx_);
}

size_t Runtime::swa_bytes() const { return swa_buf_ ? ggml_backend_buffer_get_size(swa_buf_) : 0; }

// Builds the forward graph for n tokens.  Inputs: tokens [n] i32, pos [n] i32,
// slots [n] i64 (pool rows), mask [n_kv, n] f16; for sliding layers swa_slots/swa_mask.
void Runtime::build(Graph &g, int32_t n, int32_t n_kv_pool, bool all_logits) {
    const Hparams &hp = model_->hparams();
    const Model &M = *model_;
    g.n = n;
    g.n_kv = n_kv_pool;
    g.all_logits = all_logits;
    g.n_capture = std::min(n, std::max(0, cfg_.capture_queries));
    const size_t max_nodes = 64 * size_t(hp.n_layer) + 256;
    g.meta.resize(ggml_tensor_overhead() * max_nodes + ggml_graph_overhead_custom(max_nodes, false));
    ggml_init_params ip{g.meta.size(), g.meta.data(), true};
    g.ctx = ggml_init(ip);
    ggml_context *ctx = g.ctx;
    g.gf = ggml_new_graph_custom(ctx, max_nodes, false);

    const int32_t P = n_kv_pool;  // attend over the occupied prefix of the pool
    g.tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    g.pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    g.slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
    g.mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, P, n);
    for (ggml_tensor *t : {g.tokens, g.pos, g.slots, g.mask}) ggml_set_input(t);
    if (swa_tokens_ > 0) {
        g.swa_slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
        g.swa_mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, swa_tokens_, n);
        ggml_set_input(g.swa_slots);
        ggml_set_input(g.swa_mask);
    }

    const int32_t D = hp.head_dim_k, H = hp.n_head, Hkv = hp.n_head_kv;
    const bool pool_attn = use_pool_attn(n);
    auto n_split = [&](int64_t n_kv) {
        const int64_t want = std::max<int64_t>(n_kv / 256, (2 * model_->n_threads() + Hkv - 1) / Hkv);
        return int32_t(std::max<int64_t>(1, std::min<int64_t>({want, 32, n_kv / 64})));
    };
    g.attn = {Hkv, n_split(P), hp.arch == Arch::GEMMA3 ? 1.0f : hp.attn_scale};
    g.attn_swa = {Hkv, n_split(swa_tokens_), g.attn.scale};
    ggml_tensor *x = ggml_get_rows(ctx, M.tok_embd, g.tokens);  // [n_embd, n]
    if (hp.arch == Arch::GEMMA3) x = ggml_scale(ctx, x, std::sqrt(float(hp.n_embd)));
    auto norm = [&](ggml_tensor *t, ggml_tensor *w) { return ggml_mul(ctx, ggml_rms_norm(ctx, t, hp.rms_eps), w); };

    for (int32_t il = 0; il < n_eval_layers_; ++il) {
        const LayerWeights &L = M.layers[il];
        const bool swa = hp.is_swa[il] != 0;
        ggml_tensor *cur = norm(x, L.attn_norm);
        ggml_tensor *q = ggml_mul_mat(ctx, L.wq, cur);
        ggml_tensor *k = ggml_mul_mat(ctx, L.wk, cur);
        ggml_tensor *v = ggml_mul_mat(ctx, L.wv, cur);
        if (L.bq) { q = ggml_add(ctx, q, L.bq); k = ggml_add(ctx, k, L.bk); v = ggml_add(ctx, v, L.bv); }
        q = ggml_reshape_3d(ctx, q, D, H, n);    // [D, H, n]
        k = ggml_reshape_3d(ctx, k, D, Hkv, n);  // [D, Hkv, n]
        if (L.q_norm) {
            q = norm(q, L.q_norm);
            k = norm(k, L.k_norm);
        }
        const float base = swa ? hp.rope_base_swa : hp.rope_base, scale = swa ? hp.rope_scale_swa : hp.rope_scale;
        q = ggml_rope_ext(ctx, q, g.pos, nullptr, hp.n_rot, hp.rope_mode, int(hp.n_ctx_train), base, scale, 0.f, 1.f, 32.f, 1.f);
        k = ggml_rope_ext(ctx, k, g.pos, nullptr, hp.n_rot, hp.rope_mode, int(hp.n_ctx_train), base, scale, 0.f, 1.f, 32.f, 1.f);
        if (!swa && g.n_capture > 0) {
            ggml_tensor *ql = ggml_view_3d(ctx, q, D, H, g.n_capture, q->nb[1], q->nb[2], size_t(n - g.n_capture) * q->nb[2]);
            ql = ggml_cont(ctx, ql);
            ggml_set_output(ql);
            ggml_build_forward_expand(g.gf, ql);
            g.q_out.push_back(ql);
        }
        float kq_scale = hp.attn_scale;
        if (hp.arch == Arch::GEMMA3) {
            q = ggml_scale(ctx, q, hp.attn_scale);
            kq_scale = 1.0f;
        }

        // Store K/V rows at their slots (RoPE already applied with the logical position).
        ggml_tensor *kc, *vc, *idx, *mask;
        int64_t n_kv;
        if (!swa) {
            const int32_t pi = paged_index_[il];
            kc = cache_->pool->k(pi); vc = cache_->pool->v(pi); idx = g.slots; mask = g.mask; n_kv = P;
        } else {
            const int32_t ri = -2 - paged_index_[il];
            kc = swa_k_[ri]; vc = swa_v_[ri]; idx = g.swa_slots; mask = g.swa_mask; n_kv = swa_tokens_;
        }
        ggml_tensor *ks = ggml_set_rows(ctx, kc, ggml_reshape_2d(ctx, k, hp.n_embd_k(), n), idx);
        ggml_tensor *vs = ggml_set_rows(ctx, vc, ggml_reshape_2d(ctx, v, hp.n_embd_v(), n), idx);
        ggml_build_forward_expand(g.gf, ks);
        ggml_build_forward_expand(g.gf, vs);
        // k: [D, n_kv, Hkv] viewed from the stored rows [n_embd_k, n_kv].
        ggml_tensor *kv_k = ggml_view_3d(ctx, ks, D, n_kv, Hkv, ks->nb[1], ggml_row_size(ks->type, D), 0);
        ggml_tensor *kv_v = ggml_view_3d(ctx, vs, D, n_kv, Hkv, vs->nb[1], ggml_row_size(vs->type, D), 0);
        ggml_tensor *att;
        if (pool_attn) {
            ggml_tensor *k2 = ggml_view_2d(ctx, ks, ks->ne[0], n_kv, ks->nb[1], 0);
            ggml_tensor *v2 = ggml_view_2d(ctx, vs, vs->ne[0], n_kv, vs->nb[1], 0);
            att = pool_attention_cpu(ctx, q, k2, v2, mask, swa ? &g.attn_swa : &g.attn);  // [D, H, n]
        } else {
            ggml_tensor *qp = ggml_permute(ctx, q, 0, 2, 1, 3);  // [D, n, H]
            att = ggml_flash_attn_ext(ctx, qp, kv_k, kv_v, mask, kq_scale, 0.f, 0.f);
            ggml_prec_set_acc(att, GGML_PREC_F32);
        }
        cur = ggml_reshape_2d(ctx, att, int64_t(D) * H, n);  // [D*H, n]
        cur = ggml_mul_mat(ctx, L.wo, cur);
        if (L.attn_post_norm) cur = norm(cur, L.attn_post_norm);
        x = ggml_add(ctx, x, cur);

        cur = norm(x, L.ffn_norm);
        ggml_tensor *gate = ggml_mul_mat(ctx, L.ffn_gate, cur);
        ggml_tensor *up = ggml_mul_mat(ctx, L.ffn_up, cur);
        cur = hp.arch == Arch::GEMMA3 ? ggml_geglu_split(ctx, gate, up) : ggml_swiglu_split(ctx, gate, up);
        cur = ggml_mul_mat(ctx, L.ffn_down, cur);
        if (L.ffn_post_norm) cur = norm(cur, L.ffn_post_norm);
        x = ggml_add(ctx, x, cur);
    }
    if (n_eval_layers_ < hp.n_layer) {
        // A scoring runtime (a drafter cut to its first layers): the graph ends with the
        // last layer's K/V writes and captured queries; its attention output, FFN and the
        // head are never computed, and there are no logits.
        g.logits = nullptr;
        // With one layer nothing reads the masks; keep them in the graph so they are allocated.
        ggml_build_forward_expand(g.gf, g.mask);
        if (g.swa_mask) ggml_build_forward_expand(g.gf, g.swa_mask);
        finish_graph(g);
        return;
    }
    if (!all_logits && n > 1) x = ggml_view_2d(ctx, x, hp.n_embd, 1, x->nb[1], size_t(n - 1) * x->nb[1]);
    x = norm(x, M.output_norm);
    ggml_tensor *logits = ggml_mul_mat(ctx, M.output, x);
    if (hp.final_softcap > 0.f) {
        logits = ggml_scale(ctx, logits, 1.0f / hp.final_softcap);
        logits = ggml_tanh(ctx, logits);
        logits = ggml_scale(ctx, logits, hp.final_softcap);
    }
    ggml_set_output(logits);
    g.logits = logits;
    ggml_build_forward_expand(g.gf, logits);
    finish_graph(g);
}

void Runtime::finish_graph(Graph &g) {
    if (!ggml_backend_is_cpu(model_->backend())) {
        // Without a scheduler every node runs on the model's backend: refuse a graph
        // it cannot run here, with the op named, instead of an abort inside ggml.
        for (int i = 0; i < ggml_graph_n_nodes(g.gf); ++i) {
            ggml_tensor *t = ggml_graph_node(g.gf, i);
            if (ggml_backend_supports_op(model_->backend(), t)) continue;
            std::string srcs;
            for (int j = 0; j < GGML_MAX_SRC && t->src[j]; ++j) srcs += std::string(j ? ", " : "") + ggml_type_name(t->src[j]->type);
            throw std::runtime_error(std::string("the ") + ggml_backend_name(model_->backend()) + " backend cannot run " +
                                     ggml_op_desc(t) + " (node '" + ggml_get_name(t) + "', inputs " + srcs + ") for kv_type " +
                                     cfg_.kv_type + "; try another kv_type or device='cpu'");
        }
    }
    g.alloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(model_->backend()));
    if (!ggml_gallocr_alloc_graph(g.alloc, g.gf)) throw std::runtime_error("cannot allocate the compute graph");
}

bool Runtime::use_pool_attn(int32_t n) const {
    if (!ggml_backend_is_cpu(model_->backend())) return false;
    if (cfg_.attn == "ggml") return false;
    if (cfg_.attn == "pool") return true;
    return n <= cfg_.pool_attn_max_tokens;
}

Runtime::Graph *Runtime::get_graph(int32_t n, int32_t n_kv, bool all_logits) {
    std::unique_ptr<Graph> &slot = n == 1 ? decode_graph_ : batch_graph_;
    if (slot && slot->n == n && slot->n_kv == n_kv && slot->all_logits == all_logits) return slot.get();
    auto t0 = clk::now();
    slot.reset();  // its allocator's buffer goes before the new one is made
    auto g = std::make_unique<Graph>();
    build(*g, n, n_kv, all_logits);  // may throw: the slot is only filled with a complete graph
    slot = std::move(g);
    stats_.t_graph_ms += ms_since(t0);
    return slot.get();
}

void Runtime::eval(const int32_t *tokens, int32_t n, bool all_logits, float *logits_out) {
    const Hparams &hp = model_->hparams();
    if (n <= 0) throw std::invalid_argument("eval: need at least one token");
    if (n_past_ + n > cfg_.max_ctx)
        throw std::out_of_range("eval: " + std::to_string(n_past_ + n) + " tokens exceed max_ctx " +
                                std::to_string(cfg_.max_ctx) + "; raise max_ctx or shorten the prompt");
    for (int32_t i = 0; i < n; ++i)
        if (tokens[i] < 0 || tokens[i] >= hp.n_vocab)
            throw std::invalid_argument("eval: token id " + std::to_string(tokens[i]) + " outside [0, " +
                                        std::to_string(hp.n_vocab) + ")");
    const int32_t C = cfg_.chunk_tokens, P = cache_->pool->pool_tokens();
    int32_t done = 0;
    while (done < n) {
        // Batched while the prompt fits the pool; chunk-sized pieces once eviction starts.
        int32_t m = std::min(n - done, cfg_.ubatch);
        if (n_past_ + m > P) {
            const int32_t piece = std::min(cfg_.prefill_piece > 0 ? cfg_.prefill_piece : C, cfg_.ubatch);
            m = std::min<int32_t>(n - done, std::max<int32_t>(1, piece - int32_t(n_past_ % C)));
        }
        const bool last = done + m == n;
        float *out = logits_out;
        if (all_logits) out = logits_out + size_t(done) * hp.n_vocab;
        eval_piece(tokens + done, m, all_logits, (all_logits || last) ? out : nullptr);
        done += m;
    }
}

void Runtime::eval_piece(const int32_t *tokens, int32_t n, bool all_logits, float *logits_out) {
    const int64_t pos0 = n_past_;
    const int32_t P = cache_->pool->pool_tokens();
    std::vector<int32_t> slots32(n);
    if (cache_->pager->alloc_span(pos0, n, slots32.data()) == AllocResult::NO_ROOM)
        throw std::runtime_error("eval: the pool has no room for " + std::to_string(n) + " tokens; use a larger pool");
    const Pager &pg = *cache_->pager;
    // Attention covers the occupied prefix of the pool, in steps of 256 slots.
    const int32_t n_kv = std::min(P, std::max(256, (pg.used_extent() + 255) / 256 * 256));
    Graph *g = get_graph(n, n_kv, all_logits && n > 1);
    auto t0 = clk::now();
    std::vector<int32_t> pos(n);
    std::vector<int64_t> pos64(n), slots(n);
    for (int32_t i = 0; i < n; ++i) {
        pos[i] = int32_t(pos0 + i);
        pos64[i] = pos0 + i;
        slots[i] = slots32[i];
    }
    ggml_backend_tensor_set(g->tokens, tokens, 0, sizeof(int32_t) * n);
    ggml_backend_tensor_set(g->pos, pos.data(), 0, sizeof(int32_t) * n);
    ggml_backend_tensor_set(g->slots, slots.data(), 0, sizeof(int64_t) * n);
    if (n == 1) {
        // Decode: rebuild the mask only when residency changed; else unmask the new slot.
        if (decode_mask_epoch_ != pg.epoch() || int32_t(decode_mask_.size()) != P) {
            decode_mask_.resize(P);
            pg.fill_mask(pos64.data(), 1, decode_mask_.data(), P);
            decode_mask_epoch_ = pg.epoch();
        } else {
            decode_mask_[slots[0]] = 0;
        }
        ggml_backend_tensor_set(g->mask, decode_mask_.data(), 0, sizeof(uint16_t) * n_kv);
    } else {
        std::vector<uint16_t> mask(size_t(n_kv) * n);
        pg.fill_mask(pos64.data(), n, mask.data(), n_kv);
        ggml_backend_tensor_set(g->mask, mask.data(), 0, sizeof(uint16_t) * size_t(n_kv) * n);
        decode_mask_epoch_ = -1;
    }
    if (swa_tokens_ > 0) {
        const int32_t R = swa_tokens_, W = model_->hparams().n_swa;
        std::vector<int64_t> rs(n);
        for (int32_t i = 0; i < n; ++i) {
            rs[i] = (pos0 + i) % R;
            swa_pos_[rs[i]] = pos0 + i;
        }
        std::vector<uint16_t> mask(size_t(R) * n);
        for (int32_t i = 0; i < n; ++i) {
            const int64_t qp = pos0 + i;
            for (int32_t s = 0; s < R; ++s) {
                const int64_t p = swa_pos_[s];
                mask[size_t(i) * R + s] = (p >= 0 && p <= qp && qp - p < W) ? 0x0000 : 0xFC00;
            }
        }
        ggml_backend_tensor_set(g->swa_slots, rs.data(), 0, sizeof(int64_t) * n);
        ggml_backend_tensor_set(g->swa_mask, mask.data(), 0, sizeof(uint16_t) * mask.size());
    }
    stats_.t_mask_ms += ms_since(t0);
    t0 = clk::now();
    if (ggml_backend_graph_compute(model_->backend(), g->gf) != GGML_STATUS_SUCCESS)
        throw std::runtime_error("eval: graph compute failed");
    stats_.t_compute_ms += ms_since(t0);
    sync_for_host_read();
    n_past_ = pos0 + n;
    stats_.n_eval_calls++;
    stats_.n_tokens_evaluated += n;
    if (logits_out && g->logits) ggml_backend_tensor_get(g->logits, logits_out, 0, ggml_nbytes(g->logits));
    else if (logits_out) std::fill(logits_out, logits_out + size_t(all_logits && n > 1 ? n : 1) * model_->hparams().n_vocab, 0.f);
    if (g->n_capture > 0) {
        // The capture is a window over the last capture_queries positions across evals
        // (a decode step adds one query; the window still holds the ones before it).
        // The previous window ends at pos0 - 1: truncate trims it with the cache.
        const Hparams &hp = model_->hparams();
        const size_t qsz = size_t(hp.n_head) * hp.head_dim_k, nl = g->q_out.size();
        const int32_t nc = g->n_capture, keep = std::min(n_captured_, std::max(0, cfg_.capture_queries - nc));
        std::vector<float> next(size_t(keep + nc) * qsz * nl);
        for (size_t l = 0; l < nl; ++l) {
            float *dst = next.data() + l * size_t(keep + nc) * qsz;
            if (keep > 0)
                std::memcpy(dst, captured_q_.data() + (l * size_t(n_captured_) + (n_captured_ - keep)) * qsz,
                            size_t(keep) * qsz * sizeof(float));
            ggml_backend_tensor_get(g->q_out[l], dst + size_t(keep) * qsz, 0, size_t(nc) * qsz * sizeof(float));
        }
        captured_q_.swap(next);
        n_captured_ = keep + nc;
    }
    if (cfg_.chunk_summaries) summarize_sealed(pos0, n);
}

void Runtime::summarize_sealed(int64_t pos0, int32_t n) {
    const Pager &pg = *cache_->pager;
    const int32_t C = cfg_.chunk_tokens, L = cache_->pool->n_layers(), E = model_->hparams().n_embd_k();
    const size_t per_chunk = size_t(L) * E;
    if (summ_ready_.size() != size_t(pg.n_chunks())) {
        summ_ready_.assign(pg.n_chunks(), 0);
        summ_min_.assign(per_chunk * pg.n_chunks(), 0.f);
        summ_max_.assign(per_chunk * pg.n_chunks(), 0.f);
        summ_mean_.assign(per_chunk * pg.n_chunks(), 0.f);
    }
    std::vector<float> keys(size_t(C) * E);
    bool synced = false;
    for (int64_t c = pos0 / C; c <= (pos0 + n - 1) / C; ++c) {
        if (summ_ready_[c] || pg.n_written(int32_t(c)) != C || pg.block_of(int32_t(c)) < 0) continue;
        if (!synced) {
            sync_for_host_read();  // once per eval, before the first pool read
            synced = true;
        }
        for (int32_t l = 0; l < L; ++l) {
            chunk_keys_synced(int32_t(c), l, keys.data());
            float *mn = &summ_min_[c * per_chunk + size_t(l) * E], *mx = &summ_max_[c * per_chunk + size_t(l) * E];
            float *me = &summ_mean_[c * per_chunk + size_t(l) * E];
            for (int32_t e = 0; e < E; ++e) { mn[e] = keys[e]; mx[e] = keys[e]; me[e] = 0.f; }
            for (int32_t i = 0; i < C; ++i)
                for (int32_t e = 0; e < E; ++e) {
                    const float x = keys[size_t(i) * E + e];
                    mn[e] = std::min(mn[e], x);
                    mx[e] = std::max(mx[e], x);
                    me[e] += x;
                }
            // Mean key per KV head, L2-normalised.
            const int32_t D = model_->hparams().head_dim_k;
            for (int32_t g = 0; g < E / D; ++g) {
                double ss = 0;
                for (int32_t d = 0; d < D; ++d) ss += double(me[g * D + d]) * me[g * D + d];
                const float inv = ss > 0 ? float(1.0 / std::sqrt(ss)) : 0.f;
                for (int32_t d = 0; d < D; ++d) me[g * D + d] *= inv;
            }
        }
        summ_ready_[c] = 1;
    }
}

void Runtime::qk_scores(QKMode mode, float *out, int32_t n) const {
    const Hparams &hp = model_->hparams();
    const int32_t L = cache_->pool->n_layers(), E = hp.n_embd_k(), D = hp.head_dim_k, H = hp.n_head;
    const int32_t G = H / hp.n_head_kv;
    if (n < 0 || n > cache_->pager->n_chunks()) throw std::out_of_range("qk_scores: bad chunk count");
    if (!cfg_.chunk_summaries) throw std::invalid_argument("qk_scores: the runtime keeps no chunk summaries");
    if (n_captured_ == 0) throw std::invalid_argument("qk_scores: no query captured yet (evaluate a token first)");
    const size_t per_layer_q = size_t(n_captured_) * H * D, per_chunk = size_t(L) * E;
    for (int32_t c = 0; c < n; ++c) {
        if (size_t(c) >= summ_ready_.size() || !summ_ready_[c]) { out[c] = std::numeric_limits<float>::infinity(); continue; }
        double total = 0;
        for (int32_t l = 0; l < L; ++l) {
            // the last captured token's query for this layer
            const float *q = captured_q_.data() + l * per_layer_q + size_t(n_captured_ - 1) * H * D;
            float best = -std::numeric_limits<float>::infinity();
            for (int32_t h = 0; h < H; ++h) {
                const int32_t g = h / G;
                const float *qh = q + size_t(h) * D;
                float s = 0.f;
                if (mode == QKMode::MEAN) {
                    const float *me = &summ_mean_[c * per_chunk + size_t(l) * E + size_t(g) * D];
                    for (int32_t d = 0; d < D; ++d) s += qh[d] * me[d];
                } else {
                    const float *mn = &summ_min_[c * per_chunk + size_t(l) * E + size_t(g) * D];
                    const float *mx = &summ_max_[c * per_chunk + size_t(l) * E + size_t(g) * D];
                    for (int32_t d = 0; d < D; ++d) s += std::max(qh[d] * mn[d], qh[d] * mx[d]);
                }
                best = std::max(best, s);
            }
            total += best;
        }
        out[c] = float(total / L);
    }
}

void Runtime::attention_scores(float *out, int64_t n) const {
    const Hparams &hp = model_->hparams();
    const int32_t L = cache_->pool->n_layers(), D = hp.head_dim_k, H = hp.n_head;
    if (n_captured_ == 0) throw std::invalid_argument("attention_scores: no query captured yet");
    sync_for_host_read();  // pool_attention_probs reads the pool's K rows
    std::fill(out, out + n, 0.f);
    const Pager &pg = *cache_->pager;
    const int32_t n_kv = pg.used_extent();
    std::vector<int64_t> qpos(n_captured_);
    for (int32_t i = 0; i < n_captured_; ++i) qpos[i] = n_past_ - n_captured_ + i;
    const float scale = hp.attn_scale;
    for (int32_t l = 0; l < L; ++l) {
        const float *q = captured_q_.data() + size_t(l) * n_captured_ * H * D;
        pool_attention_probs(q, n_captured_, H, hp.n_head_kv, D, cache_->pool->k(l), n_kv, pg.slot_positions().data(),
                             qpos.data(), scale, out, n);
    }
}

void Runtime::truncate(int64_t n_past) {
    if (n_past < 0 || n_past > n_past_)
        throw std::out_of_range("truncate: n_past must be in [0, " + std::to_string(n_past_) + "]");
    if (swa_tokens_ > 0 && n_past_ - n_past > int64_t(swa_tokens_) - model_->hparams().n_swa)
        throw std::invalid_argument("truncate: the sliding-window ring no longer holds the window before position " +
                                    std::to_string(n_past) + "; reset and evaluate the prefix again");
    cache_->pager->truncate(n_past);
    for (size_t c = size_t(n_past / cfg_.chunk_tokens); c < summ_ready_.size(); ++c) summ_ready_[c] = 0;
    // Captured queries at positions >= n_past go with the cache; the window keeps its start.
    if (n_captured_ > 0) {
        const int64_t first = n_past_ - n_captured_;
        const int32_t keep = int32_t(std::max<int64_t>(0, n_past - first));
        if (keep < n_captured_) {
            const Hparams &hp = model_->hparams();
            const size_t qsz = size_t(hp.n_head) * hp.head_dim_k, nl = captured_q_.size() / (size_t(n_captured_) * qsz);
            std::vector<float> next(size_t(keep) * qsz * nl);
            for (size_t l = 0; l < nl && keep > 0; ++l)
                std::memcpy(next.data() + l * size_t(keep) * qsz, captured_q_.data() + l * size_t(n_captured_) * qsz,
                            size_t(keep) * qsz * sizeof(float));
            captured_q_.swap(next);
            n_captured_ = keep;
        }
    }
    for (auto &p : swa_pos_)
        if (p >= n_past) p = -1;
    n_past_ = n_past;
    decode_mask_epoch_ = -1;
}

void Runtime::reset() {
    cache_->pager->reset();
    std::fill(summ_ready_.begin(), summ_ready_.end(), 0);
    n_captured_ = 0;
    std::fill(swa_pos_.begin(), swa_pos_.end(), -1);
    n_past_ = 0;
    decode_mask_epoch_ = -1;
}

void Runtime::sync_for_host_read() const {
    cache_->pool->fence();                       // queued page-outs/ins done (copy stream)
    ggml_backend_synchronize(model_->backend()); // queued kernels done (compute stream)
}

void Runtime::chunk_keys(int32_t c, int32_t il, float *out) const {
    sync_for_host_read();
    chunk_keys_synced(c, il, out);
}

void Runtime::chunk_keys_synced(int32_t c, int32_t il, float *out) const {
    const Pager &pg = *cache_->pager;
    const int32_t C = cfg_.chunk_tokens, b = pg.block_of(c);
    if (b < 0) throw std::invalid_argument("chunk_keys: chunk " + std::to_string(c) + " is not resident");
    if (il < 0 || il >= cache_->pool->n_layers()) throw std::out_of_range("chunk_keys: bad paged layer");
    ggml_tensor *k = cache_->pool->k(il);
    const int64_t E = k->ne[0];
    std::vector<uint8_t> raw(size_t(C) * k->nb[1]);
    ggml_backend_tensor_get(k, raw.data(), size_t(b) * C * k->nb[1], raw.size());
    const auto *tr = ggml_get_type_traits(k->type);
    for (int32_t i = 0; i < C; ++i) {
        float *row = out + size_t(i) * E;
        if (pg.slot_of(int64_t(c) * C + i) < 0) { std::fill(row, row + E, 0.f); continue; }
        if (k->type == GGML_TYPE_F32) std::memcpy(row, raw.data() + size_t(i) * k->nb[1], E * sizeof(float));
        else tr->to_float(raw.data() + size_t(i) * k->nb[1], row, E);
    }
}

}  // namespace kvflash
