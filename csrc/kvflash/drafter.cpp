#include "kvflash/drafter.h"

#include <algorithm>
#include <stdexcept>

#include "kvflash/scoring.h"
#include "kvflash/session.h"
#include "kvflash/tokenizer.h"

namespace kvflash {

std::string utf8_replace_invalid(const std::string &b) {
    static const char kReplacement[] = "\xEF\xBF\xBD";
    const auto *p = reinterpret_cast<const unsigned char *>(b.data());
    const size_t n = b.size();
    std::string out;
    out.reserve(n);
    size_t i = 0;
    while (i < n) {
        const unsigned c = p[i];
        if (c < 0x80) {
            out += char(c);
            ++i;
            continue;
        }
        // the sequence's length and its second byte's range (Unicode Table 3-7); a maximal ill-formed
        // subpart is the longest prefix of a well-formed sequence, or one byte
        size_t len = 0;
        unsigned lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) len = 2;
        else if (c == 0xE0) len = 3, lo = 0xA0;
        else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) len = 3;
        else if (c == 0xED) len = 3, hi = 0x9F;
        else if (c == 0xF0) len = 4, lo = 0x90;
        else if (c >= 0xF1 && c <= 0xF3) len = 4;
        else if (c == 0xF4) len = 4, hi = 0x8F;
        size_t k = 1;
        if (len) {
            for (; k < len && i + k < n; ++k) {
                const unsigned d = p[i + k];
                const unsigned l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
                if (d < l || d > h) break;
            }
        }
        if (len && k == len) {
            out.append(b, i, len);
        } else {
            out += kReplacement;
        }
        i += len && k == len ? len : k;
    }
    return out;
}

namespace {

class TokenizerVocab final : public DrafterVocab {
public:
    explicit TokenizerVocab(std::shared_ptr<const Tokenizer> t) : t_(std::move(t)) {
        if (!t_) throw std::invalid_argument("drafter: a tokenizer is required");
    }
    std::string bytes_of(const int32_t *ids, size_t n, std::vector<int64_t> &ends) const override {
        std::string out;
        ends.resize(n);
        for (size_t i = 0; i < n; ++i) {
            if (!t_->is_special(ids[i])) out += t_->token_to_piece(ids[i], true);   // special ones skipped
            ends[i] = int64_t(out.size());
        }
        return out;
    }
    std::vector<int32_t> encode(const std::string &text) const override {
        return t_->encode(utf8_replace_invalid(text), true, false);
    }
    bool same_as(const DrafterVocab &other) const override {
        const auto *o = dynamic_cast<const TokenizerVocab *>(&other);
        if (!o) return false;
        if (o->t_ == t_) return true;
        if (o->t_->n_vocab() != t_->n_vocab()) return false;
        for (int32_t i = 0; i < t_->n_vocab(); ++i)
            if (o->t_->token_text(i) != t_->token_text(i)) return false;
        return true;
    }

private:
    std::shared_ptr<const Tokenizer> t_;
};

}  // namespace

std::shared_ptr<const DrafterVocab> tokenizer_vocab(std::shared_ptr<const Tokenizer> tok) {
    return std::make_shared<TokenizerVocab>(std::move(tok));
}

void DrafterSettings::resolve() {
    if (n_queries < 1 || n_queries > 4096)
        throw std::invalid_argument("drafter n_queries must be an integer in [1, 4096], got " + std::to_string(n_queries));
    if (smooth_width < 0 || smooth_width > 4096)
        throw std::invalid_argument("drafter smooth_width must be in [0, 4096], got " + std::to_string(smooth_width));
    if (kv_type != "f16" && kv_type != "q8_0" && kv_type != "q4_0")
        throw std::invalid_argument("drafter kv_type must be 'f16', 'q8_0' or 'q4_0', got '" + kv_type + "'");
    if (layers < 0) throw std::invalid_argument("drafter layers must be a positive integer or None");
    if (pool < 0)
        throw std::invalid_argument("drafter pool must be a non-negative token count or None (full cache), got " +
                                    std::to_string(pool));
    if (aggregate != "max" && aggregate != "mean" && aggregate != "mass")
        throw std::invalid_argument("drafter aggregate must be 'max', 'mean' or 'mass', got '" + aggregate + "'");
    // contrast and spread work on token scores; "mass" sums heads' chunk masses natively
    const bool token_level = aggregate != "mass";
    for (auto [what, v] : {std::pair<const char *, int32_t *>{"contrast", &contrast}, {"spread", &spread}}) {
        if (*v < -1 || *v > 4096)
            throw std::invalid_argument(std::string("drafter ") + what + " must be a token count in [0, 4096] (0: off)");
        if (*v > 0 && !token_level)
            throw std::invalid_argument(std::string("drafter ") + what +
                                        " works on token scores: use aggregate='max' or 'mean' with it");
    }
    if (contrast < 0) contrast = token_level ? 32 : 0;
    if (spread < 0) spread = token_level ? 4 : 0;
}

