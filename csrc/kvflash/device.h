// Where a model computes: device strings and what this build can reach.
//
// Every GPU goes through ggml's device registry (ggml_backend_reg_by_name / _reg_dev_get): a kind names
// one of ggml's backends compiled into this build ("CUDA" for KVFLASH_CUDA, "Vulkan" for KVFLASH_VULKAN),
// the index one of the devices that backend lists.  Nothing below is per-vendor code.
#pragma once

#include <cstdint>
#include <string>

#include "ggml-backend.h"

namespace kvflash {

// Devices a model can be loaded on: "cpu", "cuda" (= "cuda:0"), "cuda:N", "vulkan" (= "vulkan:0"), "vulkan:N".
struct Device {
    enum class Kind { CPU, CUDA, VULKAN } kind = Kind::CPU;
    int32_t index = 0;
    std::string name() const;   // "cpu" | "cuda:N" | "vulkan:N"
    bool gpu() const { return kind != Kind::CPU; }
};

// Parses a device string ("auto": auto_device()).  Throws std::invalid_argument for anything else (naming the accepted forms),
// and for a GPU kind this build was compiled without (saying how to rebuild with it).  Does not check
// that the device exists (check_device_visible does).
Device parse_device(const std::string &s);

// Was this build compiled with the kind's ggml backend (KVFLASH_CUDA / KVFLASH_VULKAN)?  CPU: true.
bool compiled(Device::Kind kind);
bool cuda_compiled();
bool vulkan_compiled();

// Devices of that kind visible now (0 when the backend is not compiled in, or sees none).  Vulkan: ggml-vulkan
// lists CPU-type Vulkan devices (Mesa's lavapipe) only when GGML_VK_VISIBLE_DEVICES names them.
int32_t device_count(Device::Kind kind);
int32_t cuda_device_count();
int32_t vulkan_device_count();

// The ggml device d names (nullptr for the CPU).  Throws std::invalid_argument when it is not visible.
ggml_backend_dev_t ggml_device(const Device &d);

// Throws std::invalid_argument unless the device is visible (no-op for the CPU); `spelled` is the
// user's own string, quoted in the message.
void check_device_visible(const Device &d, const std::string &spelled);

// The device "auto" picks: the first visible CUDA device, else the first visible Vulkan one, else the CPU.
Device auto_device();

}  // namespace kvflash
