#include "kvflash/chunk_scores.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvflash/model.h"

namespace kvflash {

void chunk_peaks(const double *x, int64_t n, const int32_t *chunk_of, int32_t n_chunks, int32_t spread,
                 float *out) {
    if (spread < 0) throw std::invalid_argument("spread must be >= 0, got " + std::to_string(spread));
    const double ninf = -std::numeric_limits<double>::infinity();
    std::vector<double> best(static_cast<size_t>(std::max(n_chunks, 0)), ninf);
    for (int64_t i = 0; i < n; ++i) {
        const int32_t c = chunk_of[i];
        if (c < 0) continue;   // a token of no chunk: it still lends its score to its neighbours
        if (c >= n_chunks)
            throw std::invalid_argument("chunk_of[" + std::to_string(i) + "] = " + std::to_string(c) +
                                        " is not below n_chunks = " + std::to_string(n_chunks));
        double v = x[i];
        for (int64_t j = std::max<int64_t>(0, i - spread); j <= std::min<int64_t>(n - 1, i + spread); ++j)
            v = std::max(v, x[j]);
        best[size_t(c)] = std::max(best[size_t(c)], v);
    }
    double lo = -ninf;
    for (double b : best)
        if (b != ninf) lo = std::min(lo, b);
    for (int32_t c = 0; c < n_chunks; ++c)
        out[c] = float(best[size_t(c)] != ninf ? best[size_t(c)] : (lo == -ninf ? 0.0 : lo - 1.0));
}

void qk_peak_scores(const Runtime &rt, const PeakScoring &p, float *out, int32_t n_chunks, int32_t n_threads) {
    if (p.n_queries < 1 || p.contrast < 0 || p.spread < 0 || p.n_layers < 0)
        throw std::invalid_argument("qk peak scoring: n_queries >= 1, contrast, spread, n_layers >= 0");
    const int32_t n_cap = rt.n_captured();
    const int64_t n = rt.n_past(), C = rt.config().chunk_tokens;
    if (n_chunks < 0 || n_chunks > (n + C - 1) / C)
        throw std::invalid_argument("qk peak scoring: n_chunks " + std::to_string(n_chunks) + " exceeds the history's");
    std::vector<float> tok(static_cast<size_t>(n));
    const int32_t first = std::max(0, n_cap - p.n_queries);
    rt.history_attention(tok.data(), n, n_threads, false, nullptr, first, n_cap - first, p.n_layers);
    std::vector<double> x(tok.begin(), tok.end());
    const int32_t b0 = n_cap - p.n_queries - p.contrast;
    if (p.contrast > 0 && b0 >= 0) {   // the baseline: the queries ending `contrast` tokens earlier
        rt.history_attention(tok.data(), n, n_threads, false, nullptr, b0, p.n_queries, p.n_layers);
        for (int64_t i = 0; i < n; ++i) x[size_t(i)] -= tok[size_t(i)];
    }
    std::vector<int32_t> chunk_of(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) chunk_of[size_t(i)] = i / C < n_chunks ? int32_t(i / C) : -1;
    chunk_peaks(x.data(), n, chunk_of.data(), n_chunks, p.spread, out);
}

}  // namespace kvflash
