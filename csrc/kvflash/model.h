// A GGUF model on ggml: weights and hyper-parameters, read and validated once.
//
// Every key and tensor shape is checked before ggml sees it, so a bad file is a
// std::invalid_argument naming the problem, never an abort.  On the CPU backend
// the weights are the mmap'd file; on CUDA (a KVFLASH_CUDA build) they are
// uploaded into a ggml-cuda buffer and the mapping is dropped.  Every runtime over
// a model computes on the model's backend.  Immutable once loaded (the thread
// count aside); many runtimes may share it, from different threads too: their
// graph computes are serialized by the model's compute lock.
//
// Shapes follow ggml order (innermost first): x: [n_embd, n_tokens].
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"
#include "kvflash/device.h"
#include "kvflash/tokenizer.h"

namespace kvflash {

struct ArchOps;

struct Hparams {
    std::string arch;                                 // general.architecture
    // n_head: the query heads of every paged (global) layer; n_head_l: per layer (laguna's sliding layers
    // have more than its global ones: Forward::attention reads n_head_at), else n_head everywhere.
    int32_t n_layer = 0, n_embd = 0, n_ff = 0, n_head = 0, n_head_kv = 0;
    std::vector<int32_t> n_head_l;
    int32_t head_dim_k = 0, head_dim_v = 0, n_rot = 0, n_vocab = 0;
    int64_t n_ctx_train = 0;
    float rms_eps = 1e-5f;
    float rope_base = 10000.f, rope_scale = 1.f;      // global layers
    float rope_base_swa = 10000.f, rope_scale_swa = 1.f;
    int rope_mode = 0;                                // 0 normal (llama), 2 neox
    int32_t n_rot_swa = 0;                            // RoPE dims of the sliding layers (n_rot unless the file says)
    // Sliding layers take plain RoPE (laguna): no YaRN ramp nor magnitude there, whatever the global layers do.
    bool rope_swa_plain = false;
    // YaRN (rope.scaling.type "yarn"; ggml_rope_ext's last four arguments), every layer alike: the ramp's
    // weight (0: plain or linear scaling, these others then unused), the magnitude factor, the ramp's
    // bounds; rope_n_ctx_orig is rope.scaling.original_context_length (else context_length), where the
    // ramp's dimensions are computed from.  llama.cpp's defaults (llama-context.cpp) unless the file's
    // rope.scaling keys say otherwise.
    float rope_ext_factor = 0.f, rope_attn_factor = 1.f, rope_beta_fast = 32.f, rope_beta_slow = 1.f;
    int64_t rope_n_ctx_orig = 0;
    int32_t n_swa = 0;                                // sliding window (0: none)
    std::vector<uint8_t> is_swa;                      // per layer
    // Per layer: a recurrent layer (qwen35's Gated DeltaNet) keeps conv and SSM state instead of KV
    // (never paged); the other layers attend (paged, or the sliding ring where is_swa).
    std::vector<uint8_t> is_recr;
    // Gated DeltaNet geometry (recurrent layers): conv kernel width, value width (d_inner = heads x
    // state), the state size (the head dim of q, k and v), v heads (dt_rank) and q/k heads (groups).
    int32_t ssm_d_conv = 0, ssm_d_inner = 0, ssm_d_state = 0, ssm_dt_rank = 0, ssm_n_group = 0;
    // Multi-section RoPE (GGML_ROPE_TYPE_IMROPE and MROPE modes): dims per section; text tokens take the
    // position in the first three sections and 0 in the fourth.
    int rope_sections[4] = {0, 0, 0, 0};
    bool rope_multi = false;
    // Gated attention output (qwen35): wq's rows are, per head, the query then a gate; the attention
    // output is multiplied by sigmoid(gate) before wo.
    bool attn_out_gate = false;
    int32_t n_layer_nextn = 0;                        // MTP / nextn blocks after the trunk (skipped)
    // Gated DeltaNet sizes: the conv channels (q, k and v), a layer's conv state and SSM state (floats).
    int64_t ssm_conv_channels() const { return int64_t(ssm_d_inner) + 2 * int64_t(ssm_n_group) * ssm_d_state; }
    int64_t ssm_state_floats() const { return int64_t(ssm_d_inner / std::max(ssm_dt_rank, 1)) * (ssm_d_inner / std::max(ssm_dt_rank, 1)) * ssm_dt_rank; }
    bool recurrent() const { for (uint8_t r : is_recr) if (r) return true; return false; }
    float attn_scale = 0.f;                           // softmax scale
    float final_softcap = 0.f;                        // 0: none
    // Mixture of experts (n_expert > 0): every layer's FFN routes each token to n_expert_used of
    // n_expert experts of width n_ff_exp (ggml_mul_mat_id), plus an always-on shared expert of width
    // n_ff_shexp when the file has one; n_ff is then only the fallback width.
    int32_t n_expert = 0, n_expert_used = 0, n_ff_exp = 0, n_ff_shexp = 0;
    // Softmax / Sigmoid: over all the router's logits, the top k of those probabilities kept; SoftmaxWeight
    // (gpt-oss): the top k of the logits themselves, a softmax over the k chosen.
    enum class Gating : uint8_t { Softmax, Sigmoid, SoftmaxWeight } expert_gating = Gating::Softmax;
    // The experts' gated activation: SwiGLU, or gpt-oss's clamped variant (ggml_swiglu_oai, alpha 1.702,
    // limit 7: llama.cpp's constants).
    enum class ExpertAct : uint8_t { Swiglu, SwigluOai } expert_act = ExpertAct::Swiglu;
    bool expert_weights_norm = false;                 // the chosen experts' weights divided by their sum
    float expert_weights_scale = 0.f;                 // then multiplied by this (0 or 1: not scaled)
    // A leading run of layers whose feed-forward is the dense SwiGLU before the routed ones (laguna).
    int32_t n_layer_dense_lead = 0;
    // Per layer, as the file gives them (attention.head_count_kv and feed_forward_length may be arrays); a
    // family takes counts that vary only where ArchOps::per_layer_kv says so (gemma4), else they are one.
    std::vector<int32_t> n_head_kv_l, n_ff_l;
    // The sliding layers' head geometry (gemma4: attention.key_length_swa and the sliding layers' K/V heads;
    // every sliding layer alike, the ring's rows one size); the global layers' (head_dim_k, n_head_kv)
    // elsewhere.  n_head_kv and head_dim_k stay the paged layers' (the pool, the captured queries, the
    // scorers, snapshots).
    int32_t head_dim_swa = 0, n_head_kv_swa = 0;
    // Shared KV (gemma4's attention.shared_kv_layers): kv_src[il] >= 0 is the earlier layer whose cache
    // layer il reads; such a layer writes and keeps none (not paged, no ring).  Empty or -1: its own.
    std::vector<int32_t> kv_src;
    // Per-layer embeddings (gemma4 E2B/E4B: embedding_length_per_layer_input), 0: none.
    int32_t n_embd_per_layer = 0;
    int32_t n_head_at(int32_t il) const { return n_head_l.empty() ? n_head : n_head_l[size_t(il)]; }
    bool slides(int32_t il) const { return il >= 0 && size_t(il) < is_swa.size() && is_swa[size_t(il)] != 0; }
    int32_t head_dim_at(int32_t il) const { return slides(il) ? head_dim_swa : head_dim_k; }
    int32_t n_head_kv_at(int32_t il) const { return slides(il) ? n_head_kv_swa : n_head_kv; }
    int32_t n_ff_at(int32_t il) const { return n_ff_l.empty() ? n_ff : n_ff_l[size_t(il)]; }
    int32_t kv_source(int32_t il) const { return kv_src.empty() ? -1 : kv_src[size_t(il)]; }
    int32_t n_embd_k() const { return head_dim_k * n_head_kv; }
    int32_t n_embd_v() const { return head_dim_v * n_head_kv; }
    int32_t n_embd_k_swa() const { return head_dim_swa * n_head_kv_swa; }
    int32_t n_embd_v_swa() const { return head_dim_swa * n_head_kv_swa; }
};

// One layer's weights; an architecture leaves what it does not use null.
struct LayerWeights {
    ggml_tensor *attn_norm = nullptr, *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
    ggml_tensor *bq = nullptr, *bk = nullptr, *bv = nullptr;           // qwen2
    ggml_tensor *q_norm = nullptr, *k_norm = nullptr;                  // qwen3, gemma3
    ggml_tensor *attn_post_norm = nullptr, *ffn_post_norm = nullptr;   // gemma3
    ggml_tensor *bo = nullptr;                                         // attn_output's bias [n_embd] (gpt-oss)
    // Per query head, an attention sink [n_head] (gpt-oss): one more logit in each softmax's denominator,
    // with no value, after the scale (Forward::attention passes it to both attention paths).
    ggml_tensor *attn_sinks = nullptr;
    // The attention output gate through softplus (laguna): [n_embd, n_head] (one value per head) or
    // [n_embd, n_head * head dim] (per element), applied to the attention's output before wo.
    ggml_tensor *attn_gate = nullptr;
    ggml_tensor *ffn_norm = nullptr, *ffn_gate = nullptr, *ffn_up = nullptr, *ffn_down = nullptr;
    // MoE: the router [n_embd, n_expert], the experts [n_embd, n_ff_exp, n_expert] (gate and up, or
    // both in one [n_embd, 2 n_ff_exp, n_expert]) and [n_ff_exp, n_embd, n_expert]; the shared expert and its one-output sigmoid gate [n_embd]
    // (no gate: the shared expert is added as it is, laguna).
    ggml_tensor *ffn_gate_inp = nullptr, *ffn_gate_exps = nullptr, *ffn_up_exps = nullptr, *ffn_gate_up_exps = nullptr,
                *ffn_down_exps = nullptr;
    ggml_tensor *ffn_gate_inp_shexp = nullptr, *ffn_gate_shexp = nullptr, *ffn_up_shexp = nullptr,
                *ffn_down_shexp = nullptr;
    // Biases (gpt-oss): the router's [n_expert]; each expert's own on gate and up [n_ff_exp, n_expert] and
    // on down [n_embd, n_expert], picked per token with the experts (ggml_add_id).
    ggml_tensor *ffn_gate_inp_b = nullptr, *ffn_gate_exps_b = nullptr, *ffn_up_exps_b = nullptr,
                *ffn_down_exps_b = nullptr;
    // The score-correction bias [n_expert] (laguna, DeepSeek V3's exp_probs_b): added to the gating
    // probabilities for the choice of experts only; the weights are the unbiased probabilities.
    ggml_tensor *ffn_exp_probs_b = nullptr;
    // Gated DeltaNet (a recurrent layer): the q/k/v projection [n_embd, conv channels] and the output
    // gate z [n_embd, d_inner]; the conv kernel [d_conv, channels] (f32); the decay's bias and -exp(A)
    // [dt_rank]; beta and alpha [n_embd, dt_rank]; the gated norm [head dim]; the output [d_inner, n_embd].
    ggml_tensor *wqkv = nullptr, *wqkv_gate = nullptr, *ssm_conv1d = nullptr, *ssm_dt = nullptr, *ssm_a = nullptr,
                *ssm_beta = nullptr, *ssm_alpha = nullptr, *ssm_norm = nullptr, *ssm_out = nullptr;
    // RoPE frequency factors [n_rot / 2] (gemma4's global layers: rope_freqs, 1e30 on the dims left unrotated),
    // handed to ggml_rope_ext by Forward::attention.
    ggml_tensor *rope_freqs = nullptr;
    // gemma4: the layer's output times this one value [1] (layer_output_scale); the per-layer embedding's gate
    // [n_embd, n_embd_per_layer], projection [n_embd_per_layer, n_embd] and norm [n_embd]; the MoE layer's
    // router input scale [n_embd] (ffn_gate_inp.scale), the experts' pre-norm and the two post-norms
    // [n_embd] (dense MLP, experts), and each expert's output scale [n_expert] (ffn_down_exps.scale).
    ggml_tensor *out_scale = nullptr, *per_layer_inp_gate = nullptr, *per_layer_proj = nullptr,
                *per_layer_post_norm = nullptr;
    ggml_tensor *ffn_gate_inp_s = nullptr, *ffn_pre_norm_2 = nullptr, *ffn_post_norm_1 = nullptr,
                *ffn_post_norm_2 = nullptr, *ffn_down_exps_s = nullptr;
};

// Layers [first, last) computed on the ggml RPC server at endpoint (rpc.h): their weights live there, and a
// runtime over the model keeps their slice of the KV pool (and sliding-window ring) there too.
struct RemoteLayers {
    std::string endpoint;
    int32_t first = 0, last = 0;
};

// Contiguous layer ranges for n_layer layers over the RPC endpoints, in order, by proportions as
// llama.cpp's tensor_split: one weight per endpoint and optionally one more for the client, whose share
// is the last layers (next to the output head, which stays with the client with the input embedding).
// Empty split: equal shares over the endpoints, no layer local.  An endpoint whose share rounds to no
// layer gets none (it is left out).  std::invalid_argument naming the fault (a bad endpoint, one named
// twice, a split of the wrong length, a negative or non-finite weight, weights summing to zero).
std::vector<RemoteLayers> split_layers(int32_t n_layer, const std::vector<std::string> &endpoints,
                                       const std::vector<float> &split);

class Model {
public:
    // Throws std::invalid_argument naming the problem (not a GGUF, truncated,
    // unsupported architecture, missing key or tensor, wrong shape).
    // device: see parse_device.  "cuda" / "vulkan" need a KVFLASH_CUDA / KVFLASH_VULKAN build and a visible device
    // (std::invalid_argument otherwise; std::runtime_error if the weights do not fit).
    // n_threads <= 0: the machine's hardware threads.
    // rpc / tensor_split: layer ranges on ggml RPC servers (split_layers; the CPU device only): each
    // range's weights are uploaded to its server's buffer, and graphs run there through
    // ggml_backend_sched (the runtime).  std::runtime_error when a server does not answer or has no room.
    // repack = false: every weight stays mapped and runs ggml-cpu's plain kernels (no repacked
    // interleaves, no AMX copies), as KVFLASH_NO_REPACK=1 asks for every model and as an RPC server
    // holds its layers: the arithmetic to compare an RPC split against.
    static std::shared_ptr<Model> load(const std::string &path, int32_t n_threads = 0,
                                       const std::string &device = "cpu", const std::vector<std::string> &rpc = {},
                                       const std::vector<float> &tensor_split = {}, bool repack = true);
    ~Model();
    Model(const Model &) = delete;
    Model &operator=(const Model &) = delete;

