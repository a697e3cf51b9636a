#include "kvflash/session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace kvflash {

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void SessionConfig::validate() const {
    if (tau < 1) throw std::invalid_argument("tau must be >= 1 (decoded tokens between rescores), got " + std::to_string(tau));
    if (reeval_tokens < 1) throw std::invalid_argument("reeval_tokens must be >= 1, got " + std::to_string(reeval_tokens));
    if (prefill_rescore < 0)
        throw std::invalid_argument("prefill_rescore must be >= 0 (pooled prefill pieces between rescores; 0: none), got " +
                                    std::to_string(prefill_rescore));
    if (exact_draft < -1 || exact_draft > kMaxDraft)
        throw std::invalid_argument("exact_draft must be -1 (adaptive) or in [0, " + std::to_string(kMaxDraft) +
                                    "], got " + std::to_string(exact_draft));
    if (exact_prefill_until < 0)
        throw std::invalid_argument("exact_prefill_until must be >= 0 (the position where exact prefill stops; 0: "
                                    "none), got " + std::to_string(exact_prefill_until));
    if (scorer == Scorer::Qk) qk.validate();
    if (scorer == Scorer::Drafter && !drafter) throw std::invalid_argument("the drafter scorer needs a drafter");
}

int64_t auto_exact_prefill_until(const Model &model) {
    if (model.device().name().rfind("cpu", 0) != 0 || !model.remote_layers().empty()) return 0;
    const size_t paged = model.global_layers().size();
    if (paged == 0) return 0;
    return paged * 4 <= size_t(model.hparams().n_layer) ? 16384 : 4096;
}

// ------------------------------------------------------------------ SpecStats

void SpecStats::add(const SpecRound &r) {
    ++rounds;
    drafted += r.n_draft;
    kept += r.n_kept;
    draft_ms += r.draft_ms;
    verify_ms += r.verify_ms;
    const double w = 0.25;
    if (r.n_draft > 0) {
        a_ = (1 - w) * a_ + w * (double(r.n_kept) / double(r.n_draft));
        const double td = r.draft_ms / r.n_draft;
        td_ = have_td_ ? (1 - w) * td_ + w * td : td;
        have_td_ = true;
    }
    passes_.emplace_back(r.n_draft + 1, r.verify_ms);
    while (passes_.size() > 24) passes_.pop_front();
}

int32_t SpecStats::choose_k() const {
    bool two_lengths = false;
    for (const auto &p : passes_)
        if (p.first != passes_.front().first) two_lengths = true;
    if (!have_td_ || !two_lengths) return rounds % 2 ? 8 : 2;   // explore two lengths first
    // (t_fixed, t_token): a least-squares line through the recent passes
    const double m = double(passes_.size());
    double sn = 0, st = 0, snn = 0, snt = 0;
    for (const auto &p : passes_) {
        sn += p.first;
        st += p.second;
        snn += double(p.first) * p.first;
        snt += p.first * p.second;
    }
    const double slope = (m * snt - sn * st) / (m * snn - sn * sn);
    const double b = std::max(slope, 1e-6), f = std::max((st - slope * sn) / m, 0.0);
    const double a = std::min(std::max(a_, 0.0), 0.98);
    int32_t best = 0;
    double best_rate = -1;
    for (int32_t k = 0; k <= kMaxDraft; ++k) {   // the first of equal rates wins: the fewest drafts
        const double rate = ((1 - std::pow(a, k + 1)) / (1 - a)) / (k * td_ + f + (k + 1) * b);
        if (rate > best_rate) {
            best_rate = rate;
            best = k;
        }
    }
    return best;
}

// ------------------------------------------------------------------ Session

Session::Session(std::shared_ptr<Model> model, SessionConfig cfg) : model_(std::move(model)), cfg_(std::move(cfg)) {
    if (!model_) throw std::invalid_argument("model is required");
    cfg_.validate();
    if (cfg_.scorer == Scorer::Qk) {
        cfg_.runtime.capture_queries = std::max(cfg_.runtime.capture_queries, cfg_.qk.capture());
        cfg_.chunk_summaries = cfg_.chunk_summaries || cfg_.qk.summaries();
    }
    rt_ = std::make_unique<Runtime>(model_, cfg_.runtime);
    if (cfg_.chunk_summaries) {
        summaries_ = std::make_shared<ChunkSummaries>();
        rt_->set_observer(summaries_);
    }
    sampler_.seed(cfg_.seed);
}

