#include "kvflash/runtime.h"
#include "kvflash/one_row_cpu.h"
#include "kvflash/rpc.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <stdexcept>

#include "ggml-cpu.h"
#include "kvflash/arch.h"
#include "kvflash/attn_cpu.h"
#include "kvflash/limits.h"

namespace kvflash {

using clk = std::chrono::steady_clock;
static double ms_since(clk::time_point t) { return std::chrono::duration<double, std::milli>(clk::now() - t).count(); }

ChunkGeometry auto_chunk_geometry(int32_t pool_tokens, int32_t sink_chunks, int32_t tail_window_chunks) {
    ChunkGeometry g;
    if (pool_tokens <= 0) return g;                      // the full cache: nothing is paged
    const int32_t protect = std::max(sink_chunks, 0) + std::max(tail_window_chunks, 0) + 1;
    g.chunk_tokens = 16;
    for (int32_t c : {64, 32}) {
        if (pool_tokens / c - protect >= kAutoChunkFreeSlots) { g.chunk_tokens = c; break; }
    }
    const int32_t room = pool_tokens - protect * g.chunk_tokens;
    g.prefill_piece = g.chunk_tokens < 64 && room >= 64 ? 64 : 0;
    return g;
}

struct Runtime::Graph {
    int32_t n = 0, n_kv = 0;
    bool all_logits = false, exact = false, capture_all = false, one_row = false;
    ggml_context *ctx = nullptr;
    ggml_cgraph *gf = nullptr;
    ggml_gallocr_t alloc = nullptr;
    ggml_backend_sched_t sched = nullptr;   // layers on RPC servers: the scheduler places and allocates
    ggml_tensor *tokens = nullptr, *pos = nullptr, *slots = nullptr, *mask = nullptr;
    ggml_tensor *swa_slots = nullptr, *swa_mask = nullptr, *logits = nullptr;
    ggml_tensor *pos4 = nullptr;                 // multi-section RoPE: [4 n] i32
    ggml_tensor *conv_in = nullptr, *conv_out = nullptr, *ssm_in = nullptr, *ssm_out = nullptr;   // recurrent rows
    std::vector<ggml_tensor *> q_out;  // per paged layer: [D, H, n_capture]
    int32_t n_capture = 0;
    PoolAttnParams attn, attn_swa;   // stable addresses for the custom attention ops
    // exact graphs: per paged layer its parameters and row table (sized once, before any address is taken)
    std::vector<PoolAttnParams> attn_exact;
    std::vector<RowTable> tables;
    std::vector<uint8_t> meta;
    ~Graph() {
        if (sched) ggml_backend_sched_free(sched);
        if (alloc) ggml_gallocr_free(alloc);
        if (ctx) ggml_free(ctx);
    }
};

Runtime::Runtime(std::shared_ptr<Model> model, RuntimeConfig cfg) : model_(std::move(model)), cfg_(std::move(cfg)) {
    const Hparams &hp = model_->hparams();
    backend_ = model_->backend();
    if (!ggml_backend_is_cpu(backend_) && !remote()) {
        ggml_backend_dev_t dev = ggml_backend_get_device(backend_);
        own_backend_.reset(dev ? ggml_backend_dev_init(dev, nullptr) : nullptr);
        if (!own_backend_) throw std::runtime_error("cannot initialise a compute backend on " + model_->device().name());
        backend_ = own_backend_.get();
    }
    check_max_ctx(cfg_.max_ctx);
    if (cfg_.ubatch <= 0) throw std::invalid_argument("ubatch must be > 0");
    const ggml_type kvt = kv_type_from_name(cfg_.kv_type);
    if (cfg_.attn != "auto" && cfg_.attn != "ggml" && cfg_.attn != "pool")
        throw std::invalid_argument("attn must be 'auto', 'ggml' or 'pool', got '" + cfg_.attn + "'");
    if (cfg_.attn == "pool" && !ggml_backend_is_cpu(backend_))
        throw std::invalid_argument("attn='pool' is kvflash's CPU attention kernel; the model is on " +
                                    model_->device().name() + ": use attn='auto' or 'ggml' (ggml_flash_attn_ext)");
    if (cfg_.attn == "pool" && remote())
        throw std::invalid_argument("attn='pool' is kvflash's CPU attention kernel, which an RPC server cannot run; "
                                    "the model has layers on RPC servers: use attn='auto' or 'ggml' (ggml_flash_attn_ext)");
    if (kvt == GGML_TYPE_F32) throw std::invalid_argument("kv_type f32 is not supported by the attention kernels; use f16, q8_0 or q4_0");
    if (hp.head_dim_k % ggml_blck_size(kvt) != 0 || hp.head_dim_swa % ggml_blck_size(kvt) != 0)
        throw std::invalid_argument(std::string("kv_type ") + cfg_.kv_type + " needs a head dim that is a multiple of " +
                                    std::to_string(ggml_blck_size(kvt)));
    if (cfg_.eval_layers < 0 || cfg_.eval_layers > hp.n_layer)
        throw std::invalid_argument("eval_layers must be in [0, " + std::to_string(hp.n_layer) +
                                    "] (0: all layers), got " + std::to_string(cfg_.eval_layers));
    n_eval_layers_ = cfg_.eval_layers > 0 ? cfg_.eval_layers : hp.n_layer;
    full_cache_ = cfg_.pool_tokens <= 0;
    PagerConfig pc;
    pc.chunk_tokens = cfg_.chunk_tokens;
    pc.sink_chunks = cfg_.sink_chunks;
    pc.tail_window_chunks = cfg_.tail_window_chunks;
    pc.max_ctx = cfg_.max_ctx;
    pc.max_host_bytes = cfg_.max_host_bytes;
    // The baseline: every position has its own slot, nothing is ever evicted.
    pc.pool_tokens = full_cache_ ? int32_t(std::max<int64_t>((cfg_.max_ctx + 255) / 256 * 256, pc.min_pool_tokens()))
                                 : cfg_.pool_tokens;
    std::vector<PoolLayerSpec> specs;
    std::vector<ggml_backend_buffer_type_t> layer_bufts;   // a remote layer's pool slice on its server
    paged_index_.assign(hp.n_layer, -1);
    for (int32_t il : model_->global_layers()) {
        if (il >= n_eval_layers_) break;
        paged_index_[il] = int32_t(specs.size());
        specs.push_back({il, hp.n_embd_k(), hp.n_embd_v()});
        layer_bufts.push_back(model_->layer_buft(il));
    }
    if (!remote()) layer_bufts.clear();
    const HostStore::Backing backing = parse_host_backing(cfg_.host, cfg_.host_path);
    // On a GPU the pool is in device memory: PagedCache pages it through async copies on this runtime's
    // backend into the device's pinned host buffers (pool.cpp).
    paged_ = std::make_unique<PagedMemory>(
        std::make_unique<PagedCache>(backend_, specs, kvt, kvt, pc, backing, cfg_.host_path, layer_bufts));
    memories_.push_back(paged_.get());
    recr_index_.assign(hp.n_layer, -1);
    int32_t n_recr = 0;
    for (int32_t il = 0; il < n_eval_layers_; ++il)
        if (hp.is_recr[il]) recr_index_[il] = n_recr++;
    if (n_recr > 0) {
        if (remote()) throw std::invalid_argument("a model with recurrent layers cannot place layers on RPC servers yet");
        if (cfg_.recurrent_snapshots < 1 || cfg_.recurrent_snapshots > 256)
            throw std::invalid_argument("recurrent_snapshots must be in [1, 256], got " + std::to_string(cfg_.recurrent_snapshots));
        recr_ = std::make_unique<RecurrentState>(backend_, n_recr, hp.ssm_conv_channels(), hp.ssm_d_conv,
                                                 hp.ssm_state_floats(), cfg_.recurrent_snapshots);
        memories_.push_back(recr_.get());
    }
    // layers that read another's KV (gemma4's shared-KV layers) keep none of their own
    int32_t n_shared = 0;
    for (int32_t il = 0; il < n_eval_layers_; ++il) n_shared += hp.kv_source(il) >= 0;
    const int32_t n_swa_layers = n_eval_layers_ - int32_t(specs.size()) - n_recr - n_shared;
    if (n_swa_layers > 0) {
        // Sliding-window layers keep a ring of their window plus one piece of new keys, on the
        // model's backend like the pool (a remote layer's ring on its server).  A piece never exceeds
        // max(ubatch, chunk_tokens, prefill_piece): the ring holds the window before the piece's first
        // query plus the piece itself.
        const int64_t piece = std::max({cfg_.ubatch, cfg_.chunk_tokens, cfg_.prefill_piece});
        const int32_t R = std::max(256, int32_t(std::min<int64_t>((int64_t(hp.n_swa) + piece + 255) / 256 * 256,
                                                                  (cfg_.max_ctx + 255) / 256 * 256)));
        std::vector<ggml_backend_buffer_type_t> ring_bufts;
        for (int32_t il = 0; il < n_eval_layers_; ++il) {
            if (paged_index_[il] >= 0 || recr_index_[il] >= 0 || hp.kv_source(il) >= 0) continue;
            paged_index_[il] = -2 - int32_t(ring_bufts.size());  // -2 - ring index
            ring_bufts.push_back(model_->layer_buft(il));
        }
        ring_ = std::make_unique<SlidingRing>(backend_, R, hp.n_swa, kvt, hp.n_embd_k_swa(), hp.n_embd_v_swa(),
                                              ring_bufts);
        ring_bufts_ = ring_bufts;
        memories_.push_back(ring_.get());
    }
}

Runtime::~Runtime() {
    decode_graph_.reset();
    batch_graph_.reset();
    exact_graph_.reset();
    reread_graph_.reset();
    scratch_ring_.reset();
    recr_.reset();
    ring_.reset();
    paged_.reset();
}

size_t Runtime::swa_bytes() const { return ring_ ? ring_->device_bytes() : 0; }

// i32, slots [n] i64 (pool rows), mask [n_kv, n] f16; for sliding layers swa_slots/swa_mask.
void Runtime::build(Graph &g, int32_t n, int32_t n_kv_pool, bool all_logits, const EvalOptions &opt) {
    const Hparams &hp = model_->hparams();
    g.n = n;
    g.n_kv = n_kv_pool;
    g.all_logits = all_logits;
    g.exact = opt.exact;
    g.capture_all = opt.capture_all;
    g.one_row = opt.one_row_products && n > 1;
    g.n_capture = cfg_.capture_queries <= 0 ? 0 : opt.capture_all ? n : std::min(n, cfg_.capture_queries);
    // one-row products: up to 12 matrices a layer (7 dense; a mixture's router, three routed and four
    // shared-expert products) and the head, each up to one_row_products_nodes (+1: the views); a
    // mixture adds a sum node per chosen expert; 96 for the rest of a layer (gpt-oss's, the largest:
    // about 60 with its biases, sinks and gating)
    const size_t one_row_nodes = g.one_row ? size_t(2 * one_row_products_nodes(n, false)) : 0;
    // (gemma4: up to 14 products a layer, its per-layer embedding's two and a dense MLP beside the experts,
    // and more nodes: ArchOps::extra_nodes)
    const size_t n_products = (hp.n_expert > 0 ? 12 : 7) + (hp.n_embd_per_layer > 0 ? 2 : 0);
    const size_t per_layer = 96 + size_t(model_->arch().extra_nodes) + 2 * size_t(hp.n_expert_used) +
                             n_products * one_row_nodes;
    const size_t max_nodes = per_layer * size_t(hp.n_layer) + 256 + 2 * one_row_nodes;
    g.meta.resize(ggml_tensor_overhead() * max_nodes + ggml_graph_overhead_custom(max_nodes, false));
    ggml_init_params ip{g.meta.size(), g.meta.data(), true};
    g.ctx = ggml_init(ip);
    ggml_context *ctx = g.ctx;
    g.gf = ggml_new_graph_custom(ctx, max_nodes, false);

    g.tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    g.pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    g.slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
    g.mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv_pool, n);  // attend over the occupied prefix of the pool
    for (ggml_tensor *t : {g.tokens, g.pos, g.slots, g.mask}) ggml_set_input(t);
    if (hp.rope_multi) {
        g.pos4 = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 4 * int64_t(n));
        ggml_set_input(g.pos4);
    }
    if (recr_) {
        g.conv_in = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, recr_->d_conv() - 1);
        g.conv_out = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, recr_->conv_written(n));
        g.ssm_in = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1);
        g.ssm_out = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, recr_->ssm_written(n));
        for (ggml_tensor *t : {g.conv_in, g.conv_out, g.ssm_in, g.ssm_out}) ggml_set_input(t);
    }
    if (ring_) {
        g.swa_slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
        g.swa_mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, ring_->tokens(), n);
        ggml_set_input(g.swa_slots);
        ggml_set_input(g.swa_mask);
    }
    // Ranges that do not follow the extent (split_for): a decode step and a verification batch agree.
    auto params = [&](int64_t n_kv, int32_t n_head_kv) {
        const SplitK sk = split_for(n_kv);
        PoolAttnParams p;
        p.n_head_kv = n_head_kv;
        p.n_split = sk.n_split;
        p.range = sk.range;
        return p;   // the scale is the family's, set by Forward::attention
    };
    g.attn = params(n_kv_pool, hp.n_head_kv);
    g.attn_swa = params(ring_ ? ring_->tokens() : 0, hp.n_head_kv_swa);
    // quant_dots stays off: the query keeps its f32 values (the tiled kernel widens q8_0 / q4_0 keys to
    // f32 instead).  Rounding the query per block as ggml does moved SmolLM2's attention outputs by 1-2%
    // per layer (issue 21's note).

    Forward f;
    f.ctx = ctx;
    f.gf = g.gf;
    f.model = model_.get();
    f.hp = &hp;
    f.n = n;
    f.tokens = g.tokens;
    f.pos = g.pos;
    f.pos4 = g.pos4;
    f.conv_in = g.conv_in;
    f.conv_out = g.conv_out;
    f.ssm_in = g.ssm_in;
    f.ssm_out = g.ssm_out;
    f.pool_attn = g.exact || use_pool_attn(n);   // exact: the CPU kernel (eval checked the backend)
    f.n_capture = g.n_capture;
    f.one_row = g.one_row;
    // (kvflash's CPU kernel, whose query does not depend on its batch; ggml's batch kernel is tiled and
    // rounds otherwise than its one-query path, and GPU backends and RPC splits are not measured: they
    // keep every query)
    f.last_row_only = !all_logits && n > 1 && f.pool_attn && ggml_backend_is_cpu(backend_) && !remote();
    if (g.exact) {
        const size_t np = size_t(paged_->pool().n_layers());
        g.tables.assign(np, RowTable{});
        g.attn_exact.assign(np, g.attn);
        for (size_t i = 0; i < np; ++i) g.attn_exact[i].rows = &g.tables[i];
    }
    for (int32_t il = 0; il < n_eval_layers_; ++il) {
        const int32_t pi = paged_index_[il];
        if (pi >= 0) f.caches.push_back({paged_->pool().k(pi), paged_->pool().v(pi), g.slots, g.mask, n_kv_pool,
                                         g.exact ? &g.attn_exact[pi] : &g.attn, true});
        else if (recr_index_[il] >= 0) {
            LayerCache c;
            c.conv = recr_->conv(recr_index_[il]);
            c.ssm = recr_->ssm(recr_index_[il]);
            f.caches.push_back(c);
        } else if (hp.kv_source(il) >= 0) {
            // a shared-KV layer: its source's cache (rows, mask, kernel parameters); nothing of its own is
            // written or paged, and its queries are not captured
            LayerCache c = f.caches[size_t(hp.kv_source(il))];
            c.paged = false;
            f.caches.push_back(c);
        } else f.caches.push_back({ring_->k(-2 - pi), ring_->v(-2 - pi), g.swa_slots, g.swa_mask, ring_->tokens(),
                                 &g.attn_swa, false});
    }
    // inputs every piece sets, in the graph whether or not a layer reads them (so they are allocated):
    // multi-section RoPE reads pos4, not pos
    ggml_build_forward_expand(g.gf, g.pos);
    const ArchOps &arch = model_->arch();
    ggml_tensor *x = arch.embed(f);
    for (int32_t il = 0; il < n_eval_layers_; ++il) x = arch.layer(f, il, x);
    g.q_out = f.q_out;
    if (n_eval_layers_ < hp.n_layer) {
        // A scoring runtime (a drafter cut to its first layers): the graph ends with the
        // last layer's K/V writes and captured queries; its attention output, FFN and the
        // head are never computed, and there are no logits.
        g.logits = nullptr;
        // With one layer nothing reads the masks; keep them in the graph so they are allocated.
        ggml_build_forward_expand(g.gf, g.mask);
        if (g.swa_mask) ggml_build_forward_expand(g.gf, g.swa_mask);
        finish_graph(g);
        return;
    }
    g.logits = f.head(x, all_logits);
    ggml_set_output(g.logits);
    ggml_build_forward_expand(g.gf, g.logits);
    finish_graph(g);
}

