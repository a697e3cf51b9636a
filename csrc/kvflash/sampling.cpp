#include "kvflash/sampling.h"

#include <algorithm>
#include <cmath>
#include <locale>
#include <sstream>
#include <stdexcept>
#include <string>

namespace kvflash {

void SamplerParams::validate() const {
    if (!(temperature >= 0.f)) throw std::invalid_argument("temperature must be >= 0, got " + std::to_string(temperature));
    if (!(top_p > 0.f && top_p <= 1.f)) throw std::invalid_argument("top_p must be in (0, 1], got " + std::to_string(top_p));
    if (!(min_p >= 0.f && min_p < 1.f)) throw std::invalid_argument("min_p must be in [0, 1), got " + std::to_string(min_p));
}

// NaN breaks the candidates' ordering (std::sort needs a strict weak order: undefined
// behaviour otherwise), +inf turns the softmax into NaN, and with no finite logit
// there is nothing to choose: each is an error naming the first bad entry.
static void check_logits(const float *logits, int32_t n) {
    bool any_finite = false;
    for (int32_t i = 0; i < n; ++i) {
        const float x = logits[i];
        if (std::isnan(x) || x == INFINITY)
            throw std::invalid_argument("sample: logit " + std::to_string(i) + " is " + (std::isnan(x) ? "NaN" : "+inf") +
                                        " (the model's activations overflowed, or the logits passed in are bad)");
        any_finite = any_finite || std::isfinite(x);
    }
    if (n <= 0 || !any_finite) throw std::invalid_argument("sample: no logit is finite: nothing to sample");
}

std::string Sampler::state() const {
    std::ostringstream os;
    os.imbue(std::locale::classic());
    os << rng_;
    return os.str();
}

void Sampler::set_state(const std::string &text) {
    std::istringstream is(text);
    is.imbue(std::locale::classic());
    std::mt19937_64 r;
    is >> r;
    if (is.fail() || !(is >> std::ws).eof()) throw std::invalid_argument("sampler state: not a generator's state");
    rng_ = r;
}

double Sampler::select(const float *logits, int32_t n, const SamplerParams &p) {
    cand_.resize(n);
    for (int32_t i = 0; i < n; ++i) cand_[i] = {logits[i] / p.temperature, i};
    int32_t k = (p.top_k > 0 && p.top_k < n) ? p.top_k : n;
    auto by_logit = [](const std::pair<float, int32_t> &a, const std::pair<float, int32_t> &b) {
        return a.first != b.first ? a.first > b.first : a.second < b.second;
    };
    if (k < n) std::partial_sort(cand_.begin(), cand_.begin() + k, cand_.end(), by_logit);
    else std::sort(cand_.begin(), cand_.end(), by_logit);
    cand_.resize(k);
    const float mx = cand_[0].first;
    double sum = 0;
    for (auto &c : cand_) { c.first = std::exp(c.first - mx); sum += c.first; }
    // Nucleus: the smallest prefix whose mass reaches top_p; min_p relative to the top.
    double acc = 0;
    int32_t keep = 0;
    for (auto &c : cand_) {
        if (p.min_p > 0.f && c.first < p.min_p * cand_[0].first && keep > 0) break;
        acc += c.first / sum;
        ++keep;
        if (acc >= p.top_p) break;
    }
    cand_.resize(keep);
    double tot = 0;
    for (auto &c : cand_) tot += c.first;
    return tot;
}

static int32_t argmax(const float *logits, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; ++i)
        if (logits[i] > logits[best]) best = i;
    return best;
}

int32_t Sampler::sample(const float *logits, int32_t n, const SamplerParams &p) {
    check_logits(logits, n);
    if (p.temperature <= 0.f) return argmax(logits, n);
    const double tot = select(logits, n, p);
    std::uniform_real_distribution<double> u(0.0, tot);
    double r = u(rng_);
    for (auto &c : cand_) {
        r -= c.first;
        if (r <= 0) return c.second;
    }
    return cand_.back().second;
}

void Sampler::distribution(const float *logits, int32_t n, const SamplerParams &p,
                           std::vector<std::pair<int32_t, double>> &out) {
    check_logits(logits, n);
    out.clear();
    if (p.temperature <= 0.f) {
        out.push_back({argmax(logits, n), 1.0});
        return;
    }
    const double tot = select(logits, n, p);
    for (auto &c : cand_) out.push_back({c.second, c.first / tot});
    std::sort(out.begin(), out.end());
}

int32_t Sampler::draw(const std::vector<std::pair<int32_t, double>> &weights) {
    double tot = 0;
    for (auto &w : weights) tot += w.second;
    std::uniform_real_distribution<double> u(0.0, tot);
    double r = u(rng_);
    for (auto &w : weights) {
        if (w.second <= 0) continue;
        r -= w.second;
        if (r <= 0) return w.first;
    }
    for (auto it = weights.rbegin(); it != weights.rend(); ++it)   // rounding left r above 0
        if (it->second > 0) return it->first;
    return weights.back().first;
}

double Sampler::uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }

}  // namespace kvflash
