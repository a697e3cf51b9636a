// llama.cpp's llama_vocab behind checks: see tokenizer.h.
#include "kvflash/tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <sys/stat.h>
#include <unordered_map>

#include "ggml.h"
#include "gguf.h"
// llama.cpp's classes stay inside libkvflash (kvflash-llama-vocab is built with hidden symbols): the
// inline members this file instantiates too, so a process may load libllama beside it.
#pragma GCC visibility push(hidden)
#include "llama-arch.h"
#include "llama-model-loader.h"
#include "llama-vocab.h"
#pragma GCC visibility pop

// llama-model-loader.cpp names these two (src/llama.cpp, which would bring the whole of libllama) to
// find a model's split files.  The tokenizer's loader is built over metadata alone and never looks
// for splits: they answer "no such split", and stay out of libkvflash's exported symbols.
extern "C" __attribute__((visibility("hidden"))) int32_t llama_split_path(char *, size_t, const char *, int32_t, int32_t) {
    return 0;
}
extern "C" __attribute__((visibility("hidden"))) int32_t llama_split_prefix(char *, size_t, const char *, int32_t, int32_t) {
    return 0;
}

namespace kvflash {

namespace {

// llama.cpp's loader and vocabulary log every key they read: errors only, to stderr.  llama_log_set
// also sets ggml's logger, which is put back as it was.
void quiet_llama_log() {
    static std::once_flag once;
    std::call_once(once, [] {
        ggml_log_callback prev = nullptr;
        void *prev_ud = nullptr;
        ggml_log_get(&prev, &prev_ud);
        llama_log_set([](ggml_log_level level, const char *text, void *) {
            if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
        }, nullptr);
        ggml_log_set(prev, prev_ud);
    });
}

std::string trim(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
}

struct GgufFree {
    void operator()(gguf_context *g) const { gguf_free(g); }
};

// What llama_vocab::load asserts on (an abort) rather than throws: every token string distinct (after
// its empty-string renaming).
void check_tokens(const gguf_context *g) {
    const int64_t k = gguf_find_key(g, "tokenizer.ggml.tokens");
    if (k < 0) throw TokenizerError("no tokenizer.ggml.tokens");
    if (gguf_get_kv_type(g, k) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, k) != GGUF_TYPE_STRING)
        throw TokenizerError("tokenizer.ggml.tokens is not an array of strings");
    const size_t n = gguf_get_arr_n(g, k);
    if (n == 0) throw TokenizerError("tokenizer.ggml.tokens is empty");
    if (n > size_t(std::numeric_limits<int32_t>::max()))
        throw TokenizerError("tokenizer.ggml.tokens has " + std::to_string(n) + " entries (at most 2^31-1)");
    std::unordered_map<std::string, size_t> seen;
    seen.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        std::string w = gguf_get_arr_str(g, k, i);
        if (w.empty()) w = "[EMPTY_" + std::to_string(i) + "]";
        if (w.size() >= size_t(std::numeric_limits<int32_t>::max()) / 2)
            throw TokenizerError("tokenizer.ggml.tokens[" + std::to_string(i) + "] is too long");
        auto [it, fresh] = seen.emplace(std::move(w), i);
        if (!fresh)
            throw TokenizerError("tokenizer.ggml.tokens has a duplicate entry: " + std::to_string(it->second) +
                                 " and " + std::to_string(i) + " are the same string");
    }
}

std::string gguf_string(const gguf_context *g, const char *key) {
    const int64_t k = gguf_find_key(g, key);
    if (k < 0) return {};
    if (gguf_get_kv_type(g, k) != GGUF_TYPE_STRING) throw TokenizerError(std::string(key) + " is not a string");
    return gguf_get_val_str(g, k);
}

}  // namespace

int64_t utf8_invalid_at(std::string_view s) {
    const auto *p = reinterpret_cast<const unsigned char *>(s.data());
    const size_t n = s.size();
    size_t i = 0;
    while (i < n) {
        const unsigned c = p[i];
        if (c < 0x80) { ++i; continue; }
        size_t len;
        uint32_t cp;
        if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; }
        else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; }
        else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; }
        else return int64_t(i);
        if (i + len > n) return int64_t(i);
        for (size_t j = 1; j < len; ++j) {
            if ((p[i + j] & 0xC0) != 0x80) return int64_t(i);
            cp = (cp << 6) | (p[i + j] & 0x3F);
        }
        if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
            return int64_t(i);
        i += len;
    }
    return -1;
}

