// kvflash.Pager: the pool and its chunk table, standalone or a runtime's.
#include <stdexcept>

#include "bindings.h"
#include "ggml-cpu.h"
#include "kvflash/limits.h"
#include "kvflash/rpc.h"

namespace kvflash::bindings {

namespace {

// A standalone pager over a pool on the CPU backend or a GPU's (device), for tests, benches and custom runtimes.
struct StandalonePager {
    ggml_backend_t backend = nullptr;
    std::unique_ptr<PagedCache> cache;

    StandalonePager(PagerConfig cfg, int32_t n_layers, int32_t n_embd_k, int32_t n_embd_v, const std::string &kv_type,
                    const std::vector<int32_t> &layer_ids, const std::string &host, const std::string &host_path,
                    const std::vector<std::string> &layer_endpoints = {}, const std::string &device = "cpu") {
        if (n_layers <= 0) throw std::invalid_argument("n_layers must be >= 1, got " + std::to_string(n_layers));
        if (!layer_ids.empty() && int32_t(layer_ids.size()) != n_layers)
            throw std::invalid_argument("layer_ids has " + std::to_string(layer_ids.size()) + " entries for n_layers=" +
                                        std::to_string(n_layers));
        if (n_embd_v <= 0) n_embd_v = n_embd_k;
        const ggml_type t = kv_type_from_name(kv_type);
        cfg.validate();
        std::vector<PoolLayerSpec> layers;
        for (int32_t i = 0; i < n_layers; ++i) layers.push_back({layer_ids.empty() ? i : layer_ids[i], n_embd_k, n_embd_v});
        const HostStore::Backing backing = parse_host_backing(host, host_path);
        if (!layer_endpoints.empty() && int32_t(layer_endpoints.size()) != n_layers)
            throw std::invalid_argument("layer_endpoints has " + std::to_string(layer_endpoints.size()) +
                                        " entries for n_layers=" + std::to_string(n_layers) + " ('' for a local layer)");
        std::vector<ggml_backend_buffer_type_t> bufts;
        for (const std::string &ep : layer_endpoints) bufts.push_back(ep.empty() ? nullptr : rpc_buffer_type(ep));
        const Device dev = parse_device(device);
        check_device_visible(dev, device);
        if (dev.gpu() && !layer_endpoints.empty())
            throw std::invalid_argument("layer_endpoints (RPC servers) need the pool's own layers on the CPU device, got " +
                                        device);
        backend = dev.gpu() ? ggml_backend_dev_init(ggml_device(dev), nullptr) : ggml_backend_cpu_init();
        if (!backend) throw std::runtime_error("cannot initialise the ggml backend of " + dev.name());
        try {
            cache = std::make_unique<PagedCache>(backend, layers, t, t, cfg, backing, host_path, bufts);
        } catch (...) {
            ggml_backend_free(backend);
            throw;
        }
    }
    ~StandalonePager() {
        cache.reset();
        if (backend) ggml_backend_free(backend);
    }
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
    d["max_host_bytes"] = p.config().max_host_bytes;
    return d;
}

py::array_t<float> as_scores(const Pager &p, py::object scores) {
    auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(scores);
    if (!a) throw std::invalid_argument("scores must be a 1-D array of numbers");
    if (a.ndim() != 1) throw std::invalid_argument("scores must be 1-D (one score per chunk), got " + std::to_string(a.ndim()) + "-D");
    if (a.shape(0) > p.n_chunks())
        throw std::invalid_argument("scores has " + std::to_string(a.shape(0)) + " entries; the pager has " +
                                    std::to_string(p.n_chunks()) + " chunks");
    return a;
}

// A writable uint8 view [pool_tokens, row_bytes] of one layer's K (or V) rows; keeps self alive.
py::array_t<uint8_t> pool_rows(py::object self, int32_t layer, bool v) {
    PagerRef &s = self.cast<PagerRef &>();
    InUse use(s.busy);
    if (layer < 0 || layer >= s.pool->n_layers())
        throw std::out_of_range("layer " + std::to_string(layer) + " outside [0, " + std::to_string(s.pool->n_layers()) + ")");
    if (!s.pool->layer_host_accessible(layer))
        throw std::invalid_argument("layer " + std::to_string(layer) + "'s pool rows are not in host memory (a remote "
                                    "device's): use read_rows / write_rows");
    ggml_tensor *t = v ? s.pool->v(layer) : s.pool->k(layer);
    return py::array_t<uint8_t>({t->ne[1], int64_t(t->nb[1])}, {int64_t(t->nb[1]), int64_t(1)},
                                static_cast<uint8_t *>(t->data), self);
}

}  // namespace

// Long on purpose: the methods are thin (a check, then one core call) and read best as one list.
void bind_pager(py::module_ &m) {
    py::class_<PagerRef>(m, "Pager", R"doc(
Fixed-size KV pool plus its chunk table, on the ggml CPU backend or a GPU's.

Pager(pool_tokens=..., max_ctx=..., n_layers=1, n_embd_k=64, n_embd_v=None, kv_type="q8_0",
      layer_ids=None, chunk_tokens=64, sink_chunks=1, tail_window_chunks=4, host="ram", host_path=None,
      max_host_bytes=0, layer_endpoints=None, device="cpu")

device: "cpu", or a GPU as Model takes it ("vulkan:0", "cuda:0"): the pool in the device's memory, the
host store in its pinned host buffers, page events as async copies on the device's queue
(read_rows / write_rows wait for them first).

layer_endpoints: one entry per layer, "" for a local layer or "host:port" of a ggml RPC server
(`kvflash rpc-server`) that holds that layer's slice of the pool (the same block numbering on every
device; page events move each layer's rows through tensor get/set on its device).

host="file": host_path must not exist; the file is created, unlinked at once (nothing
is left behind) and allocated on disk as it grows (a full disk is a RuntimeError).
max_host_bytes > 0 caps the host store: a page-out past it raises RuntimeError
("host store full"), and nothing changes.
)doc")
        .def(py::init([](int32_t pool_tokens, int64_t max_ctx, int32_t n_layers, int32_t n_embd_k, py::object n_embd_v,
                         const std::string &kv_type, py::object layer_ids, int32_t chunk_tokens, int32_t sink_chunks,
                         int32_t tail_window_chunks, const std::string &host, py::object host_path,
                         int64_t max_host_bytes, py::object layer_endpoints, const std::string &device,
                         bool unfenced_rows) {
                 PagerConfig cfg;
                 cfg.chunk_tokens = chunk_tokens;
                 cfg.pool_tokens = pool_tokens;
                 cfg.sink_chunks = sink_chunks;
                 cfg.tail_window_chunks = tail_window_chunks;
                 cfg.max_ctx = max_ctx;
                 cfg.max_host_bytes = max_host_bytes;
                 auto own = std::make_shared<StandalonePager>(
                     cfg, n_layers, n_embd_k, n_embd_v.is_none() ? n_embd_k : n_embd_v.cast<int32_t>(), kv_type,
                     layer_ids.is_none() ? std::vector<int32_t>() : layer_ids.cast<std::vector<int32_t>>(), host,
                     optional_path(host_path),
                     layer_endpoints.is_none() ? std::vector<std::string>()
                                               : layer_endpoints.cast<std::vector<std::string>>(), device);
                 auto ref = std::make_unique<PagerRef>();
                 ref->fenced = !unfenced_rows;
                 ref->p = own->cache->pager.get();
                 ref->pool = own->cache->pool.get();
                 ref->owner = own;
                 return ref;
             }),
             py::kw_only(), py::arg("pool_tokens"), py::arg("max_ctx"), py::arg("n_layers") = 1, py::arg("n_embd_k") = 64,
             py::arg("n_embd_v") = py::none(), py::arg("kv_type") = "q8_0", py::arg("layer_ids") = py::none(),
             py::arg("chunk_tokens") = 64, py::arg("sink_chunks") = 1, py::arg("tail_window_chunks") = 4,
             py::arg("host") = "ram", py::arg("host_path") = py::none(), py::arg("max_host_bytes") = 0,
             py::arg("layer_endpoints") = py::none(), py::arg("device") = "cpu", py::arg("_unfenced_rows") = false)
        .def_property_readonly("layer_chunk_bytes", [](PagerRef &s) {
            std::vector<size_t> b;
            for (int32_t i = 0; i < s.pool->n_layers(); ++i) b.push_back(s.pool->layer_chunk_bytes(i));
            return b;
        }, "Bytes one chunk moves per layer on a page event (K and V rows): a remote layer's share of the wire.")
        .def("fence", [](PagerRef &s) { InUse use(s.busy); s.pool->fence(); },
             "Wait until every queued page-out and page-in has completed (on the CPU they complete in place).")
        .def("read_rows", [](PagerRef &s, int32_t layer, bool v) {
            InUse use(s.busy);
            if (layer < 0 || layer >= s.pool->n_layers())
                throw std::out_of_range("layer " + std::to_string(layer) + " outside [0, " + std::to_string(s.pool->n_layers()) + ")");
            ggml_tensor *t = v ? s.pool->v(layer) : s.pool->k(layer);
            py::array_t<uint8_t> out({t->ne[1], int64_t(t->nb[1])});
            if (s.fenced) s.pool->fence();
            ggml_backend_tensor_get(t, out.mutable_data(), 0, ggml_nbytes(t));
            return out;
        }, py::arg("layer"), py::arg("v") = false,
           "A copy [pool_tokens, row_bytes] of layer's K (v=True: V) rows, read through the backend (any device).")
        .def("write_rows", [](PagerRef &s, int32_t layer, py::array_t<int64_t, py::array::c_style | py::array::forcecast> slots,
                              py::array_t<uint8_t, py::array::c_style | py::array::forcecast> rows, bool v) {
            InUse use(s.busy);
            if (layer < 0 || layer >= s.pool->n_layers())
                throw std::out_of_range("layer " + std::to_string(layer) + " outside [0, " + std::to_string(s.pool->n_layers()) + ")");
            ggml_tensor *t = v ? s.pool->v(layer) : s.pool->k(layer);
            const size_t rb = t->nb[1];
            if (slots.ndim() != 1 || rows.ndim() != 2 || rows.shape(0) != slots.shape(0) || size_t(rows.shape(1)) != rb)
                throw std::invalid_argument("write_rows: rows must be uint8 [len(slots), " + std::to_string(rb) + "]");
            if (s.fenced) s.pool->fence();
            for (py::ssize_t i = 0; i < slots.shape(0); ++i) {
                const int64_t sl = slots.at(i);
                if (sl < 0 || sl >= t->ne[1]) throw std::out_of_range("write_rows: slot " + std::to_string(sl) + " outside the pool");
                ggml_backend_tensor_set(t, rows.data(i, 0), size_t(sl) * rb, rb);
            }
        }, py::arg("layer"), py::arg("slots"), py::arg("rows"), py::arg("v") = false,
           "Write rows [len(slots), row_bytes] at pool slots of layer's K (v=True: V), through the backend (any device).")
        .def_property_readonly("pool_tokens", [](PagerRef &s) { return s.pg().config().pool_tokens; })
        .def_property_readonly("chunk_tokens", [](PagerRef &s) { return s.pg().config().chunk_tokens; })
        .def_property_readonly("max_ctx", [](PagerRef &s) { return s.pg().config().max_ctx; })
        .def_property_readonly("sink_chunks", [](PagerRef &s) { return s.pg().config().sink_chunks; })
        .def_property_readonly("tail_window_chunks", [](PagerRef &s) { return s.pg().config().tail_window_chunks; })
        .def_property_readonly("n_blocks", [](PagerRef &s) { return s.pg().n_blocks(); })
        .def_property_readonly("n_chunks", [](PagerRef &s) { return s.pg().n_chunks(); })
        .def_property_readonly("n_layers", [](PagerRef &s) { return s.pool->n_layers(); })
        .def_property_readonly("chunk_bytes", [](PagerRef &s) { return s.pool->chunk_bytes(); })
        .def_property_readonly("pool_bytes", [](PagerRef &s) { return s.pool->bytes(); })
        .def_property_readonly("head_chunk", [](PagerRef &s) { return s.pg().head_chunk(); })
        .def_property_readonly("epoch", [](PagerRef &s) { return s.pg().epoch(); })
        .def_property_readonly("stats", [](PagerRef &s) { InUse use(s.busy); return stats_dict(s.pg(), s.pool->bytes()); })
        .def("alloc_span", [](PagerRef &s, int64_t pos0, int64_t n) -> py::object {
                 InUse use(s.busy);
                 if (n <= 0) throw std::invalid_argument("n must be >= 1, got " + std::to_string(n));
                 check_span(pos0, n, s.pg().config().max_ctx, "alloc_span");
                 py::array_t<int32_t> out(n);
                 if (s.pg().alloc_span(pos0, int32_t(n), out.mutable_data()) == AllocResult::NO_ROOM) return py::none();
                 return out;
             }, py::arg("pos0"), py::arg("n"),
             "Slots for positions [pos0, pos0+n) (int32 array), evicting/recalling as needed; None if no room.")
        .def("slot_for", [](PagerRef &s, int64_t pos) -> py::object {
                 InUse use(s.busy);
                 check_span(pos, 1, s.pg().config().max_ctx, "slot_for");
                 int32_t slot = -1;
                 if (s.pg().alloc_span(pos, 1, &slot) == AllocResult::NO_ROOM) return py::none();
                 return py::int_(slot);
             }, py::arg("pos"))
        .def("slot_of", [](PagerRef &s, int64_t pos) { InUse use(s.busy); return s.pg().slot_of(pos); }, py::arg("pos"),
             "Slot of a written, resident position, or -1.")
        .def("evict", [](PagerRef &s, int64_t c) { InUse use(s.busy); check_chunk(s.pg(), c); s.pg().evict(int32_t(c)); }, py::arg("chunk"))
        .def("recall", [](PagerRef &s, int64_t c) {
                 InUse use(s.busy);
                 check_chunk(s.pg(), c);
                 return s.pg().recall(int32_t(c)) == AllocResult::OK;
             }, py::arg("chunk"), "Bring a paged-out chunk back; False if no block can be freed.")
        .def("set_scores", [](PagerRef &s, py::object scores) {
                 InUse use(s.busy);
                 auto a = as_scores(s.pg(), scores);
                 s.pg().set_scores(a.data(), int32_t(a.shape(0)));
             }, py::arg("scores"))
        .def("clear_scores", [](PagerRef &s) { InUse use(s.busy); s.pg().clear_scores(); })
        .def("reselect", [](PagerRef &s, py::object scores) {
                 InUse use(s.busy);
                 auto a = as_scores(s.pg(), scores);
                 return s.pg().reselect(a.data(), int32_t(a.shape(0)));
             }, py::arg("scores"), "Repage to the top-scoring chunks; returns chunks moved.")
        .def("truncate", [](PagerRef &s, int64_t n_past) { InUse use(s.busy); s.pg().truncate(n_past); }, py::arg("n_past"))
        .def("reset", [](PagerRef &s) { InUse use(s.busy); s.pg().reset(); })
        .def("mask", [](PagerRef &s, py::object q_positions, py::object n_kv, int32_t window) {
                 InUse use(s.busy);
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
        .def("slot_positions", [](PagerRef &s) {
                 InUse use(s.busy);
                 const auto &v = s.pg().slot_positions();
                 return py::array_t<int64_t>(py::ssize_t(v.size()), v.data());
             })
        .def("chunk_table", [](PagerRef &s) {
                 InUse use(s.busy);
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
        .def("scores", [](PagerRef &s) -> py::object {
                 InUse use(s.busy);
                 if (!s.pg().has_scores()) return py::none();
                 const auto &v = s.pg().scores();
                 return py::array_t<float>(py::ssize_t(v.size()), v.data());
             })
        .def("check_invariants", [](PagerRef &s) {
                 InUse use(s.busy);
                 try { s.pg().check_invariants(); }
                 catch (const std::logic_error &e) { throw py::value_error(e.what()); }
             }, "Raise ValueError describing the first broken invariant.")
        .def("dump", [](PagerRef &s) { InUse use(s.busy); return s.pg().dump(); })
        .def("k_rows", [](py::object self, int32_t layer) { return pool_rows(self, layer, false); }, py::arg("layer"),
             "Writable uint8 view [pool_tokens, row_bytes] of layer's K rows.")
        .def("v_rows", [](py::object self, int32_t layer) { return pool_rows(self, layer, true); }, py::arg("layer"),
             "Writable uint8 view [pool_tokens, row_bytes] of layer's V rows.")
        .def("__repr__", [](PagerRef &s) {
                 const auto &c = s.pg().config();
                 return "<kvflash.Pager pool_tokens=" + std::to_string(c.pool_tokens) + " max_ctx=" +
                        std::to_string(c.max_ctx) + " chunk_tokens=" + std::to_string(c.chunk_tokens) + ">";
             });
}

}  // namespace kvflash::bindings
