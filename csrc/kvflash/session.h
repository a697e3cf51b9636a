// The session: one conversation's state over a Model, and the logic every client shares.
//
// A Session owns the Runtime (pool, pager, host store, graphs), the sampler, the token history,
// the last logits and the policy's schedule.  Python's kvflash.Session, the C API and the
// server are clients of it: they bring text, stop strings and (Python) policies written in
// Python, and call the verbs below.  What lives here, once:
//   - the history: always the tokens the cache holds (tokens().size() == n_past());
//   - prefill, all or nothing: a failed or interrupted prompt puts the context back as it was
//     (tokens, logits, the schedule's counter, the capture window);
//   - the rescore schedule: every max(tau, history / 45) decoded tokens, and once after a prompt
//     that outgrew the pool (then the prompt's last reeval_tokens are read again over the chosen
//     residents);
//   - the scorers: qk and its variants built in (QkScoring), or scores handed in by the client's
//     callback;
//   - truncate with the capture window read again, and continue_to (longest common prefix with the
//     history, the rest cut, the new part prefilled);
//   - exact mode's rounds (drafts over the pool, one exact verification pass) and their draft
//     length, chosen from the measured acceptance and costs;
//   - snapshots of the whole session: the runtime's state (snapshot.h) and the session's own JSON
//     (session_file.h), written and checked here for every client.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvflash/drafter.h"
#include "kvflash/runtime.h"
#include "kvflash/sampling.h"
#include "kvflash/scoring.h"
#include "kvflash/speculative.h"