const std::vector<std::string> &Tokenizer::supported_models() {
    static const std::vector<std::string> m = {"llama", "gpt2", "gemma4"};
    return m;
}

Tokenizer::Tokenizer() : vocab_(std::make_unique<llama_vocab>()) {}
Tokenizer::~Tokenizer() = default;

std::shared_ptr<const Tokenizer> Tokenizer::load(const std::string &path) {
    struct stat st{};
    if (::stat(path.c_str(), &st) != 0) throw TokenizerError(path + ": no such GGUF file");
    if (!S_ISREG(st.st_mode)) throw TokenizerError(path + ": not a regular file");
    gguf_init_params gp{/*no_alloc=*/true, /*ctx=*/nullptr};
    std::unique_ptr<gguf_context, GgufFree> g(gguf_init_from_file(path.c_str(), gp));
    if (!g) throw TokenizerError(path + ": not a GGUF file, or a truncated or corrupt one");
    return from_gguf(g.get(), path);
}

std::shared_ptr<const Tokenizer> Tokenizer::from_gguf(const gguf_context *g, const std::string &what) {
    quiet_llama_log();
    std::shared_ptr<Tokenizer> t(new Tokenizer());
    try {
        t->model_ = gguf_string(g, "tokenizer.ggml.model");
        if (gguf_find_key(g, "tokenizer.ggml.model") < 0)
            throw TokenizerError("no tokenizer (tokenizer.ggml.model missing)");
        const auto &ok = supported_models();
        if (std::find(ok.begin(), ok.end(), t->model_) == ok.end()) {
            std::string names;
            for (const auto &m : ok) names += (names.empty() ? "'" : ", '") + m + "'";
            throw TokenizerError("unsupported tokenizer model '" + t->model_ + "' (tokenizer.ggml.model); supported: " + names);
        }
        check_tokens(g);
        std::vector<std::string> splits;
        // Metadata only: no file, no tensors (the loader's third constructor path).
        llama_model_loader ml(const_cast<gguf_context *>(g), nullptr, nullptr, std::string(), splits, nullptr,
                              LLAMA_LOAD_MODE_NONE, false, true, false, nullptr, nullptr);
        t->vocab_->load(ml, LLM_KV(ml.get_arch()));
    } catch (const TokenizerError &e) {
        throw TokenizerError(what + ": " + e.what());
    } catch (const std::exception &e) {
        std::string msg = trim(e.what());
        const std::string unknown_pre = "unknown pre-tokenizer type: ";
        if (msg.rfind(unknown_pre, 0) == 0)
            msg = "unsupported pre-tokenizer " + msg.substr(unknown_pre.size()) + " (tokenizer.ggml.pre), as llama.cpp " +
                  "at the pinned sdist knows none of that name";
        throw TokenizerError(what + ": " + msg);
    }
    t->n_vocab_ = int32_t(t->vocab_->n_tokens());
    t->pre_ = gguf_string(g, "tokenizer.ggml.pre");
    for (int32_t i = 0; i < t->n_vocab_; ++i)
        if (t->vocab_->is_eog(i)) t->eog_.push_back(i);
    return t;
}

void Tokenizer::check_id(int32_t id) const {
    if (id < 0 || id >= n_vocab_)
        throw std::out_of_range("token id " + std::to_string(id) + " out of range [0, " + std::to_string(n_vocab_) + ")");
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
    if (text.size() >= size_t(std::numeric_limits<int32_t>::max()))
        throw std::invalid_argument("text of " + std::to_string(text.size()) + " bytes: at most 2^31-2");
    if (const int64_t bad = utf8_invalid_at(text); bad >= 0)
        throw std::invalid_argument("text is not valid UTF-8 (byte " + std::to_string(bad) + ")");
    // llama.cpp asserts that the specials it was told to add exist.
    if (add_special && ((vocab_->get_add_bos() && vocab_->token_bos() == LLAMA_TOKEN_NULL) ||
                        (vocab_->get_add_eos() && vocab_->token_eos() == LLAMA_TOKEN_NULL) ||
                        (vocab_->get_add_sep() && vocab_->token_sep() == LLAMA_TOKEN_NULL)))
        throw std::invalid_argument("this vocabulary asks for a BOS, EOS or SEP token it does not have: "
                                    "encode with add_special=false");
    try {
        return vocab_->tokenize(std::string(text), add_special, parse_special);
    } catch (const std::out_of_range &e) {
        // llama.cpp's byte fallback looks the byte's token up with at(): a vocabulary without it
        throw std::invalid_argument(std::string("this vocabulary cannot encode the text (a character and its bytes have "
                                                "no token; llama.cpp: ") + e.what() + ")");
    }
}

