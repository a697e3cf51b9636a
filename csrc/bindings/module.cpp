// The only pybind11 translation unit: argument checks, then one call into the core.
// Core exceptions map to Python: invalid_argument -> ValueError, out_of_range ->
// IndexError; nothing reachable from Python input may abort the interpreter.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>

#include "ggml-cpu.h"
#include "kvflash/limits.h"
#include "kvflash/model.h"
#include "kvflash/runtime.h"
#include "kvflash/scoring.h"
#include "kvflash/pool.h"
#include "kvflash/sampling.h"

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

// A Model and one Runtime over it (a session's native state).
struct PyRuntime {
    std::shared_ptr<Model> model;
    std::unique_ptr<Runtime> rt;
    std::shared_ptr<ChunkSummaries> summaries;   // chunk_summaries=True: the qk-bound/qk-mean policies' state
    Sampler sampler;
    std::vector<float> logits;
};

// The Python Pager: either a standalone pool (owns a PyPager) or a view of a
// runtime's pager (keeps the runtime alive).  One binding serves both.
struct PagerRef {
    std::shared_ptr<void> owner;
    Pager *p = nullptr;
    KVPool *pool = nullptr;
    Pager &pg() { return *p; }
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

// What this build is: CUDA compiled in, ggml's version, the registered ggml devices
// and the CPU backend's features (the instruction sets ggml-cpu was compiled for).
py::dict build_info() {
    py::dict d;
    d["cuda"] = cuda_compiled();
    d["cuda_devices"] = cuda_device_count();
    d["ggml_version"] = ggml_version();
    d["ggml_commit"] = ggml_commit();
    py::list devices;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        py::dict e;
        e["name"] = ggml_backend_dev_name(dev);
        e["description"] = ggml_backend_dev_description(dev);
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        e["memory_free"] = free;
        e["memory_total"] = total;
        devices.append(e);
    }
    d["devices"] = devices;
    py::dict feats;
    ggml_backend_reg_t cpu = ggml_backend_cpu_reg();
    auto get_features = reinterpret_cast<ggml_backend_get_features_t>(
        cpu ? ggml_backend_reg_get_proc_address(cpu, "ggml_backend_get_features") : nullptr);
    if (get_features)
        for (const ggml_backend_feature *f = get_features(cpu); f && f->name; ++f) feats[f->name] = f->value;
    d["cpu_features"] = feats;
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

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "kvflash native core: pager, KV pool and model runtime over ggml";
    m.attr("ggml_version") = ggml_version();
    m.attr("ggml_commit") = ggml_commit();
    m.def("cuda_available", [] { return cuda_compiled() && cuda_device_count() > 0; },
          "True when this build has the CUDA backend (KVFLASH_CUDA=ON) and a CUDA device is visible.");
    m.def("build_info", &build_info,
          "Dict: cuda (compiled in), cuda_devices, ggml_version, ggml_commit, devices (ggml's registered devices "
          "with memory), cpu_features (ggml-cpu's instruction sets).");
    m.attr("MAX_CONTEXT") = kMaxContext;
    m.def("check_max_ctx", [](int64_t max_ctx) { check_max_ctx(max_ctx); }, py::arg("max_ctx"),
          "ValueError unless 1 <= max_ctx <= MAX_CONTEXT, the largest context the core addresses.");
    m.def("min_pool_tokens", [](int32_t chunk_tokens, int32_t sink_chunks, int32_t tail_window_chunks) {
        PagerConfig c; c.chunk_tokens = chunk_tokens; c.sink_chunks = sink_chunks; c.tail_window_chunks = tail_window_chunks;
        return c.min_pool_tokens();
    }, py::arg("chunk_tokens") = 64, py::arg("sink_chunks") = 1, py::arg("tail_window_chunks") = 4);
    m.def("kv_type_size", [](const std::string &kv_type) {
        const ggml_type t = kv_type_from_name(kv_type);
        return py::make_tuple(ggml_type_size(t), ggml_blck_size(t));
    }, py::arg("kv_type"), "(bytes per block, elements per block) of a KV type, from ggml's type traits.");