    const Hparams &hparams() const { return hp_; }
    // The architecture family's graph builder (arch.h).
    const ArchOps &arch() const { return *arch_; }
    const std::string &path() const { return path_; }
    size_t weight_bytes() const { return weight_bytes_; }
    // Where the weights went and which of ggml's kernels multiply by them, one line per place
    // ("CPU mapped (ggml-cpu's plain kernels), layers 0-29, token_embd: 40 MiB", "CPU_REPACK (...), layers
    // 0-29: 60 MiB", "RPC h:p, layers 0-14 (...)", "AMX one-token copies (...)").
    const std::vector<std::string> &weight_placement() const { return repacked_; }
    ggml_backend_t backend() const { return backend_; }
    const Device &device() const { return device_; }
    bool on_cpu() const { return device_.kind == Device::Kind::CPU; }
    // Free and total bytes of the model's device now, from ggml's device memory query
    // (on CUDA: cudaMemGetInfo, so free is what is left after the weights and whatever
    // else is allocated; on the CPU ggml reports free == total, physical RAM).
    std::pair<size_t, size_t> device_memory() const;
    // CPU threads for the CPU backend's kernels; on CUDA only recorded.  Taken under
    // the compute lock, so it never changes under a running graph.
    void set_n_threads(int32_t n);
    // Every runtime over this model computes on its one backend (the CPU backend's
    // work buffer and thread pool, or the CUDA stream): graph computes from runtimes
    // on different threads take this lock, one at a time (Runtime::eval_piece).
    std::mutex &compute_mutex() const { return compute_mu_; }
    int32_t n_threads() const { return n_threads_; }
    // The model's tokenizer (tokenizer.h: llama.cpp's, from this file's tokenizer.* metadata), built
    // on the first call and shared after; TokenizerError when the file has none kvflash can use (the
    // next call tries again).  Thread-safe.
    std::shared_ptr<const Tokenizer> tokenizer() const;
    // Model layer indices whose attention is global (these are paged; not sliding, not recurrent, not reading
    // another layer's KV).
    std::vector<int32_t> global_layers() const;

