"""Device selection as Python sees it, in any build: device strings, the CUDA and Vulkan
rebuild hints in a build without them, cuda_available/vulkan_available/build_info,
Session(device=...), and the GPU branch of the auto pool rule (pure arithmetic, no GPU
needed).  tests/test_gpu.py is the suite that runs on a device."""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("gguf")
import kvflash  # noqa: E402
from kvflash import _core  # noqa: E402
from kvflash.devices import resolve_device  # noqa: E402
from kvflash._pool import auto_pool, kv_bytes_per_token  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinygguf import write_small_llama  # noqa: E402

CUDA_BUILT = bool(_core.build_info()["cuda"])
VULKAN_BUILT = bool(_core.build_info()["vulkan"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_small_llama(tmp_path_factory.mktemp("dev") / "tiny.gguf", seed=3)


def test_build_info_keys():
    info = _core.build_info()
    assert {"cuda", "cuda_devices", "vulkan", "vulkan_devices", "ggml_version", "ggml_commit", "devices",
            "cpu_features"} <= set(info)
    assert isinstance(info["cuda"], bool) and isinstance(info["vulkan"], bool)
    assert info["ggml_version"] == _core.ggml_version
    assert any(d["name"] == "CPU" for d in info["devices"])
    assert all(d["memory_total"] > 0 for d in info["devices"])
    assert isinstance(info["cpu_features"], dict)
    assert kvflash.build_info()["cuda"] == info["cuda"]


def test_cuda_available_consistent_with_build():
    avail = _core.cuda_available()
    assert isinstance(avail, bool)
    assert avail == (CUDA_BUILT and _core.build_info()["cuda_devices"] > 0)
    if not CUDA_BUILT:
        assert avail is False
    vk = _core.vulkan_available()
    assert vk == (VULKAN_BUILT and _core.build_info()["vulkan_devices"] > 0)
    # ggml's registry lists the same devices build_info counts
    names = [d["name"] for d in _core.build_info()["devices"]]
    assert sum(n.startswith("Vulkan") for n in names) == _core.build_info()["vulkan_devices"]
    assert sum(n.startswith("CUDA") for n in names) == _core.build_info()["cuda_devices"]


def test_cpu_model_device_and_memory(tiny):
    m = _core.Model(tiny, 1)
    assert m.device == "cpu"
    assert _core.Model(tiny, 1, device="cpu").device == "cpu"
    free, total = m.device_memory()
    assert 0 < free <= total


@pytest.mark.parametrize("bad", ["gpu", "CPU", "cuda:", "cuda:x", "cuda:-1", "cuda0", "", "metal", "vulkan:",
                                 "vulkan:x", "vulkan0", "Vulkan", "vk"])
def test_unknown_device_strings(tiny, bad):
    with pytest.raises(ValueError, match="'vulkan' or 'vulkan:N'"):
        _core.Model(tiny, 1, device=bad)


# (device, compiled in, what the message names: the backend and how to rebuild with it)
WITHOUT = [(dev, CUDA_BUILT, "CUDA", ("KVFLASH_CUDA=ON", "CMAKE_CUDA_ARCHITECTURES")) for dev in ("cuda", "cuda:0", "cuda:3")]
WITHOUT += [(dev, VULKAN_BUILT, "Vulkan", ("KVFLASH_VULKAN=ON", "vulkan-deps.sh"))
            for dev in ("vulkan", "vulkan:0", "vulkan:2")]


@pytest.mark.parametrize("dev,built,kind,hints", WITHOUT, ids=[w[0] for w in WITHOUT])
def test_a_gpu_kind_the_build_lacks_says_how_to_rebuild(tiny, dev, built, kind, hints):
    if built:
        pytest.skip(f"this build has {kind}")
    with pytest.raises(ValueError) as e:
        _core.Model(tiny, 1, device=dev)
    msg = str(e.value)
    assert f"built without {kind}" in msg
    assert all(h in msg for h in hints), msg
    with pytest.raises(ValueError, match=f"built without {kind}"):
        kvflash.Session(tiny, max_ctx=1024, kvflash=512, policy="lru", threads=1, verbose=False, device=dev)
    with pytest.raises(ValueError, match=f"built without {kind}"):
        kvflash.Pager(pool_tokens=512, max_ctx=1024, device=dev)


@pytest.mark.skipif(not VULKAN_BUILT, reason="not a Vulkan build")
def test_vulkan_build_with_no_visible_device_says_why(tiny):
    """ggml-vulkan lists a CPU-type device (lavapipe) only when GGML_VK_VISIBLE_DEVICES names it: with the
    variable unset and no GPU, the message says so (run in a child, since ggml reads it once)."""
    import subprocess
    code = ("import kvflash._core as c\n"
            "n = c.build_info()['vulkan_devices']\n"
            "try:\n"
            f"    c.Model({tiny!r}, 1, device='vulkan:%d' % n)\n"
            "except ValueError as e:\n"
            "    print('REFUSED', n, e)\n")
    env = {k: v for k, v in os.environ.items() if k != "GGML_VK_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    n = int(out.stdout.split("REFUSED", 1)[1].split()[0])
    if n == 0:
        assert "no Vulkan device is visible" in out.stdout and "GGML_VK_VISIBLE_DEVICES" in out.stdout
    else:
        assert f"{n} Vulkan device(s) visible" in out.stdout


def test_resolve_device():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("cuda:2") == "cuda:2"
    assert resolve_device("vulkan:1") == "vulkan:1"
    want = "cuda:0" if _core.cuda_available() else "vulkan:0" if _core.vulkan_available() else "cpu"
    assert resolve_device("auto") == want == _core.auto_device()
    for bad in ("gpu", "cuda:x", "vulkan:", "", None, 0):
        with pytest.raises(ValueError):
            resolve_device(bad)


def test_session_device_auto_and_cpu(tiny):
    s = kvflash.Session(tiny, max_ctx=2048, kvflash=512, policy="lru", threads=1, verbose=False, device="auto")
    assert s.device == _core.auto_device()
    s.prefill(list(range(1, 100)))
    assert s.runtime.n_past == 99
    c = kvflash.Session(tiny, max_ctx=2048, kvflash="auto", policy="lru", threads=1, verbose=False, device="cpu")
    assert c.device == "cpu" and "free RAM" in c.auto_reason
    with pytest.raises(ValueError, match="unknown device"):
        kvflash.Session(tiny, max_ctx=1024, kvflash=512, policy="lru", threads=1, verbose=False, device="tpu")


HP = {"head_dim": 64, "n_head_kv": 4}


def test_auto_pool_gpu_rule():
    per_tok = kv_bytes_per_token(HP, "q8_0", 24)          # 24 paged layers: 13056 bytes per token
    MiB = 1 << 20
    # budget = (free - 512 MiB headroom) / 2, no weights subtracted (free is measured after them)
    free = 512 * MiB + 2 * int(3000 * per_tok)
    tok, why = auto_pool(HP, "q8_0", 24, weight_bytes=10 << 30, max_ctx=131072, expect_drafter=False,
                         free_bytes=free, device="cuda:0")
    assert tok == 3000 // 256 * 256
    assert "free cuda:0 memory" in why and f"{free / MiB:.0f} MiB free" in why
    # a drafter reserves 768 MiB more
    tok_d, _ = auto_pool(HP, "q8_0", 24, 0, 131072, True, free_bytes=free + 768 * MiB, device="cuda:0")
    assert tok_d == tok
    # capped at 16K, floor at the minimum pool, never above max_ctx
    big, why = auto_pool(HP, "q8_0", 24, 0, 131072, False, free_bytes=80 << 30, device="cuda:0")
    assert big == 16384 and why.startswith("capped at 16384")
    small, why = auto_pool(HP, "q8_0", 24, 0, 131072, False, free_bytes=512 * MiB + 2 * int(100 * per_tok),
                           device="cuda:0")
    assert small == _core.min_pool_tokens() and why.startswith("floor")
    fits, why = auto_pool(HP, "q8_0", 24, 0, 1000, False, free_bytes=80 << 30, device="cuda:0")
    assert fits == 1024 and why.startswith("max_ctx 1000 fits")
    with pytest.raises(ValueError, match="free_bytes"):
        auto_pool(HP, "q8_0", 24, 0, 4096, False, device="cuda:0")
    # every GPU backend takes the same rule (Vulkan: ggml-vulkan's device memory query)
    vk, why = auto_pool(HP, "q8_0", 24, weight_bytes=10 << 30, max_ctx=131072, free_bytes=free, device="vulkan:0")
    assert vk == tok and "free vulkan:0 memory" in why
    with pytest.raises(ValueError, match="free_bytes"):
        auto_pool(HP, "q8_0", 24, 0, 4096, False, device="vulkan:1")


def test_auto_pool_cpu_rule_unchanged():
    per_tok = kv_bytes_per_token(HP, "f16", 8)
    free = (1 << 30) + (100 << 20) + 2 * int(2048 * per_tok)
    tok, why = auto_pool(HP, "f16", 8, 100 << 20, 131072, False, free_bytes=free)
    assert tok == 2048 and "free RAM" in why
