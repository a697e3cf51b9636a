// The device build's first check (issue 39): lists ggml's devices in this build of libkvflash and runs one
// matrix product on each GPU-type device (Vulkan: lavapipe counts as one where GGML_VK_VISIBLE_DEVICES
// admits it; CUDA), against the CPU backend's.  Exit status 0: every GPU device agreed (normalised error
// < 1e-3); 1: one did not, or a step failed; 77: no GPU device visible (ctest's skip).
#include <cmath>
#include <cstdio>
#include <vector>
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

static std::vector<float> run(ggml_backend_t be, const std::vector<float> &a, const std::vector<float> &b, int K, int M, int N) {
    ggml_init_params p = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
    ggml_context *ctx = ggml_init(p);
    ggml_tensor *A = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, M);
    ggml_tensor *B = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, N);
    ggml_tensor *C = ggml_mul_mat(ctx, A, B);
    ggml_cgraph *g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, C);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
    ggml_backend_tensor_set(A, a.data(), 0, ggml_nbytes(A));
    ggml_backend_tensor_set(B, b.data(), 0, ggml_nbytes(B));
    const bool ok = ggml_backend_graph_compute(be, g) == GGML_STATUS_SUCCESS;
    std::vector<float> out;
    if (ok) {
        out.resize(size_t(M) * N);
        ggml_backend_tensor_get(C, out.data(), 0, ggml_nbytes(C));
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return out;
}

int main() {
    const int K = 256, M = 64, N = 16;
    std::vector<float> a(size_t(K) * M), b(size_t(K) * N);
    for (size_t i = 0; i < a.size(); ++i) a[i] = std::sin(0.01f * float(i));
    for (size_t i = 0; i < b.size(); ++i) b[i] = std::cos(0.02f * float(i));
    ggml_backend_t cpu = ggml_backend_cpu_init();
    const std::vector<float> want = run(cpu, a, b, K, M, N);
    int gpus = 0, bad = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(d, &free, &total);
        std::printf("device %zu: %s (%s), type %d, %zu MiB free of %zu\n", i, ggml_backend_dev_name(d),
                    ggml_backend_dev_description(d), int(ggml_backend_dev_type(d)), free >> 20, total >> 20);
        if (ggml_backend_dev_type(d) != GGML_BACKEND_DEVICE_TYPE_GPU) continue;
        ++gpus;
        ggml_backend_t be = ggml_backend_dev_init(d, nullptr);
        if (!be) {
            std::printf("  cannot initialise %s\n", ggml_backend_dev_name(d));
            ++bad;
            continue;
        }
        const std::vector<float> got = run(be, a, b, K, M, N);
        if (got.size() != want.size()) {
            std::printf("  the graph did not compute on %s\n", ggml_backend_name(be));
            ++bad;
            ggml_backend_free(be);
            continue;
        }
        double err = 0, ref = 0;
        for (size_t j = 0; j < got.size(); ++j) { err += (got[j] - want[j]) * (got[j] - want[j]); ref += want[j] * want[j]; }
        const double ne = std::sqrt(err / ref);
        std::printf("  mul_mat %dx%d by %dx%d on %s: normalised error vs CPU %.2e\n", M, K, N, K, ggml_backend_name(be), ne);
        bad += !(ne < 1e-3);
        ggml_backend_free(be);
    }
    ggml_backend_free(cpu);
    std::printf("%d GPU device(s), %d wrong\n", gpus, bad);
    if (gpus == 0) return 77;
    return bad ? 1 : 0;
}
