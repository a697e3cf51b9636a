"""CUDA backend parity: the same model on CUDA and on the CPU backend.

These run only on a CUDA build on a machine with a GPU (bench/device/check.sh
runs them on a lent GPU machine); everywhere else every test skips with the
reason.  Nothing here is CUDA-specific in Python: they compare two runtimes.

The Python API of a CUDA build (csrc/bindings/; tests/test_device.py
covers the parts that behave the same in a CPU-only build):

    kvflash._core.cuda_available()        True: built with KVFLASH_CUDA=ON and a CUDA
                                          device is visible now.
    kvflash._core.Model(path, n_threads, device="cuda")
                                          weights in a ggml-cuda buffer; every
                                          Runtime over it computes on that backend,
                                          pool and sliding-window ring in VRAM, host
                                          store a pinned slab, pages moved by the
                                          async copy engine (csrc/cuda/copy_engine.h).
    Model.device                          "cpu" | "cuda:N"
    Model.device_memory()                 (free, total) bytes of the device now
    kvflash._core.Runtime(model, max_ctx=, pool_tokens=, kv_type=, ...)
                                          unchanged; on CUDA attn="auto"/"ggml" is
                                          ggml_flash_attn_ext, attn="pool" ValueError.
    Runtime.eval(tokens, all_logits)      unchanged: float32 logits on the host.
    kvflash.Session(..., device="auto")   CUDA when cuda_available(); kvflash="auto"
                                          sizes the pool from free device memory.

Error measure: normalised mean squared error, as ggml's test-backend-ops does
(sum (a-b)^2 / sum b^2, b = the CPU result), plus greedy-token identity.  The
thresholds are first estimates (f16 K/V and f32 weights on both sides; CUDA's
flash attention and matmuls accumulate differently from the CPU's): the first
GPU session should confirm or tighten them and record the observed values,
which check.sh collects from the printed lines (``CUDA-PARITY ...``).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("gguf")
core = pytest.importorskip("kvflash._core")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinygguf import write_tiny_model  # noqa: E402

NMSE_TOL = {"f16": 1e-4, "q8_0": 5e-4}


def _cuda_reason() -> str | None:
    """None if CUDA parity can run here, else why not."""
    avail = getattr(core, "cuda_available", None)
    if avail is None or not core.build_info()["cuda"]:
        return "not a CUDA build (pip install . -Ccmake.define.KVFLASH_CUDA=ON, see the README)"
    try:
        ok = bool(avail() if callable(avail) else avail)
    except Exception as e:  # a CUDA build without a driver may raise
        return f"kvflash._core.cuda_available failed: {e}"
    if not ok:
        return "CUDA build, but no usable CUDA device"
    return None


_REASON = _cuda_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def nmse(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-30))


def greedy_pair(rg, rc, prompt, steps):
    """Prompt then greedy steps on the GPU (rg) and CPU (rc) runtimes, each following its own argmax;
    stops at the first divergence.  Returns (per-step NMSE, gpu tokens, cpu tokens, last cpu logits)."""
    a, b = rg.eval(prompt, False), rc.eval(prompt, False)
    errs, ta, tb = [nmse(a, b)], [int(a.argmax())], [int(b.argmax())]
    for _ in range(steps):
        a = rg.eval(np.array([ta[-1]], np.int32), False)
        b = rc.eval(np.array([tb[-1]], np.int32), False)
        errs.append(nmse(a, b))
        ta.append(int(a.argmax()))
        tb.append(int(b.argmax()))
        if ta[-1] != tb[-1]:
            break
    return errs, ta, tb, b


def report(name: str, err: float, tol: float) -> None:
    # One greppable line per comparison; check.sh copies these into the summary.
    print(f"CUDA-PARITY {name} nmse={err:.3e} tol={tol:.0e}")


ARCH_KW = {
    # head_dim 64/128: real-model head sizes (ggml-cuda's flash attention kernels are per head size).
    "llama": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512),
    "qwen3": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=128, n_ff=512),
    "gemma3": dict(n_layer=6, n_embd=256, n_head=4, n_head_kv=1, head_dim=128, n_ff=512, gemma_sliding_window=64),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tmp_path_factory.mktemp("cuda") / f"{arch}.gguf"
            write_tiny_model(path, arch, weight_type="f32", seed=11, ctx_len=8192, **ARCH_KW[arch])
            cpu = core.Model(str(path), 4, device="cpu")
            gpu = core.Model(str(path), 4, device="cuda")
            assert (cpu.device, gpu.device) == ("cpu", "cuda:0")
            cache[arch] = (cpu, gpu)
        return cache[arch]

    yield get
    cache.clear()


def toks(n: int, seed: int, n_vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def runtimes(models, arch, **kw):
    cpu, gpu = models(arch)
    return core.Runtime(cpu, **kw), core.Runtime(gpu, **kw), cpu.hparams["n_vocab"]


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", sorted(ARCH_KW))
def test_full_cache_prefill_logits(models, arch, kv_type):
    """Full cache, a 300-token prompt in one batch: every position's logits."""
    rc, rg, V = runtimes(models, arch, max_ctx=1024, pool_tokens=0, kv_type=kv_type)
    t = toks(300, 1, V)
    a = rg.eval(t, True)
    b = rc.eval(t, True)
    err = nmse(a, b)
    report(f"full-prefill {arch} {kv_type}", err, NMSE_TOL[kv_type])
    assert err < NMSE_TOL[kv_type]
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.99


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", sorted(ARCH_KW))
def test_kvflash_paged_decode_logits_and_greedy(models, arch, kv_type):
    """kvflash: a prompt 3x the pool (pooled prefill with live eviction and paging
    through the pinned slab), then greedy decode; logits per step and the tokens."""
    kw = dict(max_ctx=4096, pool_tokens=512, kv_type=kv_type, ubatch=64)
    rc, rg, V = runtimes(models, arch, **kw)
    errs, ta, tb, b = greedy_pair(rg, rc, toks(1536, 2, V), 48)
    worst = max(errs)
    report(f"kvflash-decode {arch} {kv_type}", worst, NMSE_TOL[kv_type])
    st = rg.pager.stats
    assert st["page_outs"] > 0 and st["host_chunks"] > 0, st  # the prompt really paged through the pinned slab
    assert worst < NMSE_TOL[kv_type], (errs, st)
    srt = np.sort(b)
    assert ta == tb, f"greedy tokens diverge: cuda {ta} cpu {tb}; cpu top-2 margin {srt[-1] - srt[-2]:.3g}"


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", sorted(ARCH_KW))
def test_full_cache_greedy_decode(models, arch, kv_type):
    """Full cache: a prompt, then 32 greedy steps; logits per step and identical tokens."""
    rc, rg, V = runtimes(models, arch, max_ctx=1024, pool_tokens=0, kv_type=kv_type)
    errs, ta, tb, _ = greedy_pair(rg, rc, toks(200, 5, V), 32)
    report(f"full-decode {arch} {kv_type}", max(errs), NMSE_TOL[kv_type])
    assert max(errs) < NMSE_TOL[kv_type], errs
    assert ta == tb, f"greedy tokens diverge: cuda {ta} cpu {tb}"


