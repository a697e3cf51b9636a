"""The fuzz and sanitizer builds compile the core from the one source list libkvflash is built from
(cmake/sources.cmake), so they cannot fall behind it; the snapshot harness's tiny models are sound."""
from __future__ import annotations

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))


def _read(*p):
    with open(os.path.join(ROOT, *p)) as f:
        return f.read()


def test_the_one_source_list_holds_every_core_source():
    text = _read("cmake", "sources.cmake")
    listed = set(re.findall(r"\$\{_kvf_src\}/(\w+\.cpp)", text))
    assert "arch_*.cpp" in text   # the architecture files, by glob
    on_disk = {f for f in os.listdir(os.path.join(ROOT, "csrc", "kvflash")) if f.endswith(".cpp")}
    # the Python module's own (the attention bench's harness), listed with the bindings
    module = set(re.findall(r"csrc/kvflash/(\w+\.cpp)", _read("CMakeLists.txt").split("KVFLASH_BINDING_SOURCES", 1)[1]
                            .split(")", 1)[0]))
    assert module == {"attn_bench.cpp"}
    assert listed | module | {f for f in on_disk if f.startswith("arch_")} == on_disk and not listed & module


def test_every_build_of_the_core_uses_the_list():
    fuzz = _read("bench", "fuzz", "CMakeLists.txt")
    assert 'include("${KVF_ROOT}/cmake/sources.cmake")' in fuzz and "${KVFLASH_CORE_SOURCES}" in fuzz
    code = "\n".join(line.split("#")[0] for line in fuzz.splitlines())
    assert re.findall(r"[\w${}/.]+\.cpp", code) == ["${_t}.cpp"], "bench/fuzz lists core sources of its own"
    main = _read("CMakeLists.txt")
    assert "include(cmake/sources.cmake)" in main and "add_subdirectory(csrc)" in main
    assert "add_library(kvflash SHARED ${KVFLASH_CORE_SOURCES})" in _read("csrc", "CMakeLists.txt")
    assert "add_library(kvflash_san STATIC ${KVFLASH_CORE_SOURCES})" in main


def test_the_snapshot_harness_models_load_and_snapshot(tmp_path):
    core = pytest.importorskip("kvflash._core")
    import numpy as np
    sys.path.insert(0, HERE)
    import snapshot_models
    paths = snapshot_models.write(tmp_path)
    for p in paths:
        m = core.Model(str(p), 1)
        rt = core.Runtime(m, max_ctx=1024, pool_tokens=256, chunk_tokens=16, kv_type="f16")
        rt.eval(np.arange(600, dtype=np.int32) % m.hparams["n_vocab"])
        assert rt.pager.stats["host_chunks"] > 0
        snap = tmp_path / (p.stem + ".kvsnap")
        rt.save_snapshot(str(snap), np.arange(600, dtype=np.int32) % m.hparams["n_vocab"])
        core.Snapshot.read(str(snap), runtime=rt).check(rt)
    assert core.Model(str(paths[1]), 1).hparams["arch"] == "gemma3"