void Runtime::finish_graph(Graph &g) {
    if (remote()) {
        // The scheduler places each node with its weights (a remote layer's on its server, the embedding
        // and head here; the CPU backend last, where graph inputs go) and copies what crosses devices.
        std::vector<ggml_backend_t> bs = model_->remote_backends();
        bs.push_back(backend_);
        const size_t size = size_t(ggml_graph_size(g.gf)) * 2 + 1024;
        g.sched = ggml_backend_sched_new(bs.data(), nullptr, int(bs.size()), size, false, false);
        if (!g.sched) throw std::runtime_error("cannot create the graph scheduler");
        if (!ggml_backend_sched_alloc_graph(g.sched, g.gf))
            throw std::runtime_error("cannot allocate the compute graph across the RPC servers (out of memory there?)");
        // What ggml's server would be sent: only ops on kvflash's list (rpc_op_allowed).
        for (int i = 0; i < ggml_graph_n_nodes(g.gf); ++i) {
            ggml_tensor *t = ggml_graph_node(g.gf, i);
            if (ggml_backend_sched_get_tensor_backend(g.sched, t) == backend_) continue;
            if (!rpc_op_allowed(t)) check_rpc_graph(g.gf, i, i + 1);   // throws, naming the node
        }
        return;
    }
    if (!ggml_backend_is_cpu(backend_)) {
        // Without a scheduler every node runs on the model's backend: refuse a graph
        // it cannot run here, with the op named, instead of an abort inside ggml.
        for (int i = 0; i < ggml_graph_n_nodes(g.gf); ++i) {
            ggml_tensor *t = ggml_graph_node(g.gf, i);
            if (ggml_backend_supports_op(backend_, t)) continue;
            std::string srcs;
            for (int j = 0; j < GGML_MAX_SRC && t->src[j]; ++j) srcs += std::string(j ? ", " : "") + ggml_type_name(t->src[j]->type);
            throw std::runtime_error(std::string("the ") + ggml_backend_name(backend_) + " backend cannot run " +
                                     ggml_op_desc(t) + " (node '" + ggml_get_name(t) + "', inputs " + srcs + ") for kv_type " +
                                     cfg_.kv_type + "; try another kv_type or device='cpu'");
        }
    }
    if (reserving_) return;   // the worst case of a slot: only its op check and its size (below)
    if (own_backend_ && graph_slot_ >= 0) {
        auto &a = dev_alloc_[graph_slot_];
        if (!a) {
            // The slot's largest graph first: every paged position attended (n_kv = the pool), the most
            // tokens a piece has (ubatch) with all their logits; later graphs fit in its buffer.
            a.reset(ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend_)));
            Graph worst;
            const int32_t slot = graph_slot_;
            EvalOptions wopt;
            wopt.capture_all = cfg_.capture_queries > 0;
            reserving_ = true;
            try {
                build(worst, slot == 0 ? 1 : std::max(2, cfg_.ubatch), paged_->pool().pool_tokens(), slot == 1, wopt);
            } catch (...) {
                reserving_ = false;
                throw;
            }
            reserving_ = false;
            graph_slot_ = slot;
            if (!ggml_gallocr_reserve(a.get(), worst.gf))
                throw std::runtime_error("cannot allocate the compute graph on " + model_->device().name());
        }
        if (!ggml_gallocr_alloc_graph(a.get(), g.gf)) throw std::runtime_error("cannot allocate the compute graph");
        return;
    }
    g.alloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend_));
    if (!ggml_gallocr_alloc_graph(g.alloc, g.gf)) throw std::runtime_error("cannot allocate the compute graph");
}

