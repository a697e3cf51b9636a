"""Misuse and hostile input (issue 16): threads, iterators, interrupts and bad values
give a clear Python exception, leave the session usable, and never crash the
interpreter.  Anything that crashed before the fix runs in a child interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

core = pytest.importorskip("kvflash._core")
pytest.importorskip("gguf")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tinygguf import write_small_llama  # noqa: E402


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_small_llama(tmp_path_factory.mktemp("misuse") / "small.gguf", seed=3)


def _run_isolated(code: str, timeout: int = 300) -> tuple[int, str]:
    """Run code in a child interpreter (on this process's cores): a crash there cannot take pytest down."""
    prelude = f"import sys; sys.path.insert(0, {HERE!r})\n"
    r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout)
    return r.returncode, r.stdout + r.stderr


# ---------------------------------------------------------------- threads

def test_second_thread_on_one_runtime_is_refused(small):
    # A reset from another thread while an eval computes (GIL released) would free the
    # graph and the pager's state under it; the runtime's guard refuses it instead.
    rc, out = _run_isolated(f"""
        import threading, numpy as np
        from kvflash import _core
        m = _core.Model({small!r}, n_threads=1)
        rt = _core.Runtime(m, max_ctx=4096, pool_tokens=512, ubatch=64)
        prompt = (np.arange(3000) % 250).astype(np.int32)
        err = []
        def work():
            try:
                rt.eval(prompt)
            except BaseException as e:
                err.append(repr(e))
        t = threading.Thread(target=work)
        t.start()
        while t.is_alive() and rt.n_past == 0:  # poke only once the eval holds the runtime
            pass
        refused = other = 0
        while t.is_alive():
            try:
                rt.reset()
            except RuntimeError as e:
                assert "in use by another thread" in str(e), e
                refused += 1
            except Exception as e:
                other += 1
        t.join()
        print("refused", refused, "other", other, "err", err, "n_past", rt.n_past)
        assert not err and other == 0, (err, other)
        assert refused > 0
        rt.pager.check_invariants()
        print("OK")
    """)
    assert rc == 0 and "OK" in out, out


def test_pager_view_refused_while_its_runtime_computes(small):
    rc, out = _run_isolated(f"""
        import threading, numpy as np
        from kvflash import _core
        m = _core.Model({small!r}, n_threads=1)
        rt = _core.Runtime(m, max_ctx=4096, pool_tokens=512, ubatch=64)
        pg = rt.pager
        t = threading.Thread(target=rt.eval, args=((np.arange(3000) % 250).astype(np.int32),))
        t.start()
        while t.is_alive() and rt.n_past == 0:  # poke only once the eval holds the runtime
            pass
        refused = 0
        while t.is_alive():
            try:
                pg.reselect(np.zeros(pg.n_chunks, dtype=np.float32))
            except RuntimeError as e:
                assert "in use by another thread" in str(e), e
                refused += 1
        t.join()
        assert refused > 0 and rt.n_past == 3000
        pg.check_invariants()
        print("OK")
    """)
    assert rc == 0 and "OK" in out, out


def test_runtimes_sharing_a_model_compute_one_at_a_time(small):
    # Two runtimes over one Model share its CPU backend (work buffer, thread pool):
    # evaluated together from two threads, each must give what it gives alone.
    rc, out = _run_isolated(f"""
        import threading, numpy as np
        from kvflash import _core
        m = _core.Model({small!r}, n_threads=1)
        prompts = [(np.arange(1500) * k % 250).astype(np.int32) for k in (1, 7)]
        def run(p):
            rt = _core.Runtime(m, max_ctx=2048, pool_tokens=512, ubatch=32)
            return rt.eval(p, all_logits=True)
        alone = [run(p) for p in prompts]
        for rep in range(3):
            got = [None, None]
            def work(i):
                got[i] = run(prompts[i])
            ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
            for t in ts: t.start()
            for t in ts: t.join()
            for a, g in zip(alone, got):
                assert g is not None and np.array_equal(a, g), "logits differ when two runtimes share the model"
        print("OK")
    """)
    assert rc == 0 and "OK" in out, out


