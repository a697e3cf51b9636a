// Session snapshots (snapshot.h): Runtime.save_snapshot, Snapshot.read / check / apply.
#include <stdexcept>

#include "bindings.h"
#include "kvflash/session_file.h"
#include "kvflash/snapshot.h"

namespace kvflash::bindings {

namespace {

py::dict header_dict(const SnapshotHeader &h) {
    py::dict d;
    d["fingerprint"] = h.fingerprint; d["model_bytes"] = h.model_bytes;
    d["arch"] = h.arch; d["kv_type"] = h.kv_type; d["n_layer"] = h.n_layer; d["eval_layers"] = h.eval_layers;
    d["chunk_tokens"] = h.chunk_tokens; d["pool_tokens"] = h.pool_tokens; d["sink_chunks"] = h.sink_chunks;
    d["tail_window_chunks"] = h.tail_window_chunks; d["swa_tokens"] = h.swa_tokens;
    d["n_swa_layers"] = h.n_swa_layers; d["capture_queries"] = h.capture_queries; d["max_ctx"] = h.max_ctx;
    d["n_past"] = h.n_past; d["chunk_bytes"] = h.chunk_bytes; d["full_cache"] = bool(h.full_cache);
    d["summaries"] = bool(h.summaries); d["paged_layers"] = h.paged_layers;
    d["row_bytes_k"] = h.row_bytes_k; d["row_bytes_v"] = h.row_bytes_v;
    d["kvflash_version"] = h.kvflash_version; d["n_vocab"] = h.n_vocab; d["query_floats"] = h.query_floats;
    d["summary_floats"] = h.summary_floats; d["ring_bytes_k"] = h.ring_bytes_k; d["ring_bytes_v"] = h.ring_bytes_v;
    d["version"] = h.version; d["recurrent_layers"] = h.recurrent_layers; d["recurrent_floats"] = h.recurrent_floats;
    d["recurrent_checkpoints"] = h.recurrent_checkpoints;
    return d;
}

}  // namespace

void bind_snapshot(py::module_ &m, RuntimeClass &cls) {
    // A ValueError: a file that is not a snapshot, or one that does not fit the session.
    py::register_exception<SnapshotError>(m, "SnapshotError", PyExc_ValueError);
    m.attr("SNAPSHOT_VERSION") = kSnapshotVersion;
    m.attr("SNAPSHOT_MAX_APP_BYTES") = kSnapshotMaxAppBytes;
    m.def("model_fingerprint", [](py::object path) {
              const std::string p = py::str(path).cast<std::string>();
              py::gil_scoped_release nogil;
              return model_fingerprint(p);
          }, py::arg("path"),
          "64-bit fingerprint of a GGUF file: its size, every byte before the tensor data (header, metadata, the "
          "whole tensor table) and 4 KiB at the start, middle and end of each tensor's data.");

    m.attr("SESSION_LAYOUT") = kSessionLayout;
    // The whole session through the core (session_file.h): what Session.save / restore / load call.
    cls.def("save", [](PyRuntime &r, py::object path) {
            InUse use(&r.busy);
            const std::string p = py::str(path).cast<std::string>();
            py::gil_scoped_release nogil;
            r.session->save(p);
        }, py::arg("path"),
        "Write the whole session (the cache, the history, the logits, the sampler and the session's JSON: settings, "
        "policy, schedule state) to path, atomically.")
        .def("restore", [](PyRuntime &r, py::object path, uint64_t max_bytes, const std::string &where) {
            InUse use(&r.busy);
            const std::string p = py::str(path).cast<std::string>();
            py::gil_scoped_release nogil;
            r.session->restore(p, max_bytes, where);
        }, py::arg("path"), py::kw_only(), py::arg("max_bytes") = 0, py::arg("where") = "",
        "Replace the session's context with a snapshot's; SnapshotError naming what does not fit, and nothing changed.")
        .def("set_policy_spec", [](PyRuntime &r, const std::string &spec) {
            InUse use(&r.busy);
            r.session->set_policy_spec(spec);
        }, py::arg("spec"), "The external policy's spec (JSON) a snapshot records ('' : none).")
        .def_property_readonly("policy_name", [](PyRuntime &r) { return r.session->policy_name(); })
        .def("app_json", [](PyRuntime &r) {
            InUse use(&r.busy);
            return r.session->app_json();
        }, "The session's JSON a snapshot taken now would hold.");

    cls.def("save_snapshot", [](PyRuntime &r, py::object path, py::array tokens, py::object logits, py::bytes app) {
            InUse use(&r.busy);
            SnapshotSession s;
            auto t = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(tokens);
            if (!t || t.ndim() != 1) throw std::invalid_argument("save_snapshot: tokens must be a 1-D array of ids");
            s.tokens.assign(t.data(), t.data() + t.shape(0));
            if (!logits.is_none()) {
                auto l = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(logits);
                if (!l || l.ndim() != 1) throw std::invalid_argument("save_snapshot: logits must be a 1-D float array");
                s.logits.assign(l.data(), l.data() + l.shape(0));
            }
            s.sampler = r.session->sampler();
            s.app = std::string(app);
            const std::string p = py::str(path).cast<std::string>();
            py::gil_scoped_release nogil;
            Snapshot::save(*r.rt, r.summaries.get(), s, p);
        }, py::arg("path"), py::arg("tokens"), py::arg("logits") = py::none(), py::arg("app") = py::bytes(),
        "Write the cache's whole state, the sampler and the caller's tokens, logits and app bytes to path, "
        "atomically (a temporary file beside it, fsynced, then renamed).");

    py::class_<Snapshot, std::shared_ptr<Snapshot>>(m, "Snapshot", R"doc(
A snapshot file read into memory and checked (magic, version, section lengths and
checksums, the chunk table's invariants): Snapshot.read(path, runtime=None, max_bytes=0).
Before the file's size is allocated, its preamble, section table and header are read
and checked, each section's length is held to what the header allows, and with runtime
the header is compared with that runtime's and the file held to the largest snapshot of
its geometry; max_bytes > 0 caps the file's size as well.  Snapshot.peek(path,
runtime=None, max_bytes=0): the header and the caller's bytes alone, (header, app), with
small reads and the same checks (the header is not compared with runtime's).  check(runtime)
names the first thing that does not fit the runtime; apply(runtime) checks, then
replaces the runtime's cache and sampler with the snapshot's.  SnapshotError (a
ValueError) for every refusal, and a refusal changes nothing.
)doc")
        .def_static("read", [](py::object path, PyRuntime *r, uint64_t max_bytes) {
            const std::string p = py::str(path).cast<std::string>();
            std::unique_ptr<InUse> use;
            if (r) use = std::make_unique<InUse>(&r->busy);
            py::gil_scoped_release nogil;
            return std::make_shared<Snapshot>(Snapshot::read(p, r ? r->rt : nullptr,
                                                             r ? r->summaries.get() : nullptr, max_bytes));
        }, py::arg("path"), py::arg("runtime") = nullptr, py::arg("max_bytes") = 0)
        .def_static("peek", [](py::object path, PyRuntime *r, uint64_t max_bytes) {
            const std::string p = py::str(path).cast<std::string>();
            SnapshotPeek k;
            {
                std::unique_ptr<InUse> use;
                if (r) use = std::make_unique<InUse>(&r->busy);
                py::gil_scoped_release nogil;
                k = Snapshot::peek(p, r ? r->rt : nullptr, r ? r->summaries.get() : nullptr, max_bytes);
            }
            return py::make_tuple(header_dict(k.header), py::bytes(k.app));
        }, py::arg("path"), py::arg("runtime") = nullptr, py::arg("max_bytes") = 0)
        .def_static("max_file_bytes", [](PyRuntime &r) {
            InUse use(&r.busy);
            return Snapshot::max_file_bytes(Snapshot::header_of(*r.rt, r.summaries.get()));
        }, py::arg("runtime"), "The largest snapshot file of this runtime's geometry (Snapshot.read's cap).")
        .def_property_readonly("header", [](const Snapshot &s) { return header_dict(s.header()); })
        .def_property_readonly("tokens", [](const Snapshot &s) {
            const auto &t = s.session().tokens;
            return py::array_t<int32_t>(py::ssize_t(t.size()), t.data());
        })
        .def_property_readonly("logits", [](const Snapshot &s) -> py::object {
            const auto &l = s.session().logits;
            if (l.empty()) return py::none();
            return py::array_t<float>(py::ssize_t(l.size()), l.data());
        })
        .def_property_readonly("app", [](const Snapshot &s) { return py::bytes(s.session().app); })
        .def_static("peek_session", [](py::object path, PyRuntime *r, uint64_t max_bytes, const std::string &where) {
            const std::string p = py::str(path).cast<std::string>();
            SnapshotPeek pk;
            {
                py::gil_scoped_release nogil;
                pk = Snapshot::peek(p, r ? r->rt : nullptr, r ? r->summaries.get() : nullptr, max_bytes);
            }
            const SessionApp app = parse_session_app(pk.app, pk.header, where.empty() ? "snapshot " + p : where);
            return py::make_tuple(header_dict(pk.header), app.doc.dump());
        }, py::arg("path"), py::arg("runtime") = nullptr, py::arg("max_bytes") = 0, py::arg("where") = "",
        "(header, session JSON) of a snapshot from small reads, the session's JSON checked against the header "
        "(session_file.h): SnapshotError naming the first field that is wrong.")
        .def("session_app", [](const Snapshot &s, const std::string &where) {
            return parse_session_app(s.session().app, s.header(), where).doc.dump();
        }, py::arg("where"), "The snapshot's session JSON, checked against its header.")
        .def("check", [](const Snapshot &s, PyRuntime &r) {
            InUse use(&r.busy);
            s.check(*r.rt, r.summaries.get());
        }, py::arg("runtime"))
        .def("apply", [](const Snapshot &s, PyRuntime &r) {
            InUse use(&r.busy);
            {
                py::gil_scoped_release nogil;
                s.apply(*r.rt, r.summaries.get());
            }
            r.session->sampler() = s.session().sampler;
            r.session->restore_state(s.session().tokens, s.session().logits, 0, 0, {});
        }, py::arg("runtime"));
}

}  // namespace kvflash::bindings
