// Architecture families: what each reads from a GGUF and how its layers compute.
//
// A family is one ArchOps in one arch_*.cpp file, listed once in KVFLASH_ARCHS
// (arch.cpp).  Model::load reads the keys and tensors every family shares, then
// calls the family's read_hparams and load_layer; Runtime builds the graph as
// embed, then layer for each evaluated layer, then the shared head.  A family's
// layer gets its attention from Forward::attention, the one block that reads and
// writes the paged pool (or the sliding-window ring).
//
// Shapes follow ggml order (innermost first).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ggml.h"
#include "gguf.h"
#include "kvflash/attn_cpu.h"
#include "kvflash/model.h"

namespace kvflash {

// Typed reads of GGUF metadata; every failure is std::invalid_argument naming the file and key.
struct GGUFKeys {
    gguf_context *g;
    std::string file, arch;
    int64_t find(const std::string &k) const { return gguf_find_key(g, k.c_str()); }
    [[noreturn]] void bad(const std::string &k, const std::string &why) const;
    // The key's id; -1 when absent and not required (bad() when required).
    int64_t need(const std::string &k, bool required) const;
    // Any integer type; def when absent and not required.
    int64_t get_int(const std::string &k, int64_t def, bool required) const;
    // An integer array (bools too) of at most max_n values, or a scalar integer as one value; empty
    // when absent and not required.
    std::vector<int64_t> get_ints(const std::string &k, size_t max_n, bool required) const;
    // f32/f64, or an integer.
    double get_float(const std::string &k, double def, bool required) const;
    std::string get_str(const std::string &k, const std::string &def, bool required) const;
    // The same under "<arch>.": a() required by default, f() optional.
    int64_t a(const char *suffix, int64_t def = 0, bool req = true) const { return get_int(arch + "." + suffix, def, req); }
    double f(const char *suffix, double def = 0, bool req = false) const { return get_float(arch + "." + suffix, def, req); }
    bool has(const char *suffix) const { return find(arch + "." + suffix) >= 0; }
    // <arch>.suffix as a float that must be finite (and > 0 when positive); invalid_argument otherwise.
    float finite(const char *suffix, double def, bool positive) const;
};

// Weight lookup with its shape checked (std::invalid_argument when missing or misshapen).
struct TensorLoader {
    std::string file;
    ggml_context *meta;
    // shape in ggml order; trailing dims of the tensor must be 1.
    ggml_tensor *get(const std::string &name, const std::vector<int64_t> &shape, bool required = true) const;
    static std::string weight(int32_t il, const char *what) { return "blk." + std::to_string(il) + "." + what + ".weight"; }
    static std::string bias(int32_t il, const char *what) { return "blk." + std::to_string(il) + "." + what + ".bias"; }
};

// Where one layer's K/V rows live while a graph is built.
struct LayerCache {
    ggml_tensor *k = nullptr, *v = nullptr;   // stored rows [n_embd_k, n_rows], [n_embd_v, n_rows]
    ggml_tensor *slots = nullptr;             // [n] i64: the row each new token is written to
    ggml_tensor *mask = nullptr;              // [n_kv, n] f16: 0 visible, -inf not
    int64_t n_kv = 0;                         // rows attended over (a prefix of the stored rows)
    PoolAttnParams *params = nullptr;         // the CPU pool kernel's parameters (stable address)
    bool paged = false;                       // a pool layer (its queries may be captured)
    // a recurrent layer instead: its rings (memory.h RecurrentState), read and written at the Forward's rows
    ggml_tensor *conv = nullptr, *ssm = nullptr;
};

// One forward graph being built over n tokens: inputs, caches and the shared blocks.
struct Forward {
    ggml_context *ctx = nullptr;
    ggml_cgraph *gf = nullptr;
    const Model *model = nullptr;
    const Hparams *hp = nullptr;
    int32_t n = 0;
    ggml_tensor *tokens = nullptr, *pos = nullptr;   // [n] i32 each
    ggml_tensor *pos4 = nullptr;                     // multi-section RoPE positions [4 n] (hp->rope_multi)
    // recurrent layers' ring rows (RecurrentState::place): read conv_in [d_conv - 1] and ssm_in [1] (i32),
    // write conv_out and ssm_out (i64)
    ggml_tensor *conv_in = nullptr, *conv_out = nullptr, *ssm_in = nullptr, *ssm_out = nullptr;
    std::vector<LayerCache> caches;                  // per evaluated layer
    // per evaluated layer, the stored K / V rows after its writes (attention sets them): a layer that shares
    // another's KV (Hparams::kv_src) attends over its source's, ordered after the source's writes
    std::vector<ggml_tensor *> stored_k, stored_v;
    // gemma4's per-layer embeddings [n_embd_per_layer, n, n_layer] (its embed builds them, its layers read them)
    ggml_tensor *per_layer_inp = nullptr;
    bool pool_attn = false;                          // kvflash's CPU kernel, else ggml_flash_attn_ext
    int32_t n_capture = 0;                           // queries of the last n_capture tokens kept per paged layer
    std::vector<ggml_tensor *> q_out;                // captured queries: [D, H, n_capture] per paged layer
    // Every token's matrix products as a one-token graph computes them (one_row_cpu.h): the weights
    // of layer(il, 1), each column with ggml's one-row arithmetic.  Exact mode's verification pass.
    bool one_row = false;
    // Only the last token's logits are read (a prompt piece): the last layer's attention output feeds
    // nothing else, so there only the last query attends (Forward::attention).
    bool last_row_only = false;