def test_token_ids_are_copied_before_the_gil_is_released(small):
    # Another thread rewrites the caller's token buffer once eval has started computing
    # (its first piece is in): eval reads the ids it validated (a copy), not the new ones
    # (out-of-range ids there would reach ggml's get_rows unchecked).
    rc, out = _run_isolated(f"""
        import threading, numpy as np
        from kvflash import _core
        m = _core.Model({small!r}, n_threads=1)
        prompt = (np.arange(3000) % 250).astype(np.int32)
        ref = _core.Runtime(m, max_ctx=4096, pool_tokens=512, ubatch=64).eval(prompt.copy())
        buf = prompt.copy()
        rt = _core.Runtime(m, max_ctx=4096, pool_tokens=512, ubatch=64)
        got = []
        t = threading.Thread(target=lambda: got.append(rt.eval(buf)))
        t.start()
        while t.is_alive() and rt.n_past == 0:
            pass
        while t.is_alive():
            buf[:] = 1
        t.join()
        assert got and np.array_equal(got[0], ref)
        print("OK")
    """)
    assert rc == 0 and "OK" in out, out


def test_model_thread_count_is_bounded(small):
    # 10**5 threads: ggml's thread pool holds at most GGML_MAX_N_THREADS (512); the
    # first graph compute with more crashed the interpreter.
    rc, out = _run_isolated(f"""
        import numpy as np
        from kvflash import _core
        try:
            m = _core.Model({small!r}, n_threads=10**5)
            rt = _core.Runtime(m, max_ctx=64)
            rt.eval(np.arange(4, dtype=np.int32))
            print("LOADED")
        except ValueError as e:
            print("ValueError", e)
        m = _core.Model({small!r}, n_threads=1)
        try:
            m.n_threads = 10**5
            print("SET")
        except ValueError as e:
            print("ValueError", e)
        assert m.n_threads == 1
        print("OK")
    """)
    assert rc == 0 and "OK" in out and out.count("ValueError") == 2 and "512" in out, out


# ---------------------------------------------------------------- sampler

@pytest.mark.parametrize("bad", ["nan", "nan-some", "inf", "all-neg-inf"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_are_an_error(small, bad, temperature):
    m = core.Model(small, n_threads=1)
    rt = core.Runtime(m, max_ctx=64)
    V = rt.n_vocab
    x = np.random.default_rng(0).normal(size=V).astype(np.float32)
    if bad == "nan":
        x[:] = np.nan
    elif bad == "nan-some":
        x[::3] = np.nan
    elif bad == "inf":
        x[5] = np.inf
    else:
        x[:] = -np.inf
    with pytest.raises(ValueError, match="(?i)nan|inf|finite"):
        rt.sample(x, temperature=temperature, top_k=0, top_p=0.9)
    x[:] = 0.0
    x[7] = 5.0
    assert rt.sample(x, temperature=temperature, top_k=1) == 7  # still usable


# ---------------------------------------------------------------- session history vs native state

def _session(path, **kw):
    import kvflash
    kw = dict(dict(max_ctx=4096, kvflash=512, policy="lru", threads=1, verbose=False), **kw)
    return kvflash.Session(path, **kw)


def _consistent(s):
    assert s.n_past == len(s.tokens), (s.n_past, len(s.tokens))
    s.pager.check_invariants()


class _InterruptAfter:
    """The session's runtime, with KeyboardInterrupt raised right after the n-th return of
    one of its methods: exactly where a Ctrl-C that arrived during that call (the GIL
    released) is delivered."""

    def __init__(self, rt, name, n=1):
        self._rt, self._name, self._n = rt, name, n

    def __getattr__(self, attr):
        value = getattr(self._rt, attr)
        if attr != self._name:
            return value

        def call(*args, **kwargs):
            out = value(*args, **kwargs)
            self._n -= 1
            if self._n == 0:
                raise KeyboardInterrupt
            return out
        return call


def _ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 250, n)]


def test_ctrl_c_after_prefill_eval_leaves_history_and_cache_agreeing(small):
    s = _session(small)
    s.prefill(_ids(100))
    before = s.tokens

    def ctrl_c_once_evaluated(p):   # the last piece is in; the core has not settled the prompt yet
        if p.done == p.total and not p.finished:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        s.prefill(_ids(700, 1), progress=ctrl_c_once_evaluated)
    _consistent(s)
    assert s.tokens == before  # the interrupted prompt is not half there
    s.prefill(_ids(700, 1))    # a retry adds it once
    assert len(s.tokens) == 800
    _consistent(s)


@pytest.mark.parametrize("n", [1, 5])
def test_ctrl_c_during_generate_leaves_history_and_cache_agreeing(small, n):
    s = _session(small)
    g = s.generate(_ids(50), max_tokens=20, ignore_eos=True)
    rt = s.runtime
    s.runtime = _InterruptAfter(rt, "advance", n)
    with pytest.raises(KeyboardInterrupt):
        for _ in g:
            pass
    s.runtime = rt
    _consistent(s)
    assert len(s.tokens) == 50 + n  # the token the cache holds is in the history too
    assert s.finish_reason == "error"
    assert "".join(s.generate(max_tokens=5, ignore_eos=True)) is not None  # still usable
    _consistent(s)