def test_host_reads_of_the_pool_follow_the_copies(models):
    """The host reads of pool rows (chunk_keys, the key summaries made when a chunk
    seals, attention_scores) and the captured queries, on CUDA right after paging:
    they must see the bytes the copy engine and the kernels wrote (fence + sync)."""
    kw = dict(max_ctx=4096, pool_tokens=512, kv_type="f16", ubatch=64, chunk_summaries=True, capture_queries=4)
    rc, rg, V = runtimes(models, "llama", **kw)
    t = toks(1300, 6, V)
    for rt in (rg, rc):
        rt.eval(t, False)
        rt.pager.recall(2)  # page a chunk in just before reading it
    assert rg.pager.chunk_table()["block"][2] >= 0
    err = nmse(rg.chunk_keys(2, 0), rc.chunk_keys(2, 0))
    report("host-read chunk_keys", err, 1e-5)
    assert err < 1e-5
    err = nmse(rg.captured_queries(), rc.captured_queries())
    report("host-read captured_queries", err, 1e-5)
    assert err < 1e-5
    for mode in ("bound", "mean"):
        a, b = rg.qk_scores(mode), rc.qk_scores(mode)
        fin = np.isfinite(b)
        assert (np.isfinite(a) == fin).all()
        err = nmse(a[fin], b[fin])
        report(f"host-read qk_scores {mode}", err, 1e-4)
        assert err < 1e-4
    err = nmse(rg.attention_scores(), rc.attention_scores())
    report("host-read attention_scores", err, 1e-4)
    assert err < 1e-4