namespace kvflash {

constexpr int32_t kMaxDraft = 16;   // drafts per exact-mode round, at most

// What scores the chunks when the schedule says so.
enum class Scorer {
    None,       // lru: the pager's recency order, nothing scored
    Qk,         // qk and its variants, scored in the core (SessionConfig::qk)
    Drafter,    // a second model's attention (SessionConfig::drafter, drafter.h)
    External,   // the client's callback (a policy written in Python, scores from a C program)
};

// Exact prefill by default where it is measured to pay: on the CPU backend in one process, a model whose
// paged (global-attention) layers are at most a quarter of its layers (sliding-window and recurrent
// hybrids) reads prompts exactly up to position 16384, any other up to 4096; returns that cap, or 0 where
// exact prefill stays off (GPU backends, RPC splits, no paged layer).  Measured: Gemma-3 270M (3 of 18
// layers paged) 1.3x the pooled prefill at 16K, multi-key retrieval at 1/16 from 0.40 to 1.00 of the full
// cache's (bench/results/prefill-exact-*-gemma3-16k); SmolLM2 (every layer paged) at 4K, 1/16, single
// needles on the corpus from 20 to 30 of 60 (full cache 26) for 1.31x the pooled prefill
// (bench/results/needle-smollm2-4k-256-corpus-reporting-exact, prefill-exact-smollm2-4k); at 8K, 1/16 it
// costs 1.72x the pooled prefill (the full cache's time: prefill-exact-smollm2-8k) and bought 10 against 8
// of 24 needles in four genres (full cache 9: needle-smollm2-8k-512-corpus-reporting-*).
int64_t auto_exact_prefill_until(const Model &model);

struct SessionConfig {
    RuntimeConfig runtime;
    Scorer scorer = Scorer::None;
    QkScoring qk;               // Scorer::Qk's settings (n_layers -1: qk_auto_layers, 0: all paged layers)
    std::shared_ptr<DrafterScorer> drafter;   // Scorer::Drafter's scorer (its own model and cache)
    int32_t tau = 64;           // decoded tokens between rescores, at least
    int32_t reeval_tokens = 64; // a prompt's tail read again after its settling rescore
    // While a prompt is read over the pool: a qk rescore after every this many pooled pieces, so the
    // next pieces attend, beside the most recent half of the pool, the chunks the latest piece's own
    // queries rank highest (0: none, the settling rescore only).  Qk scorers only (they read no token
    // list); no effect with exact prefill, whose pieces attend every position anyway.
    int32_t prefill_rescore = 0;
    // A scored session's prompt that outgrew the pool: after the settling rescore, the resident chunks
    // the pooled read computed with part of the context out of the pool are read again in place with
    // exact attention (Runtime::reread), before the tail's re-read, so the chunks decode attends hold
    // the K/V the full cache would have given them (their attention reached the whole prompt).  Costs
    // those chunks' tokens once more over the whole context; with sliding-window layers, the
    // prompt's sliding rows in host RAM while it is read and settled.  No effect with exact prefill.
    bool prefill_reread = false;
    uint64_t seed = 0;
    bool exact = false;         // exact mode: speculative rounds verified over the whole context
    int32_t exact_draft = -1;   // drafts per round (-1: adaptive)
    bool exact_prefill = false; // prompts attend the whole context (implied by exact)
    // With exact_prefill (not exact mode): prompt pieces that start at or past this position are read
    // over the pool as without it, and such a prompt is settled as a pooled one (0: no limit).  Exact
    // attention's price grows with the position; the cap keeps it near the pooled read's
    // (auto_exact_prefill_until).
    int64_t exact_prefill_until = 0;
    // continue_to re-reads the capture window after a cut whatever the scorer: a scoring session
    // (the drafter's cache) whose queries another session scores with
    bool reread_capture = false;
    // the runtime keeps chunk key summaries (qk-bound / qk-mean need them; implied by those scorers)
    bool chunk_summaries = false;
    // recorded in a snapshot for the client that loads it: the caller allowed max_ctx past the
    // model's trained context; the seed was the caller's (false: none given, seed 0 used)
    bool allow_long_ctx = false;
    bool seed_given = true;
    // Throws std::invalid_argument naming the field.
    void validate() const;
};

// Exact mode's counters, and the draft length chosen from them.  A round of k drafts keeps
// (1 - a^(k+1)) / (1 - a) tokens on average (a: the per-draft acceptance) and costs
// k * t_draft + t_fixed + (k + 1) * t_token; t_fixed and t_token come from a least-squares line
// through the recent verification passes (the first rounds alternate 2 and 8 drafts so two
// lengths are seen).  k = 0 is the full cache's own step, chosen when drafting does not pay.
struct SpecStats {
    int64_t rounds = 0, drafted = 0, kept = 0;
    double draft_ms = 0, verify_ms = 0;
    void add(const SpecRound &r);
    int32_t choose_k() const;

private:
    double a_ = 0.8, td_ = 0;
    bool have_td_ = false;
    std::deque<std::pair<int32_t, double>> passes_;   // (tokens verified, ms), the last 24
};

class Session {
public:
    // External scorer: fill out with one score per chunk (n_chunks of them) and return true, or
    // return false for "no scores this time" (nothing moves).  It may throw; the rescore is then
    // not counted and nothing moved.
    using ScoreFn = std::function<bool(int32_t n_chunks, std::vector<float> &out)>;
    // Told when the history was cut back to n tokens (0: reset), for scorers with state of their own.
    using RewindFn = std::function<void(int64_t n)>;
    using ProgressFn = std::function<void(int32_t done, int32_t total)>;

    Session(std::shared_ptr<Model> model, SessionConfig cfg);

    // ---- state (plain reads)
    const Model &model() const { return *model_; }
    std::shared_ptr<Model> model_ptr() const { return model_; }
    Runtime &runtime() { return *rt_; }
    const Runtime &runtime() const { return *rt_; }
    const SessionConfig &config() const { return cfg_; }
    const std::vector<int32_t> &tokens() const { return tokens_; }
    int64_t n_past() const { return rt_->n_past(); }
    int32_t n_chunks() const;
    bool paged() const { return !rt_->full_cache(); }
    bool scored() const { return paged() && cfg_.scorer != Scorer::None; }
    bool exact() const { return cfg_.exact && paged(); }
    bool exact_prefill() const { return (cfg_.exact_prefill || cfg_.exact) && paged(); }
    // where exact prefill stops (0: it does not; exact mode reads everything exactly)
    int64_t exact_prefill_until() const { return cfg_.exact ? 0 : cfg_.exact_prefill_until; }
    const std::vector<float> &logits() const { return logits_; }   // empty: none
    bool has_logits() const { return !logits_.empty(); }
    const std::vector<float> &last_scores() const { return last_scores_; }
    int64_t rescores() const { return rescores_; }
    int64_t since_rescore() const { return since_rescore_; }
    double rescore_ms() const { return rescore_ms_; }
    // the settle's re-reads (prefill_reread): tokens read again in place, and their time
    int64_t reread_tokens() const { return reread_tokens_; }
    double reread_ms() const { return reread_ms_; }
    const SpecStats &spec() const { return spec_; }
    int32_t n_capture() const { return rt_->config().capture_queries; }
    Sampler &sampler() { return sampler_; }
    // Sample only ids below this (0: every id): padded embedding rows no tokenizer can decode.
    int32_t sample_vocab() const { return sample_vocab_; }
    void set_sample_vocab(int32_t n);
    int32_t sampled_vocab() const;