def test_interrupt_between_prompt_pieces_rolls_the_eval_back(small):
    # Ctrl-C (SIGINT) during a long prompt: the runtime stops between pieces, takes them
    # back, and eval raises KeyboardInterrupt; nothing of the prompt stays in the cache.
    rc, out = _run_isolated(f"""
        import os, signal, threading, numpy as np
        from kvflash import _core
        # Python's own Ctrl-C handler, whatever this child inherited: a shell that starts a
        # job in the background (`cmd &`) hands it SIGINT ignored, and Python keeps it so.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        m = _core.Model({small!r}, n_threads=1)
        rt = _core.Runtime(m, max_ctx=8192, pool_tokens=512, ubatch=64)
        rt.eval(np.arange(10, dtype=np.int32))
        prompt = (np.arange(8000) % 250).astype(np.int32)
        def hit():
            while rt.n_past <= 10:   # the first pieces are in
                pass
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=hit, daemon=True).start()
        try:
            rt.eval(prompt)
            print("NOT INTERRUPTED")
        except KeyboardInterrupt:
            print("KeyboardInterrupt n_past", rt.n_past)
        assert rt.n_past == 10, rt.n_past
        rt.pager.check_invariants()
        rt.eval(prompt[:100])
        print("OK")
    """)
    assert rc == 0 and "KeyboardInterrupt n_past 10" in out and "OK" in out, out


def test_failing_rescore_after_prompt_does_not_commit_it(small):
    class Boom:
        name = "boom"

        def __init__(self):
            self.fail = True

        def score(self, view):
            if self.fail:
                raise RuntimeError("policy failed")
            return np.zeros(view.n_chunks, dtype=np.float32)

    pol = Boom()
    s = _session(small, policy=pol)
    s.prefill(_ids(64))
    with pytest.raises(RuntimeError, match="policy failed"):
        s.prefill(_ids(1000, 2))  # outgrows the pool: the post-prompt rescore runs and fails
    _consistent(s)
    assert len(s.tokens) == 64
    pol.fail = False
    s.prefill(_ids(1000, 2))  # the retry adds the prompt once
    assert len(s.tokens) == 1064
    _consistent(s)


def test_second_generate_while_one_is_open_is_refused(small):
    s = _session(small)
    g = s.generate(_ids(30), max_tokens=10, ignore_eos=True)
    next(g)
    for call in (lambda: s.generate("x", max_tokens=2), lambda: s.prefill([1, 2]), s.reset,
                 lambda: s.generate(max_tokens=2)):
        with pytest.raises(RuntimeError, match="in use by another thread or iterator"):
            call()
    _consistent(s)
    rest = list(g)  # the open one carries on undisturbed
    assert len(s.tokens) == 30 + 1 + len(rest) or s.finish_reason in ("eos", "stop")
    _consistent(s)
    g2 = s.generate(max_tokens=3, ignore_eos=True)
    next(g2)
    g2.close()
    assert s.finish_reason == "closed"
    list(s.generate(max_tokens=2, ignore_eos=True))  # closed: the session is free again
    _consistent(s)


def test_generate_stops_at_max_ctx_and_says_so(small):
    s = _session(small, max_ctx=600)
    out = list(s.generate(_ids(590), max_tokens=50, ignore_eos=True))
    assert s.finish_reason == "max_ctx"
    assert s.n_past == 600 and len(out) > 0
    list(s.generate(max_tokens=0))
    assert s.finish_reason == "length"
    _consistent(s)


def test_second_thread_on_one_session_is_refused(small):
    import threading
    s = _session(small)
    started, refused, errs = threading.Event(), [], []

    def work():
        try:
            started.set()
            s.prefill(_ids(3000, 5))
        except Exception as e:  # pragma: no cover - reported below
            errs.append(e)

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    while t.is_alive() and s.runtime.n_past == 0:  # the worker is inside prefill
        pass
    while t.is_alive():
        try:
            s.reset()
        except RuntimeError as e:
            assert "in use by another thread" in str(e)
            refused.append(1)
    t.join()
    assert not errs and refused
    _consistent(s)


