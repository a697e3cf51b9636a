#include "kvflash/memory.h"

#include <algorithm>
#include <stdexcept>

namespace kvflash {

std::string Memory::rewind_refusal(int64_t n) const {
    return std::string("truncate: the ") + kind() + " cannot go back to position " + std::to_string(n);
}

SlidingRing::SlidingRing(ggml_backend_t backend, int32_t tokens, int32_t window, ggml_type type, int64_t n_embd_k,
                         int64_t n_embd_v, const std::vector<ggml_backend_buffer_type_t> &layer_bufts)
    : tokens_(tokens), window_(window) {
    const size_t nl = layer_bufts.size();
    std::vector<ggml_backend_buffer_type_t> ctx_buft;
    try {
        for (ggml_backend_buffer_type_t bt : layer_bufts) {
            size_t ci = size_t(std::find(ctx_buft.begin(), ctx_buft.end(), bt) - ctx_buft.begin());
            if (ci == ctx_buft.size()) {
                ggml_init_params ip{ggml_tensor_overhead() * (2 * nl + 1), nullptr, true};
                ggml_context *c = ggml_init(ip);
                if (!c) throw std::runtime_error("cannot allocate the sliding-window cache's metadata");
                ctx_buft.push_back(bt);
                ctxs_.push_back(c);
            }
            k_.push_back(ggml_new_tensor_2d(ctxs_[ci], type, n_embd_k, tokens_));
            v_.push_back(ggml_new_tensor_2d(ctxs_[ci], type, n_embd_v, tokens_));
        }
        for (size_t ci = 0; ci < ctxs_.size(); ++ci) {
            ggml_backend_buffer_t b = ctx_buft[ci] ? ggml_backend_alloc_ctx_tensors_from_buft(ctxs_[ci], ctx_buft[ci])
                                                   : ggml_backend_alloc_ctx_tensors(ctxs_[ci], backend);
            if (!b)
                throw std::runtime_error(std::string("cannot allocate the sliding-window cache") +
                                         (ctx_buft[ci] ? std::string(" on ") + ggml_backend_buft_name(ctx_buft[ci]) : ""));
            bufs_.push_back(b);
            ggml_backend_buffer_clear(b, 0);
        }
    } catch (...) {
        for (ggml_backend_buffer_t b : bufs_) ggml_backend_buffer_free(b);
        for (ggml_context *c : ctxs_) ggml_free(c);
        throw;
    }
    pos_.assign(size_t(tokens_), -1);
}

SlidingRing::~SlidingRing() {
    for (ggml_backend_buffer_t b : bufs_) ggml_backend_buffer_free(b);
    for (ggml_context *c : ctxs_) ggml_free(c);
}

std::string SlidingRing::rewind_refusal(int64_t n) const {
    return "truncate: the sliding-window ring no longer holds the window before position " + std::to_string(n) +
           "; reset and evaluate the prefix again";
}

void SlidingRing::truncate(int64_t n) {
    for (auto &p : pos_)
        if (p >= n) p = -1;
}

void SlidingRing::reset() { std::fill(pos_.begin(), pos_.end(), -1); }

size_t SlidingRing::device_bytes() const {
    size_t n = 0;
    for (ggml_backend_buffer_t b : bufs_) n += ggml_backend_buffer_get_size(b);
    return n;
}

void SlidingRing::place(int64_t pos0, int32_t n, int64_t *rows, uint16_t *mask) {
    const int32_t R = tokens_, W = window_;
    for (int32_t i = 0; i < n; ++i) {
        rows[i] = (pos0 + i) % R;
        pos_[size_t(rows[i])] = pos0 + i;
    }
    for (int32_t i = 0; i < n; ++i) {
        const int64_t qp = pos0 + i;
        for (int32_t s = 0; s < R; ++s) {
            const int64_t p = pos_[size_t(s)];
            mask[size_t(i) * R + s] = (p >= 0 && p <= qp && qp - p < W) ? 0x0000 : 0xFC00;
        }
    }
}

}  // namespace kvflash