    // The policy's name: "lru", qk's ("qk", "qk-bound", "qk-mean") or the external policy's spec's.
    std::string policy_name() const;
    ChunkSummaries *summaries() { return summaries_.get(); }
    const ChunkSummaries *summaries() const { return summaries_.get(); }
    std::shared_ptr<ChunkSummaries> summaries_ptr() const { return summaries_; }

    void set_scorer(ScoreFn f) { score_fn_ = std::move(f); }
    // The client's policy as a snapshot records it (and names it), whatever scores it: a JSON object
    // {"name": ...} with at most one more field, its settings ({"custom": true}: not saved; "drafter",
    // "qk": checked as the core's); session_file.h checks it.  "" : the core's own scorer's (lru, qk).
    void set_policy_spec(const std::string &json);
    const std::string &policy_spec() const { return policy_spec_; }
    void set_rewind_hook(RewindFn f) { rewind_fn_ = std::move(f); }
    // Change the schedule's settings (a restored snapshot keeps this session's own).
    void set_schedule(int32_t tau, int32_t reeval_tokens);
    // Everything in c but c.runtime (the runtime stays as built): scorer, schedule, exact mode.
    // std::invalid_argument when the runtime captures fewer queries than the scorer reads.
    void configure(const SessionConfig &c);
    // After a prompt's eval that did not go through prefill (a restored prefill shared across
    // policies): the settling rescore and re-read prefill does (n: the prompt's length).
    void settle_prompt(int32_t n);

    // ---- the verbs
    // Appends a prompt at n_past and settles it (a scored session whose prompt outgrew the pool
    // rescores and reads its tail again).  All or nothing.  Returns the tokens added.
    int32_t prefill(const int32_t *ids, int32_t n, const ProgressFn &progress = {});
    // The history becomes ids: the longest common prefix is kept (at least one token is read
    // again, for fresh logits; a scored session re-reads enough of the kept prefix to refill its
    // capture window), the rest cut, the new part prefilled.  Returns the tokens reused.
    // fresh_logits=false: ids equal to the history, with logits kept (or a scoring session, which
    // needs none), are left as they are: nothing read again.
    int64_t continue_to(const int32_t *ids, int32_t n, const ProgressFn &progress = {}, bool fresh_logits = true);
    // Rewinds to the first n tokens (0: reset) and reads the last kept ones again, so decoding
    // continues from fresh logits with a whole capture window.  std::invalid_argument when the
    // sliding-window ring no longer reaches that far back (nothing changed then).
    void truncate(int64_t n);
    void reset();
    // The token sampled from the last logits.
    int32_t sample(const SamplerParams &p);
    // Decoding: tok (sampled, not yet evaluated) enters the history; returns the token after it.
    // Rescores when the schedule says.  Exact mode: a round drafts ahead, and the kept drafts are
    // handed out by the next calls before another round; budget is how many tokens the caller
    // may still take (drafts past it are not made), stop_ids end a round's drafting.
    int32_t advance(int32_t tok, const SamplerParams &p, int64_t budget = INT64_MAX,
                    const std::vector<int32_t> &stop_ids = {});
    // At a generation's end: exact-mode drafts the caller did not take leave the cache (the last
    // logits become the verified row after the last taken token).  No-op otherwise.
    void settle();
    // Asks the scorer for chunk scores now and repages the pool; returns chunks moved.  keep_recent:
    // the chunks holding the last keep_recent positions stay resident whatever they score (a prompt's
    // pieces keep their local context while the rest of the pool is chosen).
    int32_t rescore(int64_t keep_recent = 0);
    // Scores handed in (one per chunk, up to n_chunks(), no NaN): repages the pool.
    int32_t reselect(const float *scores, int32_t n);
    // Reads the history's [pos0, pos0 + n) again in place with exact attention (Runtime::reread; its
    // errors).  The settle's repair; the tests and the bench call it directly.
    void reread(int64_t pos0, int32_t n);
    // What prefill_reread does after a settling rescore: the resident chunks in [from, until) written
    // by pooled pieces, read again in runs of consecutive chunks; a run reread refuses (a sliding
    // window the history lacks) is left as it is.  Returns the tokens read again.
    int64_t reread_resident(int64_t from, int64_t until);