bool Runtime::use_pool_attn(int32_t n) const {
    if (!ggml_backend_is_cpu(backend_) || remote()) return false;
    if (cfg_.attn == "ggml") return false;
    if (cfg_.attn == "pool") return true;
    return n <= cfg_.pool_attn_max_tokens;
}

Runtime::Graph *Runtime::get_graph(int32_t n, int32_t n_kv, bool all_logits, const EvalOptions &opt) {
    // Exact graphs have a slot of their own, so a speculative round keeps its decode graph.
    // A reread's graph binds the scratch ring (swapped in while it builds and runs): a slot of its own.
    std::unique_ptr<Graph> &slot = rereading_ ? reread_graph_ : opt.exact ? exact_graph_ : n == 1 ? decode_graph_ : batch_graph_;
    if (slot && slot->n == n && slot->n_kv == n_kv && slot->all_logits == all_logits && slot->exact == opt.exact &&
        slot->capture_all == opt.capture_all && slot->one_row == (opt.one_row_products && n > 1))
        return slot.get();
    auto t0 = clk::now();
    slot.reset();  // its allocator's buffer goes before the new one is made
    auto g = std::make_unique<Graph>();
    graph_slot_ = opt.exact ? -1 : n == 1 ? 0 : 1;
    try {
        build(*g, n, n_kv, all_logits, opt);  // may throw: the slot is only filled with a complete graph
    } catch (...) {
        graph_slot_ = -1;
        throw;
    }
    graph_slot_ = -1;
    slot = std::move(g);
    stats_.t_graph_ms += ms_since(t0);
    return slot.get();
}

