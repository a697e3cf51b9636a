"""The C library as applications use it, and the one guard for context sizes.

- The installed package ships libkvflash (the only copy of the core and of ggml:
  ``_core`` links it), kvflash.h, a CMake package and a pkg-config file.
- ``examples/c`` is built against the installed package only (its CMake package)
  and its greedy ids match ``kvflash.Session``'s on the real model with eviction.
- A max_ctx the core cannot address (2**38) is refused with a clear error at every
  entry point; each is tried in a subprocess, so a crash fails the test instead of
  killing the run.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvflash
from kvflash import _core, capi
from tinygguf import write_tiny_hybrid, write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
HUGE = 2**38 + 1920
GUARD_MSG = "above the largest context kvflash addresses"


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def c_generate(lib, s, n):
    """n greedy tokens through the C API's sample / decode (the scripts run_python runs import it)."""
    out, tok = [], ctypes.c_int32()
    assert lib.kvflash_sample(s, None, None, ctypes.byref(tok)) == 0
    for _ in range(n):
        out.append(tok.value)
        nxt = ctypes.c_int32()
        assert lib.kvflash_decode(s, tok.value, None, ctypes.byref(nxt)) == 0, lib.kvflash_last_error(s)
        tok = nxt
    return out


def py_generate(s, n):
    """n greedy tokens from a kvflash.Session (what c_generate gives from the C side)."""
    n0 = s.n_past
    list(s.generate(None, max_tokens=n, ignore_eos=True))
    return s.tokens[n0:n0 + n]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_llama(tmp_path_factory, "tiny", seed=3)


def _tiny_llama(tmp_path_factory, name: str, seed: int) -> str:
    # weight_scale 2: greedy tokens that depend on the context (write_small_llama's scale-1 llama repeats
    # one or two tokens whatever its cache holds, so comparing its tokens would prove little)
    path = tmp_path_factory.mktemp("capi") / f"{name}.gguf"
    write_tiny_model(str(path), "llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
                     weight_type="f32", seed=seed, weight_scale=2.0)
    return str(path)


# ----------------------------------------------------------------------------- the install

def test_wheel_ships_the_c_library_and_package_files():
    capi.check_installed()
    assert (capi.include_dir() / "kvflash.h").read_text().count("kvflash_session_new") >= 1
    pc = (capi.pkgconfig_dir() / "kvflash.pc").read_text()
    assert "-lkvflash" in pc and "${pcfiledir}" in pc
    for flag, fn in (("--cmake-dir", capi.cmake_dir), ("--pkgconfig-dir", capi.pkgconfig_dir),
                     ("--include-dir", capi.include_dir), ("--lib-dir", capi.lib_dir)):
        out = subprocess.run([sys.executable, "-m", "kvflash", flag], capture_output=True, text=True, check=True)
        assert Path(out.stdout.strip()) == fn()


def test_one_copy_of_the_core_and_of_ggml_per_process():
    # _core defines no ggml or kvflash core symbol of its own: it imports them from libkvflash.
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    core = Path(_core.__file__)
    defined = subprocess.run([nm, "-D", "--defined-only", str(core)], capture_output=True, text=True, check=True).stdout
    assert not re.search(r"\b(ggml_\w+|_ZN7kvflash5Pager\w*)$", defined, re.M), "ggml or the core is linked into _core"
    undefined = subprocess.run([nm, "-D", "--undefined-only", str(core)], capture_output=True, text=True,
                               check=True).stdout
    assert "ggml_backend_cpu_init" in undefined
    # Loading the library next to the module maps the same file once.
    ctypes.CDLL(str(capi.library_path()))
    maps = Path("/proc/self/maps").read_text()
    paths = {line.split()[-1] for line in maps.splitlines() if line.endswith("libkvflash.so")}
    assert paths == {str(capi.library_path())}, paths


def test_llama_cpp_s_tokenizer_stays_inside_the_library():
    # llama.cpp's vocabulary code is compiled into libkvflash with hidden symbols: none of its names is
    # exported (a process may load libllama beside kvflash), the C API's tokenizer is.
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    defined = subprocess.run([nm, "-D", "--defined-only", str(capi.library_path())], capture_output=True, text=True,
                             check=True).stdout
    names = [line.split()[-1] for line in defined.splitlines() if line.strip()]
    leaked = [n for n in names if ("llama" in n.lower() or "unicode_" in n) and n != "ggml_cpu_has_llamafile"
              and "kvflash" not in n]
    assert not leaked, leaked[:10]
    assert {"kvflash_tokenize", "kvflash_token_to_piece", "kvflash_detokenize", "kvflash_vocab_load"} <= set(names)


def _cmake() -> str:
    here = Path(sys.executable).parent / "cmake"
    exe = str(here) if here.exists() else shutil.which("cmake")
    if exe is None:
        pytest.fail("cmake not found: `pip install .[test]` installs it")
    return exe