def test_failure_in_a_later_prompt_piece_takes_the_prompt_back(small):
    # The first pieces fit; a later one needs a page-out past max_host_bytes.  The
    # runtime truncates the evaluated pieces away again, and the session's history
    # matches: a retry (after the cap is lifted) adds the prompt once.
    m = core.Model(small, n_threads=1)
    probe = core.Runtime(m, max_ctx=4096, pool_tokens=512)
    cap = 16 * probe.pager.chunk_bytes
    rt = core.Runtime(m, max_ctx=4096, pool_tokens=512, max_host_bytes=cap)
    rt.eval(np.arange(10, dtype=np.int32))
    with pytest.raises(RuntimeError, match="host store full"):
        rt.eval((np.arange(1800) % 250).astype(np.int32))
    assert rt.n_past == 10
    rt.pager.check_invariants()
    assert rt.pager.stats["host_bytes"] == 0  # the pieces' page-outs went with them
    rt.eval((np.arange(900) % 250).astype(np.int32))  # fits under the cap
    assert rt.n_past == 910

    s = _session(small, max_host_bytes=cap)
    s.prefill(_ids(10))
    with pytest.raises(RuntimeError, match="host store full"):
        s.prefill(_ids(1800, 7))
    _consistent(s)
    assert len(s.tokens) == 10


def test_session_truncate_keeps_history_and_cache_together(small):
    s = _session(small)
    s.prefill(_ids(1500))
    list(s.generate(max_tokens=10, ignore_eos=True))
    s.truncate(1000)
    _consistent(s)
    assert len(s.tokens) == 1000 and s.tokens == _ids(1500)[:1000]
    list(s.generate(max_tokens=5, ignore_eos=True))
    assert len(s.tokens) == 1005
    for bad in (-1, 2000, 1.5):
        with pytest.raises(ValueError):
            s.truncate(bad)
    s.truncate(0)
    assert s.n_past == 0 and s.tokens == []


def test_c_api_session_refuses_an_overlapping_call_and_caps_its_host_store(small):
    # ctypes releases the GIL around a C call: a guarded call (kvflash_set_seed here; a
    # kvflash_reset would free what the eval computes on) from the main thread while
    # another thread's kvflash_eval runs returns KVFLASH_EBUSY (-4) and does nothing.
    from kvflash import capi
    rc, out = _run_isolated(f"""
        import ctypes, threading
        import numpy as np
        from test_capi import declare  # the C API's signatures, as kvflash.h declares them
        lib = declare(ctypes.CDLL({str(capi.library_path())!r}))
        err = ctypes.create_string_buffer(512)
        m = lib.kvflash_model_load({small!r}.encode(), 1, err, 512)
        p = lib.kvflash_default_params()
        p.max_ctx, p.pool_tokens, p.ubatch = 4096, 512, 64
        s = lib.kvflash_session_new(m, ctypes.byref(p), err, 512)
        assert m and s, err.value
        toks = (np.arange(3000) % 250).astype(np.int32)
        got = []
        t = threading.Thread(target=lambda: got.append(lib.kvflash_eval(s, toks.ctypes.data, 3000, None)))
        t.start()
        codes = {{}}
        while t.is_alive() and lib.kvflash_n_past(s) == 0:  # the eval is under way
            pass
        while t.is_alive():
            rc = lib.kvflash_set_seed(s, 1)
            codes[rc] = codes.get(rc, 0) + 1
        t.join()
        print("codes", codes, "eval", got, "n_past", lib.kvflash_n_past(s))
        assert got == [0] and codes.get(-4, 0) > 0 and lib.kvflash_n_past(s) == 3000
        # API version 4: max_host_bytes; past it a call fails with ERUNTIME and changes nothing
        p.max_host_bytes = 1 << 18  # 15 chunks of this model: the 3000-token prompt needs ~39 page-outs
        capped = lib.kvflash_session_new(m, ctypes.byref(p), err, 512)
        assert capped, err.value
        assert lib.kvflash_eval(capped, toks.ctypes.data, 10, None) == 0
        rc = lib.kvflash_eval(capped, toks.ctypes.data, 3000, None)
        print("capped eval", rc, lib.kvflash_last_error(capped))
        assert rc == -3 and b"host store full" in lib.kvflash_last_error(capped) and lib.kvflash_n_past(capped) == 10
        p.max_host_bytes = -1
        assert not lib.kvflash_session_new(m, ctypes.byref(p), err, 512) and b"max_host_bytes" in err.value
        print("OK")
    """)
    assert rc == 0 and "OK" in out, out


def test_rewind_past_the_sliding_window_ring_resets_the_session(tmp_path):
    # gemma3's sliding-window ring cannot rewind a long prompt: a prefill that fails
    # after it was evaluated leaves the session reset (history and cache both empty),
    # never half there.
    from tinygguf import write_tiny_model
    path = tmp_path / "gemma3.gguf"
    write_tiny_model(path, "gemma3", n_layer=6, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, seed=5)

    class Boom:
        name = "boom"

        def score(self, view):
            raise RuntimeError("policy failed")

    s = _session(str(path), policy=Boom())
    s.prefill(_ids(20))
    with pytest.raises(RuntimeError, match="policy failed"):
        s.prefill(_ids(1500, 3))
    assert s.n_past == len(s.tokens) == 0
    s.pager.check_invariants()
    s.prefill(_ids(100))  # usable again
    _consistent(s)