def test_cuda_model_api(models):
    _, gpu = models("llama")
    free, total = gpu.device_memory()
    assert 0 < free <= total
    with pytest.raises(ValueError, match="CPU attention kernel"):
        core.Runtime(gpu, max_ctx=1024, pool_tokens=512, attn="pool")
    core.Runtime(gpu, max_ctx=1024, pool_tokens=512, attn="ggml").eval(toks(10, 7, gpu.hparams["n_vocab"]))
    n = core.build_info()["cuda_devices"]
    with pytest.raises(ValueError, match="CUDA device"):
        core.Model(gpu.path, 1, device=f"cuda:{n}")


def test_session_on_cuda_sizes_the_pool_from_device_memory(models):
    import kvflash
    _, gpu = models("llama")
    s = kvflash.Session(gpu.path, max_ctx=8192, kvflash="auto", policy="lru", threads=2, device="auto",
                        verbose=False)
    assert s.device == "cuda:0"
    assert "free cuda:0 memory" in s.auto_reason, s.auto_reason
    s.prefill(list(range(1, 200)))
    assert s.runtime.n_past == 199


@pytest.mark.parametrize("arch", ["llama"])
def test_kvflash_matches_full_cache_on_cuda_while_prompt_fits(models, arch):
    """On CUDA alone: kvflash (pool < context) equals the full cache while nothing
    has been evicted (same graph over a smaller pool)."""
    _, gpu = models(arch)
    V = gpu.hparams["n_vocab"]
    full = core.Runtime(gpu, max_ctx=4096, pool_tokens=0, kv_type="f16")
    flash = core.Runtime(gpu, max_ctx=4096, pool_tokens=512, kv_type="f16")
    t = toks(400, 3, V)
    err = nmse(flash.eval(t, True), full.eval(t, True))
    report(f"cuda-kvflash-vs-full {arch}", err, 1e-6)
    assert err < 1e-6


def test_truncate_and_reset_with_host_chunks(models):
    """Rewind into paged-out territory (the tail comes back from the pinned slab),
    then reset and run again: CUDA follows the CPU through the same pager decisions."""
    rc, rg, V = runtimes(models, "llama", max_ctx=4096, pool_tokens=512, kv_type="q8_0", ubatch=64)
    t = toks(1400, 4, V)
    outs = []
    for rt in (rg, rc):
        o = [rt.eval(t, False)]
        rt.truncate(700)
        o.append(rt.eval(t[700:1100], False))
        rt.reset()
        o.append(rt.eval(t[:900], False))
        outs.append(o)
    for k, (a, b) in enumerate(zip(*outs)):
        err = nmse(a, b)
        report(f"truncate-reset step{k}", err, NMSE_TOL["q8_0"])
        assert err < NMSE_TOL["q8_0"]
        assert int(a.argmax()) == int(b.argmax())
