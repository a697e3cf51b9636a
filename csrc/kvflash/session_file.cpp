#include "kvflash/session_file.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <stdexcept>

#include "kvflash/limits.h"

namespace kvflash {

using json::Value;

namespace {

constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();
constexpr int64_t kI64 = std::numeric_limits<int64_t>::max();

Value opt_int(int64_t v, bool present) { return present ? Value::integer(v) : Value::null(); }

// The qk settings as a snapshot (and Python's QKPolicy) records them.
Value qk_json(const QkScoring &q) {
    Value o = Value::object();
    o.set("mode", Value::string(q.mode));
    o.set("n_queries", Value::integer(q.n_queries));
    o.set("smooth_width", Value::integer(q.smooth_width));
    o.set("aggregate", Value::string(q.aggregate_name()));
    o.set("contrast", Value::integer(q.contrast));
    o.set("spread", Value::integer(q.spread));
    o.set("layers", q.n_layers < 0 ? Value::string("auto") : q.n_layers == 0 ? Value::null() : Value::integer(q.n_layers));
    o.set("carry", Value::integer(q.carry));
    o.set("windows", Value::integer(q.windows));
    return o;
}

// Field checks: each a predicate over the value, with the layout's ranges.
using Check = std::function<bool(const Value &)>;
struct Field {
    const char *name;
    Check ok;
    bool optional = false;   // a field later versions added: a file from before may lack it
};

Check int_in(int64_t lo, int64_t hi) {
    return [lo, hi](const Value &v) { return v.int_in(lo, hi); };
}
Check opt_in(int64_t lo, int64_t hi) {
    return [lo, hi](const Value &v) { return v.is_null() || v.int_in(lo, hi); };
}
Check one_of(std::vector<std::string> vals) {
    return [vals](const Value &v) {
        if (!v.is_string()) return false;
        for (const auto &x : vals)
            if (v.as_string() == x) return true;
        return false;
    };
}
Check short_string(size_t n) {
    return [n](const Value &v) { return v.is_string() && v.as_string().size() <= n; };
}
const Check kBool = [](const Value &v) { return v.is_bool(); };
const Check kAny = [](const Value &) { return true; };

const std::vector<Field> &config_fields() {
    static const std::vector<Field> f = {
        {"max_ctx", int_in(1, kMaxContext)}, {"kvflash", opt_in(1, kMaxContext)}, {"tau", int_in(1, kI32)},
        {"kv_type", one_of({"f16", "q8_0", "q4_0"})}, {"chunk_tokens", int_in(1, 4096)},
        {"sink_chunks", int_in(0, kI32)}, {"tail_window_chunks", int_in(0, kI32)}, {"ubatch", int_in(1, kI32)},
        {"reeval_tokens", int_in(1, kI32)},
        {"seed", [](const Value &v) { return v.is_null() || v.uint_value(nullptr); }},
        {"allow_long_ctx", kBool}, {"exact", kBool}, {"exact_draft", opt_in(0, kMaxDraft)}, {"exact_prefill", kBool},
        {"exact_prefill_until", int_in(0, kMaxContext), true},
    };
    return f;
}

const std::vector<Field> &qk_fields() {
    static const std::vector<Field> f = {
        {"mode", short_string(64)}, {"n_queries", int_in(1, 256)}, {"smooth_width", int_in(0, 4096)},
        {"aggregate", [](const Value &v) { return v.is_null() || (v.is_string() && v.as_string().size() <= 64); }},
        {"contrast", opt_in(0, kI32)}, {"spread", opt_in(0, kI32)},
        {"layers", [](const Value &v) { return v.is_null() || (v.is_string() && v.as_string() == "auto") || v.int_in(1, kI32); }},
        {"carry", opt_in(0, kI32)},
        {"windows", int_in(1, 16), true},   // added with API version 15: a file from before scored one window
    };
    return f;
}

const std::vector<Field> &drafter_fields() {
    static const std::vector<Field> f = {
        {"n_queries", int_in(1, 4096)}, {"smooth_width", int_in(0, 4096)}, {"kv_type", one_of({"f16", "q8_0", "q4_0"})},
        {"layers", opt_in(1, kI32)}, {"pool", opt_in(0, kMaxContext)}, {"aggregate", one_of({"max", "mean", "mass"})},
        {"contrast", opt_in(0, kI32)}, {"spread", opt_in(0, kI32)},
    };
    return f;
}

std::string quoted_list(const std::vector<std::string> &names) {
    std::string s;
    for (const auto &n : names) s += (s.empty() ? "" : ", ") + Value::string(n).repr();
    return s;
}

struct Checker {
    std::string where;

