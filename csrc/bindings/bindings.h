// Shared by the binding files: the Python-side handles and the argument checks
// every binding goes through.  Core exceptions map to Python: invalid_argument ->
// ValueError, out_of_range -> IndexError; nothing reachable from Python input may
// abort the interpreter.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvflash/model.h"
#include "kvflash/pool.h"
#include "kvflash/runtime.h"
#include "kvflash/session.h"
#include "kvflash/sampling.h"
#include "kvflash/scoring.h"

namespace kvflash::bindings {

namespace py = pybind11;

// One caller at a time per runtime: the bindings release the GIL around compute, so
// a second thread (or a generator of the same session resumed from another) could
// otherwise free a graph or move pages under a running eval.  Every method that reads
// or writes the runtime's state holds an InUse for its length; a second one raises
// RuntimeError instead of waiting (waiting would hide the bug, and could deadlock on
// the GIL).  Different runtimes, even over one model, run concurrently: their graph
// computes are serialized by the model's compute lock (model.h).
class InUse {
public:
    explicit InUse(std::atomic<bool> *flag) : flag_(flag) {
        if (flag_ && flag_->exchange(true))
            throw std::runtime_error("this kvflash Runtime is in use by another thread or iterator: a Session (and "
                                     "its Runtime and Pager) serves one caller at a time; give each thread its own "
                                     "Session, and finish or close() an open generate() before starting another");
    }
    ~InUse() { if (flag_) flag_->store(false); }
    InUse(const InUse &) = delete;
    InUse &operator=(const InUse &) = delete;

private:
    std::atomic<bool> *flag_;
};

// A Model and one Runtime over it (a session's native state).
struct PyRuntime {
    std::atomic<bool> busy{false};               // InUse
    std::shared_ptr<Model> model;
    std::shared_ptr<Session> session;            // the core session: runtime, sampler, history, logits, schedule
    Runtime *rt = nullptr;                       // session->runtime()
    std::shared_ptr<ChunkSummaries> summaries;   // the session's (chunk_summaries=True): qk-bound / qk-mean's state
};
using RuntimeClass = py::class_<PyRuntime, std::shared_ptr<PyRuntime>>;

// The Python Pager: either a standalone pool (owner: a StandalonePager) or a view of a
// runtime's pager (owner: the PyRuntime, kept alive).  One binding serves both.
struct PagerRef {
    std::shared_ptr<void> owner;
    Pager *p = nullptr;
    KVPool *pool = nullptr;
    std::atomic<bool> *busy = nullptr;           // the runtime's InUse flag (a runtime's pager), or none
    // read_rows / write_rows fence the pool's queued page copies first (a device pool's mover queues them
    // on the backend, where a synchronous tensor get/set does not wait for them).  False only in the race
    // test, to show that it catches the unordered version.
    bool fenced = true;
    Pager &pg() { return *p; }
};

// None -> "", else str(path) (os.PathLike too).
std::string optional_path(const py::object &path);
// A non-empty 1-D int32 view of tokens (ValueError otherwise).
py::array_t<int32_t, py::array::c_style | py::array::forcecast> token_ids(const py::array &tokens);
// The same, copied: what a call that releases the GIL reads (the caller's buffer may
// change under it once other Python threads run).
std::vector<int32_t> token_copy(const py::array &tokens);
// Sampling arguments, validated (ValueError naming the bad one).
SamplerParams sampling(float temperature, int32_t top_k, float top_p, float min_p);
// A qk settings dict (mode, aggregate, n_queries, contrast, spread, n_layers, carry, smooth_width) as the
// core's QkScoring, checked; unnamed settings take the mode's defaults.
QkScoring qk_settings(const py::dict &qk);

void bind_pager(py::module_ &m);
void bind_model(py::module_ &m);
RuntimeClass bind_runtime(py::module_ &m);
void bind_scoring(RuntimeClass &cls);   // the scoring kernels, as Runtime methods
void bind_session(RuntimeClass &cls);   // the core session's verbs, as Runtime methods
void bind_drafter(py::module_ &m);      // _core.Drafter, the drafter scorer (drafter.h)
void bind_gguf(py::module_ &m);         // gguf_metadata
void bind_tokenizer(py::module_ &m);    // Vocab (the core tokenizer)
void bind_snapshot(py::module_ &m, RuntimeClass &cls);  // Snapshot, Runtime.save_snapshot

}  // namespace kvflash::bindings