int32_t Session::n_chunks() const {
    const int64_t C = rt_->config().chunk_tokens;
    return int32_t((rt_->n_past() + C - 1) / C);
}

void Session::set_sample_vocab(int32_t n) {
    const int32_t V = model_->hparams().n_vocab;
    if (n < 0 || n > V)
        throw std::invalid_argument("sample_vocab must be in [0, n_vocab=" + std::to_string(V) + "] (0: all ids)");
    sample_vocab_ = n;
}

int32_t Session::sampled_vocab() const {
    const int32_t V = model_->hparams().n_vocab;
    return sample_vocab_ > 0 && sample_vocab_ < V ? sample_vocab_ : V;
}

void Session::set_schedule(int32_t tau, int32_t reeval_tokens) {
    SessionConfig c = cfg_;
    c.tau = tau;
    c.reeval_tokens = reeval_tokens;
    c.validate();
    cfg_ = c;
}

void Session::configure(const SessionConfig &c) {
    SessionConfig next = c;
    next.runtime = cfg_.runtime;
    next.chunk_summaries = cfg_.chunk_summaries;
    next.validate();
    if (next.scorer == Scorer::Qk) {
        if (rt_->config().capture_queries < next.qk.capture())
            throw std::invalid_argument("the qk scorer reads " + std::to_string(next.qk.capture()) +
                                        " captured queries; this runtime captures " +
                                        std::to_string(rt_->config().capture_queries));
        if (next.qk.summaries() && !summaries_)
            throw std::invalid_argument("the " + next.qk.name() +
                                        " scorer reads chunk key summaries; this runtime keeps none (build it with "
                                        "chunk_summaries)");
    }
    cfg_ = next;
}

void Session::told_rewind() {
    if (cfg_.scorer == Scorer::Drafter) cfg_.drafter->rewind(int64_t(tokens_.size()));
    if (rewind_fn_) rewind_fn_(int64_t(tokens_.size()));
}

// ---- low-level evaluation

void Session::eval(const int32_t *ids, int32_t n, bool all_logits, float *out, const EvalOptions &opt) {
    rt_->eval(ids, n, all_logits, out, opt);   // all or nothing
    tokens_.insert(tokens_.end(), ids, ids + n);
}

void Session::eval_logits(const int32_t *ids, int32_t n, bool exact) {
    if (rt_->config().eval_layers > 0)
        throw std::invalid_argument("this runtime evaluates only its first " + std::to_string(rt_->config().eval_layers) +
                                    " layers (a scoring runtime) and has no logits");
    std::vector<float> l(size_t(model_->hparams().n_vocab));
    EvalOptions opt;
    opt.exact = exact;
    opt.exact_until = exact ? exact_prefill_until() : 0;   // (exact mode: 0, every position)
    eval(ids, n, false, l.data(), opt);
    logits_.swap(l);
}

int32_t Session::eval_sample(const int32_t *ids, int32_t n, const SamplerParams &p) {
    p.validate();
    eval_logits(ids, n, false);
    return sampler_.sample(logits_.data(), sampled_vocab(), p);   // may refuse NaN logits: the eval stays
}

SpecRound Session::spec_round(int32_t tok, int32_t k, const SamplerParams &p, const std::vector<int32_t> &stop_ids) {
    if (rt_->config().eval_layers > 0) throw std::invalid_argument("spec_round: a scoring runtime has no logits to verify");
    p.validate();
    SpecRound rd = speculative_round(*rt_, sampler_, tok, k, p, sampled_vocab(), stop_ids);   // all or nothing
    tokens_.insert(tokens_.end(), rd.accepted.begin(), rd.accepted.end());
    const size_t V = size_t(model_->hparams().n_vocab);
    round_logits_.swap(rd.logits);
    logits_.assign(round_logits_.end() - V, round_logits_.end());
    return rd;
}

void Session::truncate_cache(int64_t n) {
    rt_->truncate(n);   // std::invalid_argument before anything changed
    tokens_.resize(size_t(rt_->n_past()));
    logits_.clear();
    ahead_.clear();
}

int32_t Session::sample(const SamplerParams &p) {
    p.validate();
    if (logits_.empty()) throw std::invalid_argument("nothing to sample from: evaluate a prompt first");
    return sampler_.sample(logits_.data(), sampled_vocab(), p);
}