DrafterScorer::DrafterScorer(std::shared_ptr<Model> drafter, DrafterSettings s, int64_t target_max_ctx,
                             int32_t n_threads, std::shared_ptr<const DrafterVocab> target_vocab,
                             std::shared_ptr<const DrafterVocab> drafter_vocab)
    : model_(std::move(drafter)), s_(std::move(s)), target_max_ctx_(target_max_ctx), n_threads_(n_threads),
      tv_(std::move(target_vocab)), dv_(std::move(drafter_vocab)) {
    if (!model_) throw std::invalid_argument("drafter: a model is required");
    if (bool(tv_) != bool(dv_)) throw std::invalid_argument("drafter: the bridge needs both vocabularies or neither");
    s_.resolve();
    bridged_ = tv_ && !tv_->same_as(*dv_);
    if (n_threads_ <= 0) n_threads_ = model_->n_threads();
}

DrafterScorer::~DrafterScorer() = default;

int32_t DrafterScorer::layers_used() const {
    if (!session_) return 0;
    return eval_layers_ ? eval_layers_ : model_->hparams().n_layer;
}

void DrafterScorer::load() {
    if (session_) return;
    const int32_t n_layer = model_->hparams().n_layer;
    const std::vector<int32_t> globals = model_->global_layers();
    if (globals.empty()) throw std::invalid_argument("drafter " + model_->path() + " has no full-attention layer");
    const int32_t first_global = *std::min_element(globals.begin(), globals.end());   // the scores come from these
    int32_t layers = s_.layers;
    if (layers == 0) layers = std::max({(n_layer + 3) / 4, std::min(n_layer, 8), first_global + 1});
    if (layers > n_layer)
        throw std::invalid_argument("drafter layers=" + std::to_string(layers) + " but " + model_->path() + " has " +
                                    std::to_string(n_layer) + " layers");
    if (layers <= first_global)
        throw std::invalid_argument("drafter layers=" + std::to_string(layers) + ": the first full-attention layer of " +
                                    model_->path() + " is layer " + std::to_string(first_global) +
                                    " (the others use a sliding window); use layers >= " +
                                    std::to_string(first_global + 1));
    eval_layers_ = layers == n_layer ? 0 : layers;
    SessionConfig c;
    RuntimeConfig &r = c.runtime;
    r.max_ctx = std::max<int64_t>(target_max_ctx_ * (bridged_ ? 4 : 1), 1024);
    PagerConfig pc;
    r.pool_tokens = s_.pool > 0 && s_.pool < r.max_ctx ? std::max(s_.pool, pc.min_pool_tokens()) : 0;
    r.kv_type = s_.kv_type;
    // the tail's queries and, with contrast, the baseline's (the n_queries ending `contrast` tokens
    // earlier): one feed captures both, so every token is evaluated once however often it rescores
    r.capture_queries = s_.n_queries + s_.contrast;
    r.eval_layers = eval_layers_;
    c.reread_capture = true;   // the drafter's history: continue_to refills the capture window after a cut
    session_ = std::make_shared<Session>(model_, c);
    if (interrupt_) session_->runtime().set_interrupt(interrupt_);
}

void DrafterScorer::feed(const std::vector<int32_t> &ids) {
    if (ids.empty()) {
        session_->reset();
        return;
    }
    const int64_t reused = session_->continue_to(ids.data(), int32_t(ids.size()), {}, false);
    fed_total_ += int64_t(ids.size()) - reused;
}

std::vector<double> DrafterScorer::token_scores(int32_t first) const {
    const Runtime &rt = session_->runtime();
    const int32_t n_cap = rt.n_captured();
    if (first < 0) first = std::max(0, n_cap - s_.n_queries);
    const int64_t n = rt.n_past();
    std::vector<float> tok(static_cast<size_t>(n));
    history_attention(rt, tok.data(), n, n_threads_, false, nullptr, first, std::min(s_.n_queries, n_cap - first));
    return std::vector<double>(tok.begin(), tok.end());
}