def test_cli_says_when_the_context_is_full(small, capsys):
    from kvflash import cli
    assert cli.main(["generate", "-m", small, "--max-ctx", "64", "--kvflash", "off", "--kvflash-policy", "lru",
                     "-t", "1", "-n", "200", "hello there"]) == 0
    err = capsys.readouterr().err
    assert "the context is full (max_ctx 64" in err, err


def test_c_api_readers_refuse_while_a_call_computes_and_never_block_one(small):
    # kvflash_n_past, kvflash_n_chunks, kvflash_get_stats, kvflash_get_logits and
    # kvflash_last_error read what a running kvflash_eval writes (the logits buffer it
    # fills, the pager's counters, the message).  From another thread they answer busy
    # instead (KVFLASH_EBUSY, as n_past; NULL logits; a busy message), and a reader never
    # makes a call fail: evals and decodes with readers running beside them all succeed.
    from kvflash import capi
    rc, out = _run_isolated(f"""
        import ctypes, threading
        import numpy as np
        from test_capi import declare  # the C API's signatures, as kvflash.h declares them
        lib = declare(ctypes.CDLL({str(capi.library_path())!r}))
        EBUSY = -4
        err = ctypes.create_string_buffer(512)
        m = lib.kvflash_model_load({small!r}.encode(), 1, err, 512)
        p = lib.kvflash_default_params()
        p.max_ctx, p.pool_tokens, p.ubatch = 4096, 512, 64
        s = lib.kvflash_session_new(m, ctypes.byref(p), err, 512)
        assert m and s, err.value
        toks = (np.arange(3000) % 250).astype(np.int32)
        assert lib.kvflash_eval(s, toks.ctypes.data, 10, None) == 0   # logits exist from here on
        assert lib.kvflash_n_past(s) == 10 and lib.kvflash_get_logits(s)

        got = []
        t = threading.Thread(target=lambda: got.append(lib.kvflash_eval(s, toks.ctypes.data, 3000, None)))
        t.start()
        while t.is_alive() and lib.kvflash_n_past(s) == 10:  # until the eval holds the session
            pass
        busy = dict(n_past=0, n_chunks=0, stats=0, logits=0, error=0)
        while t.is_alive():
            busy["n_past"] += lib.kvflash_n_past(s) == EBUSY
            busy["n_chunks"] += lib.kvflash_n_chunks(s) == EBUSY
            busy["stats"] += lib.kvflash_get_stats(s).n_past == EBUSY
            busy["logits"] += not lib.kvflash_get_logits(s)
            busy["error"] += b"another thread" in lib.kvflash_last_error(s)
        t.join()
        print("busy", busy, "eval", got)
        assert got == [0], got
        assert all(v > 0 for v in busy.values()), busy
        st = lib.kvflash_get_stats(s)
        assert lib.kvflash_n_past(s) == st.n_past == 3010 and st.page_outs > 0 and st.n_chunks == 48
        assert lib.kvflash_get_logits(s) and lib.kvflash_last_error(s) == b""

        # Readers hammering the session never make a call on it fail.
        stop, reads = threading.Event(), [0]
        def read():
            while not stop.is_set():
                lib.kvflash_n_past(s); lib.kvflash_get_stats(s); lib.kvflash_get_logits(s)
                lib.kvflash_n_chunks(s); lib.kvflash_last_error(s)
                reads[0] += 1
        r = threading.Thread(target=read)
        r.start()
        tok, codes = ctypes.c_int32(1), []
        for i in range(120):
            codes.append(lib.kvflash_decode(s, tok.value, None, ctypes.byref(tok)))
        codes.append(lib.kvflash_eval(s, toks.ctypes.data, 200, None))
        stop.set()
        r.join()
        print("decode codes", set(codes), "reads", reads[0])
        assert codes == [0] * len(codes), codes
        assert reads[0] > 0 and lib.kvflash_n_past(s) == 3010 + 120 + 200
        print("OK")
    """)
    assert rc == 0 and "OK" in out, out


# ---------------------------------------------------------------- the drafter's own history

@pytest.fixture(scope="module")
def drafter_file(tmp_path_factory):
    # another model with the same tokenizer: the drafter is fed the session's own ids (no bridge)
    return write_small_llama(tmp_path_factory.mktemp("misuse-drafter") / "drafter.gguf", seed=4)