std::string Tokenizer::token_to_piece(int32_t id, bool special) const {
    check_id(id);
    char small[64];
    int32_t n = vocab_->token_to_piece(id, small, int32_t(sizeof small), 0, special);
    if (n >= 0) return std::string(small, size_t(n));
    std::string out(size_t(-n), '\0');
    n = vocab_->token_to_piece(id, out.data(), int32_t(out.size()), 0, special);
    out.resize(size_t(n < 0 ? 0 : n));
    return out;
}

std::string Tokenizer::decode(const int32_t *ids, size_t n, bool remove_special, bool unparse_special) const {
    if (n > size_t(std::numeric_limits<int32_t>::max()))
        throw std::invalid_argument(std::to_string(n) + " ids: at most 2^31-1");
    size_t bound = 0;  // the pieces' sum: what llama_detokenize writes is never longer
    for (size_t i = 0; i < n; ++i) {
        check_id(ids[i]);
        bound += vocab_->token_to_piece(ids[i]).size();
    }
    if (bound >= size_t(std::numeric_limits<int32_t>::max()))
        throw std::invalid_argument("the decoded text would pass 2^31-1 bytes");
    std::string out(bound, '\0');
    const int32_t w = vocab_->detokenize(ids, int32_t(n), out.data(), int32_t(bound), remove_special, unparse_special);
    if (w < 0) throw std::runtime_error("llama_detokenize wanted more room than the pieces hold");
    out.resize(size_t(w));
    return out;
}

static int32_t id_or_none(llama_token t) { return t == LLAMA_TOKEN_NULL ? -1 : t; }
int32_t Tokenizer::bos() const { return id_or_none(vocab_->token_bos()); }
int32_t Tokenizer::eos() const { return id_or_none(vocab_->token_eos()); }
int32_t Tokenizer::eot() const { return id_or_none(vocab_->token_eot()); }
int32_t Tokenizer::unk() const { return id_or_none(vocab_->token_unk()); }
int32_t Tokenizer::pad() const { return id_or_none(vocab_->token_pad()); }
bool Tokenizer::add_bos() const { return vocab_->get_add_bos(); }
bool Tokenizer::add_eos() const { return vocab_->get_add_eos(); }
bool Tokenizer::add_space_prefix() const { return vocab_->get_add_space_prefix(); }

Tokenizer::TokenType Tokenizer::token_type(int32_t id) const {
    check_id(id);
    const llama_token_attr a = vocab_->token_get_attr(id);
    if (a & LLAMA_TOKEN_ATTR_CONTROL) return CONTROL;
    if (a & LLAMA_TOKEN_ATTR_UNKNOWN) return UNKNOWN;
    if (a & LLAMA_TOKEN_ATTR_USER_DEFINED) return USER_DEFINED;
    if (a & LLAMA_TOKEN_ATTR_BYTE) return BYTE;
    if (a & LLAMA_TOKEN_ATTR_UNUSED) return UNUSED;
    if (a & LLAMA_TOKEN_ATTR_NORMAL) return NORMAL;
    return UNDEFINED;
}

bool Tokenizer::is_control(int32_t id) const { check_id(id); return vocab_->is_control(id); }
bool Tokenizer::is_eog(int32_t id) const { check_id(id); return vocab_->is_eog(id); }
bool Tokenizer::is_special(int32_t id) const {
    check_id(id);
    return (vocab_->token_get_attr(id) & (LLAMA_TOKEN_ATTR_CONTROL | LLAMA_TOKEN_ATTR_UNKNOWN)) != 0;
}
const std::string &Tokenizer::token_text(int32_t id) const {
    check_id(id);
    return vocab_->get_token_data(id).text;
}

}  // namespace kvflash
