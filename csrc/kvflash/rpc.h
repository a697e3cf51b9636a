// ggml's RPC backend, as kvflash uses it (issue 22): a server process that lends this machine's CPU
// to a client, the client's view of a server, and the guard that keeps graphs a server cannot run
// from being sent to it.
//
// The RPC protocol has no authentication and no encryption: anyone who reaches the port can allocate
// memory and run graphs on the server.  Serve on loopback (the default) or a trusted network only.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"

namespace kvflash {

// "host:port" with a port in [1, 65535] and a non-empty host; std::invalid_argument naming the fault.
void check_rpc_endpoint(const std::string &endpoint);

// Serve this machine's CPU backend over ggml's RPC protocol at endpoint ("127.0.0.1:50052") with
// n_threads compute threads; cache_dir (empty: none) lets clients send large tensors by hash.  Blocks
// while it serves; std::runtime_error when it cannot start (the port taken, say).
void rpc_serve(const std::string &endpoint, int32_t n_threads, const std::string &cache_dir);

// (free, total) bytes of the server's device 0: a round trip that proves the server answers.
// std::runtime_error when it does not.
std::pair<size_t, size_t> rpc_device_memory(const std::string &endpoint);

// The client's backend for the server's device 0: kvflash's checked connection (HELLO first), one per
// endpoint for the life of the process (ggml's server serves one client at a time).  Not to be freed.
ggml_backend_t rpc_backend(const std::string &endpoint);

// The buffer type of the server's device 0 (after the same checked connection): where a remote
// layer's weights and pool slice are allocated.  std::runtime_error when no server answers.
ggml_backend_buffer_type_t rpc_buffer_type(const std::string &endpoint);

// Bytes through one buffer on the server: allocated there, written with tensor_set, read back with
// tensor_get (the pool's page-out and page-in path on a remote layer).  Returns what came back.
std::vector<uint8_t> rpc_round_trip(const std::string &endpoint, const std::vector<uint8_t> &bytes);

// Ops a remote (RPC) device may be given.  ggml's RPC server deserializes any op and aborts on one its
// backend lacks; a GGML_OP_CUSTOM node carries a function pointer of this process, meaningless there.
// Graph placement asks this instead of trusting supports_op.
bool rpc_op_allowed(const ggml_tensor *node);
// Throws std::invalid_argument naming the first node of gf (from index first) an RPC device must not run.
void check_rpc_graph(const ggml_cgraph *gf, int first = 0, int last = -1);

}  // namespace kvflash