def _drafter_session(small, drafter_file, **kw):
    # the drafter's own pool of 512: past it, its feeds are evaluated in chunk pieces, and a Ctrl-C is
    # taken between them (DrafterPolicy.set_interrupt stands in for one)
    from kvflash.scoring import DrafterPolicy
    return _session(small, policy=DrafterPolicy(drafter_file, threads=1, pool=512), **kw)


def _drafter_agrees(s):
    pol = s.policy
    assert not pol.bridged
    assert pol._rt.n_past == len(pol._fed), (pol._rt.n_past, len(pol._fed))
    assert pol._fed == s.tokens


def _drafter_follows(s):
    # between rescores the drafter holds a prefix of the history: what it was fed by the last one
    pol = s.policy
    assert pol._rt.n_past == len(pol._fed) and pol._fed == s.tokens[: len(pol._fed)], (pol._rt.n_past, len(s.tokens))


def test_ctrl_c_in_the_drafters_feed_during_prefill_keeps_its_history_with_the_session(small, drafter_file):
    # The prompt outgrows the pool, so prefill rescores and the drafter is fed the prompt;
    # Ctrl-C lands between the pieces of its eval.  The session rewinds to before the prompt, and the
    # drafter's cache and token list go back with it; the retry scores as if never interrupted.
    s = _drafter_session(small, drafter_file)
    s.prefill(_ids(700))
    _drafter_agrees(s)
    pol = s.policy
    pol.set_interrupt(lambda: True)   # the drafter's feed (in the core's rescore) is where it lands
    with pytest.raises(KeyboardInterrupt):
        s.prefill(_ids(300, 1))
    pol.set_interrupt(None)
    _consistent(s)
    assert s.tokens == _ids(700)
    _drafter_agrees(s)
    s.prefill(_ids(300, 1))
    _drafter_agrees(s)
    ref = _drafter_session(small, drafter_file)
    ref.prefill(_ids(700))
    ref.prefill(_ids(300, 1))
    assert s.tokens == ref.tokens
    np.testing.assert_allclose(s.last_scores, ref.last_scores, rtol=1e-5, atol=1e-7)


def test_ctrl_c_in_the_drafters_feed_during_generate_keeps_its_history_with_the_session(small, drafter_file):
    from kvflash.scoring import DrafterPolicy
    s = _drafter_session(small, drafter_file, tau=130)
    s.prefill(_ids(700))
    pol = s.policy
    pol.set_interrupt(lambda: True)   # the first decode-time rescore feeds the drafter 130 tokens, in pieces
    with pytest.raises(KeyboardInterrupt):
        for _ in s.generate(max_tokens=200, ignore_eos=True):
            pass
    pol.set_interrupt(None)
    _consistent(s)
    assert len(s.tokens) > 700
    _drafter_follows(s)   # the interrupted feed was undone: the drafter still holds what it held before it
    list(s.generate(max_tokens=20, ignore_eos=True))   # carries on, rescoring on its schedule
    _consistent(s)
    view = s.chunk_view()
    got = s.policy.score(view)                         # the next rescore: fed up to the session's history
    _drafter_agrees(s)
    want = DrafterPolicy(drafter_file, threads=1, pool=512).score(view)   # the same history, fed in one go
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * float(np.abs(want).max()))


# ---------------------------------------------------------------- captured queries across a rewind

@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    # One layer: its queries and keys depend on the tokens and positions only, not on which
    # chunks were resident when they were computed, so two sessions that hold the same
    # tokens score the same whatever their paging history.
    from tinygguf import write_tiny_model
    path = tmp_path_factory.mktemp("misuse-one") / "one.gguf"
    write_tiny_model(str(path), "llama", n_layer=1, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
                     weight_type="f32", seed=7)
    return str(path)


@pytest.mark.parametrize("cut", [1000, 1450])
def test_qk_scores_after_truncate_match_a_fresh_session(one_layer, cut):
    # The qk policy scores with the last n_queries captured queries minus the n_queries
    # `contrast` tokens before them (40 in all).  Truncating drops the captured queries past
    # the cut; a short prompt after it must still be scored with a full window, as a
    # session that never held the dropped tokens scores it.
    x, z = _ids(1500, 11), _ids(20, 12)
    a = _session(one_layer, policy="qk")
    a.prefill(x)
    a.truncate(cut)
    _consistent(a)
    assert a.tokens == x[:cut]
    a.prefill(z)            # past the pool: the post-prompt rescore scores it
    b = _session(one_layer, policy="qk")
    b.prefill(x[:cut])
    b.prefill(z)
    assert a.tokens == b.tokens
    assert a.runtime.n_captured == b.runtime.n_captured == a.policy.n_capture
    np.testing.assert_allclose(a.last_scores, b.last_scores, rtol=1e-4, atol=1e-6)