// ---- prompts

int32_t Session::prefill(const int32_t *ids, int32_t n, const ProgressFn &progress) {
    if (n < 0 || (n > 0 && !ids)) throw std::invalid_argument("prefill: ids must be non-NULL and n >= 0");
    if (n == 0) return 0;
    settle();   // exact-mode drafts not handed out leave the cache first
    if (rt_->n_past() + n > rt_->config().max_ctx)
        throw std::out_of_range("prompt of " + std::to_string(n) + " tokens on top of " + std::to_string(rt_->n_past()) +
                                " in context exceeds max_ctx " + std::to_string(rt_->config().max_ctx) +
                                "; raise max_ctx or shorten the prompt");
    const int64_t n0 = int64_t(tokens_.size());
    std::vector<float> logits0 = logits_;
    const int64_t since0 = since_rescore_;
    // the capture window: the prompt's eval replaces it, a rewind puts it back
    std::vector<float> q0;
    int32_t nq0 = 0;
    if (scored()) {
        q0 = rt_->captured_queries();
        nq0 = rt_->n_captured();
    }
    try {
        return prefill_(ids, n, progress);
    } catch (...) {
        rewind_to(n0, std::move(logits0), since0, scored() ? &q0 : nullptr, nq0);
        throw;
    }
}

int32_t Session::prefill_(const int32_t *ids, int32_t n, const ProgressFn &progress) {
    std::vector<float> l(size_t(model_->hparams().n_vocab));
    EvalOptions opt;
    opt.exact = exact_prefill();
    opt.exact_until = exact_prefill_until();
    opt.progress = progress;
    if (cfg_.prefill_rescore > 0 && cfg_.scorer == Scorer::Qk && scored() && !opt.exact) {
        // Between pieces, once the prompt has outgrown the pool: the piece just read scores the chunks
        // (its queries are the capture window) and the best of them are paged in for the next pieces.
        // Half the pool's evictable blocks stay the most recent chunks (a piece's local context),
        // the other half go to the best-ranked chunks.
        const PagerConfig &pc = rt_->pager().config();
        const int64_t recent =
            int64_t(std::max(0, rt_->pager().n_blocks() - pc.sink_chunks - pc.tail_window_chunks - 1) / 2 +
                    pc.tail_window_chunks + 1) * rt_->config().chunk_tokens;
        int32_t pieces = 0;
        opt.progress = [this, &progress, &pieces, recent](int32_t done, int32_t total) {
            if (done < total && rt_->pager().stats().host_chunks > 0 && ++pieces % cfg_.prefill_rescore == 0)
                rescore(recent);
            if (progress) progress(done, total);
        };
    }
    // the sliding layers' rows of the prompt, for the settle's re-read (freed when the prompt is settled)
    struct History {
        Runtime *rt;
        bool on;
        ~History() { if (on) rt->keep_swa_history(false); }
    } history{rt_.get(), cfg_.prefill_reread && scored() && !opt.exact && rt_->ring() != nullptr};
    if (history.on) rt_->keep_swa_history(true);
    eval(ids, n, false, l.data(), opt);
    logits_.swap(l);
    settle_prompt(n);
    return n;
}

void Session::settle_prompt(int32_t n) {
    if (!scored() || rt_->pager().stats().host_chunks == 0) return;
    // The prompt outgrew the pool: the residents are chosen against its tail now (the question
    // usually sits there); then its last tokens are read again so they, not only the last one,
    // attend to the chosen chunks in every layer.  With prefill_reread the chosen chunks the pooled
    // pieces wrote are first read again in place over the whole context (their K/V as the full cache
    // would make them), so the tail re-read attends those.  Exact prefill's K/V are already the full
    // cache's: a re-read over the pool would only make them approximate.
    since_rescore_ = 0;
    const int32_t moved = rescore();
    // (a prompt that ran past exact prefill's cap was read over the pool from there: settled as pooled)
    if (exact_prefill() && (exact_prefill_until() <= 0 || rt_->n_past() <= exact_prefill_until())) return;
    const int32_t k = std::max(1, std::min(n, cfg_.reeval_tokens));
    int64_t reread = 0;
    if (cfg_.prefill_reread && !exact_prefill()) reread = reread_resident(rt_->n_past() - n, rt_->n_past() - k);
    if (moved > 0 || reread > 0) {
        // a recurrent state rewinds to its nearest checkpoint: the tokens from there are read again
        const int64_t end = rt_->n_past(), p = rt_->recurrent() ? rt_->rewind_point(end - k) : end - k;
        const std::vector<int32_t> again(tokens_.begin() + p, tokens_.begin() + end);
        rt_->truncate(p);
        tokens_.resize(size_t(rt_->n_past()));
        eval_logits(again.data(), int32_t(again.size()), false);
    }
}

