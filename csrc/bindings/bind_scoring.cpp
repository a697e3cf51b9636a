// The scoring kernels (scoring.h) as Runtime methods: the policies' reads of the cache.
#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "bindings.h"

namespace kvflash::bindings {

void bind_scoring(RuntimeClass &cls) {
    cls
        .def("chunk_keys", [](PyRuntime &r, int32_t c, int32_t layer) {
                 InUse use(&r.busy);
                 if (c < 0 || c >= r.rt->pager().n_chunks()) throw std::out_of_range("chunk out of range");
                 const int32_t C = r.rt->config().chunk_tokens, E = r.model->hparams().n_embd_k();
                 py::array_t<float> out({py::ssize_t(C), py::ssize_t(E)});
                 r.rt->chunk_keys(c, layer, out.mutable_data());
                 return out;
             }, py::arg("chunk"), py::arg("paged_layer"),
             "Post-RoPE keys of a resident chunk for one paged layer, f32 [chunk_tokens, n_embd_k].")
        .def("qk_policy_scores", [](PyRuntime &r, int32_t n_chunks, py::dict qk, int32_t n_threads) {
                 InUse use(&r.busy);
                 const QkScoring q = qk_settings(qk);
                 if (r.rt->n_captured() == 0) throw std::invalid_argument("qk scoring: no query captured yet");
                 py::array_t<float> out(static_cast<py::ssize_t>(std::max(n_chunks, 0)));
                 if (n_threads <= 0) n_threads = r.model->n_threads();
                 {
                     py::gil_scoped_release nogil;
                     qk_scores(*r.rt, r.summaries.get(), q, out.mutable_data(), n_chunks, n_threads);
                 }
                 return out;
             }, py::arg("n_chunks"), py::arg("qk"), py::kw_only(), py::arg("n_threads") = 0,
             "The chunk scores the core's qk scorer gives chunks [0, n_chunks) with the qk settings (a dict: mode, "
             "aggregate, n_queries, contrast, spread, n_layers, carry, windows, smooth_width): what a session configured "
             "with scorer='qk' ranks by (scoring.h qk_scores).")
        .def("qk_scores", [](PyRuntime &r, const std::string &mode) {
                 InUse use(&r.busy);
                 QKMode m;
                 if (mode == "mean") m = QKMode::MEAN;
                 else if (mode == "bound") m = QKMode::BOUND;
                 else throw std::invalid_argument("mode must be 'mean' or 'bound', got '" + mode + "'");
                 const int32_t C = r.rt->config().chunk_tokens;
                 const int32_t n = int32_t((r.rt->n_past() + C - 1) / C);
                 if (!r.summaries) throw std::invalid_argument("qk_scores: the runtime keeps no chunk summaries");
                 py::array_t<float> out(n);
                 r.summaries->qk_scores(*r.rt, m, out.mutable_data(), n);
                 return out;
             }, py::arg("mode") = "bound",
             "Per-chunk scores of the sealed chunks' key summaries against the last query (needs chunk_summaries=True).")
        .def("attention_scores", [](PyRuntime &r) {
                 InUse use(&r.busy);
                 py::array_t<float> out(py::ssize_t(r.rt->n_past()));
                 {
                     py::gil_scoped_release nogil;
                     attention_scores(*r.rt, out.mutable_data(), r.rt->n_past());
                 }
                 return out;
             }, "Per position: attention paid by the captured queries (mean over them), max over heads and layers.")
        .def("history_attention", [](PyRuntime &r, int32_t n_threads, bool per_chunk, py::object groups_obj,
                                     int32_t q_first, int32_t q_count, int32_t n_layers, bool on_device) {
                 InUse use(&r.busy);
                 const int64_t C = r.rt->config().chunk_tokens;
                 int64_t n = per_chunk ? (r.rt->n_past() + C - 1) / C : r.rt->n_past();
                 py::array_t<int32_t, py::array::c_style | py::array::forcecast> groups;
                 if (!groups_obj.is_none()) {
                     groups = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(groups_obj);
                     if (!groups || groups.ndim() != 1 || groups.shape(0) != r.rt->n_past())
                         throw std::invalid_argument("history_attention: groups must be a 1-D integer array of "
                                                     "n_past (" + std::to_string(r.rt->n_past()) + ") entries");
                     int32_t mx = -1;
                     for (py::ssize_t i = 0; i < groups.shape(0); ++i) mx = std::max(mx, groups.data()[i]);
                     n = int64_t(mx) + 1;
                 }
                 py::array_t<float> out(static_cast<py::ssize_t>(n));
                 if (n_threads <= 0) n_threads = r.model->n_threads();
                 {
                     py::gil_scoped_release nogil;
                     history_attention(*r.rt, out.mutable_data(), n, n_threads, per_chunk,
                                       groups_obj.is_none() ? nullptr : groups.data(), q_first, q_count, n_layers,
                                       on_device);
                 }
                 return out;
             }, py::arg("n_threads") = 0, py::arg("per_chunk") = false, py::arg("groups") = py::none(),
             py::arg("q_first") = 0, py::arg("q_count") = -1, py::arg("n_layers") = 0, py::arg("on_device") = true,
             "Like attention_scores, over the whole history: paged-out keys are read from the host store.  "
             "per_chunk=True: one score per chunk, the attention mass it receives per layer and head "
             "(summed over its positions), max over heads and layers.  groups (int array, one entry per position, "
             "negative: none) does the same for arbitrary groups; the result has max(groups) + 1 entries.  q_first, "
             "q_count: only those captured queries (capture order, oldest first; q_count -1: the rest).  n_layers > 0: "
             "only the first n_layers paged layers (0: all).  A GPU runtime scores its pool's resident keys on its device "
             "(stock ggml ops, buffers reserved at the first call; device_scoring says what), the host-store rows here; "
             "on_device=False reads the resident keys back and scores them here (per_chunk and groups always do).")
        .def_property_readonly("device_scoring", [](PyRuntime &r) {
                 InUse use(&r.busy);
                 const DeviceScoringInfo i = device_scoring_info(*r.rt);
                 py::dict d;
                 d["bytes"] = i.bytes;
                 d["slots"] = i.slots;
                 d["queries"] = i.queries;
                 d["unusable"] = i.unusable;
                 return d;
             }, "A GPU runtime's history scoring on its device: {'bytes': device bytes reserved (0: none yet, or the "
                "device cannot score), 'slots', 'queries': what they were reserved for, 'unusable': why the device "
                "cannot score ('' when it can)}.")
        .def_property_readonly("n_paged_layers", [](PyRuntime &r) { return r.rt->pool().n_layers(); },
                               "Layers whose K/V the pool holds (gemma3: its global layers only).")
        .def("qk_peak_scores", [](PyRuntime &r, int32_t n_chunks, int32_t n_queries, int32_t contrast, int32_t spread,
                                  int32_t n_layers, int32_t n_threads, int32_t carry, int32_t windows) {
                 InUse use(&r.busy);
                 if (r.rt->n_captured() == 0) throw std::invalid_argument("qk_peak_scores: no query captured yet");
                 const PeakScoring p{n_queries, contrast, spread, n_layers, carry, windows};
                 py::array_t<float> out(static_cast<py::ssize_t>(std::max(n_chunks, 0)));
                 if (n_threads <= 0) n_threads = r.model->n_threads();
                 {
                     py::gil_scoped_release nogil;
                     qk_peak_scores(*r.rt, p, out.mutable_data(), n_chunks, n_threads);
                 }
                 return out;
             }, py::arg("n_chunks"), py::kw_only(), py::arg("n_queries") = PeakScoring{}.n_queries,
             py::arg("contrast") = PeakScoring{}.contrast, py::arg("spread") = PeakScoring{}.spread,
             py::arg("n_layers") = 0, py::arg("n_threads") = 0, py::arg("carry") = PeakScoring{}.carry,
             py::arg("windows") = PeakScoring{}.windows,
             "The qk policy's peak scores of chunks [0, n_chunks) (scoring.h): per token the attention of the last "
             "n_queries captured queries over the first n_layers paged layers (0: all), minus the baseline of the "
             "n_queries ending `contrast` tokens earlier, spread (and carry), then each chunk's peak token; windows > 1: "
             "that many windows of n_queries, a chunk ranked by its best rank in any (scoring.h).")
        .def_property_readonly("n_captured", [](PyRuntime &r) { return r.rt->n_captured(); },
                               "How many queries are captured now (the last ones evaluated, up to capture_queries).")
        .def("captured_queries", [](PyRuntime &r) {
                 InUse use(&r.busy);
                 const Hparams &h = r.model->hparams();
                 const int32_t nc = r.rt->n_captured();
                 const auto &q = r.rt->captured_queries();
                 const py::ssize_t L = nc ? py::ssize_t(q.size() / (size_t(nc) * h.n_head * h.head_dim_k)) : 0;
                 return py::array_t<float>({L, py::ssize_t(nc), py::ssize_t(h.n_head), py::ssize_t(h.head_dim_k)}, q.data());
             }, "Post-RoPE queries of the last eval's final tokens: [n_paged_layers, n_captured, n_head, head_dim].")
        .def("set_captured_queries", [](PyRuntime &r, py::array q) {
                 InUse use(&r.busy);
                 auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(q);
                 const Hparams &h = r.model->hparams();
                 // an empty window (no query captured) comes as [0, 0, n_head, head_dim]
                 if (!a || a.ndim() != 4 || (a.shape(1) > 0 && a.shape(0) != r.rt->captured_layers()) ||
                     a.shape(2) != h.n_head || a.shape(3) != h.head_dim_k)
                     throw std::invalid_argument("set_captured_queries: a float32 array [n_paged_layers=" +
                                                 std::to_string(r.rt->captured_layers()) + ", k, n_head=" +
                                                 std::to_string(h.n_head) + ", head_dim=" +
                                                 std::to_string(h.head_dim_k) + "], as captured_queries() gives");
                 const int64_t k = a.shape(1);
                 if (k > int64_t(INT32_MAX)) throw std::invalid_argument("set_captured_queries: too many queries");
                 r.rt->set_captured(std::vector<float>(a.data(), a.data() + a.size()), int32_t(k));
             }, py::arg("queries"),
             "Put back a capture window (what captured_queries() gave at this n_past, before a later eval was "
             "truncated away): the queries of positions n_past - k .. n_past - 1.");
}

}  // namespace kvflash::bindings