def test_failed_eval_gives_back_the_captured_queries(small):
    # All or nothing includes the capture window: a prompt that fails in a later piece
    # leaves the queries of the tokens before it captured, as they were.
    m = core.Model(small, n_threads=1)
    cap = 16 * core.Runtime(m, max_ctx=4096, pool_tokens=512).pager.chunk_bytes
    rt = core.Runtime(m, max_ctx=4096, pool_tokens=512, max_host_bytes=cap, capture_queries=40)
    rt.eval(np.arange(100, dtype=np.int32) % 250)
    q0 = rt.captured_queries().copy()
    assert rt.n_captured == 40
    with pytest.raises(RuntimeError, match="host store full"):
        rt.eval((np.arange(1800) % 250).astype(np.int32))
    assert rt.n_past == 100 and rt.n_captured == 40
    np.testing.assert_array_equal(rt.captured_queries(), q0)


def test_failed_prefill_gives_back_the_captured_queries(small):
    # The prompt was evaluated (its queries captured), then the post-prompt rescore failed:
    # the session rewinds, and the window is the one before the prompt again.
    from kvflash.policies import Requirements

    class Boom:
        name = "boom"
        requirements = Requirements(n_capture=40)

        def score(self, view):
            raise RuntimeError("policy failed")

    s = _session(small, policy=Boom())
    s.prefill(_ids(100))
    q0 = s.runtime.captured_queries().copy()
    assert s.runtime.n_captured == 40
    with pytest.raises(RuntimeError, match="policy failed"):
        s.prefill(_ids(1000, 2))
    _consistent(s)
    assert s.runtime.n_captured == 40
    np.testing.assert_array_equal(s.runtime.captured_queries(), q0)


# ---------------------------------------------------------------- a tokenizer that disagrees with the model

