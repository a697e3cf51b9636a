// The one place that says how large a context the core can address.
//
// Positions reach ggml as int32 (rope positions, set_rows indices) and a full-cache
// pool holds max_ctx slots rounded up to 256 in an int32, so a logical context is
// at most kMaxContext tokens.  Every entry point (PagerConfig::validate, Runtime,
// the bindings, the C API, Model::load for a GGUF's context_length) goes through
// these checks before any size is computed from max_ctx.
#pragma once

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace kvflash {

constexpr int64_t kMaxContext = int64_t(std::numeric_limits<int32_t>::max()) / 256 * 256;  // 2147483392

// Throws std::invalid_argument naming `what` unless 1 <= max_ctx <= kMaxContext.
inline void check_max_ctx(int64_t max_ctx, const char *what = "max_ctx") {
    if (max_ctx <= 0)
        throw std::invalid_argument(std::string(what) + " must be > 0, got " + std::to_string(max_ctx));
    if (max_ctx > kMaxContext)
        throw std::invalid_argument(std::string(what) + " " + std::to_string(max_ctx) +
                                    " is above the largest context kvflash addresses (" +
                                    std::to_string(kMaxContext) + " tokens: positions are 32-bit in ggml)");
}

// Throws std::out_of_range unless the span [pos0, pos0 + n) lies in [0, max_ctx); n >= 0.
// Written so that no sum can overflow, whatever the inputs.
inline void check_span(int64_t pos0, int64_t n, int64_t max_ctx, const char *what) {
    if (n < 0 || pos0 < 0 || pos0 > max_ctx || n > max_ctx - pos0)
        throw std::out_of_range(std::string(what) + ": positions [" + std::to_string(pos0) + ", +" +
                                std::to_string(n) + ") outside [0, max_ctx=" + std::to_string(max_ctx) + ")");
}

}  // namespace kvflash
