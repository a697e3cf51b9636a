#include "kvflash/rpc.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-rpc.h"

namespace kvflash {

void check_rpc_endpoint(const std::string &endpoint) {
    const size_t colon = endpoint.rfind(':');
    if (colon == std::string::npos || colon == 0)
        throw std::invalid_argument("rpc endpoint '" + endpoint + "': expected host:port (e.g. 127.0.0.1:50052)");
    const std::string port = endpoint.substr(colon + 1);
    if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
        std::stol(port) < 1 || std::stol(port) > 65535)
        throw std::invalid_argument("rpc endpoint '" + endpoint + "': the port must be a number in [1, 65535]");
}

void rpc_serve(const std::string &endpoint, int32_t n_threads, const std::string &cache_dir) {
    check_rpc_endpoint(endpoint);
    if (n_threads < 1) throw std::invalid_argument("rpc_serve: n_threads must be >= 1");
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) throw std::runtime_error("rpc_serve: no CPU device in this ggml build");
    // Returns only when it could not start (bad endpoint, a socket that would not bind).
    ggml_backend_rpc_start_server(endpoint.c_str(), cache_dir.empty() ? nullptr : cache_dir.c_str(), size_t(n_threads), 1,
                                  &cpu);
    std::fflush(stdout);
    throw std::runtime_error("rpc_serve: the server at " + endpoint + " could not start or stopped (is the port in use?)");
}

namespace {

// ggml's client aborts the process when its first connection to an endpoint fails (no server, a
// server of another protocol version, something else on the port: GGML_ABORT in its dispatcher).
// So the first time an endpoint is used, kvflash says HELLO itself, with a timeout, and turns every
// failure into an exception; then ggml connects.  The protocol's HELLO: the command byte (14), the
// request size (8 bytes), the request (24 bytes of transport capabilities, zero: plain TCP); the
// answer: its size (8 bytes), then major, minor, patch, padding and 24 bytes of capabilities.
static_assert(RPC_PROTO_MAJOR_VERSION == 7, "ggml's RPC protocol changed: check the HELLO layout below");
constexpr uint8_t kHelloCmd = 14;
constexpr size_t kCapsBytes = 24;

struct Fd {
    int fd = -1;
    ~Fd() { if (fd >= 0) ::close(fd); }
};

bool send_all(int fd, const void *p, size_t n) {
    const char *c = static_cast<const char *>(p);
    while (n > 0) {
        const ssize_t k = ::send(fd, c, n, MSG_NOSIGNAL);
        if (k <= 0) return false;
        c += k;
        n -= size_t(k);
    }
    return true;
}

bool recv_all(int fd, void *p, size_t n) {
    char *c = static_cast<char *>(p);
    while (n > 0) {
        const ssize_t k = ::recv(fd, c, n, 0);
        if (k <= 0) return false;
        c += k;
        n -= size_t(k);
    }
    return true;
}

void say_hello(const std::string &endpoint, int timeout_ms) {
    const size_t colon = endpoint.rfind(':');
    std::string host = endpoint.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    const std::string port = endpoint.substr(colon + 1);
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo *res = nullptr;
    if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || !res)
        throw std::runtime_error("rpc: cannot resolve host '" + host + "' of " + endpoint);
    std::unique_ptr<addrinfo, void (*)(addrinfo *)> hold(res, ::freeaddrinfo);
    std::string why = "no address";
    for (addrinfo *a = res; a; a = a->ai_next) {
        Fd s;
        s.fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (s.fd < 0) continue;
        const int flags = ::fcntl(s.fd, F_GETFL, 0);
        ::fcntl(s.fd, F_SETFL, flags | O_NONBLOCK);
        int rc = ::connect(s.fd, a->ai_addr, a->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            pollfd pf{s.fd, POLLOUT, 0};
            rc = ::poll(&pf, 1, timeout_ms) == 1 ? 0 : -1;
            int err = 0;
            socklen_t len = sizeof(err);
            if (rc == 0 && (::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)) {
                errno = err;
                rc = -1;
            }
        }
        if (rc != 0) {
            why = std::strerror(errno ? errno : ETIMEDOUT);
            continue;
        }
        ::fcntl(s.fd, F_SETFL, flags);
        timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
        ::setsockopt(s.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        ::setsockopt(s.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        uint8_t req[1 + 8 + kCapsBytes] = {};
        req[0] = kHelloCmd;
        const uint64_t size = kCapsBytes;
        std::memcpy(req + 1, &size, 8);
        uint64_t rsp_size = 0;
        uint8_t rsp[4 + kCapsBytes];
        if (!send_all(s.fd, req, sizeof(req)) || !recv_all(s.fd, &rsp_size, 8) || rsp_size != sizeof(rsp) ||
            !recv_all(s.fd, rsp, sizeof(rsp)))
            throw std::runtime_error("rpc: " + endpoint + " accepted a connection but did not answer as a ggml RPC "
                                     "server (protocol " + std::to_string(RPC_PROTO_MAJOR_VERSION) + ".x) within " +
                                     std::to_string(timeout_ms) + " ms");
        if (rsp[0] != RPC_PROTO_MAJOR_VERSION || rsp[1] > RPC_PROTO_MINOR_VERSION)
            throw std::runtime_error("rpc: the server at " + endpoint + " speaks protocol " + std::to_string(rsp[0]) + "." +
                                     std::to_string(rsp[1]) + "; this kvflash speaks " +
                                     std::to_string(RPC_PROTO_MAJOR_VERSION) + "." + std::to_string(RPC_PROTO_MINOR_VERSION) +
                                     " (run a server built from the same ggml)");
        return;
    }
    throw std::runtime_error("rpc: cannot connect to " + endpoint + " (" + why + "); is a server running there?");
}

struct BufferFree {
    void operator()(ggml_backend_buffer_t b) const { ggml_backend_buffer_free(b); }
};

// One connection per endpoint for the life of the process (ggml's client keeps one per endpoint too;
// its server takes one client at a time, so a second HELLO would wait behind the first connection).
ggml_backend_t connect(const std::string &endpoint) {
    check_rpc_endpoint(endpoint);
    static std::mutex mu;
    static std::map<std::string, ggml_backend_t> open;
    std::lock_guard<std::mutex> lock(mu);
    auto it = open.find(endpoint);
    if (it != open.end()) return it->second;
    say_hello(endpoint, 5000);
    ggml_backend_t b = ggml_backend_rpc_init(endpoint.c_str(), 0);
    if (!b) throw std::runtime_error("rpc: ggml could not open a backend on " + endpoint);
    open[endpoint] = b;
    return b;
}

}  // namespace

ggml_backend_t rpc_backend(const std::string &endpoint) { return connect(endpoint); }

ggml_backend_buffer_type_t rpc_buffer_type(const std::string &endpoint) {
    connect(endpoint);
    ggml_backend_buffer_type_t t = ggml_backend_rpc_buffer_type(endpoint.c_str(), 0);
    if (!t) throw std::runtime_error("rpc: no buffer type for device 0 of " + endpoint);
    return t;
}

std::pair<size_t, size_t> rpc_device_memory(const std::string &endpoint) {
    connect(endpoint);
    size_t free = 0, total = 0;
    ggml_backend_rpc_get_device_memory(endpoint.c_str(), 0, &free, &total);
    return {free, total};
}

std::vector<uint8_t> rpc_round_trip(const std::string &endpoint, const std::vector<uint8_t> &bytes) {
    if (bytes.empty()) return {};
    ggml_backend_t b = connect(endpoint);
    ggml_init_params ip{ggml_tensor_overhead() * 2, nullptr, true};
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> ctx(ggml_init(ip), ggml_free);
    if (!ctx) throw std::runtime_error("rpc_round_trip: ggml_init failed");
    ggml_tensor *t = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I8, int64_t(bytes.size()));
    std::unique_ptr<ggml_backend_buffer, BufferFree> buf(ggml_backend_alloc_ctx_tensors(ctx.get(), b));
    if (!buf) throw std::runtime_error("rpc_round_trip: the server at " + endpoint + " could not allocate " +
                                       std::to_string(bytes.size()) + " bytes");
    ggml_backend_tensor_set(t, bytes.data(), 0, bytes.size());
    std::vector<uint8_t> back(bytes.size());
    ggml_backend_tensor_get(t, back.data(), 0, back.size());
    return back;
}