def test_text_the_model_has_no_embedding_for_is_refused_before_anything_changes(tmp_path):
    # The tokenizer has one merged token more than the model has rows (" the" -> id 266):
    # prefill, generate and chat refuse text that encodes to it with a ValueError naming the
    # mismatch, and the context (a chat's cached reply included) is left as it was.
    import warnings
    import kvflash
    from tinygguf import write_tiny_model
    path = tmp_path / "bigtok.gguf"
    write_tiny_model(path, "llama", n_layer=1, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, seed=1,
                     tokenizer_extra_merges=[("Ġt", "he")],
                     extra={"tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = kvflash.Session(str(path), max_ctx=256, kvflash=None, policy="lru", threads=1, verbose=False)
    assert any("tokenizer has 267 tokens" in str(x.message) for x in w)
    assert s.tokenizer.n_vocab == 267 and s.hparams["n_vocab"] == 266
    assert 266 in s.tokenize(" the", add_special=False)
    s.prefill("hello")
    before = s.tokens
    for call in (lambda: s.prefill("hello the"), lambda: s.generate(" the", max_tokens=2)):
        with pytest.raises(ValueError, match="tokenizer.*266"):
            call()
        assert s.tokens == before
    s.reset()
    reply = "".join(s.chat([{"role": "user", "content": "hello"}], max_tokens=6, ignore_eos=True))
    assert isinstance(reply, str)
    before = s.tokens
    with pytest.raises(ValueError, match="tokenizer.*266"):
        s.chat([{"role": "user", "content": "hello"}, {"role": "user", "content": " the"}], max_tokens=2)
    assert s.tokens == before   # the cached reply was not cut away for a prompt that is refused
    _consistent(s)
    with pytest.raises(ValueError, match="outside"):
        s.prefill([266])        # ids, as before
    s.prefill(" in on")         # what encodes within the model is fine
    _consistent(s)


def test_model_ids_without_text_are_never_sampled_from_the_file(tmp_path):
    # The file's tokenizer stops at 266 tokens, the model has 300 rows: no sampler setting
    # yields an id the tokenizer cannot decode, even when the logits favour those rows.
    import kvflash
    from tinygguf import write_tiny_model
    path = tmp_path / "smalltok.gguf"
    write_tiny_model(path, "llama", n_layer=1, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_vocab=300,
                     seed=1, tokenizer_size=266)
    s = kvflash.Session(str(path), max_ctx=512, kvflash=None, policy="lru", threads=1, verbose=False)
    assert s.tokenizer.n_vocab == 266 and s.hparams["n_vocab"] == 300 and s.runtime.sample_vocab == 266
    logits = np.full(300, -5.0, dtype=np.float32)
    logits[266:] = 10.0
    for kw in (dict(temperature=0.0), dict(temperature=1.0), dict(temperature=2.0, top_k=5),
               dict(temperature=1.0, top_p=0.5), dict(temperature=1.0, min_p=0.5)):
        assert all(s.runtime.sample(logits, **kw) < 266 for _ in range(20)), kw
    s.prefill([1, 2, 3])
    for kw in (dict(temperature=0.0), dict(temperature=1.5, seed=3), dict(temperature=1.5, top_k=40, seed=4)):
        text = "".join(s.generate(max_tokens=30, ignore_eos=True, **kw))
        assert isinstance(text, str)
    assert s.n_past == len(s.tokens) and all(t < 266 for t in s.tokens)


def test_prefill_piece_is_checked_and_cuts_a_pooled_prompt(small):
    """prefill_piece must be a whole number of chunks that fits the pool's evictable room; with it a prompt
    past the pool is evaluated that many tokens at a time and stays usable (the pager's invariants hold)."""
    import kvflash
    kw = dict(max_ctx=2048, kvflash=256, policy="lru", threads=1, verbose=False, chunk_tokens=16)
    for bad in (0, 24, -16, 1.5, True):
        with pytest.raises(ValueError, match="prefill_piece must be a positive multiple"):
            kvflash.Session(small, prefill_piece=bad, **kw)
    with pytest.raises(ValueError, match="evictable room of 160"):   # 256 - (1 + 4 + 1) x 16
        kvflash.Session(small, prefill_piece=176, **kw)
    ids = [5 + i % 250 for i in range(1200)]
    a = kvflash.Session(small, prefill_piece=64, **kw)
    b = kvflash.Session(small, **kw)
    a.prefill(ids)
    b.prefill(ids)
    a.pager.check_invariants()
    assert a.n_past == b.n_past == len(ids) and a.pager.stats["host_chunks"] > 0
    # the pieces differ (64 tokens against one chunk), so what each token attended to differs
    assert not np.array_equal(a.logits(), b.logits())
    assert len(list(a.generate(None, max_tokens=4, temperature=0.0, ignore_eos=True))) == 4


def test_chunk_tokens_auto_follows_the_pool(small):
    """chunk_tokens='auto': the core's rule (the largest of 64, 32, 16 leaving >= 24 chunks free of the sink, the
    tail window and the open chunk; prompts read in 64-token pieces) -- a 512-token pool pages 16-token chunks
    and reads a prompt as chunk_tokens=16 with prefill_piece=64 does, bit for bit; a pool's floor is the
    smallest chunk's; anything but 'auto' or a positive integer is refused."""
    import kvflash
    from kvflash import _core
    assert [_core.auto_chunk_geometry(p) for p in (0, 256, 512, 768, 1024, 2048, 8192)] == [
        (64, 0), (16, 64), (16, 64), (16, 64), (32, 64), (64, 0), (64, 0)]
    assert _core.auto_chunk_geometry(1024, 1, 8) == (16, 64)   # a longer tail window leaves 32-token chunks 18 free
    kw = dict(max_ctx=2048, policy="lru", threads=1, verbose=False)
    ids = [5 + i % 250 for i in range(1200)]
    a = kvflash.Session(small, kvflash=512, chunk_tokens="auto", **kw)
    b = kvflash.Session(small, kvflash=512, chunk_tokens=16, prefill_piece=64, **kw)
    c = kvflash.Session(small, kvflash=512, chunk_tokens=16, **kw)
    assert a.chunk_tokens == 16 and a.pager.chunk_tokens == 16 and "512 tokens in 16-token chunks" in a.banner
    for s in (a, b, c):
        s.prefill(ids)
    a.pager.check_invariants()
    assert a.pager.stats["host_chunks"] > 0 and np.array_equal(a.logits(), b.logits())
    assert not np.array_equal(a.logits(), c.logits())   # the pieces are 64 tokens, not one chunk
    assert kvflash.Session(small, kvflash=1024, chunk_tokens="auto", **kw).chunk_tokens == 32
    assert kvflash.Session(small, kvflash=None, chunk_tokens="auto", **kw).chunk_tokens == 64
    assert kvflash.Session(small, kvflash=256, chunk_tokens="auto", **kw).chunk_tokens == 16   # 64's floor is 512
    with pytest.raises(ValueError, match="below the minimum 512"):
        kvflash.Session(small, kvflash=256, **kw)
    for bad in ("big", 0, -16, 1.5, None):
        with pytest.raises(ValueError, match="chunk_tokens must be a positive integer or 'auto'"):
            kvflash.Session(small, kvflash=512, chunk_tokens=bad, **kw)
