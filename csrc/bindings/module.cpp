// The only pybind11 translation unit: argument checks, then one call into the core.
// Core exceptions map to Python: invalid_argument -> ValueError, out_of_range ->
// IndexError; nothing reachable from Python input may abort the interpreter.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>

#include "ggml-cpu.h"
#include "kvflash/pool.h"

namespace py = pybind11;
using namespace kvflash;

namespace {

HostStore::Backing parse_backing(const std::string &host, const std::string &path) {
    if (host == "ram") return HostStore::Backing::RAM;
    if (host == "file" || host == "mmap") {
        if (path.empty()) throw std::invalid_argument("host='file' needs host_path= (a file to create for the store)");
        return HostStore::Backing::FILE;
    }
    throw std::invalid_argument("host must be 'ram' or 'file', got '" + host + "'");
}

// A standalone pager over a CPU-backend pool, for tests, benches and custom runtimes.
struct PyPager {
    ggml_backend_t backend = nullptr;
    std::unique_ptr<PagedCache> cache;

    PyPager(int32_t pool_tokens, int64_t max_ctx, int32_t n_layers, int32_t n_embd_k, int32_t n_embd_v,
            const std::string &kv_type, std::vector<int32_t> layer_ids, int32_t chunk_tokens, int32_t sink_chunks,
            int32_t tail_window_chunks, const std::string &host, const std::string &host_path) {
        if (n_layers <= 0) throw std::invalid_argument("n_layers must be >= 1, got " + std::to_string(n_layers));
        if (!layer_ids.empty() && int32_t(layer_ids.size()) != n_layers)
            throw std::invalid_argument("layer_ids has " + std::to_string(layer_ids.size()) + " entries for n_layers=" +
                                        std::to_string(n_layers));
        if (n_embd_v <= 0) n_embd_v = n_embd_k;
        const ggml_type t = kv_type_from_name(kv_type);
        PagerConfig cfg;
        cfg.chunk_tokens = chunk_tokens;
        cfg.pool_tokens = pool_tokens;
        cfg.sink_chunks = sink_chunks;
        cfg.tail_window_chunks = tail_window_chunks;
        cfg.max_ctx = max_ctx;
        cfg.validate();
        std::vector<PoolLayerSpec> layers;
        for (int32_t i = 0; i < n_layers; ++i) layers.push_back({layer_ids.empty() ? i : layer_ids[i], n_embd_k, n_embd_v});
        backend = ggml_backend_cpu_init();
        if (!backend) throw std::runtime_error("cannot initialise the ggml CPU backend");
        try {
            cache = std::make_unique<PagedCache>(backend, layers, t, t, cfg, parse_backing(host, host_path), host_path);
        } catch (...) {
            ggml_backend_free(backend);
            throw;
        }
    }
    ~PyPager() {
        cache.reset();
        if (backend) ggml_backend_free(backend);
    }
    Pager &pg() { return *cache->pager; }
};

void check_chunk(const Pager &p, int64_t c) {
    if (c < 0 || c >= p.n_chunks())
        throw std::out_of_range("chunk " + std::to_string(c) + " outside [0, " + std::to_string(p.n_chunks()) + ")");
}

py::dict stats_dict(const Pager &p, size_t pool_bytes) {
    const PagerStats s = p.stats();
    py::dict d;
    d["page_outs"] = s.page_outs;
    d["page_ins"] = s.page_ins;
    d["clean_skips"] = s.clean_skips;
    d["bytes_out"] = s.bytes_out;
    d["bytes_in"] = s.bytes_in;
    d["epoch"] = s.epoch;
    d["resident_chunks"] = s.resident_chunks;
    d["host_chunks"] = s.host_chunks;
    d["materialised_chunks"] = s.materialised_chunks;
    d["n_blocks"] = s.n_blocks;
    d["free_blocks"] = s.free_blocks;
    d["resident_bytes"] = pool_bytes;
    d["host_bytes"] = s.host_bytes;
    d["host_reserved_bytes"] = s.host_reserved_bytes;
    return d;
}

py::array_t<float> as_scores(const Pager &p, py::array scores) {
    auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(scores);
    if (!a) throw std::invalid_argument("scores must be a 1-D array of numbers");
    if (a.ndim() != 1) throw std::invalid_argument("scores must be 1-D (one score per chunk), got " + std::to_string(a.ndim()) + "-D");
    if (a.shape(0) > p.n_chunks())
        throw std::invalid_argument("scores has " + std::to_string(a.shape(0)) + " entries; the pager has " +
                                    std::to_string(p.n_chunks()) + " chunks");
    return a;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "kvflash native core: pager, KV pool and model runtime over ggml";
    m.attr("ggml_version") = ggml_version();
    m.attr("ggml_commit") = ggml_commit();
    m.def("min_pool_tokens", [](int32_t chunk_tokens, int32_t sink_chunks, int32_t tail_window_chunks) {
        PagerConfig c; c.chunk_tokens = chunk_tokens; c.sink_chunks = sink_chunks; c.tail_window_chunks = tail_window_chunks;
        return c.min_pool_tokens();
    }, py::arg("chunk_tokens") = 64, py::arg("sink_chunks") = 1, py::arg("tail_window_chunks") = 4);

    py::class_<PyPager>(m, "Pager", R"doc(
Fixed-size KV pool plus its chunk table, on the ggml CPU backend.

Pager(pool_tokens=..., max_ctx=..., n_layers=1, n_embd_k=64, n_embd_v=None, kv_type="q8_0",
      layer_ids=None, chunk_tokens=64, sink_chunks=1, tail_window_chunks=4, host="ram", host_path=None)
)doc")
        .def(py::init([](int32_t pool_tokens, int64_t max_ctx, int32_t n_layers, int32_t n_embd_k, py::object n_embd_v,
                         const std::string &kv_type, py::object layer_ids, int32_t chunk_tokens, int32_t sink_chunks,
                         int32_t tail_window_chunks, const std::string &host, py::object host_path) {
                 std::vector<int32_t> ids;
                 if (!layer_ids.is_none()) ids = layer_ids.cast<std::vector<int32_t>>();
                 return std::make_unique<PyPager>(pool_tokens, max_ctx, n_layers, n_embd_k,
                                                  n_embd_v.is_none() ? n_embd_k : n_embd_v.cast<int32_t>(), kv_type, ids,
                                                  chunk_tokens, sink_chunks, tail_window_chunks, host,
                                                  host_path.is_none() ? std::string() : py::str(host_path).cast<std::string>());
             }),
             py::kw_only(), py::arg("pool_tokens"), py::arg("max_ctx"), py::arg("n_layers") = 1, py::arg("n_embd_k") = 64,
             py::arg("n_embd_v") = py::none(), py::arg("kv_type") = "q8_0", py::arg("layer_ids") = py::none(),
             py::arg("chunk_tokens") = 64, py::arg("sink_chunks") = 1, py::arg("tail_window_chunks") = 4,
             py::arg("host") = "ram", py::arg("host_path") = py::none())
        .def_property_readonly("pool_tokens", [](PyPager &s) { return s.pg().config().pool_tokens; })
        .def_property_readonly("chunk_tokens", [](PyPager &s) { return s.pg().config().chunk_tokens; })
        .def_property_readonly("max_ctx", [](PyPager &s) { return s.pg().config().max_ctx; })
        .def_property_readonly("sink_chunks", [](PyPager &s) { return s.pg().config().sink_chunks; })
        .def_property_readonly("tail_window_chunks", [](PyPager &s) { return s.pg().config().tail_window_chunks; })
        .def_property_readonly("n_blocks", [](PyPager &s) { return s.pg().n_blocks(); })
        .def_property_readonly("n_chunks", [](PyPager &s) { return s.pg().n_chunks(); })
        .def_property_readonly("n_layers", [](PyPager &s) { return s.cache->pool->n_layers(); })
        .def_property_readonly("chunk_bytes", [](PyPager &s) { return s.cache->pool->chunk_bytes(); })
        .def_property_readonly("pool_bytes", [](PyPager &s) { return s.cache->pool->bytes(); })
        .def_property_readonly("head_chunk", [](PyPager &s) { return s.pg().head_chunk(); })
        .def_property_readonly("epoch", [](PyPager &s) { return s.pg().epoch(); })
        .def_property_readonly("stats", [](PyPager &s) { return stats_dict(s.pg(), s.cache->pool->bytes()); })
        .def("alloc_span", [](PyPager &s, int64_t pos0, int64_t n) -> py::object {
                 if (n <= 0) throw std::invalid_argument("n must be >= 1, got " + std::to_string(n));
                 if (pos0 < 0) throw std::out_of_range("pos0 must be >= 0, got " + std::to_string(pos0));
                 if (pos0 + n > s.pg().config().max_ctx)
                     throw std::out_of_range("positions [" + std::to_string(pos0) + ", " + std::to_string(pos0 + n) +
                                             ") go beyond max_ctx=" + std::to_string(s.pg().config().max_ctx));
                 py::array_t<int32_t> out(n);
                 if (s.pg().alloc_span(pos0, int32_t(n), out.mutable_data()) == AllocResult::NO_ROOM) return py::none();
                 return out;
             }, py::arg("pos0"), py::arg("n"),
             "Slots for positions [pos0, pos0+n) (int32 array), evicting/recalling as needed; None if no room.")
        .def("slot_for", [](PyPager &s, int64_t pos) -> py::object {
                 if (pos < 0 || pos >= s.pg().config().max_ctx)
                     throw std::out_of_range("pos " + std::to_string(pos) + " outside [0, max_ctx=" +
                                             std::to_string(s.pg().config().max_ctx) + ")");
                 int32_t slot = -1;
                 if (s.pg().alloc_span(pos, 1, &slot) == AllocResult::NO_ROOM) return py::none();
                 return py::int_(slot);
             }, py::arg("pos"))
        .def("slot_of", [](PyPager &s, int64_t pos) { return s.pg().slot_of(pos); }, py::arg("pos"),
             "Slot of a written, resident position, or -1.")
        .def("evict", [](PyPager &s, int64_t c) { check_chunk(s.pg(), c); s.pg().evict(int32_t(c)); }, py::arg("chunk"))
        .def("recall", [](PyPager &s, int64_t c) {
                 check_chunk(s.pg(), c);
                 return s.pg().recall(int32_t(c)) == AllocResult::OK;
             }, py::arg("chunk"), "Bring a paged-out chunk back; False if no block can be freed.")
        .def("set_scores", [](PyPager &s, py::array scores) {
                 auto a = as_scores(s.pg(), scores);
                 s.pg().set_scores(a.data(), int32_t(a.shape(0)));
             }, py::arg("scores"))
        .def("clear_scores", [](PyPager &s) { s.pg().clear_scores(); })
        .def("reselect", [](PyPager &s, py::array scores) {
                 auto a = as_scores(s.pg(), scores);
                 return s.pg().reselect(a.data(), int32_t(a.shape(0)));
             }, py::arg("scores"), "Repage to the top-scoring chunks; returns chunks moved.")
        .def("truncate", [](PyPager &s, int64_t n_past) { s.pg().truncate(n_past); }, py::arg("n_past"))
        .def("reset", [](PyPager &s) { s.pg().reset(); })
        .def("mask", [](PyPager &s, py::object q_positions, py::object n_kv, int32_t window) {
                 auto q = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(q_positions);
                 if (!q || q.ndim() != 1) throw std::invalid_argument("q_positions must be a 1-D array of positions");
                 for (py::ssize_t i = 0; i < q.shape(0); ++i)
                     if (q.data()[i] < 0) throw std::invalid_argument("q_positions must be >= 0");
                 const int32_t P = s.pg().config().pool_tokens;
                 const int32_t nkv = n_kv.is_none() ? P : n_kv.cast<int32_t>();
                 if (nkv < P) throw std::invalid_argument("n_kv must be >= pool_tokens (" + std::to_string(P) + ")");
                 if (window < 0) throw std::invalid_argument("window must be >= 0");
                 py::array_t<uint16_t> out({q.shape(0), py::ssize_t(nkv)});
                 s.pg().fill_mask(q.data(), int32_t(q.shape(0)), out.mutable_data(), nkv, window);
                 return out.attr("view")("float16");
             }, py::arg("q_positions"), py::arg("n_kv") = py::none(), py::arg("window") = 0,
             "F16 mask [n_q, n_kv]: 0 where the slot holds a visible position, -inf elsewhere.")
        .def("slot_positions", [](PyPager &s) {
                 const auto &v = s.pg().slot_positions();
                 return py::array_t<int64_t>(py::ssize_t(v.size()), v.data());
             })
        .def("chunk_table", [](PyPager &s) {
                 Pager &p = s.pg();
                 const int32_t n = p.n_chunks();
                 py::array_t<int32_t> block(n), host(n);
                 py::array_t<bool> dirty(n), prot(n), mat(n);
                 for (int32_t c = 0; c < n; ++c) {
                     block.mutable_data()[c] = p.block_of(c);
                     host.mutable_data()[c] = p.host_of(c);
                     dirty.mutable_data()[c] = p.is_dirty(c);
                     prot.mutable_data()[c] = p.is_materialised(c) && p.is_protected(c);
                     mat.mutable_data()[c] = p.is_materialised(c);
                 }
                 py::dict d;
                 d["block"] = block; d["host"] = host; d["dirty"] = dirty; d["protected"] = prot; d["materialised"] = mat;
                 return d;
             }, "Per-chunk arrays: block (-1 not resident), host (-1 none), dirty, protected, materialised.")
        .def("scores", [](PyPager &s) -> py::object {
                 if (!s.pg().has_scores()) return py::none();
                 const auto &v = s.pg().scores();
                 return py::array_t<float>(py::ssize_t(v.size()), v.data());
             })
        .def("check_invariants", [](PyPager &s) {
                 try { s.pg().check_invariants(); }
                 catch (const std::logic_error &e) { throw py::value_error(e.what()); }
             }, "Raise ValueError describing the first broken invariant.")
        .def("dump", [](PyPager &s) { return s.pg().dump(); })
        .def("k_rows", [](py::object self, int32_t layer) {
                 PyPager &s = self.cast<PyPager &>();
                 if (layer < 0 || layer >= s.cache->pool->n_layers())
                     throw std::out_of_range("layer " + std::to_string(layer) + " outside [0, " +
                                             std::to_string(s.cache->pool->n_layers()) + ")");
                 ggml_tensor *t = s.cache->pool->k(layer);
                 return py::array_t<uint8_t>({t->ne[1], int64_t(t->nb[1])}, {int64_t(t->nb[1]), int64_t(1)},
                                             static_cast<uint8_t *>(t->data), self);
             }, py::arg("layer"), "Writable uint8 view [pool_tokens, row_bytes] of layer's K rows.")
        .def("v_rows", [](py::object self, int32_t layer) {
                 PyPager &s = self.cast<PyPager &>();
                 if (layer < 0 || layer >= s.cache->pool->n_layers())
                     throw std::out_of_range("layer " + std::to_string(layer) + " outside [0, " +
                                             std::to_string(s.cache->pool->n_layers()) + ")");
                 ggml_tensor *t = s.cache->pool->v(layer);
                 return py::array_t<uint8_t>({t->ne[1], int64_t(t->nb[1])}, {int64_t(t->nb[1]), int64_t(1)},
                                             static_cast<uint8_t *>(t->data), self);
             }, py::arg("layer"), "Writable uint8 view [pool_tokens, row_bytes] of layer's V rows.")
        .def("__repr__", [](PyPager &s) {
                 const auto &c = s.pg().config();
                 return "<kvflash.Pager pool_tokens=" + std::to_string(c.pool_tokens) + " max_ctx=" +
                        std::to_string(c.max_ctx) + " chunk_tokens=" + std::to_string(c.chunk_tokens) + ">";
             });
}
