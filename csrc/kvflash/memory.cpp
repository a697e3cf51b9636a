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