void Runtime::eval(const int32_t *tokens, int32_t n, bool all_logits, float *logits_out, EvalOptions opt) {
    const Hparams &hp = model_->hparams();
    if (n <= 0) throw std::invalid_argument("eval: need at least one token");
    if (opt.exact && !ggml_backend_is_cpu(backend_))
        throw std::invalid_argument("eval: exact attention reads the host store from kvflash's CPU kernel; the model is on " +
                                    model_->device().name() + " (exact mode runs on the CPU backend only: device='cpu')");
    if (opt.one_row_products && !ggml_backend_is_cpu(backend_))
        throw std::invalid_argument("eval: one-row products are the CPU backend's arithmetic; the model is on " +
                                    model_->device().name());
    if ((opt.exact || opt.one_row_products) && remote())
        throw std::invalid_argument("eval: exact attention and one-row products are kvflash's CPU kernels; the model "
                                    "has layers on RPC servers (exact mode runs in one process)");
    if (opt.exact && cfg_.attn == "ggml")
        throw std::invalid_argument("eval: exact attention is kvflash's CPU kernel; this runtime was made with attn='ggml'");
    if (n_past_ + n > cfg_.max_ctx)
        throw std::out_of_range("eval: " + std::to_string(n_past_ + n) + " tokens exceed max_ctx " +
                                std::to_string(cfg_.max_ctx) + "; raise max_ctx or shorten the prompt");
    for (int32_t i = 0; i < n; ++i)
        if (tokens[i] < 0 || tokens[i] >= hp.n_vocab)
            throw std::invalid_argument("eval: token id " + std::to_string(tokens[i]) + " outside [0, " +
                                        std::to_string(hp.n_vocab) + ")");
    const int32_t C = cfg_.chunk_tokens, P = paged_->pool().pool_tokens();
    const int64_t start = n_past_;
    int32_t done = 0;
    // A later piece may fail: the capture window before the eval comes back with the cache.
    // (One token is one piece, which fails before it changes anything: no copy then.)
    const int32_t captured0 = n_captured_;
    std::vector<float> queries0;
    if (n > 1) queries0 = captured_q_;
    // The recurrent state before the eval, in host RAM, when the eval's pieces could write past what its
    // snapshots can take back.
    RecurrentState::HostCheckpoint state0;
    if (recr_ && n >= recr_->snapshots()) state0 = recr_->checkpoint();
    try {
    while (done < n) {
        // Batched while the prompt fits the pool; chunk-sized pieces once eviction starts.
        int32_t m = std::min(n - done, cfg_.ubatch);
        EvalOptions po = opt;
        po.exact = opt.exact && (opt.exact_until <= 0 || n_past_ < opt.exact_until);
        if (po.exact) {
            // As the full cache cuts a prompt (ubatch), unless the pool's evictable room is smaller.
            if (n_past_ + m > P) {
                const int32_t room = P - (cfg_.sink_chunks + cfg_.tail_window_chunks + 1) * C;
                m = std::min<int32_t>(m, std::max<int32_t>(1, room - int32_t(n_past_ % C)));
            }
            if (opt.exact_until > 0) m = int32_t(std::min<int64_t>(m, opt.exact_until - n_past_));
        } else if (n_past_ + m > P) {
            const int32_t piece = std::min(cfg_.prefill_piece > 0 ? cfg_.prefill_piece : C, cfg_.ubatch);
            m = std::min<int32_t>(n - done, std::max<int32_t>(1, piece - int32_t(n_past_ % C)));
        }
        // A recurrent state is checkpointed at the last chunk boundary a piece crosses only while its
        // snapshots still hold the state there: a piece that would run past them ends at the boundary
        // instead (one more piece per eval at most), so every eval leaves a checkpoint at its last
        // boundary and a later turn re-reads less than a chunk past it.
        if (recr_ && cfg_.recurrent_checkpoints > 0) {
            const int64_t end = n_past_ + m, b = end / C * C;
            if (b > n_past_ && end - b >= recr_->snapshots()) m = int32_t(b - n_past_);
        }
        const bool last = done + m == n;
        float *out = logits_out;
        if (all_logits) out = logits_out + size_t(done) * hp.n_vocab;
        eval_piece(tokens + done, m, all_logits, (all_logits || last) ? out : nullptr, po);
        done += m;
        if (opt.progress) opt.progress(done, n);
        if (!last && interrupt_ && interrupt_()) throw EvalInterrupted();
    }
    } catch (...) {
        // All or nothing: a failure (or an interrupt) in a later piece takes back the
        // earlier ones, unless the sliding-window ring cannot rewind that far.
        // (the recurrent state's checkpoint also undoes a failed piece's writes over the rows it read)
        if (n_past_ > start || state0.pos == start) {
            try {
                truncate_to(start, state0.pos == start ? &state0 : nullptr);
                captured_q_.swap(queries0);
                n_captured_ = captured0;
            } catch (const std::exception &) {}
        }
        throw;
    }
}