namespace kvflash {

RecurrentState::RecurrentState(ggml_backend_t backend, int32_t layers, int64_t channels, int32_t d_conv, int64_t state,
                               int32_t snapshots)
    : channels_(channels), state_(state), d_conv_(d_conv), snapshots_(snapshots) {
    if (layers <= 0 || channels <= 0 || d_conv < 2 || state <= 0 || snapshots < 1)
        throw std::invalid_argument("recurrent state: bad geometry");
    // the rows a piece writes (its last snapshots + d_conv - 2) plus the d_conv - 1 it reads before them
    conv_rows_ = std::max(snapshots_ + d_conv_ - 2, 1) + (d_conv_ - 1);
    ggml_init_params ip{ggml_tensor_overhead() * (2 * size_t(layers) + 1), nullptr, true};
    ctx_ = ggml_init(ip);
    if (!ctx_) throw std::runtime_error("cannot allocate the recurrent state's metadata");
    for (int32_t i = 0; i < layers; ++i) {
        conv_.push_back(ggml_new_tensor_2d(ctx_, GGML_TYPE_F32, channels_, conv_rows_ + 1));
        ssm_.push_back(ggml_new_tensor_2d(ctx_, GGML_TYPE_F32, state_, snapshots_ + 2));
    }
    buf_ = ggml_backend_alloc_ctx_tensors(ctx_, backend);
    if (!buf_) {
        ggml_free(ctx_);
        throw std::runtime_error("cannot allocate the recurrent state (" + std::to_string(layers) + " layers)");
    }
    ggml_backend_buffer_clear(buf_, 0);
    conv_pos_.assign(size_t(conv_rows_), -1);
    ssm_pos_.assign(size_t(snapshots_ + 1), -1);
}

RecurrentState::~RecurrentState() {
    if (buf_) ggml_backend_buffer_free(buf_);
    if (ctx_) ggml_free(ctx_);
}

size_t RecurrentState::device_bytes() const { return buf_ ? ggml_backend_buffer_get_size(buf_) : 0; }

size_t RecurrentState::device_bytes_for(int32_t layers, int64_t channels, int32_t d_conv, int64_t state,
                                        int32_t snapshots) {
    const size_t conv_rows = size_t(std::max(snapshots + d_conv - 2, 1) + (d_conv - 1));
    return size_t(layers) * ((conv_rows + 1) * size_t(channels) + size_t(snapshots + 2) * size_t(state)) * sizeof(float);
}

int64_t RecurrentState::max_rewind() const {
    // back r tokens: the SSM state after end - r - 1 and the conv rows of end - r - d_conv + 1 .. end - r - 1
    int64_t r = 0;
    while (r < end_) {
        const int64_t e = end_ - r - 1;   // the new end would be e
        bool ok = holds_ssm(e - 1);
        for (int64_t p = e - (d_conv_ - 1); ok && p < e; ++p) ok = holds_conv(p);
        if (!ok) break;
        ++r;
    }
    return r;
}

std::string RecurrentState::rewind_refusal(int64_t n) const {
    return "truncate: the recurrent state keeps the last " + std::to_string(max_rewind()) +
           " positions' states only; position " + std::to_string(n) + " is " + std::to_string(end_ - n) +
           " back (reset and evaluate the prefix again, or restore a checkpoint)";
}

void RecurrentState::truncate(int64_t n) {
    if (n >= end_) return;
    for (auto &p : conv_pos_)
        if (p >= n) p = -1;
    for (auto &p : ssm_pos_)
        if (p >= n) p = -1;
    end_ = n;
}

void RecurrentState::reset() {
    std::fill(conv_pos_.begin(), conv_pos_.end(), -1);
    std::fill(ssm_pos_.begin(), ssm_pos_.end(), -1);
    end_ = 0;
}

void RecurrentState::place(int64_t pos0, int32_t n, int32_t *conv_in, int64_t *conv_out, int32_t *ssm_in,
                           int64_t *ssm_out) {
    if (pos0 != end_) throw std::logic_error("recurrent state: a piece must start at the state's end");
    if (!holds_ssm(pos0 - 1))
        throw std::logic_error("recurrent state: the state before position " + std::to_string(pos0) + " is gone");
    for (int64_t p = pos0 - (d_conv_ - 1); p < pos0; ++p)
        if (!holds_conv(p))
            throw std::logic_error("recurrent state: the conv input of position " + std::to_string(p) + " is gone");
    // reads: a position before 0 (or not held: the runtime checked) is the zero row
    for (int32_t j = 0; j < d_conv_ - 1; ++j) {
        const int64_t p = pos0 - (d_conv_ - 1) + j;
        conv_in[j] = p < 0 ? conv_rows_ : int32_t(p % conv_rows_);
    }
    ssm_in[0] = pos0 == 0 ? snapshots_ + 1 : int32_t((pos0 - 1) % (snapshots_ + 1));
    const int32_t nc = conv_written(n), ns = ssm_written(n);
    for (int32_t j = 0; j < nc; ++j) {
        const int64_t p = pos0 + n - nc + j;
        conv_out[j] = p % conv_rows_;
        conv_pos_[size_t(p % conv_rows_)] = p;
    }
    for (int32_t j = 0; j < ns; ++j) {   // newest first
        const int64_t p = pos0 + n - 1 - j;
        ssm_out[j] = p % (snapshots_ + 1);
        ssm_pos_[size_t(p % (snapshots_ + 1))] = p;
    }
    end_ = pos0 + n;
}

bool RecurrentState::can_checkpoint(int64_t pos) const {
    if (pos < 0 || pos > end_ || !holds_ssm(pos - 1)) return false;
    for (int64_t p = pos - (d_conv_ - 1); p < pos; ++p)
        if (!holds_conv(p)) return false;
    return true;
}

RecurrentState::HostCheckpoint RecurrentState::checkpoint(int64_t pos) const {
    if (!can_checkpoint(pos)) throw std::logic_error("recurrent state: no state held at position " + std::to_string(pos));
    const int64_t end_ = pos;   // the rows below read the state at pos
    HostCheckpoint c;
    c.pos = end_;
    c.data.resize(checkpoint_floats());
    float *d = c.data.data();
    const size_t row = size_t(channels_) * sizeof(float);
    for (int32_t i = 0; i < n_layers(); ++i) {
        for (int32_t j = 0; j < d_conv_ - 1; ++j, d += channels_) {
            const int64_t p = end_ - (d_conv_ - 1) + j;
            if (p < 0) std::fill(d, d + channels_, 0.f);
            else ggml_backend_tensor_get(conv_[size_t(i)], d, size_t(p % conv_rows_) * row, row);
        }
        if (end_ == 0) std::fill(d, d + state_, 0.f);
        else ggml_backend_tensor_get(ssm_[size_t(i)], d, size_t((end_ - 1) % (snapshots_ + 1)) * state_ * sizeof(float),
                                     size_t(state_) * sizeof(float));
        d += state_;
    }
    return c;
}

void RecurrentState::restore(const HostCheckpoint &c) {
    if (c.pos < 0 || c.data.size() != checkpoint_floats()) throw std::invalid_argument("recurrent state: a checkpoint of another shape");
    reset();
    end_ = c.pos;
    const float *d = c.data.data();
    const size_t row = size_t(channels_) * sizeof(float);
    for (int32_t i = 0; i < n_layers(); ++i) {
        for (int32_t j = 0; j < d_conv_ - 1; ++j, d += channels_) {
            const int64_t p = end_ - (d_conv_ - 1) + j;
            if (p < 0) continue;
            ggml_backend_tensor_set(conv_[size_t(i)], d, size_t(p % conv_rows_) * row, row);
            conv_pos_[size_t(p % conv_rows_)] = p;
        }
        if (end_ > 0) {
            ggml_backend_tensor_set(ssm_[size_t(i)], d, size_t((end_ - 1) % (snapshots_ + 1)) * state_ * sizeof(float),
                                    size_t(state_) * sizeof(float));
            ssm_pos_[size_t((end_ - 1) % (snapshots_ + 1))] = end_ - 1;
        }
        d += state_;
    }
}

}  // namespace kvflash