void Session::rewind_to(int64_t n, std::vector<float> logits, int64_t since, const std::vector<float> *queries,
                        int32_t n_queries) {
    ahead_.clear();
    try {
        if (rt_->n_past() > n) {
            rt_->truncate(n);
            if (queries) rt_->set_captured(*queries, n_queries);
        }
        tokens_.resize(size_t(rt_->n_past()));
        logits_ = std::move(logits);
        since_rescore_ = since;
    } catch (const std::invalid_argument &) {   // the sliding-window ring cannot rewind that far
        reset_();
    }
    if (rt_->n_past() != int64_t(tokens_.size()) || rt_->n_past() != n) reset_();   // never leave them apart
    told_rewind();
}

int64_t Session::continue_to(const int32_t *ids, int32_t n, const ProgressFn &progress, bool fresh_logits) {
    if (n <= 0 || !ids) throw std::invalid_argument("continue_to: ids must be non-NULL and n > 0");
    settle();
    int64_t common = 0;
    const int64_t m = std::min<int64_t>(int64_t(tokens_.size()), n);
    while (common < m && tokens_[size_t(common)] == ids[common]) ++common;
    if (common == n && int64_t(tokens_.size()) == n && !fresh_logits && (has_logits() || cfg_.reread_capture))
        return n;   // the context is ids already, with its logits (a restored slot): nothing to read
    if (common == n) --common;   // read the last token again: fresh logits
    common = std::max<int64_t>(common, 0);
    if (common < int64_t(tokens_.size())) {
        // Cutting drops the captured queries past the cut: a scored session re-reads enough of the
        // kept prefix that the new part's eval captures a whole window (exact mode cuts where the
        // full cache cuts, so its cache keeps the full cache's bits).
        std::vector<int64_t> cuts{common};
        if ((scored() || cfg_.reread_capture) && !exact() && n - common < n_capture())
            cuts.insert(cuts.begin(), std::max<int64_t>(0, n - n_capture()));
        bool cut = false;
        for (int64_t c : cuts) {
            if (rt_->recurrent()) c = rt_->rewind_point(c);   // its nearest checkpoint at or before c
            if (c == 0 && rt_->recurrent()) continue;
            try {
                rt_->truncate(c);
            } catch (const std::invalid_argument &) {   // the sliding-window ring does not reach back to c
                continue;
            }
            common = c;
            cut = true;
            break;
        }
        if (!cut) {
            reset_();
            common = 0;
        }
        tokens_.resize(size_t(rt_->n_past()));
        logits_.clear();
        ahead_.clear();
        told_rewind();
    }
    prefill(ids + common, int32_t(n - common), progress);
    return common;
}

void Session::truncate(int64_t n) {
    if (n < 0 || n > int64_t(tokens_.size()))
        throw std::out_of_range("truncate: n_tokens must be in [0, " + std::to_string(tokens_.size()) + "], got " +
                                std::to_string(n));
    truncate_(n);
}

void Session::truncate_(int64_t n) {
    ahead_.clear();
    if (n == 0) {
        reset_();
        return;
    }
    if (n == int64_t(tokens_.size())) return;
    // A scored session's capture window is read again; exact mode reads back only the last token,
    // as the full cache does (one-token arithmetic: the cache keeps the full cache's bits), and
    // keeps the window's earlier queries that survive the cut.
    int64_t k = scored() && !exact() ? std::min<int64_t>(n, n_capture()) : 1;
    // a recurrent state rewinds to its nearest checkpoint: the tokens from there are read again
    if (rt_->recurrent()) k = n - rt_->rewind_point(n - k);
    if (k >= n && rt_->recurrent()) {   // nothing to rewind to: the whole prefix again
        const std::vector<int32_t> all(tokens_.begin(), tokens_.begin() + n);
        reset_();
        prefill(all.data(), int32_t(all.size()));
        return;
    }
    const std::vector<int32_t> kept(tokens_.begin() + (n - k), tokens_.begin() + n);
    try {
        try {
            rt_->truncate(n - k);   // std::invalid_argument (ring) before anything changed
        } catch (const std::invalid_argument &) {
            if (k == 1) throw;
            k = 1;   // the ring reaches back to the last token only: a shorter capture window then
            rt_->truncate(n - k);
        }
        tokens_.resize(size_t(rt_->n_past()));
        logits_.clear();
        eval_logits(kept.data() + (kept.size() - size_t(k)), int32_t(k), exact_prefill());
    } catch (...) {
        // The cache holds a prefix of the history whatever happened: the history follows it.
        // After a failed re-read that is n - k tokens, without logits; prefill continues it.
        tokens_.resize(size_t(rt_->n_past()));
        told_rewind();
        throw;
    }
    told_rewind();
}

