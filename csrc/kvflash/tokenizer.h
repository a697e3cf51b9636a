// The tokenizer: llama.cpp's own (llama_vocab from the pinned sdist, compiled into the core by
// third_party/ggml/llama_vocab.cmake), loaded from a GGUF file's tokenizer.* metadata alone, so its
// ids are llama.cpp's for every vocabulary llama.cpp reads.  The Python Tokenizer's encode and its
// id -> bytes table, the C API's kvflash_tokenize / token_to_piece / detokenize and Model::tokenizer()
// all come through here.
//
// Every input is checked before llama.cpp's code sees it (its vocabulary code asserts, aborting the
// process, on an id out of range or a BOS it was told to add and does not have): bad input is a C++
// exception here, a status in the C API, a ValueError / IndexError in Python.
//
// Thread safety: a loaded Tokenizer is immutable; every method is const and may run on many threads
// at once (llama.cpp keeps no state between calls but the tables built at load).
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

struct gguf_context;
struct llama_vocab;

namespace kvflash {

// A vocabulary llama.cpp (or kvflash) cannot use: no tokenizer keys, an unsupported model or
// pre-tokenizer, inconsistent arrays.  The message names the key.
class TokenizerError : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
};

class Tokenizer {
public:
    // llama.cpp's token types (tokenizer.ggml.token_type), as kvflash names them.
    enum TokenType : int32_t { UNDEFINED = 0, NORMAL = 1, UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, UNUSED = 5, BYTE = 6 };

    // The tokenizer.ggml.model values kvflash accepts: the families it loads ("llama": SentencePiece
    // BPE, "gpt2": byte-level BPE, "gemma4": Gemma 4's).  Others that llama.cpp reads (bert, t5, rwkv,
    // ...) are refused with TokenizerError until a model family needs them.
    static const std::vector<std::string> &supported_models();

    // From a GGUF file: its metadata only (tensor data is never read).  TokenizerError for a file
    // that is not a GGUF, has no tokenizer or one that cannot be used.
    static std::shared_ptr<const Tokenizer> load(const std::string &path);
    // From metadata already parsed (a Model's).  g is read during the call only.
    static std::shared_ptr<const Tokenizer> from_gguf(const gguf_context *g, const std::string &what = "GGUF metadata");
    ~Tokenizer();
    Tokenizer(const Tokenizer &) = delete;
    Tokenizer &operator=(const Tokenizer &) = delete;

    // Token ids for text (UTF-8; std::invalid_argument naming the first invalid byte otherwise).
    // add_special: BOS / EOS as the vocabulary asks (add_bos() / add_eos()); parse_special: control
    // tokens written in the text become their ids (user-defined ones always do), as llama_tokenize.
    std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const;
    // Token id's bytes (llama_token_to_piece with lstrip 0): special = false renders control tokens
    // as nothing.  std::out_of_range for an id outside [0, n_vocab).
    std::string token_to_piece(int32_t id, bool special) const;
    // The text of ids, as llama_detokenize (remove_special: drop the BOS / EOS encode adds;
    // unparse_special: render control tokens' text).  std::out_of_range for an id out of range.
    std::string decode(const int32_t *ids, size_t n, bool remove_special, bool unparse_special) const;
    std::string decode(const std::vector<int32_t> &ids, bool remove_special, bool unparse_special) const {
        return decode(ids.data(), ids.size(), remove_special, unparse_special);
    }

    int32_t n_vocab() const { return n_vocab_; }
    const std::string &model() const { return model_; }  // tokenizer.ggml.model
    const std::string &pre() const { return pre_; }      // tokenizer.ggml.pre as llama.cpp reads it ("" none)
    // Special ids, -1 when the vocabulary has none.
    int32_t bos() const;
    int32_t eos() const;
    int32_t eot() const;
    int32_t unk() const;
    int32_t pad() const;
    bool add_bos() const;
    bool add_eos() const;
    bool add_space_prefix() const;
    // The ids that end generation (llama_vocab_is_eog: eos, eot, eom and the end-of-turn tokens
    // llama.cpp recognises by text), ascending.
    const std::vector<int32_t> &eog_ids() const { return eog_; }
    // Per id; std::out_of_range outside [0, n_vocab).
    TokenType token_type(int32_t id) const;
    bool is_control(int32_t id) const;  // llama.cpp's control attribute
    bool is_eog(int32_t id) const;
    // Control or unknown: what decoding with skip_special drops (kvflash's Python convention).
    bool is_special(int32_t id) const;
    const std::string &token_text(int32_t id) const;  // the vocabulary string ("Ġworld", "▁the")

    void check_id(int32_t id) const;  // std::out_of_range unless 0 <= id < n_vocab

private:
    Tokenizer();
    std::unique_ptr<llama_vocab> vocab_;
    int32_t n_vocab_ = 0;
    std::string model_, pre_;
    std::vector<int32_t> eog_;
};

// The first invalid byte of s as UTF-8 (overlong forms, surrogates and code points past U+10FFFF
// included), or -1 when s is valid.
int64_t utf8_invalid_at(std::string_view s);

}  // namespace kvflash
