// Exact mode: the full cache's output from a paged session, by self-speculative verification.
//
// A round drafts up to k tokens with the same model over the resident pool (cheap, approximate
// attention), takes the drafts' cache entries back, and evaluates the pending token and the drafts
// in one batch whose attention reads every position of the context (EvalOptions::exact: pool rows
// and host-store rows, bit-exact copies).  The longest prefix the full model agrees with is kept:
//   greedy       a draft stays while it is the verify pass's argmax; the first disagreement is
//                replaced by the verify pass's own token;
//   sampling     speculative rejection sampling: draft x ~ q is kept with probability
//                min(1, p(x) / q(x)); at the first rejection the token is drawn from
//                max(p - q, 0), renormalized; after k kept drafts one more comes from the last
//                verified row.  The tokens then follow the full cache's distribution p (with the
//                sampler's temperature, top-k, top-p and min-p applied to both p and q).
// The cache then holds exactly the pending token and the kept drafts, with the K/V the verify
// pass wrote for them, which is what the full cache would hold.
#pragma once

#include <cstdint>
#include <vector>

#include "kvflash/runtime.h"
#include "kvflash/sampling.h"

namespace kvflash {

struct SpecRound {
    std::vector<int32_t> accepted;   // now in the cache, in order: the pending token, then the kept drafts
    int32_t next = -1;               // the token chosen after them (pending: not evaluated)
    int32_t n_draft = 0;             // drafts made (fewer than k when one was a stop id)
    int32_t n_kept = 0;              // drafts kept
    double draft_ms = 0, verify_ms = 0;
    // The verify pass's logits, one row of n_vocab per evaluated token: row i follows accepted[i].
    std::vector<float> logits;
};

// One round from the pending token tok at rt.n_past().  Drafting stops after a draft in stop_ids
// (an end of turn: nothing after it would be used).  n_sample: ids sampled from each row (the
// tokenizer's vocabulary; <= n_vocab).  Preconditions (std::invalid_argument / out_of_range
// otherwise, nothing changed): k >= 0, rt.n_past() + k + 1 <= max_ctx, tok a valid id, params
// validated.  All or nothing: on any failure the cache is truncated back to where it was (tok not
// evaluated) and the error propagates.
SpecRound speculative_round(Runtime &rt, Sampler &sampler, int32_t tok, int32_t k, const SamplerParams &params,
                            int32_t n_sample, const std::vector<int32_t> &stop_ids);

}  // namespace kvflash