void Session::reset() { reset_(); }

void Session::reset_() {
    rt_->reset();
    tokens_.clear();
    logits_.clear();
    round_logits_.clear();
    ahead_.clear();
    since_rescore_ = 0;
    last_scores_.clear();
    if (cfg_.scorer == Scorer::Drafter) cfg_.drafter->reset();
    if (rewind_fn_) rewind_fn_(0);
}

// ---- decoding

void Session::maybe_rescore() {
    if (!scored()) return;
    const int64_t period = std::max<int64_t>(cfg_.tau, int64_t(tokens_.size()) / 45);
    if (since_rescore_ < period) return;
    since_rescore_ = 0;
    rescore();
}

int32_t Session::advance(int32_t tok, const SamplerParams &p, int64_t budget, const std::vector<int32_t> &stop_ids) {
    if (!exact()) {
        p.validate();
        eval_logits(&tok, 1, false);   // tok is in the history once it is in the cache
        ++since_rescore_;
        const int32_t next = sampler_.sample(logits_.data(), sampled_vocab(), p);
        maybe_rescore();
        return next;
    }
    if (!ahead_.empty()) {   // tok was kept by the last round and is in the cache already
        ahead_.pop_front();
        return ahead_.empty() ? round_next_ : ahead_.front();
    }
    return round(tok, p, budget, stop_ids);
}

int32_t Session::round(int32_t tok, const SamplerParams &p, int64_t budget, const std::vector<int32_t> &stop_ids) {
    maybe_rescore();   // at a round's start nothing is ahead: the pool the drafts read is chosen here
    const int64_t n0 = int64_t(tokens_.size());
    const int64_t cap = std::min<int64_t>({budget - 1, rt_->config().max_ctx - n0 - 1, int64_t(kMaxDraft), rt_->max_rewind()});
    const int32_t want = cfg_.exact_draft >= 0 ? cfg_.exact_draft : spec_.choose_k();
    const int32_t k = int32_t(std::max<int64_t>(0, std::min<int64_t>(cap, want)));
    SpecRound r = spec_round(tok, k, p, stop_ids);
    since_rescore_ += int64_t(r.accepted.size());
    spec_.add(r);
    // tok is the history's now; the kept drafts wait in ahead_ (in the cache, not yet handed out)
    ahead_.assign(r.accepted.begin() + 1, r.accepted.end());
    round_base_ = n0;
    round_next_ = r.next;
    return ahead_.empty() ? r.next : ahead_.front();
}

void Session::settle() {
    if (ahead_.empty()) return;
    // tokens_ holds what the cache holds: the handed-out tokens, then the drafts still ahead
    const int64_t n = int64_t(tokens_.size()) - int64_t(ahead_.size());
    const size_t V = size_t(model_->hparams().n_vocab);
    const size_t row = size_t(n - 1 - round_base_);
    std::vector<float> verified(round_logits_.begin() + row * V, round_logits_.begin() + (row + 1) * V);
    ahead_.clear();
    if (scored()) {
        truncate_(n);   // reads the last token again with one-token arithmetic, as truncate() does
    } else {
        rt_->truncate(n);
        tokens_.resize(size_t(n));
        logits_ = std::move(verified);
        told_rewind();
    }
}

// ---- scoring

void Session::reread(int64_t pos0, int32_t n) {
    if (pos0 < 0 || n <= 0 || pos0 + n > int64_t(tokens_.size()))
        throw std::invalid_argument("reread: the span [" + std::to_string(pos0) + ", " + std::to_string(pos0 + n) +
                                    ") must lie inside the history [0, " + std::to_string(tokens_.size()) + ")");
    rt_->reread(tokens_.data() + pos0, pos0, n);
}

