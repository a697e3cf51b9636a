// The drafter scorer: a second, smaller model scores the target's chunks by the attention its
// own tail pays each of them (the reference's method, with kvflash's own cache under it).
//
// The drafter keeps a cache of the whole history in a scoring core session (session.h, with
// reread_capture) and is fed only what it has not seen (continue_to: the common prefix kept).  At a
// rescore it captures the queries of its last n_queries tokens and takes per history token the
// attention those queries pay it (history_attention over every key, paged-out ones included),
// minus, with contrast, what the queries ending `contrast` tokens earlier pay it.  A chunk scores its
// peak token (aggregate "max", chunk_peaks with spread), the mean of its smoothed tokens ("mean"),
// or each head's attention mass per chunk ("mass").  When the drafter's vocabulary is not the
// target's, the history is turned into text, re-tokenized for the drafter, and each drafter token
// lands in the target chunk holding its first byte (the cross-tokenizer bridge, through a
// DrafterVocab pair).  The drafter's runtime is built at the first score.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvflash/model.h"

namespace kvflash {

class Session;

struct DrafterSettings {
    int32_t n_queries = 16;        // the drafter's latest queries that score, 1 .. 4096
    int32_t smooth_width = 5;      // "mean"'s moving average
    std::string kv_type = "q8_0";  // the drafter's own cache
    int32_t layers = 0;            // evaluate the first N layers (0: a quarter, at least 8, through the first
                                   // full-attention layer)
    int32_t pool = 1024;           // the drafter's own pool in tokens (0: a full cache)
    std::string aggregate = "max"; // "max", "mean" or "mass"
    int32_t contrast = -1, spread = -1;   // -1: the aggregate's default (32 and 4 for max / mean; 0 for mass)
    // std::invalid_argument with DrafterPolicy's messages; resolves contrast and spread.
    void resolve();
};

// What the bridge needs of a tokenizer (the core's tokenizer implements it for both models).
class DrafterVocab {
public:
    virtual ~DrafterVocab() = default;
    // The bytes the ids decode to, special tokens skipped; ends[i]: the end offset of ids[i]'s bytes.
    virtual std::string bytes_of(const int32_t *ids, size_t n, std::vector<int64_t> &ends) const = 0;
    // Text to ids with the model's special prefix, special tokens not parsed.
    virtual std::vector<int32_t> encode(const std::string &text) const = 0;
    // The same vocabulary (every token's text, in order).
    virtual bool same_as(const DrafterVocab &other) const = 0;
};

class Tokenizer;

// The core tokenizer as the bridge's vocabulary (what the C API's drafter uses; Python's DrafterPolicy
// hands its kvflash.Tokenizer objects, which are the same tokenizer underneath).  encode reads the bytes
// as Python's bytes.decode("utf-8", "replace") does: each maximal ill-formed subpart becomes U+FFFD.
std::shared_ptr<const DrafterVocab> tokenizer_vocab(std::shared_ptr<const Tokenizer> tok);
// bytes with every ill-formed UTF-8 subpart replaced by U+FFFD (the Unicode standard's practice, Python's).
std::string utf8_replace_invalid(const std::string &bytes);

class DrafterScorer {
public:
    // target_max_ctx: the target session's context (the drafter's is as long, four times with a bridge);
    // vocabs (both or neither): the bridge's tokenizers; without them the vocabularies must agree.
    DrafterScorer(std::shared_ptr<Model> drafter, DrafterSettings s, int64_t target_max_ctx, int32_t n_threads,
                  std::shared_ptr<const DrafterVocab> target_vocab = nullptr,
                  std::shared_ptr<const DrafterVocab> drafter_vocab = nullptr);
    ~DrafterScorer();

    const DrafterSettings &settings() const { return s_; }
    const Model &model() const { return *model_; }
    bool bridged() const { return bridged_; }
    bool loaded() const { return session_ != nullptr; }
    int32_t layers_used() const;      // 0 before the first score
    int32_t eval_layers() const { return eval_layers_; }   // the drafter runtime's eval_layers (0: all)
    int64_t fed_tokens_total() const { return fed_total_; }
    // out: n_chunks scores of the target's history (tokens[0 .. n)).  Builds the drafter's runtime at
    // the first call.
    void score(const int32_t *tokens, int64_t n, int32_t n_chunks, int32_t chunk_tokens, std::vector<float> &out);
    // The target's history was cut back to n tokens: forget what the drafter was fed past them (a
    // bridged drafter's tokens are its own: it finds the common prefix at its next feed instead).
    void rewind(int64_t n);
    void reset();
    // The drafter's own session (nullptr before the first score); load() builds it now.
    Session *session() { return session_.get(); }
    std::shared_ptr<Session> session_ptr() const { return session_; }
    void load();
    // Asked between the pieces of the drafter's evals (its session's runtime): true stops them.
    void set_interrupt(std::function<bool()> f);

private:
    void feed(const std::vector<int32_t> &ids);
    std::vector<double> token_scores(int32_t first) const;
    void chunk_scores(const std::vector<int32_t> &ids, const std::vector<int32_t> &chunk_of, int32_t n_chunks,
                      std::vector<float> &out);

    std::shared_ptr<Model> model_;
    DrafterSettings s_;
    int64_t target_max_ctx_;
    int32_t n_threads_;
    std::shared_ptr<const DrafterVocab> tv_, dv_;
    bool bridged_ = false;
    int32_t eval_layers_ = 0;
    std::shared_ptr<Session> session_;
    std::function<bool()> interrupt_;
    int64_t fed_total_ = 0;
};

}  // namespace kvflash
