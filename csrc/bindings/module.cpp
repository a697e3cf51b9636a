// The _core module: build facts and small helpers here; each class in its own file.
#include "bindings.h"

#include <stdexcept>

#include "ggml-cpu.h"
#include "kvflash/attn_cpu.h"
#include "kvflash/limits.h"
#include "kvflash/rpc.h"

namespace kvflash::bindings {

std::string optional_path(const py::object &path) {
    return path.is_none() ? std::string() : py::str(path).cast<std::string>();
}

py::array_t<int32_t, py::array::c_style | py::array::forcecast> token_ids(const py::array &tokens) {
    auto t = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(tokens);
    if (!t || t.ndim() != 1 || t.shape(0) == 0) throw std::invalid_argument("tokens must be a non-empty 1-D array of token ids");
    return t;
}

std::vector<int32_t> token_copy(const py::array &tokens) {
    auto t = token_ids(tokens);
    return std::vector<int32_t>(t.data(), t.data() + t.shape(0));
}

SamplerParams sampling(float temperature, int32_t top_k, float top_p, float min_p) {
    const SamplerParams sp{temperature, top_k, top_p, min_p};
    sp.validate();
    return sp;
}

namespace {

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

}  // namespace

}  // namespace kvflash::bindings

PYBIND11_MODULE(_core, m) {
    using namespace kvflash;
    using namespace kvflash::bindings;
    m.doc() = "kvflash native core: pager, KV pool and model runtime over ggml";
    m.attr("ggml_version") = ggml_version();
    m.attr("ggml_commit") = ggml_commit();
    m.def("cuda_available", [] { return cuda_compiled() && cuda_device_count() > 0; },
          "True when this build has the CUDA backend (KVFLASH_CUDA=ON) and a CUDA device is visible.");
    m.def("build_info", &build_info,
          "Dict: cuda (compiled in), cuda_devices, ggml_version, ggml_commit, devices (ggml's registered devices "
          "with memory), cpu_features (ggml-cpu's instruction sets).");
    m.attr("MAX_CONTEXT") = kMaxContext;
    m.def("chunk_peaks", [](py::array_t<double, py::array::c_style | py::array::forcecast> x,
                            py::array_t<int32_t, py::array::c_style | py::array::forcecast> chunk_of, int32_t n_chunks,
                            int32_t spread, int32_t carry) {
              if (x.ndim() != 1 || chunk_of.ndim() != 1 || x.shape(0) != chunk_of.shape(0))
                  throw std::invalid_argument("chunk_peaks: x and chunk_of must be 1-D arrays of one length");
              if (n_chunks < 0) throw std::invalid_argument("chunk_peaks: n_chunks must be >= 0");
              py::array_t<float> out(static_cast<py::ssize_t>(n_chunks));
              chunk_peaks(x.data(), x.shape(0), chunk_of.data(), n_chunks, spread, out.mutable_data(), carry);
              return out;
          }, py::arg("x"), py::arg("chunk_of"), py::arg("n_chunks"), py::arg("spread") = 0, py::arg("carry") = 0,
          "Token scores to chunk scores (scoring.h): each token the max of the `spread` tokens either side, each "
          "chunk its peak token (chunk_of < 0: a token of no chunk); empty chunks score one below the lowest; carry: "
          "a token also takes, a hair lower, the scores of the `carry` tokens before it.");
    m.def("qk_auto_layers", &qk_auto_layers, py::arg("n_paged"),
          "The qk policy's default layer count for a model with n_paged paged layers.");
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

    m.def("quantize_rows", [](py::array_t<float, py::array::c_style | py::array::forcecast> a, const std::string &type) {
        if (a.ndim() != 2) throw std::invalid_argument("quantize_rows: a 2-D float32 array [rows, cols]");
        int64_t found = -1;
        for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
            const char *name = ggml_type_name(ggml_type(t));
            if (name && type == name && ggml_get_type_traits(ggml_type(t))->blck_size > 0) found = t;
        }
        if (found < 0) throw std::invalid_argument("quantize_rows: unknown ggml type '" + type + "'");
        const ggml_type t = ggml_type(found);
        const int64_t rows = a.shape(0), cols = a.shape(1);
        if (cols % ggml_blck_size(t)) throw std::invalid_argument("quantize_rows: " + std::to_string(cols) + " columns are not a "
                                                                  "multiple of " + type + "'s block of " + std::to_string(ggml_blck_size(t)));
        if (ggml_quantize_requires_imatrix(t)) throw std::invalid_argument("quantize_rows: " + type + " needs an importance matrix");
        py::array_t<uint8_t> out({py::ssize_t(rows), py::ssize_t(ggml_row_size(t, cols))});
        ggml_quantize_chunk(t, a.data(), out.mutable_data(), 0, rows, cols, nullptr);
        return out;
    }, py::arg("a"), py::arg("type"),
       "ggml's own quantization of float32 rows to a ggml type ('q6_K', 'q4_K', 'q8_0', ...): uint8 [rows, row bytes] "
       "(tests write K-quant weights with it).");
    m.def("rpc_serve", [](const std::string &endpoint, int32_t threads, const std::string &cache_dir) {
        py::gil_scoped_release nogil;
        kvflash::rpc_serve(endpoint, threads, cache_dir);
    }, py::arg("endpoint"), py::arg("threads") = 1, py::arg("cache_dir") = "",
       "Serve this machine's CPU over ggml's RPC protocol at host:port; blocks while serving.  The protocol has no "
       "authentication: loopback or a trusted network only.");
    m.def("check_rpc_endpoint", &kvflash::check_rpc_endpoint, py::arg("endpoint"),
          "ValueError unless endpoint is host:port with a port in [1, 65535].");
    m.def("split_layers", [](int32_t n_layer, const std::vector<std::string> &rpc, const std::vector<float> &split) {
        py::list out;
        for (const kvflash::RemoteLayers &R : kvflash::split_layers(n_layer, rpc, split))
            out.append(py::make_tuple(R.endpoint, R.first, R.last));
        return out;
    }, py::arg("n_layer"), py::arg("rpc"), py::arg("tensor_split") = std::vector<float>{},
       "The layer ranges Model(rpc=, tensor_split=) places: [(endpoint, first, last)], last exclusive; this "
       "process keeps the layers after the last range.  ValueError naming a bad endpoint or split.");
    m.def("rpc_device_memory", [](const std::string &endpoint) {
        py::gil_scoped_release nogil;
        return kvflash::rpc_device_memory(endpoint);
    }, py::arg("endpoint"), "(free, total) bytes of the RPC server's device; RuntimeError when none answers.");
    m.def("rpc_round_trip", [](const std::string &endpoint, py::bytes data) {
        std::string in = data;
        std::vector<uint8_t> back;
        {
            py::gil_scoped_release nogil;
            back = kvflash::rpc_round_trip(endpoint, std::vector<uint8_t>(in.begin(), in.end()));
        }
        return py::bytes(reinterpret_cast<const char *>(back.data()), back.size());
    }, py::arg("endpoint"), py::arg("data"),
       "data written into a buffer on the RPC server and read back (the remote pool's page-out/page-in path).");
    m.def("split_for", [](int64_t n_kv) {
        if (n_kv < 1) throw std::invalid_argument("split_for: n_kv must be >= 1");
        const kvflash::SplitK sk = kvflash::split_for(n_kv);
        return py::make_tuple(sk.n_split, sk.range);
    }, py::arg("n_kv"), "(ranges, slots per range) of the pool attention's split-K over n_kv attended slots.");
    m.def("pool_attention_tiled_available", &kvflash::pool_attention_tiled_available,
          "whether this build has the tiled pool-attention kernel for q8_0 / q4_0 K and V (AVX-512 VNNI): the "
          "runtime's for those pools, f32 dots; quant_dots=True takes its integer dots instead");
    m.def("pool_attention", [](py::array_t<float, py::array::c_style | py::array::forcecast> q, py::array k, py::array v,
                               py::array_t<uint8_t, py::array::c_style | py::array::forcecast> visible,
                               const std::string &kv_type, int32_t n_head_kv, float scale, int32_t n_split,
                               int32_t n_threads, bool quant_dots, bool tiled, int32_t table_rows) {
        const ggml_type t = kv_type_from_name(kv_type);
        if (q.ndim() != 3) throw std::invalid_argument("pool_attention: q must be [n, n_head, head_dim] float32");
        const int32_t n = int32_t(q.shape(0)), H = int32_t(q.shape(1)), D = int32_t(q.shape(2));
        auto kb = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>::ensure(k);
        auto vb = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>::ensure(v);
        if (n_head_kv < 1 || D < 1) throw std::invalid_argument("pool_attention: n_head_kv and head_dim must be >= 1");
        if (int64_t(D) * n_head_kv % ggml_blck_size(t))
            throw std::invalid_argument("pool_attention: a K/V row is not a whole number of blocks of its type");
        const size_t row = ggml_row_size(t, int64_t(D) * n_head_kv);
        if (!kb || !vb || kb.ndim() != 2 || vb.ndim() != 2 || size_t(kb.shape(1)) != row || size_t(vb.shape(1)) != row ||
            kb.shape(0) != vb.shape(0))
            throw std::invalid_argument("pool_attention: k and v must be [n_kv, " + std::to_string(row) +
                                        "] uint8 rows of " + kv_type);
        const int64_t n_kv = kb.shape(0);
        if (visible.ndim() != 2 || visible.shape(0) != n || visible.shape(1) != n_kv)
            throw std::invalid_argument("pool_attention: visible must be [n, n_kv]");
        py::array_t<float> out({py::ssize_t(n), py::ssize_t(H), py::ssize_t(D)});
        {
            py::gil_scoped_release nogil;
            pool_attention_once(q.data(), n, H, n_head_kv, D, t, kb.data(), vb.data(), n_kv, visible.data(), scale,
                                n_split, n_threads, quant_dots, out.mutable_data(), tiled, table_rows);
        }
        return out;
    }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("visible"), py::arg("kv_type"), py::arg("n_head_kv"),
       py::arg("scale"), py::arg("n_split") = 1, py::arg("n_threads") = 1, py::arg("quant_dots") = false,
       py::arg("tiled") = true, py::arg("table_rows") = 0,
       "The CPU pool attention op once over these arrays (tests): q [n, H, D] float32, k / v [n_kv, row bytes] rows "
       "of kv_type, visible [n, n_kv]; returns [n, H, D].  table_rows > 0: the rows are read through a row table "
       "of chunks of that many rows, stored out of order (the exact mode's path).");
    m.def("bench_pool_attention", [](int32_t n_kv, int32_t head_dim, int32_t n_head, int32_t n_head_kv,
                                     const std::string &kv_type, int32_t n_threads, int32_t n_layers, int32_t n_queries,
                                     int32_t iters, uint64_t seed, bool quant_dots, bool tiled) {
        const ggml_type t = kv_type_from_name(kv_type);
        AttnBenchResult r;
        {
            py::gil_scoped_release nogil;
            r = bench_pool_attention(n_kv, head_dim, n_head, n_head_kv, t, n_threads, n_layers, n_queries, iters, seed,
                                     quant_dots, tiled);
        }
        py::dict d;
        d["attn_s"] = r.attn_s;
        d["read_s"] = r.read_s;
        d["copy_s"] = r.copy_s;
        d["kv_bytes"] = r.kv_bytes;
        d["n_split"] = r.n_split;
        return d;
    }, py::arg("n_kv"), py::arg("head_dim"), py::arg("n_head"), py::arg("n_head_kv"), py::arg("kv_type") = "q8_0",
       py::arg("n_threads") = 1, py::arg("n_layers") = 30, py::arg("n_queries") = 1, py::arg("iters") = 20,
       py::arg("seed") = 0, py::arg("quant_dots") = false, py::arg("tiled") = true,
       "The CPU pool attention op alone (bench attention): seconds per iteration of n_layers pools' decode attention "
       "in one graph, beside a one-thread read pass and a memcpy of the same K/V bytes; and those bytes.");

    bind_pager(m);
    bind_model(m);
    RuntimeClass rt = bind_runtime(m);
    bind_scoring(rt);
    bind_gguf(m);
    bind_snapshot(m, rt);
}
