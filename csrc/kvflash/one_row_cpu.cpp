#include "kvflash/one_row_cpu.h"

#include <cstring>
#include <vector>

#include "ggml-cpu.h"

namespace kvflash {

namespace {

// dst [M, n] = w [K, M] · x [K, n], one vec_dot per output as ggml's one-row mul_mat takes it.
void one_row_mm(ggml_tensor *dst, int ith, int nth, void *) {
    const ggml_tensor *w = dst->src[0], *x = dst->src[1];
    const int64_t K = w->ne[0], M = w->ne[1], n = x->ne[1];
    const ggml_type_traits_cpu *tw = ggml_get_type_traits_cpu(w->type);
    const ggml_type vt = tw->vec_dot_type;
    const size_t qrow = ggml_row_size(vt, K);
    // Every thread converts all columns itself (n * K values: small beside the weight), as the
    // one-row path converts its one column; block-wise conversions do not depend on who does them.
    thread_local std::vector<char> qbuf;
    const char *cols;
    if (vt == GGML_TYPE_F32) {
        cols = nullptr;
    } else {
        if (qbuf.size() < qrow * size_t(n)) qbuf.resize(qrow * size_t(n));
        ggml_from_float_t from_float = ggml_get_type_traits_cpu(vt)->from_float;
        for (int64_t j = 0; j < n; ++j)
            from_float(reinterpret_cast<const float *>(static_cast<const char *>(x->data) + j * x->nb[1]),
                       qbuf.data() + size_t(j) * qrow, K);
        cols = qbuf.data();
    }
    const int64_t r0 = M * ith / nth, r1 = M * (ith + 1) / nth;
    for (int64_t r = r0; r < r1; ++r) {
        const char *wr = static_cast<const char *>(w->data) + r * w->nb[1];
        for (int64_t j = 0; j < n; ++j) {
            const void *c = cols ? static_cast<const void *>(cols + size_t(j) * qrow)
                                 : static_cast<const void *>(static_cast<const char *>(x->data) + j * x->nb[1]);
            float s;
            tw->vec_dot(int(K), &s, 0, wr, 0, c, 0, 1);
            *reinterpret_cast<float *>(static_cast<char *>(dst->data) + j * dst->nb[1] + r * dst->nb[0]) = s;
        }
    }
}

}  // namespace

ggml_tensor *one_row_products(ggml_context *ctx, ggml_tensor *w, ggml_tensor *x, bool plain) {
    GGML_ASSERT(x->type == GGML_TYPE_F32 && x->ne[0] == w->ne[0] && x->ne[2] == 1 && x->ne[3] == 1);
    GGML_ASSERT(w->ne[2] == 1 && w->ne[3] == 1 && x->nb[0] == sizeof(float));
    const int64_t n = x->ne[1];
    if (n == 1) return ggml_mul_mat(ctx, w, x);
    if (plain) {
        GGML_ASSERT(ggml_get_type_traits_cpu(w->type)->vec_dot != nullptr);
        ggml_tensor *args[2] = {w, x};
        return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], n, 1, 1, args, 2, one_row_mm, GGML_N_TASKS_MAX, nullptr);
    }
    // Extra buffers keep their own layouts: one ggml product per column, joined pairwise.
    std::vector<ggml_tensor *> parts;
    for (int64_t j = 0; j < n; ++j)
        parts.push_back(ggml_mul_mat(ctx, w, ggml_view_2d(ctx, x, x->ne[0], 1, x->nb[1], size_t(j) * x->nb[1])));
    while (parts.size() > 1) {
        std::vector<ggml_tensor *> next;
        for (size_t i = 0; i + 1 < parts.size(); i += 2) next.push_back(ggml_concat(ctx, parts[i], parts[i + 1], 1));
        if (parts.size() % 2) next.push_back(parts.back());
        parts.swap(next);
    }
    return parts[0];
}

int64_t one_row_products_nodes(int64_t n, bool plain) { return n <= 1 ? 1 : plain ? 1 : 3 * n; }

}  // namespace kvflash