    py::class_<PagerRef>(m, "Pager", R"doc(
Fixed-size KV pool plus its chunk table, on the ggml CPU backend.

Pager(pool_tokens=..., max_ctx=..., n_layers=1, n_embd_k=64, n_embd_v=None, kv_type="q8_0",
      layer_ids=None, chunk_tokens=64, sink_chunks=1, tail_window_chunks=4, host="ram", host_path=None)
)doc")
        .def(py::init([](int32_t pool_tokens, int64_t max_ctx, int32_t n_layers, int32_t n_embd_k, py::object n_embd_v,
                         const std::string &kv_type, py::object layer_ids, int32_t chunk_tokens, int32_t sink_chunks,
                         int32_t tail_window_chunks, const std::string &host, py::object host_path) {
                 std::vector<int32_t> ids;
                 if (!layer_ids.is_none()) ids = layer_ids.cast<std::vector<int32_t>>();
                 auto own = std::make_shared<PyPager>(pool_tokens, max_ctx, n_layers, n_embd_k,
                                                  n_embd_v.is_none() ? n_embd_k : n_embd_v.cast<int32_t>(), kv_type, ids,
                                                  chunk_tokens, sink_chunks, tail_window_chunks, host,
                                                  host_path.is_none() ? std::string() : py::str(host_path).cast<std::string>());
                 auto ref = std::make_unique<PagerRef>();
                 ref->p = own->cache->pager.get();
                 ref->pool = own->cache->pool.get();
                 ref->owner = own;
                 return ref;
             }),
             py::kw_only(), py::arg("pool_tokens"), py::arg("max_ctx"), py::arg("n_layers") = 1, py::arg("n_embd_k") = 64,
             py::arg("n_embd_v") = py::none(), py::arg("kv_type") = "q8_0", py::arg("layer_ids") = py::none(),
             py::arg("chunk_tokens") = 64, py::arg("sink_chunks") = 1, py::arg("tail_window_chunks") = 4,
             py::arg("host") = "ram", py::arg("host_path") = py::none())
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
        .def_property_readonly("stats", [](PagerRef &s) { return stats_dict(s.pg(), s.pool->bytes()); })
        .def("alloc_span", [](PagerRef &s, int64_t pos0, int64_t n) -> py::object {
                 if (n <= 0) throw std::invalid_argument("n must be >= 1, got " + std::to_string(n));
                 check_span(pos0, n, s.pg().config().max_ctx, "alloc_span");
                 py::array_t<int32_t> out(n);
                 if (s.pg().alloc_span(pos0, int32_t(n), out.mutable_data()) == AllocResult::NO_ROOM) return py::none();
                 return out;
             }, py::arg("pos0"), py::arg("n"),
             "Slots for positions [pos0, pos0+n) (int32 array), evicting/recalling as needed; None if no room.")
        .def("slot_for", [](PagerRef &s, int64_t pos) -> py::object {
                 check_span(pos, 1, s.pg().config().max_ctx, "slot_for");
                 int32_t slot = -1;
                 if (s.pg().alloc_span(pos, 1, &slot) == AllocResult::NO_ROOM) return py::none();
                 return py::int_(slot);
             }, py::arg("pos"))
        .def("slot_of", [](PagerRef &s, int64_t pos) { return s.pg().slot_of(pos); }, py::arg("pos"),
             "Slot of a written, resident position, or -1.")
        .def("evict", [](PagerRef &s, int64_t c) { check_chunk(s.pg(), c); s.pg().evict(int32_t(c)); }, py::arg("chunk"))
        .def("recall", [](PagerRef &s, int64_t c) {
                 check_chunk(s.pg(), c);
                 return s.pg().recall(int32_t(c)) == AllocResult::OK;
             }, py::arg("chunk"), "Bring a paged-out chunk back; False if no block can be freed.")
        .def("set_scores", [](PagerRef &s, py::object scores) {
                 auto a = as_scores(s.pg(), scores);
                 s.pg().set_scores(a.data(), int32_t(a.shape(0)));
             }, py::arg("scores"))
        .def("clear_scores", [](PagerRef &s) { s.pg().clear_scores(); })
        .def("reselect", [](PagerRef &s, py::object scores) {
                 auto a = as_scores(s.pg(), scores);
                 return s.pg().reselect(a.data(), int32_t(a.shape(0)));
             }, py::arg("scores"), "Repage to the top-scoring chunks; returns chunks moved.")
        .def("truncate", [](PagerRef &s, int64_t n_past) { s.pg().truncate(n_past); }, py::arg("n_past"))
        .def("reset", [](PagerRef &s) { s.pg().reset(); })
        .def("mask", [](PagerRef &s, py::object q_positions, py::object n_kv, int32_t window) {
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
                 const auto &v = s.pg().slot_positions();
                 return py::array_t<int64_t>(py::ssize_t(v.size()), v.data());
             })
        .def("chunk_table", [](PagerRef &s) {
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
                 if (!s.pg().has_scores()) return py::none();
                 const auto &v = s.pg().scores();
                 return py::array_t<float>(py::ssize_t(v.size()), v.data());
             })
        .def("check_invariants", [](PagerRef &s) {
                 try { s.pg().check_invariants(); }
                 catch (const std::logic_error &e) { throw py::value_error(e.what()); }
             }, "Raise ValueError describing the first broken invariant.")
        .def("dump", [](PagerRef &s) { return s.pg().dump(); })
        .def("k_rows", [](py::object self, int32_t layer) {
                 PagerRef &s = self.cast<PagerRef &>();
                 if (layer < 0 || layer >= s.pool->n_layers())
                     throw std::out_of_range("layer " + std::to_string(layer) + " outside [0, " +
                                             std::to_string(s.pool->n_layers()) + ")");
                 if (!s.pool->host_accessible()) throw std::invalid_argument("the pool is not in host memory");
                 ggml_tensor *t = s.pool->k(layer);
                 return py::array_t<uint8_t>({t->ne[1], int64_t(t->nb[1])}, {int64_t(t->nb[1]), int64_t(1)},
                                             static_cast<uint8_t *>(t->data), self);
             }, py::arg("layer"), "Writable uint8 view [pool_tokens, row_bytes] of layer's K rows.")
        .def("v_rows", [](py::object self, int32_t layer) {
                 PagerRef &s = self.cast<PagerRef &>();
                 if (layer < 0 || layer >= s.pool->n_layers())
                     throw std::out_of_range("layer " + std::to_string(layer) + " outside [0, " +
                                             std::to_string(s.pool->n_layers()) + ")");
                 if (!s.pool->host_accessible()) throw std::invalid_argument("the pool is not in host memory");
                 ggml_tensor *t = s.pool->v(layer);
                 return py::array_t<uint8_t>({t->ne[1], int64_t(t->nb[1])}, {int64_t(t->nb[1]), int64_t(1)},
                                             static_cast<uint8_t *>(t->data), self);
             }, py::arg("layer"), "Writable uint8 view [pool_tokens, row_bytes] of layer's V rows.")
        .def("__repr__", [](PagerRef &s) {
                 const auto &c = s.pg().config();
                 return "<kvflash.Pager pool_tokens=" + std::to_string(c.pool_tokens) + " max_ctx=" +
                        std::to_string(c.max_ctx) + " chunk_tokens=" + std::to_string(c.chunk_tokens) + ">";
             });