    [[noreturn]] void bad(const std::string &why) const {
        throw SnapshotError(where + ": its session state is malformed: " + why);
    }

    // d is an object with exactly fields' names, each passing its check.
    void fields(const Value &d, const std::vector<Field> &spec, const std::string &what) const {
        if (!d.is_object()) bad(what + " is not an object");
        std::set<std::string> want;
        for (const auto &f : spec) want.insert(f.name);
        std::vector<std::string> extra, missing;
        for (const auto &m : d.members())
            if (!want.count(m.first)) extra.push_back(m.first);
        for (const auto &f : spec)
            if (!d.find(f.name) && !f.optional) missing.push_back(f.name);
        std::sort(extra.begin(), extra.end());
        std::sort(missing.begin(), missing.end());
        if (!extra.empty()) bad(what + " has unknown field(s) " + quoted_list(extra));
        if (!missing.empty()) bad(what + " has no field(s) " + quoted_list(missing));
        for (const auto &f : spec) {
            if (!d.find(f.name)) continue;   // an optional field the file does not have
            const Value &v = *d.find(f.name);
            if (!f.ok(v)) bad(what + "." + f.name + " = " + v.repr() + " is out of range or of the wrong type");
        }
    }
};

int32_t i32(const Value &v) {
    int64_t x = 0;
    v.int_in(std::numeric_limits<int32_t>::min(), kI32, &x);
    return int32_t(x);
}

// A qk spec (checked for types and ranges) as the core's settings, by QKPolicy's rules.
QkScoring qk_from(const Value &q) {
    const std::string mode = q.find("mode")->as_string();
    if (mode != "keys" && mode != "bound" && mode != "mean")
        throw std::invalid_argument("qk mode must be one of keys, bound, mean; got " + Value::string(mode).repr());
    const Value &agg = *q.find("aggregate");
    QkScoring s = QkScoring::defaults(mode, agg.is_null() ? "" : agg.as_string());
    const bool peak = s.aggregate == QkAggregate::Peak && mode == "keys";
    auto resolve = [&](const char *k, int32_t def) {
        const Value &v = *q.find(k);
        return v.is_null() ? (peak ? def : 0) : i32(v);
    };
    s.contrast = resolve("contrast", 32);   // a file without the field: written when 32 was the default
    s.spread = resolve("spread", 4);        // likewise: 4 was the default then (8 now)
    s.carry = resolve("carry", 16);
    const Value *w = q.find("windows");
    s.windows = w && !w->is_null() ? i32(*w) : 1;
    s.smooth_width = i32(*q.find("smooth_width"));
    const Value &layers = *q.find("layers");
    if (mode == "keys") {
        s.n_queries = i32(*q.find("n_queries"));
        s.n_layers = layers.is_null() ? 0 : layers.is_string() ? -1 : i32(layers);
    } else if (!(layers.is_null() || layers.is_string())) {
        throw std::invalid_argument("qk layers works on the history attention: use mode 'keys' with it");
    }
    s.validate();
    return s;
}

}  // namespace

std::string session_app_json(const Session &s) {
    const SessionConfig &c = s.config();
    const Runtime &rt = s.runtime();
    const RuntimeConfig &r = rt.config();
    Value cfg = Value::object();
    cfg.set("max_ctx", Value::integer(r.max_ctx));
    cfg.set("kvflash", rt.full_cache() ? Value::null() : Value::integer(rt.pool().pool_tokens()));
    cfg.set("tau", Value::integer(c.tau));
    cfg.set("kv_type", Value::string(r.kv_type));
    cfg.set("chunk_tokens", Value::integer(r.chunk_tokens));
    cfg.set("sink_chunks", Value::integer(r.sink_chunks));
    cfg.set("tail_window_chunks", Value::integer(r.tail_window_chunks));
    cfg.set("ubatch", Value::integer(r.ubatch));
    cfg.set("reeval_tokens", Value::integer(c.reeval_tokens));
    cfg.set("seed", c.seed_given ? Value::uinteger(c.seed) : Value::null());
    cfg.set("allow_long_ctx", Value::boolean(c.allow_long_ctx));
    cfg.set("exact", Value::boolean(c.exact));
    cfg.set("exact_draft", opt_int(c.exact_draft, c.exact_draft >= 0));
    cfg.set("exact_prefill", Value::boolean(c.exact_prefill));
    cfg.set("exact_prefill_until", Value::integer(c.exact_prefill_until));

    Value pol = Value::object();
    if (!s.policy_spec().empty()) {   // the client's policy, as it saves itself (a scorer-less one included)
        pol = json::parse(s.policy_spec());
    } else if (c.scorer == Scorer::None) {
        pol.set("name", Value::string("lru"));
    } else if (c.scorer == Scorer::Qk) {
        pol.set("name", Value::string(c.qk.name()));
        pol.set("qk", qk_json(c.qk));
    } else if (c.scorer == Scorer::Drafter) {
        const DrafterSettings &d = c.drafter->settings();
        Value o = Value::object();
        o.set("n_queries", Value::integer(d.n_queries));
        o.set("smooth_width", Value::integer(d.smooth_width));
        o.set("kv_type", Value::string(d.kv_type));
        o.set("layers", opt_int(d.layers, d.layers > 0));
        o.set("pool", opt_int(d.pool, d.pool > 0));
        o.set("aggregate", Value::string(d.aggregate));
        o.set("contrast", Value::integer(d.contrast));
        o.set("spread", Value::integer(d.spread));
        pol.set("name", Value::string("drafter"));
        pol.set("drafter", std::move(o));
    } else {
        throw std::invalid_argument("save: the session's external policy has no spec (set_policy_spec)");
    }

    Value st = Value::object();
    st.set("since_rescore", Value::integer(s.since_rescore()));
    st.set("rescores", Value::integer(s.rescores()));
    if (s.last_scores().empty()) {
        st.set("last_scores", Value::null());
    } else {
        Value a = Value::array();
        for (float x : s.last_scores()) a.push(Value::number(double(x)));
        st.set("last_scores", std::move(a));
    }

    Value app = Value::object();
    app.set("kvflash_session", Value::integer(kSessionLayout));
    app.set("config", std::move(cfg));
    app.set("policy", std::move(pol));
    app.set("state", std::move(st));
    return app.dump();
}

std::string check_policy_spec(const std::string &spec) {
    Value v;
    try {
        v = json::parse(spec);
    } catch (const json::JsonError &e) {
        throw std::invalid_argument(std::string("policy spec: ") + e.what());
    }
    const Value *name = v.is_object() ? v.find("name") : nullptr;
    if (!name || !name->is_string() || name->as_string().empty() || name->as_string().size() > 200)
        throw std::invalid_argument("policy spec: an object with a name (1 to 200 characters)");
    // {"name"} (a registered policy with no settings), {"name", "custom": true} (not saved: the loader gives
    // the policy), {"name", "drafter": {...}} or {"name", KEY: {settings of a registered policy}}
    if (v.members().size() > 2)
        throw std::invalid_argument("policy spec: {\"name\": ...} with at most one more field (its settings)");
    if (v.members().size() == 2) {
        const auto &[key, val] = v.members()[0].first == "name" ? v.members()[1] : v.members()[0];
        if (key.empty() || key.size() > 64)
            throw std::invalid_argument("policy spec: its settings' key must be 1 to 64 characters");
        if (key == "custom" ? !(val.is_bool() && val.as_bool()) : !val.is_object())
            throw std::invalid_argument("policy spec: custom must be true, settings an object");
        if (key == "drafter" || key == "qk") {
            Checker c{"policy spec"};
            try {
                c.fields(val, key == "qk" ? qk_fields() : drafter_fields(), "policy." + key);
            } catch (const SnapshotError &e) {
                throw std::invalid_argument(e.what());
            }
        }
    }
    return v.dump();
}

SessionApp parse_session_app(const std::string &bytes, const SnapshotHeader &head, const std::string &where) {
    const std::string none = where + " holds no kvflash Session state (it was not written by Session.save)";
    SessionApp out;
    try {
        out.doc = json::parse(bytes);
    } catch (const json::JsonError &) {
        throw SnapshotError(none);
    }
    const Value &app = out.doc;
    if (!app.is_object() || !app.find("kvflash_session")) throw SnapshotError(none);
    const Value &layout = *app.find("kvflash_session");
    if (!layout.int_in(kSessionLayout, kSessionLayout))
        throw SnapshotError(where + " holds Session state of layout " + layout.repr() + "; this kvflash reads layout " +
                            std::to_string(kSessionLayout));
    Checker ck{where};
    ck.fields(app, {{"kvflash_session", kAny}, {"config", kAny}, {"policy", kAny}, {"state", kAny}}, "the session state");
    const Value &cfg = *app.find("config"), &st = *app.find("state"), &pol = *app.find("policy");
    ck.fields(cfg, config_fields(), "config");
    ck.fields(st, {{"since_rescore", int_in(0, kI64)}, {"rescores", int_in(0, kI64)},
                   {"last_scores", [](const Value &v) { return v.is_null() || v.is_array(); }}},
              "state");
    const int64_t n_chunks = (head.max_ctx + head.chunk_tokens - 1) / std::max<int64_t>(1, head.chunk_tokens);
    const Value &ls = *st.find("last_scores");
    if (ls.is_array()) {
        bool ok = int64_t(ls.items().size()) <= n_chunks;
        for (const auto &x : ls.items()) ok = ok && x.is_number() && !std::isnan(x.as_double());
        if (!ok) ck.bad("state.last_scores is not a list of at most " + std::to_string(n_chunks) + " numbers");
        for (const auto &x : ls.items()) out.last_scores.push_back(float(x.as_double()));
        out.has_last_scores = true;
    }
    st.find("since_rescore")->int_in(0, kI64, &out.since_rescore);
    st.find("rescores")->int_in(0, kI64, &out.rescores);

    const Value *name = pol.is_object() ? pol.find("name") : nullptr;
    if (!name || !name->is_string() || name->as_string().empty() || name->as_string().size() > 200)
        ck.bad("policy has no name");
    out.policy = name->as_string();
    SessionConfig &c = out.config;
    if (out.policy == "lru") {
        ck.fields(pol, {{"name", kAny}}, "policy");
        c.scorer = Scorer::None;
        out.builtin = true;
    } else if (pol.find("qk")) {
        ck.fields(pol, {{"name", kAny}, {"qk", kAny}}, "policy");
        ck.fields(*pol.find("qk"), qk_fields(), "policy.qk");
        try {
            c.qk = qk_from(*pol.find("qk"));
        } catch (const std::invalid_argument &e) {
            ck.bad(std::string("the policy's settings: ") + e.what());
        }
        if (c.qk.name() != out.policy)
            ck.bad("policy.name = " + name->repr() + " but its qk settings are " + Value::string(c.qk.name()).repr() + "'s");
        c.scorer = Scorer::Qk;
        out.builtin = true;
    } else if (pol.find("drafter")) {
        ck.fields(pol, {{"name", [](const Value &v) { return v.as_string() == "drafter"; }}, {"drafter", kAny}}, "policy");
        const Value &d = *pol.find("drafter");
        ck.fields(d, drafter_fields(), "policy.drafter");
        DrafterSettings &ds = out.drafter_settings;
        auto opt = [&](const char *k, int32_t none) { return d.find(k)->is_null() ? none : i32(*d.find(k)); };
        ds.n_queries = i32(*d.find("n_queries"));
        ds.smooth_width = i32(*d.find("smooth_width"));
        ds.kv_type = d.find("kv_type")->as_string();
        ds.layers = opt("layers", 0);
        ds.pool = opt("pool", 0);
        ds.aggregate = d.find("aggregate")->as_string();
        ds.contrast = opt("contrast", -1);
        ds.spread = opt("spread", -1);
        try {
            ds.resolve();
        } catch (const std::invalid_argument &e) {
            ck.bad(std::string("the policy's settings: ") + e.what());
        }
        out.drafter = true;
        c.scorer = Scorer::Drafter;
    } else if (pol.members().size() == 1) {   // a registered policy that saves no settings
        c.scorer = Scorer::External;
    } else {
        // a user's policy: {"name", "custom": true} or {"name", KEY: {settings}} (the client checks them
        // against what the name was registered with)
        if (pol.members().size() != 2) ck.bad("policy has fields beyond its name and its settings");
        const auto &[key, val] = pol.members()[0].first == "name" ? pol.members()[1] : pol.members()[0];
        if (key == "custom" ? !(val.is_bool() && val.as_bool()) : !(val.is_object() && key.size() <= 64))
            ck.bad("policy." + key + " = " + val.repr() + " is out of range or of the wrong type");
        c.scorer = Scorer::External;
    }

    // What builds the session must be what the cache's header says the cache is.
    auto cfg_int = [&](const char *k) {
        int64_t x = 0;
        cfg.find(k)->int_in(std::numeric_limits<int64_t>::min(), kI64, &x);
        return x;
    };
    const std::pair<const char *, int64_t> same[] = {
        {"max_ctx", head.max_ctx}, {"chunk_tokens", head.chunk_tokens}, {"sink_chunks", head.sink_chunks},
        {"tail_window_chunks", head.tail_window_chunks}};
    if (cfg.find("max_ctx")->int_in(1, kMaxContext) && cfg_int("max_ctx") != head.max_ctx)
        ck.bad("config.max_ctx = " + cfg.find("max_ctx")->repr() + " but the cache's header has " +
               std::to_string(head.max_ctx));
    if (cfg.find("kv_type")->as_string() != head.kv_type)
        ck.bad("config.kv_type = " + cfg.find("kv_type")->repr() + " but the cache's header has " +
               Value::string(head.kv_type).repr());
    for (const auto &[k, hv] : same)
        if (cfg_int(k) != hv)
            ck.bad(std::string("config.") + k + " = " + cfg.find(k)->repr() + " but the cache's header has " +
                   std::to_string(hv));
    const Value &pool = *cfg.find("kvflash");
    if (pool.is_null() != bool(head.full_cache) || (!pool.is_null() && cfg_int("kvflash") != head.pool_tokens))
        ck.bad("config.kvflash = " + pool.repr() + " but the cache's header has a " +
               (head.full_cache ? std::string("full cache") : "pool of " + std::to_string(head.pool_tokens) + " tokens"));

    RuntimeConfig &r = c.runtime;
    r.max_ctx = cfg_int("max_ctx");
    r.pool_tokens = pool.is_null() ? 0 : int32_t(cfg_int("kvflash"));
    r.kv_type = cfg.find("kv_type")->as_string();
    r.chunk_tokens = int32_t(cfg_int("chunk_tokens"));
    r.sink_chunks = int32_t(cfg_int("sink_chunks"));
    r.tail_window_chunks = int32_t(cfg_int("tail_window_chunks"));
    r.ubatch = int32_t(cfg_int("ubatch"));
    r.capture_queries = head.capture_queries;
    c.chunk_summaries = head.summaries != 0;
    c.tau = int32_t(cfg_int("tau"));
    c.reeval_tokens = int32_t(cfg_int("reeval_tokens"));
    const Value &seed = *cfg.find("seed");
    c.seed_given = !seed.is_null();
    if (c.seed_given) seed.uint_value(&c.seed);
    c.allow_long_ctx = cfg.find("allow_long_ctx")->as_bool();
    c.exact = cfg.find("exact")->as_bool();
    c.exact_prefill = cfg.find("exact_prefill")->as_bool();
    c.exact_prefill_until = cfg.find("exact_prefill_until") ? cfg_int("exact_prefill_until") : 0;
    c.exact_draft = cfg.find("exact_draft")->is_null() ? -1 : int32_t(cfg_int("exact_draft"));
    return out;
}

// ------------------------------------------------------------------ Session's snapshot verbs

std::string Session::policy_name() const {
    if (!policy_spec_.empty()) return json::parse(policy_spec_).find("name")->as_string();
    if (cfg_.scorer == Scorer::None) return "lru";
    if (cfg_.scorer == Scorer::Qk) return cfg_.qk.name();
    if (cfg_.scorer == Scorer::Drafter) return "drafter";
    return "";
}

void Session::set_policy_spec(const std::string &spec) { policy_spec_ = spec.empty() ? "" : check_policy_spec(spec); }

std::string Session::app_json() const { return session_app_json(*this); }

void Session::save(const std::string &path) const {
    SnapshotSession s;
    s.tokens = tokens_;
    s.logits = logits_;
    s.sampler = sampler_;
    s.app = app_json();
    Snapshot::save(*rt_, summaries_.get(), s, path);
}

void Session::restore(const std::string &path, uint64_t max_bytes, const std::string &where_) {
    const std::string where = where_.empty() ? "snapshot " + path : where_;
    auto fits = [&](const SessionApp &app) {
        const std::string mine = policy_name();
        if (app.policy != mine)
            throw SnapshotError("snapshot does not fit this session: the policy differs (the file has " +
                                Value::string(app.policy).repr() + ", this session " + Value::string(mine).repr() + ")");
    };
    // the header and the session state first (small reads), the file held to this session's geometry
    const SnapshotPeek peek = Snapshot::peek(path, rt_.get(), summaries_.get(), max_bytes);
    fits(parse_session_app(peek.app, peek.header, where));
    const Snapshot snap = Snapshot::read(path, rt_.get(), summaries_.get(), max_bytes);
    const SessionApp app = parse_session_app(snap.session().app, snap.header(), where);   // the file read whole
    fits(app);
    snap.apply(*rt_, summaries_.get());   // checks everything, then replaces the cache
    sampler_ = snap.session().sampler;
    restore_state(snap.session().tokens, snap.session().logits, app.since_rescore, app.rescores, app.last_scores);
    if (cfg_.scorer == Scorer::Drafter) cfg_.drafter->reset();   // it re-feeds the history at its next rescore
}

}  // namespace kvflash