void Runtime::eval_piece(const int32_t *tokens, int32_t n, bool all_logits, float *logits_out, const EvalOptions &opt) {
    const int64_t pos0 = n_past_;
    const int32_t P = paged_->pool().pool_tokens();
    std::vector<int32_t> slots(n);
    if (paged_->pager().alloc_span(pos0, n, slots.data()) == AllocResult::NO_ROOM)
        throw std::runtime_error("eval: the pool has no room for " + std::to_string(n) + " tokens; use a larger pool");
    // a pooled piece once something is on the host only: it attends less than the whole context
    // (asked until the first such piece only: the pager's count walks every chunk, and decode passes here)
    const bool pooled = pooled_from_ < 0 && !opt.exact && !full_cache_ && paged_->pager().stats().host_chunks > 0;
    // Attention covers the occupied prefix of the pool, in steps of 256 slots; exact attention covers
    // the context's positions in the same steps (what the full cache's identity placement attends).
    const int32_t n_kv = opt.exact ? int32_t((pos0 + n + 255) / 256 * 256)
                                   : std::min(P, std::max(256, (paged_->pager().used_extent() + 255) / 256 * 256));
    Graph *g = nullptr;
    try {
        g = get_graph(n, n_kv, all_logits && n > 1, opt);
        auto t0 = clk::now();
        ggml_backend_tensor_set(g->tokens, tokens, 0, sizeof(int32_t) * n);
        set_masks(*g, pos0, n, slots.data(), n_kv);
        if (g->exact) set_exact_rows(*g, pos0, n);
        stats_.t_mask_ms += ms_since(t0);
        t0 = clk::now();
        {
            // One graph at a time on the model's backend (model.h): runtimes sharing a model
            // share its CPU work buffer and thread pool (or its CUDA stream).
            std::lock_guard<std::mutex> lock(model_->compute_mutex());
            const ggml_status st = g->sched ? ggml_backend_sched_graph_compute(g->sched, g->gf)
                                            : ggml_backend_graph_compute(backend_, g->gf);
            if (st != GGML_STATUS_SUCCESS) throw std::runtime_error("eval: graph compute failed");
            sync_for_host_read();
        }
        stats_.t_compute_ms += ms_since(t0);
    } catch (...) {
        // The piece's positions were allocated but never computed: every memory forgets them, so
        // the pager, the ring and n_past agree again.
        for (Memory *m : memories_) m->truncate(pos0);
        decode_mask_epoch_ = -1;
        throw;
    }
    n_past_ = pos0 + n;
    if (pooled && pooled_from_ < 0) pooled_from_ = pos0;
    if (hist_.on && ring_) history_put(*ring_, pos0, n);
    if (recr_) take_checkpoint();
    stats_.n_eval_calls++;
    stats_.n_tokens_evaluated += n;
    if (logits_out && g->logits) ggml_backend_tensor_get(g->logits, logits_out, 0, ggml_nbytes(g->logits));
    else if (logits_out) std::fill(logits_out, logits_out + size_t(all_logits && n > 1 ? n : 1) * model_->hparams().n_vocab, 0.f);
    if (g->n_capture > 0) keep_captured(*g, cfg_.capture_queries + (g->capture_all ? g->n : 0));
    if (observer_) observer_->evaluated(*this, pos0, n);
}

// Positions, slots and masks of a piece at [pos0, pos0 + n).
void Runtime::set_masks(Graph &g, int64_t pos0, int32_t n, const int32_t *slots32, int32_t n_kv) {
    const Pager &pg = paged_->pager();
    const int32_t P = paged_->pool().pool_tokens();
    std::vector<int32_t> pos(n);
    std::vector<int64_t> pos64(n), slots(n);
    for (int32_t i = 0; i < n; ++i) {
        pos[i] = int32_t(pos0 + i);
        pos64[i] = pos0 + i;
        slots[i] = slots32[i];
    }
    ggml_backend_tensor_set(g.pos, pos.data(), 0, sizeof(int32_t) * n);
    ggml_backend_tensor_set(g.slots, slots.data(), 0, sizeof(int64_t) * n);
    if (g.exact) {
        decode_mask_epoch_ = -1;   // set_exact_rows writes this graph's mask (over positions)
    } else if (n == 1) {
        // Decode: rebuild the mask only when residency changed; else unmask the new slot.
        if (decode_mask_epoch_ != pg.epoch() || int32_t(decode_mask_.size()) != P) {
            decode_mask_.resize(P);
            pg.fill_mask(pos64.data(), 1, decode_mask_.data(), P);
            decode_mask_epoch_ = pg.epoch();
        } else {
            decode_mask_[slots[0]] = 0;
        }
        ggml_backend_tensor_set(g.mask, decode_mask_.data(), 0, sizeof(uint16_t) * n_kv);
    } else {
        std::vector<uint16_t> mask(size_t(n_kv) * n);
        pg.fill_mask(pos64.data(), n, mask.data(), n_kv);
        ggml_backend_tensor_set(g.mask, mask.data(), 0, sizeof(uint16_t) * size_t(n_kv) * n);
        decode_mask_epoch_ = -1;
    }
    if (g.pos4) {   // text tokens: the position in the first three sections, 0 in the fourth
        std::vector<int32_t> p4(4 * size_t(n), 0);
        for (int32_t i = 0; i < n; ++i) p4[size_t(i)] = p4[size_t(n + i)] = p4[size_t(2 * n + i)] = pos[size_t(i)];
        ggml_backend_tensor_set(g.pos4, p4.data(), 0, sizeof(int32_t) * p4.size());
    }
    if (recr_) {
        std::vector<int32_t> ci(size_t(recr_->d_conv() - 1)), si(1);
        std::vector<int64_t> co(size_t(recr_->conv_written(n))), so(size_t(recr_->ssm_written(n)));
        recr_->place(pos0, n, ci.data(), co.data(), si.data(), so.data());
        ggml_backend_tensor_set(g.conv_in, ci.data(), 0, sizeof(int32_t) * ci.size());
        ggml_backend_tensor_set(g.conv_out, co.data(), 0, sizeof(int64_t) * co.size());
        ggml_backend_tensor_set(g.ssm_in, si.data(), 0, sizeof(int32_t));
        ggml_backend_tensor_set(g.ssm_out, so.data(), 0, sizeof(int64_t) * so.size());
    }
    if (!ring_) return;
    std::vector<int64_t> rs(n);
    std::vector<uint16_t> mask(size_t(ring_->tokens()) * n);
    ring_->place(pos0, n, rs.data(), mask.data());
    ggml_backend_tensor_set(g.swa_slots, rs.data(), 0, sizeof(int64_t) * n);
    ggml_backend_tensor_set(g.swa_mask, mask.data(), 0, sizeof(uint16_t) * mask.size());
}

// The capture is a window over the last capture_queries positions across evals (a
// decode step adds one query; the window still holds the ones before it).  The
// previous window ends at the piece's first position: truncate trims it with the cache.
void Runtime::keep_captured(const Graph &g, int32_t cap) {
    const Hparams &hp = model_->hparams();
    const size_t qsz = size_t(hp.n_head) * hp.head_dim_k, nl = g.q_out.size();
    const int32_t nc = g.n_capture, keep = std::min(n_captured_, std::max(0, cap - nc));
    std::vector<float> next(size_t(keep + nc) * qsz * nl);
    for (size_t l = 0; l < nl; ++l) {
        float *dst = next.data() + l * size_t(keep + nc) * qsz;
        if (keep > 0)
            std::memcpy(dst, captured_q_.data() + (l * size_t(n_captured_) + (n_captured_ - keep)) * qsz,
                        size_t(keep) * qsz * sizeof(float));
        ggml_backend_tensor_get(g.q_out[l], dst + size_t(keep) * qsz, 0, size_t(nc) * qsz * sizeof(float));
    }
    captured_q_.swap(next);
    n_captured_ = keep + nc;
}

