#include "kvflash/device.h"

#include <stdexcept>

namespace kvflash {

static const char *const kDeviceForms =
    "'auto', 'cpu', 'cuda', 'cuda:N', 'vulkan' or 'vulkan:N' (N: a device index of that backend)";

namespace {

struct KindInfo {
    const char *prefix;      // the device string's
    const char *reg;         // ggml's registry name of the backend
    const char *label;       // for messages
    const char *rebuild;     // how to get a build with it
};

const KindInfo &info(Device::Kind k) {
    static const KindInfo cuda{"cuda", "CUDA", "CUDA",
                               "pip install . -Ccmake.define.KVFLASH_CUDA=ON -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=<your "
                               "GPU's, e.g. 86, 89 or 90> (or KVFLASH_CUDA=ON pip install .; needs the CUDA toolkit with "
                               "cuBLAS, see the README)"};
    static const KindInfo vulkan{"vulkan", "Vulkan", "Vulkan",
                                 "pip install . -Ccmake.define.KVFLASH_VULKAN=ON (or KVFLASH_VULKAN=ON pip install .; needs "
                                 "the Vulkan headers, loader and glslc: bash .ci/vulkan-deps.sh, see the README)"};
    static const KindInfo cpu{"cpu", "CPU", "CPU", ""};
    return k == Device::Kind::CUDA ? cuda : k == Device::Kind::VULKAN ? vulkan : cpu;
}

ggml_backend_reg_t registry(Device::Kind k) {
    if (k == Device::Kind::CPU || !compiled(k)) return nullptr;
    return ggml_backend_reg_by_name(info(k).reg);
}

}  // namespace

std::string Device::name() const {
    return kind == Kind::CPU ? std::string("cpu") : std::string(info(kind).prefix) + ":" + std::to_string(index);
}

Device parse_device(const std::string &s) {
    Device d;
    if (s == "cpu") return d;
    if (s == "auto") return auto_device();
    for (Device::Kind k : {Device::Kind::CUDA, Device::Kind::VULKAN}) {
        const std::string p = info(k).prefix;
        if (s != p && s.rfind(p + ":", 0) != 0) continue;
        d.kind = k;
        if (s.size() > p.size()) {
            const std::string n = s.substr(p.size() + 1);
            if (n.empty() || n.size() > 4 || n.find_first_not_of("0123456789") != std::string::npos)
                throw std::invalid_argument("device '" + s + "': the " + info(k).label +
                                            " device index must be a non-negative integer; use " + kDeviceForms);
            d.index = std::stoi(n);
        }
        if (!compiled(k))
            throw std::invalid_argument("device '" + s + "': kvflash was built without " + info(k).label +
                                        ". Rebuild it with ggml's " + info(k).label + " backend: " + info(k).rebuild +
                                        ", or use device='cpu'");
        return d;
    }
    throw std::invalid_argument("unknown device '" + s + "': use " + kDeviceForms);
}

bool compiled(Device::Kind kind) {
    switch (kind) {
    case Device::Kind::CPU: return true;
    case Device::Kind::CUDA:
#ifdef KVFLASH_WITH_CUDA
        return true;
#else
        return false;
#endif
    case Device::Kind::VULKAN:
#ifdef KVFLASH_WITH_VULKAN
        return true;
#else
        return false;
#endif
    }
    return false;
}

bool cuda_compiled() { return compiled(Device::Kind::CUDA); }
bool vulkan_compiled() { return compiled(Device::Kind::VULKAN); }

int32_t device_count(Device::Kind kind) {
    if (kind == Device::Kind::CPU) return 1;
    ggml_backend_reg_t reg = registry(kind);
    return reg ? int32_t(ggml_backend_reg_dev_count(reg)) : 0;
}

int32_t cuda_device_count() { return device_count(Device::Kind::CUDA); }
int32_t vulkan_device_count() { return device_count(Device::Kind::VULKAN); }

void check_device_visible(const Device &d, const std::string &spelled) {
    if (!d.gpu()) return;
    const KindInfo &k = info(d.kind);
    const int32_t n_dev = device_count(d.kind);
    if (n_dev == 0) {
        std::string why = d.kind == Device::Kind::VULKAN
                              ? " (no Vulkan driver or device; a CPU-type Vulkan device such as Mesa's lavapipe is "
                                "listed only when GGML_VK_VISIBLE_DEVICES names its index, e.g. GGML_VK_VISIBLE_DEVICES=0)"
                              : " (no driver, or CUDA_VISIBLE_DEVICES hides them)";
        throw std::invalid_argument("device '" + spelled + "': kvflash was built with " + k.label + " but no " + k.label +
                                    " device is visible" + why + "; use device='cpu'");
    }
    if (d.index >= n_dev)
        throw std::invalid_argument("device '" + spelled + "': " + std::to_string(n_dev) + " " + k.label +
                                    " device(s) visible (" + k.prefix + ":0 .. " + k.prefix + ":" +
                                    std::to_string(n_dev - 1) + ")");
}

ggml_backend_dev_t ggml_device(const Device &d) {
    if (!d.gpu()) return nullptr;
    check_device_visible(d, d.name());
    return ggml_backend_reg_dev_get(registry(d.kind), size_t(d.index));
}

Device auto_device() {
    for (Device::Kind k : {Device::Kind::CUDA, Device::Kind::VULKAN})
        if (device_count(k) > 0) return Device{k, 0};
    return Device{};
}

}  // namespace kvflash