    py::class_<Model, std::shared_ptr<Model>>(m, "Model", R"doc(
GGUF weights and hyper-parameters (immutable, shareable).

Model(path, n_threads=0, device="cpu"): device "cpu", "cuda" (= "cuda:0") or "cuda:N".
On CUDA the weights are uploaded to the device and every Runtime over the model
computes there (pool, sliding-window ring and graphs in device memory, paged
chunks in a pinned host slab).  ValueError for an unknown device, for CUDA in a
build without it, or for a CUDA device that is not visible.
)doc")
        .def(py::init([](py::object path, int32_t n_threads, const std::string &device) {
                 if (n_threads < 0) throw std::invalid_argument("n_threads must be >= 0 (0: all cores)");
                 std::string p = py::str(path).cast<std::string>();
                 py::gil_scoped_release nogil;
                 return Model::load(p, n_threads, device);
             }), py::arg("path"), py::arg("n_threads") = 0, py::arg("device") = "cpu")
        .def_property_readonly("path", &Model::path)
        .def_property_readonly("device", [](const Model &m) { return m.device().name(); },
                               "'cpu' or 'cuda:N'.")
        .def("device_memory", &Model::device_memory,
             "(free, total) bytes of the model's device now (ggml's device memory query; on CUDA free is what is "
             "left after the weights and everything else allocated; on the CPU ggml reports free == total).")
        .def_property_readonly("weight_bytes", &Model::weight_bytes)
        .def_property("n_threads", &Model::n_threads, [](Model &m, int32_t n) {
            if (n <= 0) throw std::invalid_argument("n_threads must be >= 1");
            m.set_n_threads(n);
        })
        .def_property_readonly("global_layers", &Model::global_layers)
        .def_property_readonly("hparams", [](const Model &m) {
            const Hparams &h = m.hparams();
            py::dict d;
            d["arch"] = h.arch;
            d["n_layer"] = h.n_layer; d["n_embd"] = h.n_embd; d["n_ff"] = h.n_ff;
            d["n_head"] = h.n_head; d["n_head_kv"] = h.n_head_kv; d["head_dim"] = h.head_dim_k;
            d["n_vocab"] = h.n_vocab; d["n_ctx_train"] = h.n_ctx_train; d["rms_eps"] = h.rms_eps;
            d["rope_base"] = h.rope_base; d["rope_base_swa"] = h.rope_base_swa; d["rope_mode"] = h.rope_mode;
            d["n_swa"] = h.n_swa; d["attn_scale"] = h.attn_scale;
            std::vector<bool> swa(h.is_swa.begin(), h.is_swa.end());
            d["is_swa"] = swa;
            return d;
        });