// Exact pieces: per paged layer a row table over the positions' chunks (the pool's block where the
// chunk is resident, else its host-store copy: [layer][K rows][V rows] in a host chunk), and the
// causal mask over positions.  After alloc_span, so the piece's evictions are already in the store.
void Runtime::set_exact_rows(Graph &g, int64_t pos0, int32_t n) {
    Pager &pg = paged_->pager();
    const KVPool &pool = paged_->pool();
    const int32_t C = cfg_.chunk_tokens, n_kv = g.n_kv, nch = (n_kv + C - 1) / C;
    size_t widest = 0;   // the stand-in chunk is sized once, before any table points into it
    for (size_t pi = 0; pi < g.tables.size(); ++pi)
        widest = std::max({widest, size_t(C) * pool.k(int32_t(pi))->nb[1], size_t(C) * pool.v(int32_t(pi))->nb[1]});
    if (zero_rows_.size() < widest) zero_rows_.assign(widest, 0);
    size_t host_off = 0;
    for (size_t pi = 0; pi < g.tables.size(); ++pi) {
        const ggml_tensor *k = pool.k(int32_t(pi)), *v = pool.v(int32_t(pi));
        const size_t kc = size_t(C) * k->nb[1], vc = size_t(C) * v->nb[1];
        RowTable &t = g.tables[pi];
        t.chunk_rows = C;
        t.k.assign(nch, zero_rows_.data());
        t.v.assign(nch, zero_rows_.data());
        for (int32_t c = 0; c < std::min(nch, pg.n_chunks()); ++c) {
            if (const int32_t b = pg.block_of(c); b >= 0) {
                t.k[c] = static_cast<const char *>(k->data) + size_t(b) * kc;
                t.v[c] = static_cast<const char *>(v->data) + size_t(b) * vc;
            } else if (const int32_t h = pg.host_of(c); h >= 0) {
                const char *hb = reinterpret_cast<const char *>(pg.host_store().ptr(h)) + host_off;
                t.k[c] = hb;
                t.v[c] = hb + kc;
            }
        }
        host_off += kc + vc;
    }
    std::vector<uint16_t> mask(size_t(n_kv) * n, 0xFC00);
    for (int32_t i = 0; i < n; ++i)
        std::fill_n(mask.begin() + size_t(i) * n_kv, std::min<int64_t>(n_kv, pos0 + i + 1), uint16_t(0));
    ggml_backend_tensor_set(g.mask, mask.data(), 0, sizeof(uint16_t) * mask.size());
}

void Runtime::check_remote_ops(int32_t n) {
    if (n < 1) throw std::invalid_argument("check_remote_ops: need at least one token");
    Graph g;
    build(g, n, std::min(paged_->pool().pool_tokens(), 256), false, EvalOptions{});
    check_rpc_graph(g.gf);
}

void Runtime::trim_captured() {
    const int32_t cap = std::max(0, cfg_.capture_queries);
    if (n_captured_ <= cap) return;
    const Hparams &hp = model_->hparams();
    const size_t qsz = size_t(hp.n_head) * hp.head_dim_k, nl = captured_q_.size() / (size_t(n_captured_) * qsz);
    std::vector<float> next(size_t(cap) * qsz * nl);
    for (size_t l = 0; l < nl && cap > 0; ++l)
        std::memcpy(next.data() + l * size_t(cap) * qsz,
                    captured_q_.data() + (l * size_t(n_captured_) + (n_captured_ - cap)) * qsz, size_t(cap) * qsz * sizeof(float));
    captured_q_.swap(next);
    n_captured_ = cap;
}

int32_t Runtime::captured_layers() const { return paged_->pool().n_layers(); }  // the paged layers evaluated

void Runtime::set_captured(std::vector<float> q, int32_t k) {
    const Hparams &hp = model_->hparams();
    if (k < 0 || k > cfg_.capture_queries || k > n_past_)
        throw std::invalid_argument("set_captured: " + std::to_string(k) + " queries, at most capture_queries (" +
                                    std::to_string(cfg_.capture_queries) + ") and n_past (" +
                                    std::to_string(n_past_) + ")");
    const size_t want = size_t(captured_layers()) * size_t(k) * hp.n_head * hp.head_dim_k;
    if (q.size() != want)
        throw std::invalid_argument("set_captured: " + std::to_string(q.size()) + " floats for " + std::to_string(k) +
                                    " queries; expected " + std::to_string(want) +
                                    " ([paged layers][queries][n_head][head_dim])");
    captured_q_ = std::move(q);
    n_captured_ = k;
}

void Runtime::truncate(int64_t n_past) {
    const RecurrentState::HostCheckpoint *ck = nullptr;
    for (const auto &c : checkpoints_)
        if (c.pos == n_past) ck = &c;
    if (ck) {   // copied: truncate_to drops the checkpoints past n_past (not this one, but keep it simple)
        const RecurrentState::HostCheckpoint keep = *ck;
        truncate_to(n_past, &keep);
        return;
    }
    truncate_to(n_past, nullptr);
}

void Runtime::take_checkpoint() {
    if (cfg_.recurrent_checkpoints <= 0) return;
    const int64_t C = cfg_.chunk_tokens, c = n_past_ / C * C;
    if (c <= 0 || (!checkpoints_.empty() && checkpoints_.back().pos >= c) || !recr_->can_checkpoint(c)) return;
    checkpoints_.push_back(recr_->checkpoint(c));
    if (checkpoints_.size() <= size_t(cfg_.recurrent_checkpoints)) return;
    // Over the limit: drop the checkpoint whose neighbours are closest together relative to its age (the
    // oldest and the newest two stay), so the kept ones thin out about geometrically with age and a rewind
    // of d tokens re-reads O(d) more, whatever d is -- a prompt's settling re-read (a few chunks back)
    // finds one near, and a chat turn's cut (a few tokens back: past the newest boundary, or just before
    // it) re-reads less than a chunk past it.
    size_t drop = 0;
    double rel = std::numeric_limits<double>::max();
    const int64_t newest = checkpoints_.back().pos;
    const size_t keep_newest = checkpoints_.size() >= 4 ? 2 : 1;
    for (size_t i = 1; i + keep_newest < checkpoints_.size(); ++i) {
        const double g = double(checkpoints_[i + 1].pos - checkpoints_[i - 1].pos) /
                         double(newest - checkpoints_[i].pos + C);
        if (g < rel) { rel = g; drop = i; }   // ties: the older one
    }
    checkpoints_.erase(checkpoints_.begin() + std::ptrdiff_t(drop));
}

int64_t Runtime::rewind_point(int64_t n) const {
    if (n <= 0) return 0;
    auto reaches = [&](int64_t p, const Memory *skip) {
        for (const Memory *m : memories_)
            if (m != skip && n_past_ - p > m->max_rewind()) return false;
        return true;
    };
    if (n >= n_past_ || reaches(n, nullptr)) return std::min(n, n_past_);
    for (auto it = checkpoints_.rbegin(); it != checkpoints_.rend(); ++it)
        if (it->pos <= n && reaches(it->pos, recr_.get())) return it->pos;
    return 0;
}