    ggml_tensor *tok_embd = nullptr, *output_norm = nullptr, *output = nullptr;
    // gemma4's per-layer embeddings (E2B/E4B): the table [n_embd_per_layer * n_layer, n_vocab], the model's
    // projection [n_embd, n_embd_per_layer * n_layer] and its norm [n_embd_per_layer]; null otherwise.
    ggml_tensor *per_layer_tok_embd = nullptr, *per_layer_model_proj = nullptr, *per_layer_proj_norm = nullptr;
    std::vector<LayerWeights> layers;
    // The weights a graph of n tokens multiplies by: for one-token graphs (decode) the copies in ggml's
    // AMX buffer where the load made them (its kernels for one row are the fast ones; for several rows
    // they crashed here, so batches keep the mapped weights).
    const LayerWeights &layer(int32_t il, int32_t n) const {
        return n == 1 && !decode_layers_.empty() ? decode_layers_[size_t(il)] : layers[size_t(il)];
    }
    // w's bytes are ggml's own layout in the file mapping (no extra buffer converted them).
    bool plain(const ggml_tensor *w) const { return w->buffer == buf_ && w->extra == nullptr; }
    ggml_tensor *output_for(int32_t n) const { return n == 1 && decode_output_ ? decode_output_ : output; }

    // The layer ranges on RPC servers (empty: every layer local) and, per range, the server's backend
    // (kvflash's checked connection, one per endpoint for the process) and buffer type.
    const std::vector<RemoteLayers> &remote_layers() const { return remote_; }
    const std::vector<ggml_backend_t> &remote_backends() const { return remote_backends_; }
    // The buffer type of layer il's device: the server's for a remote layer, nullptr for a local one.
    ggml_backend_buffer_type_t layer_buft(int32_t il) const;
    // The index into remote_layers() of layer il's range, or -1 when the layer is local.
    int32_t layer_remote(int32_t il) const;
    // Weight bytes held on each server (as remote_layers()).
    const std::vector<size_t> &remote_bytes() const { return remote_bytes_; }

private:
    Model() = default;
    void read_header(const std::string &path);    // magic, gguf header, tensor extents, hparams
    void read_tensors();                          // every weight, with its shape checked
    void place_weights(int32_t n_threads);        // mmap (CPU) or upload (CUDA); remote layers uploaded
    // per GGUF tensor: the CPU extra buffer type that takes it (nullptr: stays mapped)
    std::vector<ggml_backend_buffer_type_t> extra_placement() const;

