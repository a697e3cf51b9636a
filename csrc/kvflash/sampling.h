// Token sampling over one row of logits: greedy, or temperature + top-k + top-p
// with a seeded generator (same seed, same logits -> same token).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace kvflash {

struct SamplerParams {
    float temperature = 0.f;  // <= 0: greedy (argmax, lowest id on ties)
    int32_t top_k = 0;        // <= 0: all
    float top_p = 1.f;        // nucleus mass in (0, 1]
    float min_p = 0.f;        // drop tokens below min_p * p(max)
    // Throws std::invalid_argument naming the bad field: temperature >= 0, top_p in (0, 1],
    // min_p in [0, 1) (NaN fails each).  Every entry point checks through here.
    void validate() const;
};

class Sampler {
public:
    explicit Sampler(uint64_t seed = 0) : rng_(seed) {}
    void seed(uint64_t s) { rng_.seed(s); }
    // The generator's whole state as text (a snapshot's SAMP section), and back:
    // set_state throws std::invalid_argument for text state() did not write.
    std::string state() const;
    void set_state(const std::string &text);
    // logits: n floats.  Precondition: params validated by the caller.  Throws
    // std::invalid_argument for a NaN or +inf logit, or when none is finite.
    int32_t sample(const float *logits, int32_t n, const SamplerParams &p);
    // The distribution sample() draws from: (id, probability) pairs summing to 1, ids ascending
    // (greedy: the argmax alone, probability 1).  Same preconditions and errors as sample().
    void distribution(const float *logits, int32_t n, const SamplerParams &p, std::vector<std::pair<int32_t, double>> &out);
    // One id drawn in proportion to the weights (not all zero), from this generator.
    int32_t draw(const std::vector<std::pair<int32_t, double>> &weights);
    // A uniform number in [0, 1) from this generator.
    double uniform();

private:
    // The candidates sample() draws from, weights unnormalized, in cand_ (best first); their total.
    double select(const float *logits, int32_t n, const SamplerParams &p);
    std::mt19937_64 rng_;
    std::vector<std::pair<float, int32_t>> cand_;
};

}  // namespace kvflash