void Runtime::truncate_to(int64_t n_past, const RecurrentState::HostCheckpoint *ck) {
    if (n_past < 0 || n_past > n_past_)
        throw std::out_of_range("truncate: n_past must be in [0, " + std::to_string(n_past_) + "]");
    // the recurrent state comes back from a checkpoint taken at n_past, when one is given
    const Memory *restored = ck && recr_ && ck->pos == n_past ? recr_.get() : nullptr;
    for (const Memory *m : memories_)   // every memory can go back that far (to 0 always), or nothing changes
        if (m != restored && n_past > 0 && n_past_ - n_past > m->max_rewind())
            throw std::invalid_argument(m->rewind_refusal(n_past));
    for (Memory *m : memories_)
        if (m != restored) m->truncate(n_past);
    if (restored) recr_->restore(*ck);
    while (!checkpoints_.empty() && checkpoints_.back().pos > n_past) checkpoints_.pop_back();
    if (pooled_from_ >= n_past) pooled_from_ = -1;
    hist_.hi = std::min(hist_.hi, n_past);
    hist_.lo = std::min(hist_.lo, hist_.hi);
    if (observer_) observer_->truncated(*this, n_past);
    // Captured queries at positions >= n_past go with the cache; the window keeps its start.
    if (n_captured_ > 0) {
        const int64_t first = n_past_ - n_captured_;
        const int32_t keep = int32_t(std::max<int64_t>(0, n_past - first));
        if (keep < n_captured_) {
            const Hparams &hp = model_->hparams();
            const size_t qsz = size_t(hp.n_head) * hp.head_dim_k, nl = captured_q_.size() / (size_t(n_captured_) * qsz);
            std::vector<float> next(size_t(keep) * qsz * nl);
            for (size_t l = 0; l < nl && keep > 0; ++l)
                std::memcpy(next.data() + l * size_t(keep) * qsz, captured_q_.data() + l * size_t(n_captured_) * qsz,
                            size_t(keep) * qsz * sizeof(float));
            captured_q_.swap(next);
            n_captured_ = keep;
        }
    }
    n_past_ = n_past;
    decode_mask_epoch_ = -1;
}

int64_t Runtime::max_rewind() const {
    int64_t r = std::numeric_limits<int64_t>::max();
    for (const Memory *m : memories_) r = std::min(r, m->max_rewind());
    return r;
}

void Runtime::reset() {
    for (Memory *m : memories_) m->reset();
    checkpoints_.clear();
    pooled_from_ = -1;
    hist_.base = hist_.lo = hist_.hi = 0;
    if (observer_) observer_->truncated(*this, 0);
    n_captured_ = 0;
    n_past_ = 0;
    decode_mask_epoch_ = -1;
}

void Runtime::sync_for_host_read() const {
    paged_->pool().fence();                       // queued page-outs/ins done (copy stream)
    ggml_backend_synchronize(backend_); // queued kernels done (compute stream)
}

void Runtime::chunk_keys(int32_t c, int32_t il, float *out) const {
    sync_for_host_read();
    chunk_keys_synced(c, il, out);
}

void Runtime::chunk_keys_synced(int32_t c, int32_t il, float *out) const {
    const Pager &pg = paged_->pager();
    const int32_t C = cfg_.chunk_tokens, b = pg.block_of(c);
    if (b < 0) throw std::invalid_argument("chunk_keys: chunk " + std::to_string(c) + " is not resident");
    if (il < 0 || il >= paged_->pool().n_layers()) throw std::out_of_range("chunk_keys: bad paged layer");
    ggml_tensor *k = paged_->pool().k(il);
    const int64_t E = k->ne[0];
    std::vector<uint8_t> raw(size_t(C) * k->nb[1]);
    ggml_backend_tensor_get(k, raw.data(), size_t(b) * C * k->nb[1], raw.size());
    const auto *tr = ggml_get_type_traits(k->type);
    for (int32_t i = 0; i < C; ++i) {
        float *row = out + size_t(i) * E;
        if (pg.slot_of(int64_t(c) * C + i) < 0) { std::fill(row, row + E, 0.f); continue; }
        if (k->type == GGML_TYPE_F32) std::memcpy(row, raw.data() + size_t(i) * k->nb[1], E * sizeof(float));
        else tr->to_float(raw.data() + size_t(i) * k->nb[1], row, E);
    }
}

// ---- reread: a past span computed again in place with exact attention

void Runtime::history_put(const SlidingRing &from, int64_t pos0, int32_t n) {
    // the history stays one contiguous run of positions: a piece that does not extend it starts it again
    if (pos0 < hist_.lo || pos0 > hist_.hi) {
        hist_.base = hist_.lo = hist_.hi = pos0;
        for (auto &r : hist_.k) r.clear();
        for (auto &r : hist_.v) r.clear();
    }
    const int32_t nl = from.n_layers(), R = from.tokens();
    hist_.k.resize(size_t(nl));
    hist_.v.resize(size_t(nl));
    for (int32_t i = 0; i < nl; ++i)
        for (bool isv : {false, true}) {
            const ggml_tensor *t = isv ? from.v(i) : from.k(i);
            std::vector<uint8_t> &rows = isv ? hist_.v[size_t(i)] : hist_.k[size_t(i)];
            const size_t rb = t->nb[1];
            rows.resize(std::max(rows.size(), size_t(pos0 + n - hist_.base) * rb));
            for (int32_t j = 0; j < n;) {   // ring rows are contiguous up to its wrap
                const int64_t r = (pos0 + j) % R;
                const int32_t m = int32_t(std::min<int64_t>(n - j, R - r));
                ggml_backend_tensor_get(t, rows.data() + size_t(pos0 + j - hist_.base) * rb, size_t(r) * rb, size_t(m) * rb);
                j += m;
            }
        }
    hist_.hi = std::max(hist_.hi, pos0 + n);   // (a reread rewrites rows inside the run)
}

void Runtime::keep_swa_history(bool on) {
    hist_ = SwaHistory{};
    hist_.on = on;
    if (!on || !ring_ || n_past_ == 0) return;
    // seeded with the run of positions before n_past the ring still holds
    const std::vector<int64_t> &held = ring_->positions();
    const int32_t R = ring_->tokens();
    int64_t from = n_past_;
    while (from > 0 && n_past_ - from < R && held[size_t((from - 1) % R)] == from - 1) --from;
    hist_.base = hist_.lo = hist_.hi = from;
    if (from < n_past_) history_put(*ring_, from, int32_t(n_past_ - from));
}

