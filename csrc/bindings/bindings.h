// Shared by the binding files: the Python-side handles and the argument checks
// every binding goes through.  Core exceptions map to Python: invalid_argument ->
// ValueError, out_of_range -> IndexError; nothing reachable from Python input may
// abort the interpreter.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvflash/model.h"
#include "kvflash/pool.h"
#include "kvflash/runtime.h"
#include "kvflash/sampling.h"
#include "kvflash/scoring.h"

namespace kvflash::bindings {

namespace py = pybind11;

// A Model and one Runtime over it (a session's native state).
struct PyRuntime {
    std::shared_ptr<Model> model;
    std::unique_ptr<Runtime> rt;
    std::shared_ptr<ChunkSummaries> summaries;   // chunk_summaries=True: the qk-bound/qk-mean policies' state
    Sampler sampler;
    std::vector<float> logits;                   // after the last eval_sample
};
using RuntimeClass = py::class_<PyRuntime, std::shared_ptr<PyRuntime>>;

// The Python Pager: either a standalone pool (owner: a StandalonePager) or a view of a
// runtime's pager (owner: the PyRuntime, kept alive).  One binding serves both.
struct PagerRef {
    std::shared_ptr<void> owner;
    Pager *p = nullptr;
    KVPool *pool = nullptr;
    Pager &pg() { return *p; }
};

// None -> "", else str(path) (os.PathLike too).
std::string optional_path(const py::object &path);
// A non-empty 1-D int32 view of tokens (ValueError otherwise).
py::array_t<int32_t, py::array::c_style | py::array::forcecast> token_ids(const py::array &tokens);
// Sampling arguments, validated (ValueError naming the bad one).
SamplerParams sampling(float temperature, int32_t top_k, float top_p, float min_p);

void bind_pager(py::module_ &m);
void bind_model(py::module_ &m);
RuntimeClass bind_runtime(py::module_ &m);
void bind_scoring(RuntimeClass &cls);   // the scoring kernels, as Runtime methods
void bind_gguf(py::module_ &m);         // gguf_metadata

}  // namespace kvflash::bindings
