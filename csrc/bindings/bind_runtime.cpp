// kvflash._core.Model and Runtime: loading, evaluation, sampling and the cache's lifecycle.
#include <stdexcept>

#include "bindings.h"
#include "kvflash/session.h"
#include "kvflash/speculative.h"

namespace kvflash::bindings {

// A class's methods are thin (checks, then one core call) and read best as one list.
void bind_model(py::module_ &m) {
    py::class_<Model, std::shared_ptr<Model>>(m, "Model", R"doc(
GGUF weights and hyper-parameters (immutable, shareable).

Model(path, n_threads=0, device="cpu", rpc=[], tensor_split=[], repack=True): device "cpu", "cuda"
(= "cuda:0"), "cuda:N", "vulkan" (= "vulkan:0"), "vulkan:N" or "auto" (the first CUDA device, else the
first Vulkan one, else the CPU).  On a GPU (any backend ggml has, through its device registry) the
weights are uploaded to the device and every Runtime over the model computes there (pool,
sliding-window ring and graphs in device memory, paged chunks in the device's pinned host buffers where
it has them).  ValueError for an unknown device, for a GPU backend this build lacks, or for a device
that is not visible.

rpc: "host:port" endpoints of `kvflash rpc-server` processes; contiguous layer ranges
go to them in order, by tensor_split's weights (one per endpoint, and optionally one
more: this process's share, the last layers; empty: equal shares, no layer local).
Their weights are uploaded there, and every Runtime over the model keeps those layers'
pool slices there and runs them there (ggml_backend_sched).  The embedding and the
output head stay here.  RuntimeError when a server does not answer or has no room.

repack=False keeps every weight mapped from the file and multiplied by ggml-cpu's plain
kernels (no repacked interleaves, no AMX copies), as KVFLASH_NO_REPACK=1 does for every
model and as an RPC server holds its layers: weight_placement says what each part runs.
)doc")
        .def(py::init([](py::object path, int32_t n_threads, const std::string &device, std::vector<std::string> rpc,
                         std::vector<float> tensor_split, bool repack) {
                 if (n_threads < 0) throw std::invalid_argument("n_threads must be >= 0 (0: all cores)");
                 std::string p = py::str(path).cast<std::string>();
                 py::gil_scoped_release nogil;
                 return Model::load(p, n_threads, device, rpc, tensor_split, repack);
             }), py::arg("path"), py::arg("n_threads") = 0, py::arg("device") = "cpu",
             py::arg("rpc") = std::vector<std::string>{}, py::arg("tensor_split") = std::vector<float>{},
             py::arg("repack") = true)
        .def_property_readonly("remote_layers", [](const Model &m) {
            py::list out;
            for (size_t r = 0; r < m.remote_layers().size(); ++r) {
                const RemoteLayers &R = m.remote_layers()[r];
                py::dict d;
                d["endpoint"] = R.endpoint; d["first"] = R.first; d["last"] = R.last;
                d["weight_bytes"] = r < m.remote_bytes().size() ? m.remote_bytes()[r] : size_t(0);
                out.append(d);
            }
            return out;
        }, "the layer ranges on RPC servers: [{'endpoint', 'first', 'last' (exclusive), 'weight_bytes'}]")
        .def_property_readonly("path", &Model::path)
        .def_property_readonly("device", [](const Model &m) { return m.device().name(); },
                               "'cpu', 'cuda:N' or 'vulkan:N'.")
        .def("device_memory", &Model::device_memory,
             "(free, total) bytes of the model's device now (ggml's device memory query; on a GPU free is what is "
             "left after the weights and everything else allocated; on the CPU ggml reports free == total).")
        .def_property_readonly("weight_bytes", &Model::weight_bytes)
        .def_property_readonly("weight_placement", &Model::weight_placement,
                               "where the weights went and which of ggml's kernels multiply by them, one line per "
                               "place: 'CPU mapped (ggml-cpu's plain kernels), layers 0-29, ...: N MiB', CPU_REPACK or "
                               "AMX (converted copies), RPC servers' ranges (repack=False or KVFLASH_NO_REPACK=1: "
                               "every weight mapped)")
        .def_property("n_threads", &Model::n_threads, [](Model &m, int32_t n) {
            if (n <= 0) throw std::invalid_argument("n_threads must be >= 1");
            m.set_n_threads(n);
        })
        .def_property_readonly("global_layers", &Model::global_layers)
        .def_property_readonly("auto_exact_prefill_until", &auto_exact_prefill_until,
                               "Where exact_prefill='auto' stops reading prompts exactly on this model (0: it stays off): "
                               "kvflash::auto_exact_prefill_until")
        .def("recurrent_bytes", [](const Model &m, int32_t snapshots, int32_t checkpoints) {
            const Hparams &h = m.hparams();
            int32_t layers = 0;
            for (uint8_t r : h.is_recr) layers += r != 0;
            py::dict d;
            d["layers"] = layers;
            d["state_bytes"] = layers ? RecurrentState::device_bytes_for(layers, h.ssm_conv_channels(), h.ssm_d_conv,
                                                                         h.ssm_state_floats(), snapshots) : size_t(0);
            d["checkpoint_bytes"] = layers ? RecurrentState::checkpoint_bytes_for(layers, h.ssm_conv_channels(),
                                                                                  h.ssm_d_conv, h.ssm_state_floats())
                                           : size_t(0);
            d["checkpoints"] = layers ? checkpoints : 0;
            return d;
        }, py::arg("snapshots") = RuntimeConfig{}.recurrent_snapshots,
           py::arg("checkpoints") = RuntimeConfig{}.recurrent_checkpoints,
           "what the recurrent layers' state takes beside the KV (qwen35): {'layers', 'state_bytes' (its rings, on the "
           "device), 'checkpoint_bytes' (one host checkpoint), 'checkpoints'}; zeros without recurrent layers")
        .def_property_readonly("hparams", [](const Model &m) {
            const Hparams &h = m.hparams();
            py::dict d;
            d["arch"] = h.arch;
            d["n_layer"] = h.n_layer; d["n_embd"] = h.n_embd; d["n_ff"] = h.n_ff;
            d["n_head"] = h.n_head; d["n_head_kv"] = h.n_head_kv; d["head_dim"] = h.head_dim_k;
            d["n_vocab"] = h.n_vocab; d["n_ctx_train"] = h.n_ctx_train; d["rms_eps"] = h.rms_eps;
            d["rope_base"] = h.rope_base; d["rope_base_swa"] = h.rope_base_swa; d["rope_mode"] = h.rope_mode;
            d["n_swa"] = h.n_swa; d["attn_scale"] = h.attn_scale;
            d["rope_scale"] = h.rope_scale; d["rope_ext_factor"] = h.rope_ext_factor;
            d["rope_attn_factor"] = h.rope_attn_factor; d["rope_n_ctx_orig"] = h.rope_n_ctx_orig;
            std::vector<bool> swa(h.is_swa.begin(), h.is_swa.end());
            d["is_swa"] = swa;
            std::vector<int32_t> heads;
            for (int32_t il = 0; il < h.n_layer; ++il) heads.push_back(h.n_head_at(il));
            d["n_head_per_layer"] = heads;
            d["n_rot"] = h.n_rot; d["n_rot_swa"] = h.n_rot_swa; d["rope_scale_swa"] = h.rope_scale_swa;
            d["n_layer_dense_lead"] = h.n_layer_dense_lead;
            // per-layer geometry (gemma4: the sliding layers' head dim and K/V heads, shared-KV sources)
            std::vector<int32_t> kvh, ff, src;
            for (int32_t il = 0; il < h.n_layer; ++il) {
                kvh.push_back(h.n_head_kv_at(il));
                ff.push_back(h.n_ff_at(il));
                src.push_back(h.kv_source(il));
            }
            d["n_head_kv_per_layer"] = kvh; d["n_ff_per_layer"] = ff; d["kv_src"] = src;
            d["head_dim_swa"] = h.head_dim_swa; d["n_embd_per_layer"] = h.n_embd_per_layer;
            d["final_softcap"] = h.final_softcap;
            return d;
        });
}

// Long on purpose, as bind_model: one list of thin methods.
RuntimeClass bind_runtime(py::module_ &m) {
    RuntimeClass cls(m, "Runtime", R"doc(
Per-session native state over a Model: the paged KV pool (kvflash) or a full
cache (pool_tokens=0), plus compute graphs.  Driven by kvflash.Session.
)doc");
    cls.def(py::init([](std::shared_ptr<Model> model, int64_t max_ctx, int32_t pool_tokens, const std::string &kv_type,
                         int32_t chunk_tokens, int32_t sink_chunks, int32_t tail_window_chunks, int32_t ubatch,
                         const std::string &host, py::object host_path, uint64_t seed, const std::string &attn,
                         int32_t pool_attn_max_tokens, int32_t capture_queries, bool chunk_summaries,
                         int32_t prefill_piece, int32_t eval_layers, int64_t max_host_bytes) {
                 if (prefill_piece < 0) throw std::invalid_argument("prefill_piece must be >= 0 (0: chunk_tokens)");
                 if (capture_queries < 0 || capture_queries > 4096)
                     throw std::invalid_argument("capture_queries must be in [0, 4096]");
                 if (!model) throw std::invalid_argument("model is required");
                 if (pool_tokens < 0) throw std::invalid_argument("pool_tokens must be >= 0 (0: full cache)");
                 if (ubatch <= 0) throw std::invalid_argument("ubatch must be >= 1");
                 RuntimeConfig c;
                 c.max_ctx = max_ctx; c.pool_tokens = pool_tokens; c.kv_type = kv_type; c.chunk_tokens = chunk_tokens;
                 c.sink_chunks = sink_chunks; c.tail_window_chunks = tail_window_chunks; c.ubatch = ubatch;
                 c.host = host;  // parsed by the core (parse_host_backing), as for the Pager
                 c.host_path = optional_path(host_path);
                 c.attn = attn;
                 c.pool_attn_max_tokens = pool_attn_max_tokens;
                 c.capture_queries = capture_queries;
                 c.prefill_piece = prefill_piece;
                 c.eval_layers = eval_layers;
                 c.max_host_bytes = max_host_bytes;
                 SessionConfig sc;
                 sc.runtime = c;
                 sc.seed = seed;
                 sc.chunk_summaries = chunk_summaries;
                 auto r = std::make_shared<PyRuntime>();
                 r->model = model;
                 r->session = std::make_unique<Session>(model, sc);
                 r->rt = &r->session->runtime();
                 r->summaries = r->session->summaries_ptr();
                 // Ctrl-C between the pieces of a long prompt: the runtime takes the evaluated
                 // pieces back and eval raises KeyboardInterrupt (PyErr_CheckSignals set it).
                 r->rt->set_interrupt([] {
                     py::gil_scoped_acquire gil;
                     return PyErr_CheckSignals() != 0;
                 });
                 return r;
             }), py::arg("model"), py::kw_only(), py::arg("max_ctx"), py::arg("pool_tokens") = 0,
             py::arg("kv_type") = "q8_0", py::arg("chunk_tokens") = 64, py::arg("sink_chunks") = 1,
             py::arg("tail_window_chunks") = 4, py::arg("ubatch") = 512, py::arg("host") = "ram",
             py::arg("host_path") = py::none(), py::arg("seed") = 0, py::arg("attn") = "auto",
             py::arg("pool_attn_max_tokens") = 1 << 30, py::arg("capture_queries") = 1,
             py::arg("chunk_summaries") = false, py::arg("prefill_piece") = 0, py::arg("eval_layers") = 0,
             py::arg("max_host_bytes") = 0)
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
            ref.busy = &r->busy;
            return ref;
        })
        .def("eval", [](PyRuntime &r, py::array tokens, bool all_logits, bool exact, bool one_row_products,
                        py::object progress) {
                 InUse use(&r.busy);
                 if (!progress.is_none() && !PyCallable_Check(progress.ptr()))
                     throw std::invalid_argument("eval: progress must be a callable (done, total, page_outs) or None");
                 const std::vector<int32_t> t = token_copy(tokens);
                 if (t.size() > size_t(INT32_MAX)) throw std::invalid_argument("eval: too many tokens in one call");
                 const int32_t n = int32_t(t.size()), V = r.model->hparams().n_vocab;
                 py::array_t<float> out = all_logits ? py::array_t<float>({py::ssize_t(n), py::ssize_t(V)})
                                                     : py::array_t<float>(py::ssize_t(V));
                 float *o = out.mutable_data();
                 try {
                     py::gil_scoped_release nogil;
                     EvalOptions opt;
                     opt.exact = exact;
                     opt.one_row_products = one_row_products;
                     if (!progress.is_none())
                         opt.progress = [&r, &progress](int32_t done, int32_t total) {
                             const int64_t outs = r.rt->pager().stats().page_outs;
                             py::gil_scoped_acquire gil;
                             progress(done, total, outs);   // what it raises ends the eval (all or nothing)
                         };
                     r.session->eval(t.data(), n, all_logits, o, opt);
                 } catch (const EvalInterrupted &) {
                     throw py::error_already_set();  // the KeyboardInterrupt PyErr_CheckSignals raised
                 }
                 return out;
             }, py::arg("tokens"), py::arg("all_logits") = false, py::arg("exact") = false,
             py::arg("one_row_products") = false, py::arg("progress") = py::none(),
             "Append tokens at n_past; returns float32 logits [n_vocab] (last) or [n, n_vocab].  progress: called "
             "with (tokens done, tokens in the call, the pager's page-outs so far) after each piece, the GIL held; "
             "what it raises ends the eval with nothing of it kept.  exact=True: "
             "attention over every position, resident rows from the pool and paged-out rows from the host store, "
             "as the full cache computes it (CPU backend only).  one_row_products=True: every token's matrix "
             "products as a one-token eval computes them, bit for bit (CPU backend only; a verification pass).")
        .def("check_rpc_ops", [](PyRuntime &r, int32_t n) {
                 InUse use(&r.busy);
                 r.rt->check_remote_ops(n);
             }, py::arg("n_tokens") = 1,
             "Raise ValueError naming the first node of this runtime's graph (n_tokens tokens) that a ggml RPC "
             "server must not be sent (kvflash's CPU attention op: use attn='ggml' for remote layers).")
        .def("spec_round", [](PyRuntime &r, int32_t tok, int32_t k, float temperature, int32_t top_k, float top_p,
                              float min_p, std::vector<int32_t> stop_ids) {
                 if (r.rt->config().eval_layers > 0)
                     throw std::invalid_argument("spec_round: a scoring runtime has no logits to verify");
                 InUse use(&r.busy);
                 const SamplerParams sp = sampling(temperature, top_k, top_p, min_p);
                 SpecRound rd;
                 {
                     py::gil_scoped_release nogil;
                     rd = r.session->spec_round(tok, k, sp, stop_ids);
                 }
                 py::dict d;
                 d["accepted"] = rd.accepted;
                 d["next"] = rd.next;
                 d["n_draft"] = rd.n_draft;
                 d["n_kept"] = rd.n_kept;
                 d["draft_ms"] = rd.draft_ms;
                 d["verify_ms"] = rd.verify_ms;
                 return d;
             }, py::arg("tok"), py::arg("k"), py::arg("temperature") = 0.f, py::arg("top_k") = 0, py::arg("top_p") = 1.f,
             py::arg("min_p") = 0.f, py::arg("stop_ids") = std::vector<int32_t>{},
             "One exact-mode round from the pending token tok (not yet evaluated): up to k drafts over the pool, "
             "then one exact verification pass; the cache keeps tok and the drafts the full model agrees with.  "
             "Returns {accepted, next, n_draft, n_kept, draft_ms, verify_ms}; last_logits() is then the row after "
             "the last accepted token, round_logits(i) the row after accepted[i].")
        .def("round_logits", [](PyRuntime &r, int32_t i) {
                 InUse use(&r.busy);
                 const std::vector<float> &rl = r.session->round_logits();
                 const int64_t V = r.model->hparams().n_vocab, n = int64_t(rl.size()) / std::max<int64_t>(V, 1);
                 if (i < 0 || i >= n)
                     throw std::out_of_range("round_logits: row " + std::to_string(i) + " of the last round's " + std::to_string(n));
                 return py::array_t<float>(py::ssize_t(V), rl.data() + size_t(i) * V);
             }, py::arg("i"))
        .def("eval_sample", [](PyRuntime &r, py::array tokens, float temperature, int32_t top_k, float top_p, float min_p) {
                 if (r.rt->config().eval_layers > 0)
                     throw std::invalid_argument("eval_sample: this runtime evaluates only its first " +
                                                 std::to_string(r.rt->config().eval_layers) +
                                                 " layers (a scoring runtime) and has no logits to sample");
                 InUse use(&r.busy);
                 const std::vector<int32_t> t = token_copy(tokens);
                 if (t.size() > size_t(INT32_MAX)) throw std::invalid_argument("eval_sample: too many tokens in one call");
                 const int32_t n = int32_t(t.size());
                 const SamplerParams sp = sampling(temperature, top_k, top_p, min_p);
                 int32_t tok;
                 try {
                     py::gil_scoped_release nogil;
                     tok = r.session->eval_sample(t.data(), n, sp);
                 } catch (const EvalInterrupted &) {
                     throw py::error_already_set();
                 }
                 return tok;
             }, py::arg("tokens"), py::arg("temperature") = 0.f, py::arg("top_k") = 0, py::arg("top_p") = 1.f,
             py::arg("min_p") = 0.f, "Append tokens and sample the next token id from the last logits.")
        .def("sample", [](PyRuntime &r, py::array logits, float temperature, int32_t top_k, float top_p, float min_p) {
                 InUse use(&r.busy);
                 auto l = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(logits);
                 const int32_t V = r.model->hparams().n_vocab;
                 if (!l || l.ndim() != 1 || l.shape(0) != V)
                     throw std::invalid_argument("logits must be a 1-D array of n_vocab=" + std::to_string(V) + " floats");
                 const SamplerParams sp = sampling(temperature, top_k, top_p, min_p);
                 return r.session->sampler().sample(l.data(), r.session->sampled_vocab(), sp);
             }, py::arg("logits"), py::arg("temperature") = 0.f, py::arg("top_k") = 0, py::arg("top_p") = 1.f,
             py::arg("min_p") = 0.f, "Sample a token id from a logits row with the runtime's seeded sampler.")
        .def("last_logits", [](PyRuntime &r) {
                 InUse use(&r.busy);
                 const std::vector<float> &l = r.session->logits();
                 return py::array_t<float>(py::ssize_t(l.size()), l.data());
             })
        .def("seed", [](PyRuntime &r, uint64_t s) { InUse use(&r.busy); r.session->sampler().seed(s); }, py::arg("seed"))
        .def_property("sample_vocab", [](PyRuntime &r) { return r.session->sample_vocab(); }, [](PyRuntime &r, int32_t n) {
                 InUse use(&r.busy);
                 r.session->set_sample_vocab(n);
             }, "Sample only ids below this (0: every id): a tokenizer with fewer ids than the model's vocabulary "
                "(padded embedding rows) can decode every id sampled.")
        .def("truncate", [](PyRuntime &r, int64_t n) { InUse use(&r.busy); r.session->truncate_cache(n); }, py::arg("n_past"))
        .def_property_readonly("max_rewind", [](PyRuntime &r) { return r.rt->max_rewind(); },
                               "how far back truncate can go from n_past (the sliding-window ring's slack)")
        .def_property_readonly("checkpoints", [](PyRuntime &r) { return r.rt->checkpoint_positions(); },
                               "positions of the recurrent state's host checkpoints (chunk boundaries), oldest first")
        .def_property_readonly("memories", [](PyRuntime &r) {
            py::list out;
            for (const Memory *m : r.rt->memories()) {
                py::dict d;
                d["kind"] = m->kind(); d["device_bytes"] = m->device_bytes(); d["max_rewind"] = m->max_rewind();
                out.append(d);
            }
            return out;
        }, "what holds the context: [{'kind', 'device_bytes', 'max_rewind'}] per memory (the paged KV, the "
           "sliding-window ring, the recurrent state)")
        .def("reset", [](PyRuntime &r) { InUse use(&r.busy); r.session->reset(); })
        .def_property_readonly("timings", [](PyRuntime &r) {
            const RuntimeStats &s = r.rt->stats();
            py::dict d;
            d["eval_calls"] = s.n_eval_calls; d["tokens"] = s.n_tokens_evaluated;
            d["graph_ms"] = s.t_graph_ms; d["compute_ms"] = s.t_compute_ms; d["mask_ms"] = s.t_mask_ms;
            return d;
        });
    return cls;
}

}  // namespace kvflash::bindings