std::string Runtime::reread_refusal(int64_t pos0, int32_t n) const {
    if (!ggml_backend_is_cpu(backend_) || remote())
        return "reread: exact attention reads the host store from kvflash's CPU kernel, in one process (the CPU "
               "backend only)";
    if (cfg_.attn == "ggml") return "reread: exact attention is kvflash's CPU kernel; this runtime was made with attn='ggml'";
    if (recr_) return "reread: recurrent layers carry their state forward; a past span cannot be read again in place";
    if (n <= 0 || pos0 < 0 || pos0 + n > n_past_)
        return "reread: the span [" + std::to_string(pos0) + ", " + std::to_string(pos0 + n) + ") must be written: inside [0, " +
               std::to_string(n_past_) + ")";
    const Pager &pg = paged_->pager();
    const int32_t C = cfg_.chunk_tokens;
    for (int64_t c = pos0 / C; c <= (pos0 + n - 1) / C; ++c)
        if (pg.block_of(int32_t(c)) < 0) return "reread: chunk " + std::to_string(c) + " is not resident (recall it first)";
    for (int64_t p = pos0; p < pos0 + n; ++p)
        if (pg.slot_of(p) < 0) return "reread: position " + std::to_string(p) + " is not written";
    if (ring_) {
        const int64_t need = std::max<int64_t>(0, pos0 - ring_->window() + 1);
        if (!hist_.on) return "reread: the sliding-window layers need their history (keep_swa_history(true) before the span is read)";
        if (hist_.lo > need || hist_.hi < pos0 + n)
            return "reread: the sliding history holds [" + std::to_string(hist_.lo) + ", " + std::to_string(hist_.hi) +
                   "), not the window before the span and the span ([" + std::to_string(need) + ", " +
                   std::to_string(pos0 + n) + "))";
    }
    return "";
}

void Runtime::reread(const int32_t *tokens, int64_t pos0, int32_t n) {
    const std::string why = reread_refusal(pos0, n);
    if (!why.empty()) throw std::invalid_argument(why);
    const int32_t V = model_->hparams().n_vocab;
    for (int32_t i = 0; i < n; ++i)
        if (tokens[i] < 0 || tokens[i] >= V)
            throw std::invalid_argument("reread: token id " + std::to_string(tokens[i]) + " outside [0, " + std::to_string(V) + ")");
    // pieces as exact prefill cuts them (ubatch); with sliding layers no longer than the scratch ring
    // holds beside the window
    int32_t most = cfg_.ubatch;
    if (ring_) most = std::min(most, ring_->tokens() - ring_->window());
    most = std::max(1, most);
    for (int32_t done = 0; done < n;) {
        const int32_t m = std::min(n - done, most);
        reread_piece(tokens + done, pos0 + done, m, done == 0);
        done += m;
    }
}

void Runtime::reread_piece(const int32_t *tokens, int64_t pos0, int32_t n, bool load_window) {
    Pager &pg = paged_->pager();
    const int32_t C = cfg_.chunk_tokens;
    std::vector<int32_t> slots(n);
    for (int32_t i = 0; i < n; ++i) slots[size_t(i)] = pg.slot_of(pos0 + i);
    if (ring_) {
        if (!scratch_ring_) {
            const Hparams &hp = model_->hparams();
            scratch_ring_ = std::make_unique<SlidingRing>(backend_, ring_->tokens(), ring_->window(), ring_->k(0)->type,
                                                          hp.n_embd_k_swa(), hp.n_embd_v_swa(), ring_bufts_);
        }
        if (load_window) {
            // the scratch ring holds the window before pos0, from the history (the pieces after the first
            // find theirs there: the ring holds the window plus a piece)
            SlidingRing &sr = *scratch_ring_;
            const int32_t R = sr.tokens();
            std::vector<int64_t> held(size_t(R), -1);
            for (int64_t p = std::max<int64_t>(0, pos0 - sr.window() + 1); p < pos0; ++p) {
                held[size_t(p % R)] = p;
                for (int32_t i = 0; i < sr.n_layers(); ++i) {
                    const size_t kb = sr.k(i)->nb[1], vb = sr.v(i)->nb[1];
                    ggml_backend_tensor_set(sr.k(i), hist_.k[size_t(i)].data() + size_t(p - hist_.base) * kb, size_t(p % R) * kb, kb);
                    ggml_backend_tensor_set(sr.v(i), hist_.v[size_t(i)].data() + size_t(p - hist_.base) * vb, size_t(p % R) * vb, vb);
                }
            }
            sr.set_positions(std::move(held));
        }
    }
    // the rows change from here on: the host copies of the span's chunks are stale
    for (int64_t c = pos0 / C; c <= (pos0 + n - 1) / C; ++c) pg.mark_dirty(int32_t(c));
    struct Swap {   // the scratch ring stands in for the decode ring while the piece builds and runs
        Runtime &rt;
        explicit Swap(Runtime &r) : rt(r) {
            rt.rereading_ = true;
            if (rt.ring_) std::swap(rt.ring_, rt.scratch_ring_);
        }
        ~Swap() {
            if (rt.ring_) std::swap(rt.ring_, rt.scratch_ring_);
            rt.rereading_ = false;
            rt.decode_mask_epoch_ = -1;
        }
    };
    const int32_t n_kv = int32_t((pos0 + n + 255) / 256 * 256);
    EvalOptions opt;
    opt.exact = true;
    {
        Swap swap(*this);
        Graph *g = get_graph(n, n_kv, false, opt);
        auto t0 = clk::now();
        ggml_backend_tensor_set(g->tokens, tokens, 0, sizeof(int32_t) * n);
        set_masks(*g, pos0, n, slots.data(), n_kv);
        set_exact_rows(*g, pos0, n);
        stats_.t_mask_ms += ms_since(t0);
        t0 = clk::now();
        std::lock_guard<std::mutex> lock(model_->compute_mutex());
        if (ggml_backend_graph_compute(backend_, g->gf) != GGML_STATUS_SUCCESS)
            throw std::runtime_error("reread: graph compute failed");
        sync_for_host_read();
        stats_.t_compute_ms += ms_since(t0);
    }
    stats_.n_eval_calls++;
    stats_.n_tokens_evaluated += n;
    if (ring_) {
        // the new sliding rows: into the history, and into the decode ring where it still holds them
        history_put(*scratch_ring_, pos0, n);
        const int32_t R = ring_->tokens(), Rs = scratch_ring_->tokens();
        std::vector<uint8_t> row;
        for (int64_t p = pos0; p < pos0 + n; ++p) {
            if (ring_->positions()[size_t(p % R)] != p) continue;
            for (int32_t i = 0; i < ring_->n_layers(); ++i)
                for (bool isv : {false, true}) {
                    ggml_tensor *src = isv ? scratch_ring_->v(i) : scratch_ring_->k(i), *dst = isv ? ring_->v(i) : ring_->k(i);
                    const size_t rb = dst->nb[1];
                    row.resize(rb);
                    ggml_backend_tensor_get(src, row.data(), size_t(p % Rs) * rb, rb);
                    ggml_backend_tensor_set(dst, row.data(), size_t(p % R) * rb, rb);
                }
        }
    }
    if (observer_) observer_->rewritten(*this, pos0, n);
}

}  // namespace kvflash