bool rpc_op_allowed(const ggml_tensor *node) {
    switch (node->op) {
        // what a paged layer's graph on a remote device is made of (ggml_flash_attn_ext for attention)
        case GGML_OP_NONE:
        case GGML_OP_VIEW:
        case GGML_OP_RESHAPE:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE:
        case GGML_OP_CPY:
        case GGML_OP_CONT:
        case GGML_OP_DUP:
        case GGML_OP_ADD:
        case GGML_OP_MUL:
        case GGML_OP_SCALE:
        case GGML_OP_RMS_NORM:
        case GGML_OP_MUL_MAT:
        case GGML_OP_GET_ROWS:
        case GGML_OP_SET_ROWS:
        case GGML_OP_ROPE:
        case GGML_OP_SOFT_MAX:
        case GGML_OP_FLASH_ATTN_EXT:
        case GGML_OP_GLU:
        case GGML_OP_CONCAT:
        case GGML_OP_SUM_ROWS:
        case GGML_OP_SUB:
        case GGML_OP_POOL_1D:   // the remote share of a rescore (scoring.cpp)
        // a routed MoE feed-forward (Forward::ffn): router scores, top-k, weight normalisation, expert products
        case GGML_OP_ARGSORT:
        case GGML_OP_DIV:
        case GGML_OP_CLAMP:
        case GGML_OP_MUL_MAT_ID:
            return true;
        case GGML_OP_UNARY:
            switch (ggml_get_unary_op(node)) {
                case GGML_UNARY_OP_SILU:
                case GGML_UNARY_OP_GELU:
                case GGML_UNARY_OP_TANH:
                case GGML_UNARY_OP_EXP:
                case GGML_UNARY_OP_SIGMOID:   // sigmoid routing, a shared expert's gate
                    return true;
                default:
                    return false;
            }
        default:   // GGML_OP_CUSTOM and the rest: never sent
            return false;
    }
}

void check_rpc_graph(const ggml_cgraph *gf, int first, int last) {
    auto *g = const_cast<ggml_cgraph *>(gf);
    const int n = ggml_graph_n_nodes(g);
    if (last < 0 || last > n) last = n;
    for (int i = std::max(0, first); i < last; ++i) {
        const ggml_tensor *t = ggml_graph_node(g, i);
        if (rpc_op_allowed(t)) continue;
        const std::string what = t->op == GGML_OP_CUSTOM
            ? std::string("a custom op (kvflash's CPU attention kernel or another of this process's functions: "
                          "a server cannot run it; remote layers use ggml_flash_attn_ext)")
            : std::string("op ") + ggml_op_desc(t) + " (not on kvflash's list for remote devices)";
        throw std::invalid_argument("rpc: node '" + std::string(ggml_get_name(t)) + "' is " + what +
                                    "; it must run on a local device");
    }
}

}  // namespace kvflash
