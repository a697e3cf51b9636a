// Where a model computes: device strings and what this build can reach.
#pragma once

#include <cstdint>
#include <string>

namespace kvflash {

// Devices a model can be loaded on: "cpu", "cuda" (= "cuda:0") or "cuda:N".
struct Device {
    enum class Kind { CPU, CUDA } kind = Kind::CPU;
    int32_t index = 0;
    std::string name() const;   // "cpu" | "cuda:N"
};

// Parses a device string.  Throws std::invalid_argument for anything else (naming
// the accepted forms), and for "cuda..." in a build without CUDA (saying how to
// rebuild with it).  Does not check that the CUDA device exists (Model::load does).
Device parse_device(const std::string &s);

// Was this build compiled with KVFLASH_CUDA (ggml-cuda linked in)?
bool cuda_compiled();

// CUDA devices visible now (0 without CUDA compiled in, or without a driver/device).
int32_t cuda_device_count();

// Throws std::invalid_argument unless a CUDA device is visible at d.index (no-op for the CPU).
void check_device_visible(const Device &d, const std::string &spelled);

}  // namespace kvflash