    std::string path_;
    Device device_;
    Hparams hp_;
    const ArchOps *arch_ = nullptr;
    gguf_context *gguf_ = nullptr;
    mutable std::mutex tokenizer_mu_;
    mutable std::shared_ptr<const Tokenizer> tokenizer_;
    ggml_context *meta_ = nullptr;
    ggml_backend_t backend_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
    std::vector<ggml_backend_buffer_t> extra_bufs_;   // matrix weights converted for ggml's CPU kernels
    ggml_context *decode_meta_ = nullptr;             // the one-token graphs' copies (AMX), see layer()
    std::vector<LayerWeights> decode_layers_;
    ggml_tensor *decode_output_ = nullptr;
    void place_decode_copies(const std::vector<ggml_backend_buffer_type_t> &where);
    std::vector<std::string> repacked_;               // weight_placement()'s lines
    bool repack_ = true;                              // extra CPU buffer types allowed (load's repack)
    void *map_ = nullptr;             // the file mapping (CPU backend only; unmapped after a CUDA upload)
    size_t map_bytes_ = 0, weight_bytes_ = 0;
    int32_t n_threads_ = 1;
    mutable std::mutex compute_mu_;
    std::vector<RemoteLayers> remote_;
    std::vector<ggml_backend_t> remote_backends_;          // owned by rpc.cpp's connection table
    std::vector<ggml_backend_buffer_type_t> remote_bufts_;
    std::vector<ggml_backend_buffer_t> remote_bufs_;
    std::vector<size_t> remote_bytes_;
    // per GGUF tensor: the remote range holding it ("blk.N." names of a remote layer), or -1
    std::vector<int32_t> tensor_remote() const;
};

}  // namespace kvflash
