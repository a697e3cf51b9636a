#include "kvflash/speculative.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

namespace kvflash {

using Dist = std::vector<std::pair<int32_t, double>>;   // ids ascending

static double prob_of(const Dist &d, int32_t id) {
    auto it = std::lower_bound(d.begin(), d.end(), std::make_pair(id, -1.0));
    return it != d.end() && it->first == id ? it->second : 0.0;
}

static double ms_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

SpecRound speculative_round(Runtime &rt, Sampler &sampler, int32_t tok, int32_t k, const SamplerParams &params,
                            int32_t n_sample, const std::vector<int32_t> &stop_ids) {
    const int32_t V = rt.model().hparams().n_vocab;
    const int64_t n0 = rt.n_past();
    if (k < 0) throw std::invalid_argument("speculative round: k must be >= 0, got " + std::to_string(k));
    if (n0 + k + 1 > rt.config().max_ctx)
        throw std::out_of_range("speculative round: " + std::to_string(k) + " drafts past position " + std::to_string(n0) +
                                " exceed max_ctx " + std::to_string(rt.config().max_ctx));
    if (k > rt.max_rewind())
        throw std::invalid_argument("speculative round: " + std::to_string(k) + " drafts cannot be taken back: the "
                                    "sliding-window ring rewinds at most " + std::to_string(rt.max_rewind()) + " tokens");
    if (tok < 0 || tok >= V) throw std::invalid_argument("speculative round: token id " + std::to_string(tok) + " outside the vocabulary");
    if (n_sample <= 0 || n_sample > V) n_sample = V;
    SpecRound r;
    std::vector<int32_t> seq{tok};   // the pending token, then the drafts
    std::vector<Dist> q;              // each draft's distribution
    std::vector<float> row(V);
    try {
        auto t0 = std::chrono::steady_clock::now();
        int32_t cur = tok;
        for (int32_t i = 0; i < k; ++i) {
            rt.eval(&cur, 1, false, row.data());
            q.emplace_back();
            sampler.distribution(row.data(), n_sample, params, q.back());
            cur = params.temperature <= 0.f ? q.back()[0].first : sampler.draw(q.back());
            seq.push_back(cur);
            if (std::find(stop_ids.begin(), stop_ids.end(), cur) != stop_ids.end()) break;
        }
        r.n_draft = int32_t(seq.size()) - 1;
        r.draft_ms = ms_since(t0);
        // The drafts' entries attended the pool only: take them back and evaluate the whole run exactly.
        rt.truncate(n0);
        t0 = std::chrono::steady_clock::now();
        r.logits.resize(seq.size() * size_t(V));
        EvalOptions opt;
        opt.exact = true;
        opt.capture_all = true;
        opt.one_row_products = true;   // the full cache decodes these one at a time
        rt.eval(seq.data(), int32_t(seq.size()), true, r.logits.data(), opt);
        r.verify_ms = ms_since(t0);
        Dist p;
        int32_t kept = 0;
        for (; kept < r.n_draft; ++kept) {
            const int32_t x = seq[kept + 1];
            sampler.distribution(&r.logits[size_t(kept) * V], n_sample, params, p);
            const double px = prob_of(p, x), qx = prob_of(q[kept], x);
            // Greedy: p and q are point masses, so this keeps x exactly when it is the argmax (no draw).
            const bool keep = px >= qx || (px > 0 && sampler.uniform() * qx < px);
            if (keep) continue;
            Dist resid;
            for (auto &e : p) {
                const double w = e.second - prob_of(q[kept], e.first);
                if (w > 0) resid.push_back({e.first, w});
            }
            // (greedy: the residual is the verify pass's argmax; no draw, as sample() makes none)
            r.next = params.temperature <= 0.f ? p[0].first : resid.empty() ? sampler.draw(p) : sampler.draw(resid);
            break;
        }
        if (kept == r.n_draft) {   // every draft kept: one more token from the last verified row
            sampler.distribution(&r.logits[size_t(kept) * V], n_sample, params, p);
            r.next = params.temperature <= 0.f ? p[0].first : sampler.draw(p);
        }
        r.n_kept = kept;
        r.accepted.assign(seq.begin(), seq.begin() + kept + 1);
        rt.truncate(n0 + kept + 1);
        rt.trim_captured();
        r.logits.resize(size_t(kept + 1) * V);
    } catch (...) {
        try {
            if (rt.n_past() > n0) rt.truncate(n0);
            rt.trim_captured();
        } catch (...) {}
        throw;
    }
    return r;
}

}  // namespace kvflash
