#include "kvflash/device.h"

#include <stdexcept>

#ifdef KVFLASH_WITH_CUDA
#include "ggml-cuda.h"
#endif

namespace kvflash {

static const char *const kDeviceForms = "'cpu', 'cuda' or 'cuda:N' (N: a CUDA device index)";

std::string Device::name() const { return kind == Kind::CPU ? std::string("cpu") : "cuda:" + std::to_string(index); }

Device parse_device(const std::string &s) {
    Device d;
    if (s == "cpu") return d;
    if (s == "cuda" || s.rfind("cuda:", 0) == 0) {
        d.kind = Device::Kind::CUDA;
        if (s.size() > 4) {
            const std::string n = s.substr(5);
            if (n.empty() || n.size() > 4 || n.find_first_not_of("0123456789") != std::string::npos)
                throw std::invalid_argument("device '" + s + "': the CUDA device index must be a non-negative integer; use " +
                                            kDeviceForms);
            d.index = std::stoi(n);
        }
#ifndef KVFLASH_WITH_CUDA
        throw std::invalid_argument(
            "device '" + s + "': kvflash was built without CUDA. Rebuild it with the CUDA backend: "
            "pip install . -Ccmake.define.KVFLASH_CUDA=ON -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=<your GPU's, e.g. 86, 89 "
            "or 90> (or KVFLASH_CUDA=ON pip install .; needs the CUDA toolkit with cuBLAS, see the README), "
            "or use device='cpu'");
#endif
        return d;
    }
    throw std::invalid_argument("unknown device '" + s + "': use " + kDeviceForms);
}

bool cuda_compiled() {
#ifdef KVFLASH_WITH_CUDA
    return true;
#else
    return false;
#endif
}

int32_t cuda_device_count() {
#ifdef KVFLASH_WITH_CUDA
    return int32_t(ggml_backend_cuda_get_device_count());
#else
    return 0;
#endif
}

void check_device_visible(const Device &d, const std::string &spelled) {
    if (d.kind != Device::Kind::CUDA) return;
    const int32_t n_dev = cuda_device_count();
    if (n_dev == 0)
        throw std::invalid_argument("device '" + spelled + "': kvflash was built with CUDA but no CUDA device is visible "
                                    "(no driver, or CUDA_VISIBLE_DEVICES hides them); use device='cpu'");
    if (d.index >= n_dev)
        throw std::invalid_argument("device '" + spelled + "': " + std::to_string(n_dev) +
                                    " CUDA device(s) visible (cuda:0 .. cuda:" + std::to_string(n_dev - 1) + ")");
}

}  // namespace kvflash