    // ---- low-level evaluation (the bench, tests, exact mode's round, a scoring runtime): the
    // history follows the cache through each of them.
    void eval(const int32_t *ids, int32_t n, bool all_logits, float *out, const EvalOptions &opt = {});
    int32_t eval_sample(const int32_t *ids, int32_t n, const SamplerParams &p);
    SpecRound spec_round(int32_t tok, int32_t k, const SamplerParams &p, const std::vector<int32_t> &stop_ids);
    const std::vector<float> &round_logits() const { return round_logits_; }
    void truncate_cache(int64_t n);   // the cache alone cut to n (no re-read); logits dropped

    // ---- snapshots (the file: snapshot.h; the session's JSON in it: session_file.h)
    // Writes the whole session to path, atomically.
    void save(const std::string &path) const;
    // Replaces this session's context with the file's: SnapshotError naming what does not fit (the
    // geometry, the model file, the policy) or what is wrong with the file, and then nothing changed.
    // The session's own schedule settings stay.  max_bytes > 0: a cap of the caller's on the file.
    // where: how errors name the file ("snapshot PATH" when empty).
    void restore(const std::string &path, uint64_t max_bytes = 0, const std::string &where = "");
    // The JSON the snapshot's session state section holds for this session now.
    std::string app_json() const;
    void restore_state(std::vector<int32_t> tokens, std::vector<float> logits, int64_t since_rescore,
                       int64_t rescores, std::vector<float> last_scores);

private:
    int32_t prefill_(const int32_t *ids, int32_t n, const ProgressFn &progress);
    void maybe_rescore();
    void rewind_to(int64_t n, std::vector<float> logits, int64_t since, const std::vector<float> *queries,
                   int32_t n_queries);
    void truncate_(int64_t n);
    void reset_();
    void told_rewind();
    int32_t round(int32_t tok, const SamplerParams &p, int64_t budget, const std::vector<int32_t> &stop_ids);
    void eval_logits(const int32_t *ids, int32_t n, bool exact);

    std::shared_ptr<Model> model_;
    SessionConfig cfg_;
    std::unique_ptr<Runtime> rt_;
    std::shared_ptr<ChunkSummaries> summaries_;
    std::string policy_spec_;          // the external policy's spec (JSON), for snapshots
    Sampler sampler_;
    int32_t sample_vocab_ = 0;
    std::vector<int32_t> tokens_;
    std::vector<float> logits_;        // after the last evaluated token (empty: none)
    std::vector<float> round_logits_;  // the last round's verified rows [accepted][n_vocab]
    std::vector<float> last_scores_;   // the chunk scores of the last rescore
    int64_t since_rescore_ = 0, rescores_ = 0;
    double rescore_ms_ = 0;
    int64_t reread_tokens_ = 0;
    double reread_ms_ = 0;
    ScoreFn score_fn_;
    RewindFn rewind_fn_;
    // exact mode: drafts the last round kept that advance() has not handed out yet
    std::deque<int32_t> ahead_;
    int64_t round_base_ = 0;
    int32_t round_next_ = -1;
    SpecStats spec_;
};

}  // namespace kvflash