    // The weights layer il multiplies by in this graph.
    const LayerWeights &weights(int32_t il) const { return model->layer(il, one_row ? 1 : n); }
    // w [K, M] times x [K, cols] -> [M, cols]: ggml_mul_mat, or one_row_products when one_row.
    ggml_tensor *mm(ggml_tensor *w, ggml_tensor *x) const;

    // t: [n_embd or D, ...]; RMS norm times w.
    ggml_tensor *norm(ggml_tensor *t, ggml_tensor *w) const;
    // The attention-over-pool block of layer il.  q: [D, H, n], k: [D, Hkv, n] (normed, pre-RoPE),
    // v: [n_embd_v, n] (D, Hkv: the layer's, Hparams::head_dim_at / n_head_kv_at).  RoPE (the layer's base:
    // sliding or global; its frequency factors where the layer has rope_freqs), the query capture, q *= q_scale
    // (skipped when 1), K/V stored at the slots, attention with softmax scale kq_scale over the
    // layer's visible rows.  A layer that reads another's KV (Hparams::kv_source) passes k = v = nullptr: it
    // stores nothing and attends over its source's rows with its source's mask.  Returns [D*H, n].  In the
    // model's last layer with last_row_only, every row's K/V are stored but only the last query attends;
    // its output is repeated over the n rows (the other rows' results are never read).
    ggml_tensor *attention(int32_t il, ggml_tensor *q, ggml_tensor *k, ggml_tensor *v, float q_scale, float kq_scale);
    // The feed-forward block of layer il on x [n_embd, n] (normed): SwiGLU, or the routed mixture
    // when the model has experts (moe), plus the shared expert where the layer has one.
    ggml_tensor *ffn(int32_t il, ggml_tensor *x);
    // Experts w [K, M, n_expert] times x [K, rows, n] for the experts ids [k, n] (i32) picked per token
    // -> [M, k, n] (rows: 1, broadcast to the k experts, or k): ggml_mul_mat_id, or with one_row one
    // routed product per token, each as a one-token graph computes it.
    ggml_tensor *mm_id(ggml_tensor *w, ggml_tensor *x, ggml_tensor *ids) const;
    // x: [n_embd, n] -> logits [n_vocab, n or 1]: output norm, output matrix, softcap when set.
    ggml_tensor *head(ggml_tensor *x, bool all_logits) const;
};

struct ArchOps {
    const char *name;   // general.architecture
    // After the shared keys: this family's own keys and variant switches (rope mode, scales, windows).
    void (*read_hparams)(const GGUFKeys &kv, Hparams &hp);
    // After the shared tensors of layer il: the family's own (biases, q/k norms, post norms).
    void (*load_layer)(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L);
    // Token embedding: returns x [n_embd, n].
    ggml_tensor *(*embed)(Forward &f);
    // Layer il over x [n_embd, n]; returns the residual stream after it.
    ggml_tensor *(*layer)(Forward &f, int32_t il, ggml_tensor *x);
    // load_layer loads every tensor of a layer (the hybrids: their layers are not the shared
    // attention + FFN block); else Model::load reads the shared ones first.
    bool whole_layers = false;
    // The family's graph takes YaRN RoPE (Hparams::rope_ext_factor != 0); a file asking for it is refused
    // by the others.
    bool yarn = false;
    // The family's layers may have their own query head counts (attention.head_count as an array: laguna's
    // sliding layers); the others refuse a count that varies.
    bool per_layer_heads = false;
    // The family's layers may have their own K/V head counts and FFN widths (attention.head_count_kv and
    // feed_forward_length as arrays: gemma4); the others refuse values that vary.
    bool per_layer_kv = false;
    // Graph nodes a layer may take beyond the runtime's budget of 96 (gemma4's MoE layer with per-layer embeddings).
    int32_t extra_nodes = 0;
    // After the shared model tensors (token_embd, output_norm, output), before the layers: the family's own
    // model-wide tensors (gemma4's per-layer embeddings); nullptr: none.
    void (*load_model)(const TensorLoader &t, const Hparams &hp, Model &m) = nullptr;
};

// Layer il's feed-forward weights: the dense SwiGLU (ffn_gate / ffn_up / ffn_down), or load_moe's.
void load_ffn(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L);
// The MoE tensors of layer il (the router, the experts, the shared expert where the file has one),
// shapes from hp's n_expert / n_ff_exp / n_ff_shexp.  Model::load calls it when hp.n_expert > 0.
void load_moe(const TensorLoader &t, const Hparams &hp, int32_t il, LayerWeights &L);

// For a family whose RoPE covers the whole head (llama.cpp asserts it): std::invalid_argument otherwise.
void full_rope(const GGUFKeys &kv, const Hparams &hp);
// hp.is_swa from <arch>.attention.sliding_window_pattern: a per-layer bool array (n_layer values), or a period
// (default_period when absent; 0: every layer slides) whose last layer is global, or its first with
// dense_first (llama.cpp's set_swa_pattern).  std::invalid_argument for a bad array or period, or a pattern
// that leaves no global layer (kvflash pages the global layers).
void read_swa_pattern(const GGUFKeys &kv, Hparams &hp, int64_t default_period, bool dense_first);
// For a family whose graph has no experts: std::invalid_argument when the file has some.
void refuse_experts(const GGUFKeys &kv, const Hparams &hp);
// A routed-expert width read from <arch>.expert_feed_forward_length, else fallback; checked > 0.
int32_t expert_width(const GGUFKeys &kv, int64_t fallback);
// A weight of the given shape that must be F32 (biases and scales the graph adds or multiplies into f32
// activations): TensorLoader::get, then std::invalid_argument ("<what> must be F32") for another type;
// nullptr when absent and not required.
ggml_tensor *f32_tensor(const TensorLoader &t, const std::string &name, const std::vector<int64_t> &shape,
                        bool required = true, const char *what = "it");

// The family registered under a general.architecture value, or nullptr.
const ArchOps *find_arch(const std::string &name);
// "llama, qwen2, ..." in registration order (for error messages).
std::string arch_list();

}  // namespace kvflash
