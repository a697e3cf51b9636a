"""The corrupt-GGUF corpus (tests/gguf_corpus.py): every bad file is an error from the
Python loader and from the C API, none crashes; the good one loads and evaluates.
Each loader runs over the whole corpus in a child interpreter, which reports file by
file, so a crash names the file that caused it.  (CI runs the same corpus through the
C API under ASan/UBSan: tests/cpp/test_gguf_corpus.cpp.)"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

core = pytest.importorskip("kvflash._core")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gguf_corpus  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    paths = gguf_corpus.write(tmp_path_factory.mktemp("corpus"))
    assert sum(p.name.startswith("bad-") for p in paths) >= 40
    return paths


def _run(code: str, paths) -> dict:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)] + [str(p) for p in paths],
                       capture_output=True, text=True, timeout=600)
    names = [os.path.basename(str(p)) for p in paths]
    seen = {}
    for line in r.stdout.splitlines():  # (ggml's abort handler may print a backtrace here too)
        name, tab, verdict = line.partition("\t")
        if tab and name in names:
            seen[name] = verdict
    done = len(seen)
    assert r.returncode == 0, (f"the loader crashed (rc {r.returncode}) on {names[min(done, len(names) - 1)]} "
                               f"after {done} files:\n{r.stderr[-3000:]}")
    return seen


def _check(seen: dict, paths) -> None:
    bad = {os.path.basename(str(p)): seen.get(os.path.basename(str(p))) for p in paths}
    loaded = sorted(n for n, v in bad.items() if n.startswith("bad-") and not v.startswith("error"))
    assert not loaded, f"corrupt files that loaded: {loaded}"
    assert bad["ok.gguf"] == "ok", bad["ok.gguf"]


def test_python_loader_refuses_every_corrupt_file(corpus):
    seen = _run("""
        import os, sys, numpy as np
        from kvflash import _core
        for p in sys.argv[1:]:
            name = os.path.basename(p)
            try:
                m = _core.Model(p, n_threads=1)
                rt = _core.Runtime(m, max_ctx=64)
                rt.eval(np.arange(4, dtype=np.int32) % rt.n_vocab)
                verdict = "ok"
            except ValueError as e:
                verdict = "error " + str(e)
            print(name + "\\t" + verdict.replace("\\n", " "), flush=True)
    """, corpus)
    _check(seen, corpus)


def test_c_api_refuses_every_corrupt_file(corpus):
    from kvflash import capi
    seen = _run(f"""
        import ctypes, os, sys
        lib = ctypes.CDLL({str(capi.library_path())!r})
        lib.kvflash_model_load.restype = ctypes.c_void_p
        lib.kvflash_model_load.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]
        lib.kvflash_model_free.argtypes = [ctypes.c_void_p]
        for p in sys.argv[1:]:
            err = ctypes.create_string_buffer(512)
            m = lib.kvflash_model_load(p.encode(), 1, err, len(err))
            if m:
                lib.kvflash_model_free(m)
                verdict = "ok"
            else:
                verdict = "error " + err.value.decode(errors="replace")
                assert err.value, "NULL without a message"
            print(os.path.basename(p) + "\\t" + verdict, flush=True)
    """, corpus)
    _check(seen, corpus)


def test_vocabulary_beyond_int32_is_refused(tmp_path):
    # Every byte of the 2^31 + 8 row embedding is in the (sparse) file: before the range
    # check, n_vocab was narrowed to a negative int32 and the model loaded.
    p = gguf_corpus.write_vocab_over_int32(tmp_path / "vocab.gguf")
    code = f"""
        import numpy as np
        from kvflash import _core
        try:
            m = _core.Model({str(p)!r}, n_threads=1)
            print("LOADED n_vocab", m.hparams["n_vocab"], flush=True)
            _core.Runtime(m, max_ctx=64).eval(np.arange(4, dtype=np.int32))
        except ValueError as e:
            print("ValueError", e)
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ValueError" in r.stdout and "2^31" in r.stdout, r.stdout + r.stderr[-2000:]


def test_corrupt_header_errors_say_what_is_wrong(corpus):
    # ggml's parser reports the reason only in its log: the loader puts it in the error.
    want = {"bad-offset-misaligned.gguf": "offset", "bad-duplicate-key.gguf": "duplicate key",
            "bad-version-99.gguf": "version", "bad-type-unknown.gguf": "invalid ggml type",
            "bad-tensor-name-long.gguf": "too long"}
    for p in corpus:
        if p.name in want:
            with pytest.raises(ValueError, match=want[p.name]):
                core.Model(str(p), n_threads=1)
