// The session's own state inside a snapshot (the APPS section, snapshot.h): one JSON object,
// written and checked here for every client (Python's Session, the C API), so a file saved by
// one loads in the other.
//
// Layout 2 (the "kvflash_session" field), every field required (but exact_prefill_until, which files
// written before it lack: 0 then) and no other allowed:
//   config  the session's settings: max_ctx, kvflash (pool tokens, null: full cache), tau, kv_type,
//           chunk_tokens, sink_chunks, tail_window_chunks, ubatch, reeval_tokens, seed (null: none
//           given), allow_long_ctx, exact, exact_draft (null: adaptive), exact_prefill,
//           exact_prefill_until (0: no cap)
//   policy  {"name": "lru"} | {"name": "qk" | "qk-bound" | "qk-mean", "qk": {mode, n_queries,
//           smooth_width, aggregate, contrast, spread, layers, carry, windows (since API version 15; absent: 1)}} |
//           {"name": "drafter",
//           "drafter": {n_queries, smooth_width, kv_type, layers, pool, aggregate, contrast, spread}}
//           | {"name": NAME, "custom": true or {settings of a registered policy}}
//   state   since_rescore, rescores, last_scores (null or one number per chunk, at most)
// Nothing in it names a file: the model and a drafter are the loader's to give.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvflash/json.h"
#include "kvflash/session.h"
#include "kvflash/snapshot.h"

namespace kvflash {

constexpr int32_t kSessionLayout = 2;

// A snapshot's session state, checked against its header.
struct SessionApp {
    json::Value doc;        // the whole object, checked
    SessionConfig config;   // the settings and a built-in policy's scorer (runtime: geometry only)
    std::string policy;     // the policy's name
    bool builtin = false;   // lru or qk: config.scorer and config.qk say it all
    bool drafter = false;   // the drafter: drafter_settings, with the drafter model the loader's to give
    DrafterSettings drafter_settings;
    int64_t since_rescore = 0, rescores = 0;
    std::vector<float> last_scores;
    bool has_last_scores = false;
};

// The JSON of s's session state (layout 2).
std::string session_app_json(const Session &s);

// Parses and checks app (a snapshot's APPS bytes) against head.  SnapshotError "WHERE: its session
// state is malformed: WHY" (or "WHERE holds no kvflash Session state ...") naming the first field
// that is missing, unknown, of the wrong type or out of range, or disagrees with the header.
SessionApp parse_session_app(const std::string &app, const SnapshotHeader &head, const std::string &where);

// A policy spec a client hands in for an external policy (Session::set_policy_spec): std::invalid_argument
// unless it is an object of the layout's policy forms.  Returns it compacted.
std::string check_policy_spec(const std::string &spec);

}  // namespace kvflash
