// The core session's verbs on kvflash._core.Runtime (csrc/kvflash/session.h): what
// kvflash.Session calls instead of keeping the logic in Python.
#include <stdexcept>

#include "bindings.h"

namespace kvflash::bindings {

namespace {

// Calls a Python callable from a core callback, the GIL taken.  A Python error already pending
// (a Ctrl-C the interrupt hook saw, on its way out) is set aside for the call and put back.  The
// runtime's InUse flag is lent to the callback (a policy reads the runtime it scores: the
// pager's table, the scoring kernels) and taken back after; the Python Session's own lock still
// keeps other threads out.
template <class F> void call_python(std::atomic<bool> *busy, F f) {
    py::gil_scoped_acquire gil;
    const bool held = busy->exchange(false);
    struct Retake {
        std::atomic<bool> *b;
        bool held;
        ~Retake() { b->store(held); }
    } retake{busy, held};
    PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
    PyErr_Fetch(&type, &value, &tb);
    struct Restore {
        PyObject *t, *v, *b;
        ~Restore() {
            if (t) PyErr_Restore(t, v, b);
        }
    } restore{type, value, tb};
    f();
}

py::array_t<float> logits_array(const Session &s) {
    const std::vector<float> &l = s.logits();
    return py::array_t<float>(py::ssize_t(l.size()), l.data());
}

// Runs f with the GIL released; a Ctrl-C seen between pieces comes back as KeyboardInterrupt.
template <class F> auto nogil(F f) {
    try {
        py::gil_scoped_release release;
        return f();
    } catch (const EvalInterrupted &) {
        throw py::error_already_set();
    }
}

Session::ProgressFn progress_fn(PyRuntime &r, const py::object &progress) {
    if (progress.is_none()) return {};
    if (!PyCallable_Check(progress.ptr()))
        throw std::invalid_argument("progress must be a callable (done, total, page_outs) or None");
    return [&r, progress](int32_t done, int32_t total) {
        const int64_t outs = r.rt->pager().stats().page_outs;
        py::gil_scoped_acquire gil;
        progress(done, total, outs);   // what it raises ends the call, all or nothing
    };
}

}  // namespace

QkScoring qk_settings(const py::dict &qk) {
    const py::object mode = qk.contains("mode") ? py::object(qk["mode"]) : py::object(py::str("keys"));
    const py::object agg = qk.contains("aggregate") ? py::object(qk["aggregate"]) : py::object(py::none());
    QkScoring q = QkScoring::defaults(mode.cast<std::string>(), agg.is_none() ? "" : agg.cast<std::string>());
    for (auto item : qk) {
        const std::string k = py::str(item.first);
        if (k == "mode" || k == "aggregate") continue;
        const int32_t v = item.second.cast<int32_t>();
        if (k == "n_queries") q.n_queries = v;
        else if (k == "contrast") q.contrast = v;
        else if (k == "spread") q.spread = v;
        else if (k == "n_layers") q.n_layers = v;
        else if (k == "carry") q.carry = v;
        else if (k == "windows") q.windows = v;
        else if (k == "smooth_width") q.smooth_width = v;
        else throw std::invalid_argument("qk settings are mode, aggregate, n_queries, contrast, spread, n_layers, carry, "
                                         "windows, smooth_width; got '" + k + "'");
    }
    q.validate();
    return q;
}

void bind_session(RuntimeClass &cls) {
    cls.def("configure", [](PyRuntime &r, const std::string &scorer, py::dict qk, int32_t tau, int32_t reeval_tokens,
                            bool exact, int32_t exact_draft, bool exact_prefill, bool reread_capture,
                            std::shared_ptr<DrafterScorer> drafter, py::object allow_long_ctx, py::object seed_given,
                            int32_t prefill_rescore, bool prefill_reread, int64_t exact_prefill_until) {
                 InUse use(&r.busy);
                 SessionConfig c = r.session->config();
                 if (scorer == "none") c.scorer = Scorer::None;
                 else if (scorer == "qk" || scorer == "peak") c.scorer = Scorer::Qk;
                 else if (scorer == "drafter") c.scorer = Scorer::Drafter;
                 else if (scorer == "external") c.scorer = Scorer::External;
                 else throw std::invalid_argument("scorer must be 'none', 'qk', 'drafter' or 'external', got '" + scorer +
                                                  "'");
                 c.qk = qk_settings(qk);
                 c.drafter = c.scorer == Scorer::Drafter ? drafter : nullptr;
                 c.tau = tau;
                 c.reeval_tokens = reeval_tokens;
                 c.prefill_rescore = prefill_rescore;
                 c.prefill_reread = prefill_reread;
                 c.exact = exact;
                 c.exact_draft = exact_draft;
                 c.exact_prefill = exact_prefill;
                 c.exact_prefill_until = exact_prefill_until;
                 c.reread_capture = reread_capture;
                 if (!allow_long_ctx.is_none()) c.allow_long_ctx = allow_long_ctx.cast<bool>();
                 if (!seed_given.is_none()) c.seed_given = seed_given.cast<bool>();
                 r.session->configure(c);
             }, py::kw_only(), py::arg("scorer") = "none", py::arg("qk") = py::dict(), py::arg("tau") = 64,
             py::arg("reeval_tokens") = 64, py::arg("exact") = false, py::arg("exact_draft") = -1,
             py::arg("exact_prefill") = false, py::arg("reread_capture") = false, py::arg("drafter") = nullptr,
             py::arg("allow_long_ctx") = py::none(), py::arg("seed_given") = py::none(), py::arg("prefill_rescore") = 0,
             py::arg("prefill_reread") = false, py::arg("exact_prefill_until") = 0,
             "The session's scorer ('none': lru; 'qk': qk and its variants scored in the core with the qk settings "
             "(mode, aggregate, n_queries, contrast, spread, n_layers (-1 auto, 0 all), carry, windows, smooth_width); "
             "'drafter': the _core.Drafter given as drafter; 'external': the callable given to set_scorer), its "
             "rescore schedule and exact mode (exact_prefill_until: where exact prefill stops, 0: no cap); prefill_reread: a prompt's settle reads the resident chunks its pooled "
             "pieces wrote again in place with exact attention (Session::reread_resident); reread_capture: "
             "continue_to refills the capture window after a cut whatever the scorer (a scoring runtime); allow_long_ctx, "
             "seed_given (None: as they were): what a snapshot records of the caller's choices.")
        .def("set_scorer", [](PyRuntime &r, py::object fn) {
                 InUse use(&r.busy);
                 if (fn.is_none()) {
                     r.session->set_scorer({});
                     return;
                 }
                 if (!PyCallable_Check(fn.ptr())) throw std::invalid_argument("set_scorer: a callable(n_chunks) or None");
                 std::atomic<bool> *busy = &r.busy;
                 r.session->set_scorer([fn, busy](int32_t n, std::vector<float> &out) {
                     bool have = false;
                     call_python(busy, [&] {
                         py::object got = fn(n);
                         if (got.is_none()) return;
                         auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(got);
                         if (!a || a.ndim() != 1)
                             throw std::invalid_argument("the scorer must return a 1-D float array or None");
                         out.assign(a.data(), a.data() + a.shape(0));
                         have = true;
                     });
                     return have;
                 });
             }, py::arg("fn"),
             "The external scorer: fn(n_chunks) -> one score per chunk (float array) or None (nothing moves), "
             "called with the GIL held when the schedule (or rescore()) asks.")
        .def("set_rewind_hook", [](PyRuntime &r, py::object fn) {
                 InUse use(&r.busy);
                 if (fn.is_none()) {
                     r.session->set_rewind_hook({});
                     return;
                 }
                 std::atomic<bool> *busy = &r.busy;
                 r.session->set_rewind_hook([fn, busy](int64_t n) { call_python(busy, [&] { fn(n); }); });
             }, py::arg("fn"), "fn(n_tokens): told when the history was cut back (0: reset).")
        .def_property_readonly("tokens", [](PyRuntime &r) {
            const std::vector<int32_t> &t = r.session->tokens();
            return py::array_t<int32_t>(py::ssize_t(t.size()), t.data());
        }, "the token history the cache holds (a copy)")
        .def_property_readonly("has_logits", [](PyRuntime &r) { return r.session->has_logits(); })
        .def_property_readonly("rescores", [](PyRuntime &r) { return r.session->rescores(); })
        .def_property_readonly("since_rescore", [](PyRuntime &r) { return r.session->since_rescore(); })
        .def_property_readonly("rescore_ms", [](PyRuntime &r) { return r.session->rescore_ms(); })
        .def_property_readonly("reread_tokens", [](PyRuntime &r) { return r.session->reread_tokens(); },
                               "Tokens the settles' re-reads (prefill_reread) read again in place, in all")
        .def_property_readonly("reread_ms", [](PyRuntime &r) { return r.session->reread_ms(); },
                               "The settles' re-reads' time, in all")
        .def_property_readonly("last_scores", [](PyRuntime &r) -> py::object {
            const std::vector<float> &s = r.session->last_scores();
            if (s.empty()) return py::none();
            return py::array_t<float>(py::ssize_t(s.size()), s.data());
        })
        .def_property_readonly("spec_stats", [](PyRuntime &r) {
            const SpecStats &s = r.session->spec();
            py::dict d;
            d["rounds"] = s.rounds; d["drafted"] = s.drafted; d["kept"] = s.kept;
            d["draft_ms"] = s.draft_ms; d["verify_ms"] = s.verify_ms;
            return d;
        })
        .def("prefill", [](PyRuntime &r, py::array ids, py::object progress) {
                 InUse use(&r.busy);
                 const std::vector<int32_t> t = token_copy(ids);
                 if (t.size() > size_t(INT32_MAX)) throw std::invalid_argument("prefill: too many tokens in one call");
                 const Session::ProgressFn fn = progress_fn(r, progress);
                 nogil([&] { return r.session->prefill(t.data(), int32_t(t.size()), fn); });
                 return logits_array(*r.session);
             }, py::arg("ids"), py::arg("progress") = py::none(),
             "Append a prompt and settle it (the rescore of a prompt that outgrew the pool, its tail read again); "
             "all or nothing.  Returns the last logits.")
        .def("continue_to", [](PyRuntime &r, py::array ids, py::object progress, bool fresh_logits) {
                 InUse use(&r.busy);
                 const std::vector<int32_t> t = token_copy(ids);
                 if (t.size() > size_t(INT32_MAX)) throw std::invalid_argument("continue_to: too many tokens in one call");
                 const Session::ProgressFn fn = progress_fn(r, progress);
                 return nogil([&] { return r.session->continue_to(t.data(), int32_t(t.size()), fn, fresh_logits); });
             }, py::arg("ids"), py::arg("progress") = py::none(), py::arg("fresh_logits") = true,
             "The history becomes ids: the longest common prefix kept, the rest cut, the new part prefilled.  "
             "Returns the tokens reused.  fresh_logits=False: ids equal to the history change nothing.")
        .def("settle_prompt", [](PyRuntime &r, py::array ids) {
                 InUse use(&r.busy);
                 const std::vector<int32_t> t = token_copy(ids);
                 nogil([&] { r.session->settle_prompt(int32_t(t.size())); return 0; });
             }, py::arg("ids"))
        .def("rewind", [](PyRuntime &r, int64_t n) {
                 InUse use(&r.busy);
                 nogil([&] { r.session->truncate(n); return 0; });
             }, py::arg("n_tokens"),
             "Cut the history to its first n_tokens (0: reset) and read the last kept ones again (a scored "
             "session: its capture window), so decoding continues from fresh logits.")
        .def("advance", [](PyRuntime &r, int32_t tok, float temperature, int32_t top_k, float top_p, float min_p,
                           int64_t budget, std::vector<int32_t> stop_ids) {
                 InUse use(&r.busy);
                 const SamplerParams sp = sampling(temperature, top_k, top_p, min_p);
                 return nogil([&] { return r.session->advance(tok, sp, budget, stop_ids); });
             }, py::arg("tok"), py::arg("temperature") = 0.f, py::arg("top_k") = 0, py::arg("top_p") = 1.f,
             py::arg("min_p") = 0.f, py::arg("budget") = INT64_MAX, py::arg("stop_ids") = std::vector<int32_t>{},
             "tok (sampled, not yet evaluated) enters the history; returns the token after it.  Rescores on the "
             "schedule; exact mode drafts ahead (budget: tokens the caller may still take).")
        .def("settle", [](PyRuntime &r) {
                 InUse use(&r.busy);
                 nogil([&] { r.session->settle(); return 0; });
             }, "At a generation's end: exact-mode drafts not taken leave the cache.")
        .def("rescore", [](PyRuntime &r, int64_t keep_recent) {
                 InUse use(&r.busy);
                 if (keep_recent < 0) throw std::invalid_argument("rescore: keep_recent must be >= 0");
                 return nogil([&] { return r.session->rescore(keep_recent); });
             }, py::arg("keep_recent") = 0,
             "Score the chunks now and repage the pool; returns chunks moved.  keep_recent: the chunks holding the "
             "last keep_recent positions stay resident whatever they score (prefill_rescore's rescores keep "
             "the recent half of the pool's evictable blocks).")
        .def("reread", [](PyRuntime &r, int64_t pos0, int32_t n) {
                 InUse use(&r.busy);
                 nogil([&] { r.session->reread(pos0, n); return 0; });
             }, py::arg("pos0"), py::arg("n"),
             "Read the history's positions [pos0, pos0 + n) again in place with exact attention: each token attends "
             "every position before it (resident rows and the host store's), its K/V rows overwrite its first "
             "read's.  Nothing else changes (n_past, residency, logits).  ValueError saying why where it cannot "
             "run (a chunk not resident, a GPU runtime, recurrent layers, a sliding window without its history).")
        .def("reread_resident", [](PyRuntime &r, int64_t from_pos, int64_t until) {
                 InUse use(&r.busy);
                 return nogil([&] { return r.session->reread_resident(from_pos, until); });
             }, py::arg("from_pos"), py::arg("until"),
             "The settle's repair (prefill_reread): the resident chunks in [from_pos, until) written by pooled "
             "pieces, read again in place; returns the tokens read again.")
        .def("keep_swa_history", [](PyRuntime &r, bool on) {
                 InUse use(&r.busy);
                 r.rt->keep_swa_history(on);
             }, py::arg("on"),
             "Sliding-window layers: keep every position's rows in host RAM from now on (on), or free them; what "
             "reread needs for a past position's window.  No-op without sliding layers.")
        .def_property_readonly("pooled_from", [](PyRuntime &r) { return r.rt->pooled_from(); },
             "The first position a piece read without the whole context in the pool (-1: none).")
        .def("sample_last", [](PyRuntime &r, float temperature, int32_t top_k, float top_p, float min_p) {
                 InUse use(&r.busy);
                 return r.session->sample(sampling(temperature, top_k, top_p, min_p));
             }, py::arg("temperature") = 0.f, py::arg("top_k") = 0, py::arg("top_p") = 1.f, py::arg("min_p") = 0.f,
             "Sample from the last logits with the session's sampler.")
        .def("restore_state", [](PyRuntime &r, int64_t since_rescore, int64_t rescores, py::object last_scores) {
                 InUse use(&r.busy);
                 std::vector<float> sc;
                 if (!last_scores.is_none()) {
                     auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(last_scores);
                     if (!a || a.ndim() != 1) throw std::invalid_argument("last_scores must be a 1-D float array or None");
                     sc.assign(a.data(), a.data() + a.shape(0));
                 }
                 const Session &s = *r.session;
                 r.session->restore_state(s.tokens(), s.logits(), since_rescore, rescores, std::move(sc));
             }, py::arg("since_rescore"), py::arg("rescores"), py::arg("last_scores") = py::none(),
             "The schedule's counters after a snapshot was applied (the history and logits come with it).");
}

}  // namespace kvflash::bindings