@pytest.fixture(scope="module")
def c_example(tmp_path_factory):
    """examples/c built against the installed wheel through its CMake package (nothing from the source tree)."""
    build = tmp_path_factory.mktemp("example-build")
    cmake = _cmake()
    cfg = subprocess.run([cmake, "-S", str(ROOT / "examples" / "c"), "-B", str(build),
                          f"-Dkvflash_DIR={capi.cmake_dir()}", "-DCMAKE_BUILD_TYPE=Release"],
                         capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    bld = subprocess.run([cmake, "--build", str(build)], capture_output=True, text=True)
    assert bld.returncode == 0, bld.stdout + bld.stderr
    exe = build / "kvflash_generate"
    assert exe.exists()
    ldd = shutil.which("ldd")
    if ldd:
        linked = subprocess.run([ldd, str(exe)], capture_output=True, text=True).stdout
        assert str(capi.library_path()) in linked, linked
    return exe


def _run_example(exe, model, ids, *args, tmp_path):
    f = tmp_path / "ids.txt"
    f.write_text(" ".join(map(str, ids)) + "\n")
    proc = subprocess.run([str(exe), str(model), "--ids-file", str(f), *map(str, args)], capture_output=True,
                          text=True, timeout=600)
    return proc


def _parse(stdout: str):
    gen = re.search(r"^generated:(.*)$", stdout, re.M)
    st = re.search(r"^stats: (.*)$", stdout, re.M)
    assert gen and st, stdout
    stats = {k: int(v) for k, v in (kv.split("=") for kv in st.group(1).split())}
    return [int(t) for t in gen.group(1).split()], stats


def test_c_example_reports_errors_as_status(c_example, tiny, tmp_path):
    bad = _run_example(c_example, tmp_path / "missing.gguf", [1, 2, 3], tmp_path=tmp_path)
    assert bad.returncode == 1 and "kvflash:" in bad.stderr
    huge = _run_example(c_example, tiny, [1, 2, 3], "--max-ctx", HUGE, tmp_path=tmp_path)
    assert huge.returncode == 1 and GUARD_MSG in huge.stderr, huge.stderr
    small = _run_example(c_example, tiny, [1, 2, 3], "--pool", 256, tmp_path=tmp_path)
    assert small.returncode == 1 and "minimum" in small.stderr, small.stderr
    oob = _run_example(c_example, tiny, [1, 10**6], tmp_path=tmp_path)
    assert oob.returncode == 1 and "kvflash:" in oob.stderr, oob.stderr


def _session_ids(model, ids, n, *, pool, policy, kv_type="q8_0", threads=2):
    s = kvflash.Session(model, max_ctx=4096, kvflash=pool, policy=policy, kv_type=kv_type, threads=threads,
                        verbose=False)
    s.prefill(ids)
    for _ in s.generate(None, max_tokens=n, ignore_eos=True):
        pass
    return s.tokens[len(ids):], s.stats


@pytest.mark.parametrize("policy", ["lru", "qk"])
def test_c_example_matches_session_on_tiny_model(c_example, tiny, tmp_path, policy):
    ids = [(i * 37 + 11) % 250 + 3 for i in range(900)]  # 900 tokens through a 512 pool: pages
    want, st = _session_ids(tiny, ids, 80, pool=512, policy=policy)
    proc = _run_example(c_example, tiny, ids, "-n", 80, "--pool", 512, "--policy", policy, "-t", 2, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got, cst = _parse(proc.stdout)
    assert got == want
    assert cst["page_outs"] == st["page_outs"] > 0
    assert cst["rescores"] == (st["rescores"] if policy == "qk" else 0)


@pytest.mark.model
def test_c_example_matches_session_on_smollm2(c_example, tmp_path, policy="qk"):
    # qk: eviction during the prompt, a prompt rescore with re-read, decode-time rescores.
    model = kvflash.resolve_model("smollm2-135m")
    s = kvflash.Session(model, max_ctx=4096, kvflash=512, policy="lru", verbose=False)
    text = ("The lighthouse keeper wrote the day's weather in his log, then climbed the stairs to trim the wick. " * 18 +
            "The secret word is marigold. " +
            "Ships passed in the night and the keeper counted their lights from the gallery. " * 18 +
            "\nQuestion: what is the secret word? Answer:")
    ids = s.tokenize(text)
    assert len(ids) > 600  # past the 512-token pool: eviction in play
    want, st = _session_ids(model, ids, 72, pool=512, policy=policy)
    proc = _run_example(c_example, model, ids, "-n", 72, "--pool", 512, "--policy", policy, "-t", 2,
                        "--kv-type", "q8_0", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got, cst = _parse(proc.stdout)
    assert got == want
    assert cst["page_outs"] == st["page_outs"] > 0
    assert cst["rescores"] == st["rescores"] >= 2   # the prompt's and at least one during decode
    assert cst["n_past"] == len(ids) + 71


# ----------------------------------------------------------------------------- the tokenizer (API version 9)

def _vocab_dir():
    from kvflash import _registry
    try:
        return Path(_registry.vocab_dir())
    except Exception as e:  # no registry access and nothing cached
        pytest.skip(f"vocab dir unavailable ({type(e).__name__}: {e})")


# Every vocabulary the pinned sdist ships test vectors for that the core tokenizer loads (bert-bge's
# WordPiece is refused).
C_VOCABS = ["llama-spm", "llama-bpe", "qwen2", "gpt-2", "qwen35", "gemma-4", "phi-3", "command-r",
            "deepseek-coder", "deepseek-llm", "falcon", "mpt", "refact", "starcoder"]


@pytest.mark.parametrize("name", C_VOCABS)
def test_c_tokenizer_matches_llama_cpp_vectors(c_example, name):
    """examples/c/tokenize.c through kvflash_tokenize: every line of the .out file, and the pieces give each text back."""
    d = _vocab_dir()
    vocab = d / f"ggml-vocab-{name}.gguf"
    proc = subprocess.run([str(c_example.parent / "kvflash_tokenize"), str(vocab), str(vocab) + ".inp", "--cases"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = (Path(str(vocab) + ".out")).read_text(encoding="utf-8").split("\n")
    if want and want[-1] == "":
        want.pop()
    got = proc.stdout.split("\n")[:-1]
    assert len(got) == len(want) >= 40
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.split() == w.split(), f"{name} case {i}"


def test_c_tokenizer_from_a_model_and_special_tokens(c_example, tiny, tmp_path):
    # the tiny model's own vocabulary (SentencePiece-style, BOS added), --special: add_special and parse_special
    f = tmp_path / "text.txt"
    f.write_text("Hello <s> world", encoding="utf-8")
    proc = subprocess.run([str(c_example.parent / "kvflash_tokenize"), tiny, str(f), "--special"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from kvflash.tokenizer import Tokenizer
    assert [int(x) for x in proc.stdout.split()] == Tokenizer.from_gguf(tiny).encode("Hello <s> world", parse_special=True)
    missing = subprocess.run([str(c_example.parent / "kvflash_tokenize"), str(tmp_path / "none.gguf"), str(f)],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "no such GGUF file" in missing.stderr


def test_c_tokenizer_bad_input_is_a_status(tiny):
    """Every misuse of the tokenizer functions answers a status and a message, in a subprocess (an abort fails it)."""
    proc = run_python(f"""
        import ctypes
        from kvflash import capi
        L = ctypes.CDLL(str(capi.library_path()))
        P, I, S = ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t
        L.kvflash_vocab_load.restype = P
        L.kvflash_vocab_load.argtypes = [ctypes.c_char_p, ctypes.c_char_p, S]
        L.kvflash_model_load.restype = P
        L.kvflash_model_load.argtypes = [ctypes.c_char_p, I, ctypes.c_char_p, S]
        L.kvflash_model_vocab.restype = P
        L.kvflash_model_vocab.argtypes = [P, ctypes.c_char_p, S]
        L.kvflash_tokenize.argtypes = [P, ctypes.c_char_p, S, ctypes.POINTER(I), I, ctypes.c_int, ctypes.c_int,
                                       ctypes.POINTER(I)]
        L.kvflash_token_to_piece.argtypes = [P, I, ctypes.c_char_p, I, ctypes.c_int, ctypes.POINTER(I)]
        L.kvflash_detokenize.argtypes = [P, ctypes.POINTER(I), I, ctypes.c_char_p, I, ctypes.c_int, ctypes.c_int,
                                         ctypes.POINTER(I)]
        L.kvflash_vocab_last_error.restype = ctypes.c_char_p
        L.kvflash_vocab_free.argtypes = [P]
        L.kvflash_model_free.argtypes = [P]
        for f in ("n_tokens", "bos", "eos"):
            getattr(L, "kvflash_vocab_" + f).argtypes = [P]
        L.kvflash_vocab_is_eog.argtypes = [P, I]
        err = ctypes.create_string_buffer(512)
        assert L.kvflash_vocab_load(b"/nonexistent.gguf", err, 512) is None and b"no such GGUF" in err.value
        assert L.kvflash_vocab_load(None, err, 512) is None and b"NULL" in err.value
        m = L.kvflash_model_load({tiny!r}.encode(), 1, err, 512)
        v = L.kvflash_model_vocab(m, err, 512)
        assert v, err.value
        L.kvflash_model_free(m)        # the vocab handle keeps what it needs
        n = L.kvflash_vocab_n_tokens(v)
        assert n > 0 and L.kvflash_vocab_n_tokens(None) == 0 and L.kvflash_vocab_bos(None) == -1
        out = (I * 64)()
        n_out = I(0)
        rc = lambda: L.kvflash_vocab_last_error().decode()
        assert L.kvflash_tokenize(v, b"hello", 5, out, 64, 1, 0, ctypes.byref(n_out)) == 0 and n_out.value >= 1
        assert L.kvflash_tokenize(v, b"hello world", 11, out, 1, 1, 0, ctypes.byref(n_out)) == -5 and n_out.value > 1
        assert "needed" in rc()
        assert L.kvflash_tokenize(v, b"ab\\xffcd", 5, out, 64, 0, 0, ctypes.byref(n_out)) == -1 and "UTF-8" in rc()
        assert L.kvflash_tokenize(v, b"\\xed\\xa0\\x80", 3, out, 64, 0, 0, ctypes.byref(n_out)) == -1  # a surrogate
        assert L.kvflash_tokenize(None, b"a", 1, out, 64, 0, 0, ctypes.byref(n_out)) == -1 and "NULL" in rc()
        assert L.kvflash_tokenize(v, None, 3, out, 64, 0, 0, ctypes.byref(n_out)) == -1
        assert L.kvflash_tokenize(v, b"a", 1, None, 4, 0, 0, ctypes.byref(n_out)) == -1
        assert L.kvflash_tokenize(v, b"a", 1, out, -1, 0, 0, ctypes.byref(n_out)) == -1
        assert L.kvflash_tokenize(v, b"a", 1, out, 64, 0, 0, None) == -1
        assert L.kvflash_tokenize(v, b"a", 2**31 + 5, out, 64, 0, 0, ctypes.byref(n_out)) == -1 and "2^31" in rc()
        buf = ctypes.create_string_buffer(64)
        for bad in (-1, n, 2**31 - 1):
            assert L.kvflash_token_to_piece(v, bad, buf, 64, 1, ctypes.byref(n_out)) == -2 and "out of range" in rc()
            assert L.kvflash_vocab_is_eog(v, bad) == 0
        ids = (I * 3)(1, n + 7, 2)
        assert L.kvflash_detokenize(v, ids, 3, buf, 64, 0, 0, ctypes.byref(n_out)) == -2
        assert L.kvflash_detokenize(v, ids, -1, buf, 64, 0, 0, ctypes.byref(n_out)) == -1
        assert L.kvflash_detokenize(v, None, 2, buf, 64, 0, 0, ctypes.byref(n_out)) == -1
        assert L.kvflash_tokenize(v, b"hello", 5, out, 64, 0, 0, ctypes.byref(n_out)) == 0 and rc() == ""
        k = n_out.value
        assert L.kvflash_detokenize(v, out, k, buf, 64, 0, 0, ctypes.byref(n_out)) == 0
        assert buf.raw[:n_out.value] == b"hello", buf.raw[:n_out.value]
        assert L.kvflash_detokenize(v, out, k, buf, 1, 0, 0, ctypes.byref(n_out)) == -5 and n_out.value == 5
        L.kvflash_vocab_free(v)
        L.kvflash_vocab_free(None)
        print("STATUSES OK")
    """)
    assert proc.returncode == 0 and "STATUSES OK" in proc.stdout, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- the size guard

def test_max_context_constant():
    assert _core.MAX_CONTEXT == 2**31 - 256
    _core.check_max_ctx(_core.MAX_CONTEXT)
    for bad in (0, -1, _core.MAX_CONTEXT + 1, HUGE):
        with pytest.raises(ValueError):
            _core.check_max_ctx(bad)


def _expect_guard(code: str):
    proc = run_python(code)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "REFUSED" in proc.stdout and GUARD_MSG in proc.stdout, proc.stdout + proc.stderr


def test_pager_refuses_huge_max_ctx():
    _expect_guard(f"""
        import kvflash
        try:
            p = kvflash.Pager(pool_tokens=512, max_ctx={HUGE}, n_layers=1, n_embd_k=32, kv_type="f16")
            p.alloc_span(1920, 64)
            print("ACCEPTED")
        except ValueError as e:
            print("REFUSED", e)
    """)


def test_pager_positions_past_max_ctx_are_index_errors():
    p = kvflash.Pager(pool_tokens=512, max_ctx=4096, n_layers=1, n_embd_k=32, kv_type="f16")
    for pos0, n in ((4096, 1), (4000, 200), (2**62, 64), (-1, 1)):
        with pytest.raises(IndexError):
            p.alloc_span(pos0, n)
    with pytest.raises(ValueError):
        p.alloc_span(0, 0)
    p.check_invariants()


def test_runtime_refuses_huge_max_ctx(tiny):
    _expect_guard(f"""
        from kvflash import _core
        m = _core.Model({str(tiny)!r}, 1)
        for pool in (0, 512):
            try:
                _core.Runtime(m, max_ctx={HUGE}, pool_tokens=pool)
                print("ACCEPTED")
            except ValueError as e:
                print("REFUSED", e)
    """)


@pytest.mark.parametrize("kw", ["allow_long_ctx=True, kvflash=512", "kvflash='auto'", "kvflash=None"])
def test_session_refuses_huge_max_ctx(tiny, kw):
    _expect_guard(f"""
        import kvflash
        try:
            kvflash.Session({str(tiny)!r}, max_ctx={HUGE}, {kw}, policy="lru", verbose=False)
            print("ACCEPTED")
        except ValueError as e:
            print("REFUSED", e)
    """)


def test_gguf_context_length_above_the_limit_is_clamped(tmp_path):
    path = tmp_path / "longctx.gguf"
    write_tiny_model(path, "llama", n_layer=1, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, ctx_len=2**40)
    proc = run_python(f"""
        import kvflash
        m = kvflash.Model({str(path)!r}, 1)
        print("N_CTX_TRAIN", m.hparams["n_ctx_train"])
        s = kvflash.Session({str(path)!r}, kvflash=512, policy="lru", verbose=False)
        print("MAX_CTX", s.max_ctx)
        s.prefill([1, 2, 3])
        print("OK", s.n_past)
    """)
    assert proc.returncode == 0, proc.stderr
    assert f"N_CTX_TRAIN {_core.MAX_CONTEXT}" in proc.stdout
    assert f"MAX_CTX {_core.MAX_CONTEXT}" in proc.stdout and "OK 3" in proc.stdout
    assert "context_length 1099511627776 is above the largest context" in proc.stderr


class Params(ctypes.Structure):
    """struct kvflash_params as kvflash.h declares it (API version 15; 12 and 14 changed values, not fields)."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("max_ctx", ctypes.c_int64), ("pool_tokens", ctypes.c_int32),
                ("kv_type", ctypes.c_char_p), ("chunk_tokens", ctypes.c_int32), ("sink_chunks", ctypes.c_int32),
                ("tail_window_chunks", ctypes.c_int32), ("ubatch", ctypes.c_int32), ("policy", ctypes.c_char_p),
                ("tau", ctypes.c_int32), ("qk_queries", ctypes.c_int32), ("reeval_tokens", ctypes.c_int32),
                ("seed", ctypes.c_uint64), ("qk_contrast", ctypes.c_int32), ("qk_spread", ctypes.c_int32),
                ("qk_layers", ctypes.c_int32), ("max_host_bytes", ctypes.c_int64), ("qk_carry", ctypes.c_int32),
                ("exact", ctypes.c_int32), ("exact_prefill", ctypes.c_int32), ("exact_draft", ctypes.c_int32),
                ("qk_aggregate", ctypes.c_char_p), ("qk_smooth_width", ctypes.c_int32), ("drafter", ctypes.c_void_p),
                ("drafter_layers", ctypes.c_int32), ("drafter_pool", ctypes.c_int32), ("drafter_queries", ctypes.c_int32),
                ("prefill_rescore", ctypes.c_int32), ("prefill_reread", ctypes.c_int32), ("qk_windows", ctypes.c_int32)]


class Stats(ctypes.Structure):
    """struct kvflash_stats as kvflash.h declares it."""
    _fields_ = [("n_past", ctypes.c_int64), ("page_outs", ctypes.c_int64), ("page_ins", ctypes.c_int64),
                ("bytes_out", ctypes.c_int64), ("bytes_in", ctypes.c_int64),
                ("resident_chunks", ctypes.c_int32), ("host_chunks", ctypes.c_int32),
                ("resident_bytes", ctypes.c_uint64), ("host_bytes", ctypes.c_uint64),
                ("pool_tokens", ctypes.c_int32), ("n_chunks", ctypes.c_int32), ("rescores", ctypes.c_int64)]


def declare(lib):
    """The C API's signatures on a ctypes handle of libkvflash (the tests' subprocesses share it)."""
    V, I32, I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    sig = {"kvflash_default_params": (Params, []),
           "kvflash_max_context": (I64, []),
           "kvflash_model_load": (V, [ctypes.c_char_p, I32, ctypes.c_char_p, ctypes.c_size_t]),
           "kvflash_model_free": (None, [V]),
           "kvflash_session_new": (V, [V, ctypes.POINTER(Params), ctypes.c_char_p, ctypes.c_size_t]),
           "kvflash_eval": (ctypes.c_int, [V, V, I32, V]),
           "kvflash_decode": (ctypes.c_int, [V, I32, V, ctypes.POINTER(I32)]),
           "kvflash_sample": (ctypes.c_int, [V, V, V, ctypes.POINTER(I32)]),
           "kvflash_continue": (ctypes.c_int, [V, V, I32, ctypes.POINTER(I64), V]),
           "kvflash_rewind": (ctypes.c_int, [V, I64]),
           "kvflash_settle": (ctypes.c_int, [V]),
           "kvflash_save": (ctypes.c_int, [V, ctypes.c_char_p]),
           "kvflash_restore": (ctypes.c_int, [V, ctypes.c_char_p, ctypes.c_uint64]),
           "kvflash_session_load": (V, [V, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]),
           "kvflash_reset": (ctypes.c_int, [V]),
           "kvflash_session_free": (None, [V]),
           "kvflash_set_seed": (ctypes.c_int, [V, ctypes.c_uint64]),
           "kvflash_n_past": (I64, [V]),
           "kvflash_n_chunks": (I32, [V]),
           "kvflash_get_stats": (Stats, [V]),
           "kvflash_get_logits": (ctypes.POINTER(ctypes.c_float), [V]),
           "kvflash_last_error": (ctypes.c_char_p, [V])}
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


def test_c_api_refuses_huge_max_ctx_and_bad_params(tiny):
    proc = run_python(f"""
        import ctypes
        from kvflash import capi
        from test_capi import Params, declare
        lib = declare(ctypes.CDLL(str(capi.library_path())))
        err = ctypes.create_string_buffer(512)
        p = lib.kvflash_default_params()
        assert p.struct_size == ctypes.sizeof(Params), (p.struct_size, ctypes.sizeof(Params))
        # the C default qk is Python's QKPolicy() (both the core's PeakScoring)
        from kvflash.scoring import QKPolicy
        d = QKPolicy()
        assert (p.qk_queries, p.qk_contrast, p.qk_spread) == (d.n_queries, d.contrast, d.spread), \
            (p.qk_queries, p.qk_contrast, p.qk_spread)
        assert p.policy == b"qk", p.policy   # Session's default (API version 14)
        print("MAX", lib.kvflash_max_context())
        m = lib.kvflash_model_load({str(tiny).encode()!r}, 1, err, 512)
        assert m, err.value
        def refused(**kw):
            q = lib.kvflash_default_params()
            for k, v in kw.items():
                setattr(q, k, v)
            err.value = b""
            s = lib.kvflash_session_new(m, ctypes.byref(q), err, 512)
            return None if s else err.value.decode()
        print("HUGE", refused(max_ctx={HUGE}, pool_tokens=512))
        print("HUGE_FULL", refused(max_ctx={HUGE}, pool_tokens=0))
        print("POLICY", refused(policy=b"belady"))
        print("DRAFTERLESS", refused(policy=b"drafter", pool_tokens=512))
        print("SIZE", refused(struct_size=0))
        print("QKC", refused(policy=b"qk", pool_tokens=512, qk_contrast=-1))
        print("QKS", refused(policy=b"qk", pool_tokens=512, qk_spread=300))
        print("QKL", refused(policy=b"qk", pool_tokens=512, qk_layers=-2))
        print("QKCA", refused(policy=b"qk", pool_tokens=512, qk_carry=-1))
        print("PRE", refused(policy=b"qk", pool_tokens=512, prefill_rescore=-1))
        print("RRD", refused(policy=b"qk", pool_tokens=512, prefill_reread=2))
        print("QKW", refused(policy=b"qk", pool_tokens=512, qk_windows=0), refused(policy=b"qk", pool_tokens=512,
                                                                                    qk_windows=17))
        print("QKW_OK", refused(policy=b"qk", pool_tokens=512, qk_windows=3) is None)
        print("EPF", refused(policy=b"qk", pool_tokens=512, exact_prefill=3))
        print("EPA_OK", refused(policy=b"qk", pool_tokens=512, exact_prefill=2) is None)  # auto (API version 12)
        print("CHK", refused(pool_tokens=512, chunk_tokens=-1))
        # chunk_tokens 0: auto (API version 13): 16-token chunks for a 256-token pool, which 64's floor refuses
        print("CHA_OK", refused(pool_tokens=256, chunk_tokens=0) is None, refused(pool_tokens=256) is not None)
        q = lib.kvflash_default_params()
        q.pool_tokens, q.chunk_tokens = 512, 0
        s = lib.kvflash_session_new(m, ctypes.byref(q), err, 512)
        ids = (ctypes.c_int32 * 100)(*[5 + i for i in range(100)])
        assert s and lib.kvflash_eval(s, ids, 100, None) == 0
        print("CHA_CHUNKS", lib.kvflash_n_chunks(s))   # ceil(100 / 16)
        lib.kvflash_session_free(s)
        v14 = refused(policy=b"qk", pool_tokens=512, struct_size=Params.qk_windows.offset)  # API version 14
        print("V14_OK", v14 is None, lib.kvflash_default_params().qk_windows == {_core.QK_PEAK_DEFAULTS['windows']})
        v10 = refused(policy=b"qk", pool_tokens=512, struct_size=Params.prefill_reread.offset)  # API version 10
        print("V10_OK", v10 is None, lib.kvflash_default_params().prefill_reread)
        v9 = refused(policy=b"qk", pool_tokens=512, struct_size=Params.prefill_rescore.offset)  # API version 9
        print("V9_OK", v9 is None, lib.kvflash_default_params().prefill_rescore)
        v4 = refused(policy=b"qk", pool_tokens=512, struct_size=Params.qk_carry.offset)  # API version 4
        print("V4_OK", v4 is None, lib.kvflash_default_params().qk_carry)
        v2 = refused(policy=b"qk", pool_tokens=512, struct_size=Params.qk_contrast.offset)  # API version 2
        print("V2_OK", v2 is None)
        old = refused(struct_size=Params.policy.offset)  # a caller built against API version 1
        print("OLD_OK", old is None)
        # ... keeps the recency it had (no rescore once a prompt outgrows the pool); the default scores
        def rescores(**kw):
            q = lib.kvflash_default_params()
            for k, v in kw.items():
                setattr(q, k, v)
            s = lib.kvflash_session_new(m, ctypes.byref(q), err, 512)
            assert s, err.value
            ids = (ctypes.c_int32 * 700)(*[1 + (i * 7) % 250 for i in range(700)])
            assert lib.kvflash_eval(s, ids, 700, None) == 0, lib.kvflash_last_error(s)
            n = lib.kvflash_get_stats(s).rescores
            lib.kvflash_session_free(s)
            return n
        print("V1_RESCORES", rescores(pool_tokens=512, struct_size=Params.policy.offset), rescores(pool_tokens=512))
        lib.kvflash_model_free(m)
        print("LOADFAIL", lib.kvflash_model_load(b"/nonexistent.gguf", 1, err, 512), err.value.decode())
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"MAX {_core.MAX_CONTEXT}" in out
    assert re.search(rf"^HUGE .*{GUARD_MSG}", out, re.M) and re.search(rf"^HUGE_FULL .*{GUARD_MSG}", out, re.M), out
    assert re.search(r'^POLICY .*policy must be "lru" or "qk"', out, re.M), out
    v1, default = map(int, re.search(r"^V1_RESCORES (\d+) (\d+)$", out, re.M).groups())
    assert v1 == 0 and default > 0, out
    assert re.search(r'^DRAFTERLESS .*"drafter" needs params.drafter', out, re.M), out
    assert re.search(r"^SIZE .*struct_size", out, re.M), out
    assert "OLD_OK True" in out and "V2_OK True" in out and "V4_OK True 16" in out and "V9_OK True 0" in out
    assert "V10_OK True 0" in out and "EPA_OK True" in out and "V14_OK True True" in out and "QKW_OK True" in out
    assert "CHA_OK True True" in out and "CHA_CHUNKS 7" in out, out
    assert re.search(r"^CHK .*params\.chunk_tokens must be 0 \(auto", out, re.M), out
    for tag, field in (("QKC", "qk_contrast"), ("QKS", "qk_spread"), ("QKL", "qk_layers"), ("QKCA", "qk_carry"),
                       ("PRE", "prefill_rescore"), ("RRD", "prefill_reread"), ("EPF", "exact_prefill"),
                       ("QKW", "qk_windows")):
        assert re.search(rf"^{tag} .*params\.{field} must be", out, re.M), out
    assert re.search(r"^LOADFAIL None .+", out, re.M), out


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory):
    # another llama of the same vocabulary: the drafter is fed the target's own ids (no bridge)
    return _tiny_llama(tmp_path_factory, "drafter", seed=8)


def test_c_api_and_python_session_are_one_core(tiny, tiny_drafter):
    """The C API and kvflash.Session drive the same core session: for every built-in policy (lru, qk and its
    variants, the drafter), exact mode, exact prefill and the settle's re-read, with prefix reuse (kvflash_continue /
    Session.continue_to) and a rewind, the tokens and final logits are bit-equal, and (where the round
    lengths do not differ) so are page-outs and rescores."""
    proc = run_python(f"""
        DRAFTER = {tiny_drafter!r}
        import ctypes
        import numpy as np
        import kvflash
        from kvflash import capi
        from test_capi import Params, Stats, c_generate, declare
        lib = declare(ctypes.CDLL(str(capi.library_path())))
        err = ctypes.create_string_buffer(512)
        m = lib.kvflash_model_load({tiny!r}.encode(), 1, err, 512)
        assert m, err.value
        rng = np.random.default_rng(5)
        ids = [int(x) for x in rng.integers(3, 250, 1300)]
        more = [int(x) for x in rng.integers(3, 250, 20)]   # fewer than qk's 40 captured queries: the cut re-reads
        V = kvflash.Model({tiny!r}, 1).hparams["n_vocab"]

        dm = lib.kvflash_model_load(DRAFTER.encode(), 1, err, 512)   # another llama, the same vocabulary
        assert dm, err.value

        def c_run(mode, steps, policy="qk", aggregate="peak"):
            q = lib.kvflash_default_params()
            q.max_ctx, q.pool_tokens, q.policy, q.tau = 2048, 512, policy.encode(), 16
            q.qk_aggregate = aggregate.encode()
            q.drafter = dm
            q.exact = int(mode == "exact")
            q.exact_prefill = int(mode == "exact_prefill")
            q.prefill_reread = int(mode == "prefill_reread")
            s = lib.kvflash_session_new(m, ctypes.byref(q), err, 512)
            assert s, err.value
            arr = lambda x: (ctypes.c_int32 * len(x))(*x)
            out = []
            def gen(n):
                out.extend(c_generate(lib, s, n))
                assert lib.kvflash_settle(s) == 0
            assert lib.kvflash_eval(s, arr(ids), len(ids), None) == 0, lib.kvflash_last_error(s)
            gen(steps)
            conv = ids + out[:steps // 2] + more   # diverges from the history: a cut, then a re-read
            reused = ctypes.c_int64()
            assert lib.kvflash_continue(s, arr(conv), len(conv), ctypes.byref(reused), None) == 0, lib.kvflash_last_error(s)
            gen(steps)
            assert lib.kvflash_rewind(s, len(conv) + 3) == 0, lib.kvflash_last_error(s)
            gen(steps)
            logits = np.ctypeslib.as_array(lib.kvflash_get_logits(s), shape=(V,)).copy()
            st = lib.kvflash_get_stats(s)
            r = (out, reused.value, logits, st.page_outs, st.rescores, st.n_past)
            lib.kvflash_session_free(s)
            return r

        def py_run(mode, steps, policy="qk", aggregate="peak"):
            if aggregate != "peak":
                policy = kvflash.scoring.QKPolicy(aggregate=aggregate)
            if policy == "drafter":
                policy = kvflash.scoring.DrafterPolicy(DRAFTER, threads=1)
            s = kvflash.Session({tiny!r}, max_ctx=2048, kvflash=512, policy=policy, tau=16, threads=1, verbose=False,
                                seed=0, exact=mode == "exact", exact_prefill=mode == "exact_prefill",
                                prefill_reread=mode == "prefill_reread")
            out = []
            def gen(n):
                n0 = s.n_past
                list(s.generate(None, max_tokens=n, ignore_eos=True))
                out.extend(s.tokens[n0:n0 + n])
            s.prefill(ids)
            gen(steps)
            conv = ids + out[:steps // 2] + more   # diverges from the history: a cut, then a re-read
            reused = s.continue_to(conv)
            gen(steps)
            s.truncate(len(conv) + 3)
            gen(steps)
            st = s.stats
            return out, reused, s.logits(), st["page_outs"], st["rescores"], st["n_past"]

        runs = [("pooled", "qk", "peak"), ("exact_prefill", "qk", "peak"), ("exact", "qk", "peak"),
                ("prefill_reread", "qk", "peak"),
                ("lru", "lru", "peak"), ("qk-bound", "qk-bound", "peak"), ("qk-mean", "qk-mean", "peak"),
                ("qk-chunk", "qk", "chunk"), ("qk-token", "qk", "token"), ("drafter", "drafter", "peak")]
        for mode, policy, agg in runs:
            c, p = c_run(mode, 24, policy, agg), py_run(mode, 24, policy, agg)
            assert c[0] == p[0], (mode, c[0], p[0])
            assert c[1] == p[1], (mode, "reused", c[1], p[1])
            assert np.array_equal(c[2], p[2]), (mode, "logits", float(np.abs(c[2] - p[2]).max()))
            assert c[5] == p[5], (mode, "n_past", c[5], p[5])
            assert c[3] > 0 and (c[4] >= 3) == (policy != "lru") and 0 < c[1] <= len(ids) + 12, \
                (mode, "paged, rescored, reused", c[1:5:2], c[4])
            if mode != "exact":   # exact rounds: C takes no budget, so its last rounds draft further
                assert (c[3], c[4]) == (p[3], p[4]), (mode, "page-outs, rescores", c[3:5], p[3:5])
            print(mode, "ok", len(c[0]), c[1], c[3], c[4])
        lib.kvflash_model_free(m)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for mode in ("pooled", "exact_prefill", "exact", "prefill_reread", "lru", "qk-bound", "qk-mean", "qk-chunk", "qk-token", "drafter"):
        assert f"{mode} ok 72" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    d = tmp_path_factory.mktemp("capi-hybrid")
    return {a: write_tiny_hybrid(d / f"{a}.gguf", a, seed=3)["path"] for a in ("qwen35", "qwen35moe", "qwen3moe")}


@pytest.mark.parametrize("policy", ["lru", "qk"])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3moe"])
def test_c_example_matches_session_on_the_new_families(c_example, hybrids, tmp_path, arch, policy):
    """The C API is the same core on MoE and hybrid models: the same greedy tokens and pager traffic as
    kvflash.Session over a pool smaller than the prompt."""
    ids = [(i * 37 + 11) % 250 + 3 for i in range(900)]
    want, st = _session_ids(hybrids[arch], ids, 60, pool=512, policy=policy)
    proc = _run_example(c_example, hybrids[arch], ids, "-n", 60, "--pool", 512, "--policy", policy, "-t", 2,
                        tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got, cst = _parse(proc.stdout)
    assert got == want
    assert cst["page_outs"] == st["page_outs"] > 0


def test_hybrid_snapshots_cross_the_languages(hybrids, tmp_path):
    """A qwen35 session's snapshot (its recurrent state and checkpoints) saved through the C API continues in
    kvflash.Session, and the reverse, with the tokens the saving session gives after its save."""
    model, d = hybrids["qwen35"], str(tmp_path)
    proc = run_python(f"""
        import ctypes, os
        import numpy as np
        import kvflash
        from kvflash import capi
        from test_capi import declare
        lib = declare(ctypes.CDLL(str(capi.library_path())))
        err = ctypes.create_string_buffer(1024)
        m = lib.kvflash_model_load({model!r}.encode(), 1, err, 1024)
        assert m, err.value
        ids = [int(x) for x in np.random.default_rng(9).integers(3, 250, 900)]
        q = lib.kvflash_default_params()
        q.max_ctx, q.pool_tokens, q.policy, q.tau = 2048, 512, b"lru", 16
        c = lib.kvflash_session_new(m, ctypes.byref(q), err, 1024)
        assert c, err.value

        from test_capi import c_generate, py_generate
        c_gen = lambda s, n: c_generate(lib, s, n)

        py_gen = py_generate

        assert lib.kvflash_eval(c, (ctypes.c_int32 * len(ids))(*ids), len(ids), None) == 0
        c_gen(c, 12)
        p1 = os.path.join({d!r}, "c.kvsnap")
        assert lib.kvflash_save(c, p1.encode()) == 0, lib.kvflash_last_error(c)
        want = c_gen(c, 20)
        s = kvflash.Session.load(p1, {model!r}, threads=1)
        assert py_gen(s, 20) == want, "C -> Python"
        t = kvflash.Session({model!r}, max_ctx=2048, kvflash=512, policy="lru", tau=16, threads=1, verbose=False)
        t.prefill(ids[:700])
        py_gen(t, 12)
        p2 = os.path.join({d!r}, "py.kvsnap")
        t.save(p2)
        want = py_gen(t, 20)
        l = lib.kvflash_session_load(m, p2.encode(), 0, err, 1024)
        assert l, err.value
        assert c_gen(l, 20) == want, "Python -> C"
        print("hybrid round trips ok")
        lib.kvflash_session_free(l)
        lib.kvflash_session_free(c)
        lib.kvflash_model_free(m)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hybrid round trips ok" in proc.stdout


def test_snapshots_cross_the_languages(tiny, tmp_path):
    """One file format from every client: a snapshot saved through the C API loads in kvflash.Session and
    continues with the tokens the C session gives after its save, and the reverse (kvflash_session_load and
    kvflash_restore), for lru, qk and qk-bound (chunk summaries); a corrupt file, another policy and a policy
    written in Python are refused with the reason, and the refused session is as it was."""
    d = str(tmp_path)
    proc = run_python(f"""
        import ctypes, os
        import numpy as np
        import kvflash
        from kvflash import capi
        from test_capi import Params, Stats, declare
        lib = declare(ctypes.CDLL(str(capi.library_path())))
        err = ctypes.create_string_buffer(1024)
        m = lib.kvflash_model_load({tiny!r}.encode(), 1, err, 1024)
        assert m, err.value
        rng = np.random.default_rng(9)
        ids = [int(x) for x in rng.integers(3, 250, 900)]
        arr = lambda x: (ctypes.c_int32 * len(x))(*x)

        def c_new(policy):
            q = lib.kvflash_default_params()
            q.max_ctx, q.pool_tokens, q.policy, q.tau = 2048, 512, policy.encode(), 16
            s = lib.kvflash_session_new(m, ctypes.byref(q), err, 1024)
            assert s, err.value
            return s

        from test_capi import c_generate, py_generate
        c_gen = lambda s, n: c_generate(lib, s, n)

        def py_new(policy):
            return kvflash.Session({tiny!r}, max_ctx=2048, kvflash=512, policy=policy, tau=16, threads=1, verbose=False)

        py_gen = py_generate

        for policy in ("lru", "qk", "qk-bound"):
            # C saves, Python loads
            c = c_new(policy)
            assert lib.kvflash_eval(c, arr(ids), len(ids), None) == 0
            c_gen(c, 12)
            p1 = os.path.join({d!r}, policy + "-c.kvsnap")
            assert lib.kvflash_save(c, p1.encode()) == 0, lib.kvflash_last_error(c)
            want = c_gen(c, 12)
            s = kvflash.Session.load(p1, {tiny!r}, threads=1)
            assert s.policy.name == policy and s.n_past == len(ids) + 12, (s.policy.name, s.n_past)
            assert py_gen(s, 12) == want, (policy, "C -> Python")
            # Python saves, C loads (a new session) and restores (into one that fits)
            t = py_new(policy)
            t.prefill(ids[:700])
            py_gen(t, 12)
            p2 = os.path.join({d!r}, policy + "-py.kvsnap")
            t.save(p2)
            want = py_gen(t, 12)
            l = lib.kvflash_session_load(m, p2.encode(), 0, err, 1024)
            assert l, err.value
            assert c_gen(l, 12) == want, (policy, "Python -> C load")
            assert lib.kvflash_restore(c, p2.encode(), 0) == 0, lib.kvflash_last_error(c)
            assert lib.kvflash_n_past(c) == 712 and c_gen(c, 12) == want, (policy, "Python -> C restore")
            lib.kvflash_session_free(l)
            lib.kvflash_session_free(c)
            print(policy, "round trips ok")

        # refusals: the session refused is as it was
        c = c_new("qk")
        assert lib.kvflash_eval(c, arr(ids[:300]), 300, None) == 0
        raw = open(os.path.join({d!r}, "qk-py.kvsnap"), "rb").read()
        bad = os.path.join({d!r}, "bad.kvsnap")
        open(bad, "wb").write(raw[: len(raw) // 2])
        print("TRUNC", lib.kvflash_restore(c, bad.encode(), 0), lib.kvflash_last_error(c).decode())
        print("POLICY", lib.kvflash_restore(c, os.path.join({d!r}, "lru-py.kvsnap").encode(), 0),
              lib.kvflash_last_error(c).decode())
        print("CAP", lib.kvflash_restore(c, os.path.join({d!r}, "qk-py.kvsnap").encode(), 4096),
              lib.kvflash_last_error(c).decode())
        assert lib.kvflash_n_past(c) == 300
        fresh = c_new("qk")
        assert lib.kvflash_eval(fresh, arr(ids[:300]), 300, None) == 0
        assert c_gen(c, 8) == c_gen(fresh, 8), "a refused restore changed the session"

        class Mine:
            name = "mine"
            def score(self, view):
                return None
        u = py_new(Mine())
        u.prefill(ids[:200])
        pu = os.path.join({d!r}, "custom.kvsnap")
        u.save(pu)
        err.value = b""
        print("CUSTOM", lib.kvflash_session_load(m, pu.encode(), 0, err, 1024), err.value.decode())
        print("LOADBAD", lib.kvflash_session_load(m, bad.encode(), 0, err, 1024), err.value.decode())
        lib.kvflash_model_free(m)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for policy in ("lru", "qk", "qk-bound"):
        assert f"{policy} round trips ok" in out, out
    assert re.search(r"^TRUNC -1 .*snapshot", out, re.M), out
    assert re.search(r"^POLICY -1 .*the policy differs \(the file has 'lru', this session 'qk'\)", out, re.M), out
    assert re.search(r"^CAP -1 .*4096", out, re.M), out
    assert re.search(r"^CUSTOM None .*policy 'mine', which a C session cannot run", out, re.M), out
    assert re.search(r"^LOADBAD None .*snapshot", out, re.M), out


@pytest.mark.model
def test_c_drafter_bridges_like_python_on_the_real_pair():
    """The C API's drafter is the core's drafter scorer, as Python's DrafterPolicy is: Gemma-3 270M as the
    target (262K SentencePiece vocabulary), SmolLM2-135M as the drafter (49K BPE), so the scores go through
    the byte-span bridge (the core tokenizer's pieces in C, the Python Tokenizer's in Python); a passkey
    prompt past the pool gives the same residents, rescores and greedy tokens from both."""
    gemma, smol = str(kvflash.resolve_model("gemma3-270m")), str(kvflash.resolve_model("smollm2-135m"))
    proc = run_python(f"""
        import ctypes
        import numpy as np
        import kvflash
        from kvflash import capi
        from test_capi import Params, Stats, declare
        lib = declare(ctypes.CDLL(str(capi.library_path())))
        lib.kvflash_chunk_flags.restype, lib.kvflash_chunk_flags.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
        err = ctypes.create_string_buffer(1024)
        filler = ("The weather was calm and the river ran slowly past the old mill. "
                  "Farmers carried their grain along the road to the market in the valley. ")
        text = (filler * 3 + "The secret passkey is 48213. Remember it. " + filler * 40 +
                "\\nQuestion: What is the secret passkey given in the text above?\\nAnswer: The secret passkey is")
        s = kvflash.Session({gemma!r}, max_ctx=4096, kvflash=512, policy="drafter", drafter={smol!r}, threads=2,
                            verbose=False)
        ids = s.tokenize(text)
        s.prefill(ids)
        n0 = s.n_past
        list(s.generate(max_tokens=6, ignore_eos=True))
        py_tokens, py_block = s.tokens[n0:], s.pager.chunk_table()["block"] >= 0
        assert s.policy.bridged
        m = lib.kvflash_model_load({gemma!r}.encode(), 2, err, 1024)
        d = lib.kvflash_model_load({smol!r}.encode(), 2, err, 1024)
        assert m and d, err.value
        q = lib.kvflash_default_params()
        q.max_ctx, q.pool_tokens, q.policy, q.drafter = 4096, 512, b"drafter", d
        c = lib.kvflash_session_new(m, ctypes.byref(q), err, 1024)
        assert c, err.value
        arr = (ctypes.c_int32 * len(ids))(*ids)
        assert lib.kvflash_eval(c, arr, len(ids), None) == 0, lib.kvflash_last_error(c)
        out, tok = [], ctypes.c_int32()
        assert lib.kvflash_sample(c, None, None, ctypes.byref(tok)) == 0
        for _ in range(6):
            out.append(tok.value)
            nxt = ctypes.c_int32()
            assert lib.kvflash_decode(c, tok.value, None, ctypes.byref(nxt)) == 0, lib.kvflash_last_error(c)
            tok = nxt
        n = lib.kvflash_n_chunks(c)
        flags = (ctypes.c_uint8 * n)()
        assert lib.kvflash_chunk_flags(c, flags, n) == 0
        c_block = np.array([bool(f & 1) for f in flags])
        st = lib.kvflash_get_stats(c)
        assert out == py_tokens, (out, py_tokens)
        assert np.array_equal(c_block, py_block[:n]), "residents differ"
        assert st.rescores == s.stats["rescores"] >= 1, (st.rescores, s.stats["rescores"])
        print("bridged ok", out)
    """, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bridged ok" in proc.stdout