    py::class_<PyRuntime, std::shared_ptr<PyRuntime>>(m, "Runtime", R"doc(
Per-session native state over a Model: the paged KV pool (kvflash) or a full
cache (pool_tokens=0), plus compute graphs.  Driven by kvflash.Session.
)doc")
        .def(py::init([](std::shared_ptr<Model> model, int64_t max_ctx, int32_t pool_tokens, const std::string &kv_type,
                         int32_t chunk_tokens, int32_t sink_chunks, int32_t tail_window_chunks, int32_t ubatch,
                         const std::string &host, py::object host_path, uint64_t seed, const std::string &attn,
                         int32_t pool_attn_max_tokens, int32_t capture_queries, bool chunk_summaries,
                         int32_t prefill_piece, int32_t eval_layers) {
                 if (prefill_piece < 0) throw std::invalid_argument("prefill_piece must be >= 0 (0: chunk_tokens)");
                 if (capture_queries < 0 || capture_queries > 4096)
                     throw std::invalid_argument("capture_queries must be in [0, 4096]");
                 if (!model) throw std::invalid_argument("model is required");
                 if (pool_tokens < 0) throw std::invalid_argument("pool_tokens must be >= 0 (0: full cache)");
                 if (ubatch <= 0) throw std::invalid_argument("ubatch must be >= 1");
                 RuntimeConfig c;
                 c.max_ctx = max_ctx; c.pool_tokens = pool_tokens; c.kv_type = kv_type; c.chunk_tokens = chunk_tokens;
                 c.sink_chunks = sink_chunks; c.tail_window_chunks = tail_window_chunks; c.ubatch = ubatch;
                 c.host = host == "mmap" ? "file" : host;
                 c.attn = attn;
                 c.pool_attn_max_tokens = pool_attn_max_tokens;
                 c.capture_queries = capture_queries;
                 c.prefill_piece = prefill_piece;
                 c.eval_layers = eval_layers;
                 c.host_path = host_path.is_none() ? std::string() : py::str(host_path).cast<std::string>();
                 if (c.host == "file" && c.host_path.empty()) throw std::invalid_argument("host='file' needs host_path=");
                 auto r = std::make_shared<PyRuntime>();
                 r->model = model;
                 r->rt = std::make_unique<Runtime>(model, c);
                 if (chunk_summaries) {
                     r->summaries = std::make_shared<ChunkSummaries>();
                     r->rt->set_observer(r->summaries);
                 }
                 r->sampler.seed(seed);
                 return r;
             }), py::arg("model"), py::kw_only(), py::arg("max_ctx"), py::arg("pool_tokens") = 0,
             py::arg("kv_type") = "q8_0", py::arg("chunk_tokens") = 64, py::arg("sink_chunks") = 1,
             py::arg("tail_window_chunks") = 4, py::arg("ubatch") = 512, py::arg("host") = "ram",
             py::arg("host_path") = py::none(), py::arg("seed") = 0, py::arg("attn") = "auto",
             py::arg("pool_attn_max_tokens") = 1 << 30, py::arg("capture_queries") = 1,
             py::arg("chunk_summaries") = false, py::arg("prefill_piece") = 0, py::arg("eval_layers") = 0)
        .def_property_readonly("n_past", [](PyRuntime &r) { return r.rt->n_past(); })
        .def_property_readonly("max_ctx", [](PyRuntime &r) { return r.rt->config().max_ctx; })
        .def_property_readonly("full_cache", [](PyRuntime &r) { return r.rt->full_cache(); })
        .def_property_readonly("eval_layers", [](PyRuntime &r) { return r.rt->config().eval_layers; },
                               "0: all layers; > 0: a scoring runtime over the first eval_layers layers (no logits)")
        .def_property_readonly("pool_tokens", [](PyRuntime &r) { return r.rt->pool().pool_tokens(); })
        .def_property_readonly("pool_bytes", [](PyRuntime &r) { return r.rt->pool().bytes(); })
        .def_property_readonly("swa_bytes", [](PyRuntime &r) { return r.rt->swa_bytes(); })
        .def_property_readonly("n_vocab", [](PyRuntime &r) { return r.model->hparams().n_vocab; })
        .def_property_readonly("model", [](PyRuntime &r) { return r.model; })
        .def_property_readonly("pager", [](std::shared_ptr<PyRuntime> r) {
            PagerRef ref;
            ref.owner = r;
            ref.p = &r->rt->pager();
            ref.pool = &r->rt->pool();
            return ref;
        })
        .def("eval", [](PyRuntime &r, py::array tokens, bool all_logits) {
                 auto t = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(tokens);
                 if (!t || t.ndim() != 1 || t.shape(0) == 0)
                     throw std::invalid_argument("tokens must be a non-empty 1-D array of token ids");
                 const int32_t n = int32_t(t.shape(0)), V = r.model->hparams().n_vocab;
                 py::array_t<float> out = all_logits ? py::array_t<float>({py::ssize_t(n), py::ssize_t(V)})
                                                     : py::array_t<float>(py::ssize_t(V));
                 float *o = out.mutable_data();
                 const int32_t *tp = t.data();
                 {
                     py::gil_scoped_release nogil;
                     r.rt->eval(tp, n, all_logits, o);
                 }
                 return out;
             }, py::arg("tokens"), py::arg("all_logits") = false,
             "Append tokens at n_past; returns float32 logits [n_vocab] (last) or [n, n_vocab].")
        .def("eval_sample", [](PyRuntime &r, py::array tokens, float temperature, int32_t top_k, float top_p, float min_p) {
                 if (r.rt->config().eval_layers > 0)
                     throw std::invalid_argument("eval_sample: this runtime evaluates only its first " +
                                                 std::to_string(r.rt->config().eval_layers) +
                                                 " layers (a scoring runtime) and has no logits to sample");
                 auto t = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(tokens);
                 if (!t || t.ndim() != 1 || t.shape(0) == 0)
                     throw std::invalid_argument("tokens must be a non-empty 1-D array of token ids");
                 const int32_t n = int32_t(t.shape(0)), V = r.model->hparams().n_vocab;
                 SamplerParams sp{temperature, top_k, top_p, min_p};
                 sp.validate();
                 r.logits.resize(V);
                 const int32_t *tp = t.data();
                 int32_t tok;
                 {
                     py::gil_scoped_release nogil;
                     r.rt->eval(tp, n, false, r.logits.data());
                     tok = r.sampler.sample(r.logits.data(), V, sp);
                 }
                 return tok;
             }, py::arg("tokens"), py::arg("temperature") = 0.f, py::arg("top_k") = 0, py::arg("top_p") = 1.f,
             py::arg("min_p") = 0.f, "Append tokens and sample the next token id from the last logits.")
        .def("sample", [](PyRuntime &r, py::array logits, float temperature, int32_t top_k, float top_p, float min_p) {
                 auto l = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(logits);
                 const int32_t V = r.model->hparams().n_vocab;
                 if (!l || l.ndim() != 1 || l.shape(0) != V)
                     throw std::invalid_argument("logits must be a 1-D array of n_vocab=" + std::to_string(V) + " floats");
                 const SamplerParams sp{temperature, top_k, top_p, min_p};
                 sp.validate();
                 return r.sampler.sample(l.data(), V, sp);
             }, py::arg("logits"), py::arg("temperature") = 0.f, py::arg("top_k") = 0, py::arg("top_p") = 1.f,
             py::arg("min_p") = 0.f, "Sample a token id from a logits row with the runtime's seeded sampler.")
        .def("last_logits", [](PyRuntime &r) {
                 return py::array_t<float>(py::ssize_t(r.logits.size()), r.logits.data());
             })
        .def("seed", [](PyRuntime &r, uint64_t s) { r.sampler.seed(s); }, py::arg("seed"))
        .def("truncate", [](PyRuntime &r, int64_t n) { r.rt->truncate(n); }, py::arg("n_past"))
        .def("reset", [](PyRuntime &r) { r.rt->reset(); })
        .def("chunk_keys", [](PyRuntime &r, int32_t c, int32_t layer) {
                 if (c < 0 || c >= r.rt->pager().n_chunks()) throw std::out_of_range("chunk out of range");
                 const int32_t C = r.rt->config().chunk_tokens, E = r.model->hparams().n_embd_k();
                 py::array_t<float> out({py::ssize_t(C), py::ssize_t(E)});
                 r.rt->chunk_keys(c, layer, out.mutable_data());
                 return out;
             }, py::arg("chunk"), py::arg("paged_layer"),
             "Post-RoPE keys of a resident chunk for one paged layer, f32 [chunk_tokens, n_embd_k].")
        .def("qk_scores", [](PyRuntime &r, const std::string &mode) {
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
                 py::array_t<float> out(py::ssize_t(r.rt->n_past()));
                 {
                     py::gil_scoped_release nogil;
                     attention_scores(*r.rt, out.mutable_data(), r.rt->n_past());
                 }
                 return out;
             }, "Per position: attention paid by the captured queries (mean over them), max over heads and layers.")
        .def("history_attention", [](PyRuntime &r, int32_t n_threads, bool per_chunk, py::object groups_obj,
                                     int32_t q_first, int32_t q_count) {
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
                                             groups_obj.is_none() ? nullptr : groups.data(), q_first, q_count);
                 }
                 return out;
             }, py::arg("n_threads") = 0, py::arg("per_chunk") = false, py::arg("groups") = py::none(),
             py::arg("q_first") = 0, py::arg("q_count") = -1,
             "Like attention_scores, over the whole history: paged-out keys are read from the host store.  "
             "per_chunk=True: one score per chunk, the attention mass it receives per layer and head "
             "(summed over its positions), max over heads and layers.  groups (int array, one entry per position, "
             "negative: none) does the same for arbitrary groups; the result has max(groups) + 1 entries.  q_first, "
             "q_count: only those captured queries (capture order, oldest first; q_count -1: the rest).")
        .def_property_readonly("n_captured", [](PyRuntime &r) { return r.rt->n_captured(); },
                               "How many queries are captured now (the last ones evaluated, up to capture_queries).")
        .def("captured_queries", [](PyRuntime &r) {
                 const Hparams &h = r.model->hparams();
                 const int32_t nc = r.rt->n_captured();
                 const auto &q = r.rt->captured_queries();
                 const py::ssize_t L = nc ? py::ssize_t(q.size() / (size_t(nc) * h.n_head * h.head_dim_k)) : 0;
                 return py::array_t<float>({L, py::ssize_t(nc), py::ssize_t(h.n_head), py::ssize_t(h.head_dim_k)}, q.data());
             }, "Post-RoPE queries of the last eval's final tokens: [n_paged_layers, n_captured, n_head, head_dim].")
        .def_property_readonly("timings", [](PyRuntime &r) {
            const RuntimeStats &s = r.rt->stats();
            py::dict d;
            d["eval_calls"] = s.n_eval_calls; d["tokens"] = s.n_tokens_evaluated;
            d["graph_ms"] = s.t_graph_ms; d["compute_ms"] = s.t_compute_ms; d["mask_ms"] = s.t_mask_ms;
            return d;
        });
}