int64_t Session::reread_resident(int64_t from, int64_t until) {
    const int64_t pooled = rt_->pooled_from();
    if (pooled < 0) return 0;
    const Pager &pg = rt_->pager();
    const int64_t C = rt_->config().chunk_tokens;
    const int64_t c0 = std::max<int64_t>(std::max<int64_t>(from, 0), pooled) / C, c1 = std::min<int64_t>(until, rt_->n_past()) / C;
    int64_t done = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t c = c0; c < c1;) {
        if (pg.block_of(int32_t(c)) < 0 || pg.n_written(int32_t(c)) != C) { ++c; continue; }
        int64_t e = c + 1;
        while (e < c1 && pg.block_of(int32_t(e)) >= 0 && pg.n_written(int32_t(e)) == C) ++e;
        const int32_t len = int32_t((e - c) * C);
        if (rt_->reread_refusal(c * C, len).empty()) {
            rt_->reread(tokens_.data() + c * C, c * C, len);
            done += len;
            reread_tokens_ += len;
        }
        c = e;
    }
    reread_ms_ += ms_since(t0);
    return done;
}

int32_t Session::rescore(int64_t keep_recent) {
    const int32_t n = n_chunks();
    if (n == 0 || cfg_.scorer == Scorer::None) return 0;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> scores;
    bool have = false;
    if (cfg_.scorer == Scorer::Qk) {
        scores.resize(size_t(n));
        qk_scores(*rt_, summaries_.get(), cfg_.qk, scores.data(), n, model_->n_threads());
        have = true;
    } else if (cfg_.scorer == Scorer::Drafter) {
        cfg_.drafter->score(tokens_.data(), int64_t(tokens_.size()), n, rt_->config().chunk_tokens, scores);
        have = true;
    } else if (score_fn_) {
        have = score_fn_(n, scores);
        if (have && int32_t(scores.size()) != n)
            throw std::invalid_argument("the policy returned " + std::to_string(scores.size()) + " scores for " +
                                        std::to_string(n) + " chunks: one per chunk");
    }
    int32_t moved = 0;
    if (have) {
        for (int32_t i = 0; i < n; ++i)
            if (std::isnan(scores[size_t(i)])) throw std::invalid_argument("the policy returned NaN scores");
        if (keep_recent > 0) {
            const int64_t C = rt_->config().chunk_tokens, first = std::max<int64_t>(0, rt_->n_past() - keep_recent) / C;
            for (int64_t c = first; c < n; ++c) scores[size_t(c)] = std::numeric_limits<float>::infinity();
        }
        moved = rt_->pager().reselect(scores.data(), n);
        last_scores_ = std::move(scores);
    }
    ++rescores_;
    rescore_ms_ += ms_since(t0);
    return moved;
}

int32_t Session::reselect(const float *scores, int32_t n) {
    if (!scores || n < 0) throw std::invalid_argument("reselect: scores must be non-NULL and n >= 0");
    if (n > n_chunks())
        throw std::out_of_range("reselect: " + std::to_string(n) + " scores for " + std::to_string(n_chunks()) + " chunks");
    for (int32_t i = 0; i < n; ++i)
        if (std::isnan(scores[i])) throw std::invalid_argument("reselect: score " + std::to_string(i) + " is NaN");
    return rt_->pager().reselect(scores, n);
}

void Session::restore_state(std::vector<int32_t> tokens, std::vector<float> logits, int64_t since_rescore,
                            int64_t rescores, std::vector<float> last_scores) {
    if (int64_t(tokens.size()) != rt_->n_past())
        throw std::invalid_argument("restore_state: " + std::to_string(tokens.size()) + " tokens for a cache of " +
                                    std::to_string(rt_->n_past()));
    if (!logits.empty() && logits.size() != size_t(model_->hparams().n_vocab))
        throw std::invalid_argument("restore_state: logits are not one row of n_vocab");
    tokens_ = std::move(tokens);
    logits_ = std::move(logits);
    since_rescore_ = since_rescore;
    rescores_ = rescores;
    last_scores_ = std::move(last_scores);
    ahead_.clear();
    round_logits_.clear();
}

}  // namespace kvflash