void DrafterScorer::chunk_scores(const std::vector<int32_t> &ids, const std::vector<int32_t> &chunk_of,
                                 int32_t n_chunks, std::vector<float> &out) {
    feed(ids);
    out.assign(size_t(n_chunks), 0.0f);
    const Runtime &rt = session_->runtime();
    const int32_t n_cap = rt.n_captured();
    if (s_.aggregate == "mass") {   // each head's attention mass per chunk, max over heads and layers
        int32_t groups = 0;
        for (int32_t c : chunk_of) groups = std::max(groups, c + 1);
        std::vector<float> got(static_cast<size_t>(groups));
        history_attention(rt, got.data(), groups, n_threads_, false, chunk_of.data(), std::max(0, n_cap - s_.n_queries));
        for (int32_t c = 0; c < std::min(groups, n_chunks); ++c) out[size_t(c)] = got[size_t(c)];
        return;
    }
    std::vector<double> base;
    if (s_.contrast && n_cap == s_.n_queries + s_.contrast) base = token_scores(0);   // ending `contrast` earlier
    std::vector<double> x = token_scores(-1);
    for (size_t i = 0; i < std::min(base.size(), x.size()); ++i) x[i] -= base[i];
    const int64_t n = std::min<int64_t>(int64_t(x.size()), int64_t(chunk_of.size()));
    if (s_.aggregate == "max") chunk_peaks(x.data(), n, chunk_of.data(), n_chunks, s_.spread, out.data());
    else chunk_means(x.data(), n, chunk_of.data(), n_chunks, s_.spread, s_.smooth_width, out.data());
}

void DrafterScorer::score(const int32_t *tokens, int64_t n, int32_t n_chunks, int32_t chunk_tokens,
                          std::vector<float> &out) {
    if (!session_) load();
    if (n <= 0 || n_chunks <= 0) {
        out.assign(size_t(std::max(n_chunks, 0)), 0.0f);
        return;
    }
    if (!bridged_) {
        std::vector<int32_t> ids(tokens, tokens + n), chunk_of(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) chunk_of[size_t(i)] = int32_t(i / chunk_tokens);
        chunk_scores(ids, chunk_of, n_chunks, out);
        return;
    }
    // Cross-tokenizer bridge: drafter token scores mapped to target chunks by byte spans.
    std::vector<int64_t> t_ends, d_ends;
    const std::string text = tv_->bytes_of(tokens, size_t(n), t_ends);
    const std::vector<int32_t> d_ids = dv_->encode(text);
    dv_->bytes_of(d_ids.data(), d_ids.size(), d_ends);
    // the end byte of each target chunk; each drafter token lands in the chunk that holds its first byte
    std::vector<int64_t> chunk_end(static_cast<size_t>(n_chunks));
    for (int32_t c = 0; c < n_chunks; ++c)
        chunk_end[size_t(c)] = t_ends[size_t(std::min<int64_t>(int64_t(c + 1) * chunk_tokens, int64_t(t_ends.size())) - 1)];
    std::vector<int32_t> chunk_of(d_ids.size());
    for (size_t i = 0; i < d_ids.size(); ++i) {
        const int64_t start = i == 0 ? 0 : d_ends[i - 1];
        const int64_t c = std::upper_bound(chunk_end.begin(), chunk_end.end(), start) - chunk_end.begin();
        chunk_of[i] = int32_t(std::min<int64_t>(std::max<int64_t>(c, 0), n_chunks - 1));
    }
    chunk_scores(d_ids, chunk_of, n_chunks, out);
}

void DrafterScorer::rewind(int64_t n) {
    if (!session_ || bridged_ || session_->n_past() <= n) return;
    try {
        session_->truncate_cache(n);
    } catch (const std::invalid_argument &) {   // a sliding-window ring that does not reach back so far
        session_->reset();
    }
}

void DrafterScorer::set_interrupt(std::function<bool()> f) {
    interrupt_ = std::move(f);
    if (session_) session_->runtime().set_interrupt(interrupt_);
}

void DrafterScorer::reset() {
    if (session_) session_->reset();
}

}  // namespace kvflash
