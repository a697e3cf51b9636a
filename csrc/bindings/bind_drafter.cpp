// _core.Drafter: the drafter scorer (csrc/kvflash/drafter.h), the drafter policy's engine.  Python's
// DrafterPolicy holds one and hands it to its session's core (Runtime.configure(scorer="drafter")),
// which scores with it on the schedule; the bridge's tokenizers are the Python Tokenizer objects.
#include <stdexcept>

#include "bindings.h"
#include "kvflash/drafter.h"

namespace kvflash::bindings {

namespace {

// A kvflash.Tokenizer as the bridge's vocabulary: bytes_of(ids, skip_special=True), encode(text,
// add_special=True) and the token list, called with the GIL taken (rescores run with it released).
class PyVocab final : public DrafterVocab {
public:
    explicit PyVocab(py::object tok) : tok_(std::move(tok)) {}
    ~PyVocab() override {
        py::gil_scoped_acquire gil;
        tok_ = py::object();
    }
    std::string bytes_of(const int32_t *ids, size_t n, std::vector<int64_t> &ends) const override {
        py::gil_scoped_acquire gil;
        py::array_t<int32_t> a(static_cast<py::ssize_t>(n), ids);
        py::tuple got = tok_.attr("bytes_of")(a, py::arg("skip_special") = true);
        auto e = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(got[1]);
        if (!e || e.ndim() != 1 || size_t(e.shape(0)) != n)
            throw std::invalid_argument("the tokenizer's bytes_of gave no end offset per token");
        ends.assign(e.data(), e.data() + n);
        return std::string(got[0].cast<py::bytes>());
    }
    std::vector<int32_t> encode(const std::string &text) const override {
        py::gil_scoped_acquire gil;
        // as the drafter reads it: the history's bytes as text, invalid UTF-8 replaced
        py::object s = py::bytes(text).attr("decode")("utf-8", "replace");
        return tok_.attr("encode")(s, py::arg("add_special") = true, py::arg("parse_special") = false)
            .cast<std::vector<int32_t>>();
    }
    bool same_as(const DrafterVocab &other) const override {
        const auto *o = dynamic_cast<const PyVocab *>(&other);
        if (!o) return false;
        py::gil_scoped_acquire gil;
        return tok_.attr("n_vocab").equal(o->tok_.attr("n_vocab")) && tok_.attr("tokens").equal(o->tok_.attr("tokens"));
    }

private:
    py::object tok_;
};

template <class T> T opt(const py::object &v, T none) { return v.is_none() ? none : v.cast<T>(); }

}  // namespace

DrafterSettings settings_of(int32_t n_queries, int32_t smooth_width, const std::string &kv_type, const py::object &layers,
                            const py::object &pool, const std::string &aggregate, const py::object &contrast,
                            const py::object &spread) {
    DrafterSettings s;
    s.n_queries = n_queries;
    s.smooth_width = smooth_width;
    s.kv_type = kv_type;
    s.layers = opt<int32_t>(layers, 0);
    s.pool = opt<int32_t>(pool, 0);
    s.aggregate = aggregate;
    s.contrast = opt<int32_t>(contrast, -1);
    s.spread = opt<int32_t>(spread, -1);
    return s;
}

py::dict settings_dict(const DrafterSettings &s) {
    py::dict o;
    o["n_queries"] = s.n_queries; o["smooth_width"] = s.smooth_width; o["kv_type"] = s.kv_type;
    o["layers"] = s.layers > 0 ? py::object(py::int_(s.layers)) : py::object(py::none());
    o["pool"] = s.pool > 0 ? py::object(py::int_(s.pool)) : py::object(py::none());
    o["aggregate"] = s.aggregate; o["contrast"] = s.contrast; o["spread"] = s.spread;
    return o;
}

void bind_drafter(py::module_ &m) {
    m.def("drafter_settings", [](int32_t n_queries, int32_t smooth_width, const std::string &kv_type, py::object layers,
                                 py::object pool, const std::string &aggregate, py::object contrast, py::object spread) {
              DrafterSettings s = settings_of(n_queries, smooth_width, kv_type, layers, pool, aggregate, contrast, spread);
              s.resolve();
              return settings_dict(s);
          }, py::kw_only(), py::arg("n_queries") = 16, py::arg("smooth_width") = 5, py::arg("kv_type") = "q8_0",
          py::arg("layers") = py::none(), py::arg("pool") = 1024, py::arg("aggregate") = "max",
          py::arg("contrast") = py::none(), py::arg("spread") = py::none(),
          "The drafter's settings checked and resolved as the core takes them (ValueError naming a bad one).");
    py::class_<DrafterScorer, std::shared_ptr<DrafterScorer>>(m, "Drafter", R"doc(
The drafter scorer (csrc/kvflash/drafter.h): a second model's own scoring session over the target's
history, scoring the target's chunks by the attention its tail pays them.  Drafter(model, target_max_ctx,
n_threads, n_queries=16, smooth_width=5, kv_type="q8_0", layers=None, pool=1024, aggregate="max",
contrast=None, spread=None, target_vocab=None, drafter_vocab=None): the vocabularies (kvflash.Tokenizer
objects, both or neither) bridge a drafter whose tokenizer is not the target's.  Given to a Runtime with
configure(scorer="drafter", drafter=...); the drafter's runtime is built at the first score (or load()).
)doc")
        .def(py::init([](std::shared_ptr<Model> model, int64_t target_max_ctx, int32_t n_threads, int32_t n_queries,
                         int32_t smooth_width, const std::string &kv_type, py::object layers, py::object pool,
                         const std::string &aggregate, py::object contrast, py::object spread, py::object target_vocab,
                         py::object drafter_vocab) {
                 const DrafterSettings s =
                     settings_of(n_queries, smooth_width, kv_type, layers, pool, aggregate, contrast, spread);
                 std::shared_ptr<const DrafterVocab> tv, dv;
                 if (!target_vocab.is_none()) tv = std::make_shared<PyVocab>(target_vocab);
                 if (!drafter_vocab.is_none()) dv = std::make_shared<PyVocab>(drafter_vocab);
                 auto d = std::make_shared<DrafterScorer>(model, s, target_max_ctx, n_threads, tv, dv);
                 d->set_interrupt([] {   // Ctrl-C between the pieces of the drafter's evals
                     py::gil_scoped_acquire gil;
                     return PyErr_CheckSignals() != 0;
                 });
                 return d;
             }), py::arg("model"), py::arg("target_max_ctx"), py::arg("n_threads") = 0, py::kw_only(),
             py::arg("n_queries") = 16, py::arg("smooth_width") = 5, py::arg("kv_type") = "q8_0",
             py::arg("layers") = py::none(), py::arg("pool") = 1024, py::arg("aggregate") = "max",
             py::arg("contrast") = py::none(), py::arg("spread") = py::none(), py::arg("target_vocab") = py::none(),
             py::arg("drafter_vocab") = py::none())
        .def_property_readonly("bridged", &DrafterScorer::bridged)
        .def_property_readonly("loaded", &DrafterScorer::loaded)
        .def_property_readonly("layers_used", [](const DrafterScorer &d) -> py::object {
            return d.loaded() ? py::int_(d.layers_used()) : py::object(py::none());
        })
        .def_property_readonly("fed_tokens_total", &DrafterScorer::fed_tokens_total)
        .def_property_readonly("settings", [](const DrafterScorer &d) { return settings_dict(d.settings()); })
        .def_property_readonly("eval_layers", &DrafterScorer::eval_layers)
        .def("load", [](DrafterScorer &d) {
            py::gil_scoped_release nogil;
            d.load();
        }, "Build the drafter's runtime now (otherwise at the first score).")
        .def("runtime", [](DrafterScorer &d) -> py::object {
            if (!d.loaded()) return py::none();
            auto r = std::make_shared<PyRuntime>();
            r->session = d.session_ptr();
            r->model = r->session->model_ptr();
            r->rt = &r->session->runtime();
            r->summaries = r->session->summaries_ptr();
            return py::cast(r);
        }, "The drafter's own runtime (a view of its scoring session; None before it is loaded).")
        .def("score", [](DrafterScorer &d, py::array tokens, int32_t n_chunks, int32_t chunk_tokens) {
            if (n_chunks < 0 || chunk_tokens < 1) throw std::invalid_argument("score: n_chunks >= 0, chunk_tokens >= 1");
            const std::vector<int32_t> ids = token_copy(tokens);
            if (int64_t(ids.size()) > int64_t(n_chunks) * chunk_tokens)
                throw std::invalid_argument("score: more tokens than n_chunks chunks hold");
            std::vector<float> out;
            try {
                py::gil_scoped_release nogil;
                d.score(ids.data(), int64_t(ids.size()), n_chunks, chunk_tokens, out);
            } catch (const EvalInterrupted &) {   // the interrupt hook set KeyboardInterrupt
                throw py::error_already_set();
            }
            return py::array_t<float>(py::ssize_t(out.size()), out.data());
        }, py::arg("tokens"), py::arg("n_chunks"), py::arg("chunk_tokens"),
        "Feed the drafter up to tokens (the target's history) and score its n_chunks chunks.")
        .def("set_interrupt", [](DrafterScorer &d, py::object fn) {
            if (fn.is_none()) {
                d.set_interrupt([] {
                    py::gil_scoped_acquire gil;
                    return PyErr_CheckSignals() != 0;
                });
                return;
            }
            if (!PyCallable_Check(fn.ptr())) throw std::invalid_argument("set_interrupt: a callable() -> bool, or None");
            d.set_interrupt([fn] {
                py::gil_scoped_acquire gil;
                if (PyErr_CheckSignals() != 0) return true;
                if (!fn().cast<bool>()) return false;
                PyErr_SetNone(PyExc_KeyboardInterrupt);   // the eval stops as at a Ctrl-C
                return true;
            });
        }, py::arg("fn"),
        "fn() is asked between the pieces of the drafter's evals (with Ctrl-C, which is always checked); True stops "
        "the eval as a Ctrl-C does (KeyboardInterrupt; the eval and the rescore around it are undone).  None: Ctrl-C "
        "alone.")
        .def("rewind", [](DrafterScorer &d, int64_t n) {
            py::gil_scoped_release nogil;
            d.rewind(n);
        }, py::arg("n_tokens"))
        .def("reset", [](DrafterScorer &d) { d.reset(); });
}

}  // namespace kvflash::bindings
