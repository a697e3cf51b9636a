"""Fetching pinned artifacts from the package registry pip is configured for.

Stdlib only: CMake runs this file as a script at configure time, before the
native module exists (``python _registry.py ggml-sdist``), and the Python layer
imports it to fetch models and tokenizer test vocabularies.  Nothing here names
a registry address; pip's own configuration decides where packages come from.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# The ggml we build against: the llama-cpp-python sdist vendors ggml 0.25.3
# (llama.cpp commit 0c1e570).  Pinned by version and by the sdist's digest.
GGML_SDIST = {
    "package": "llama-cpp-python",
    "version": "0.3.36",
    "filename": "llama_cpp_python-0.3.36.tar.gz",
    "sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "ggml_dir": "llama_cpp_python-0.3.36/vendor/llama.cpp/ggml",
    "models_dir": "llama_cpp_python-0.3.36/vendor/llama.cpp/models",
}


class FetchError(RuntimeError):
    """A pinned artifact could not be obtained or failed its checksum."""


def cache_dir() -> Path:
    """Where downloaded artifacts live: $KVFLASH_CACHE, else ~/.cache/kvflash."""
    env = os.environ.get("KVFLASH_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvflash"
    base.mkdir(parents=True, exist_ok=True)
    return base


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(requirement: str, dest: Path, *, sdist: bool = False) -> None:
    """Run ``pip download --no-deps`` for one pinned requirement into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(dest), requirement]
    if sdist:
        # --no-build-isolation: pip must read the sdist's metadata; without it pip
        # would build that package's whole build toolchain (cmake) from source.
        cmd[5:5] = ["--no-binary", ":all:", "--no-build-isolation"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}")


def fetch_file(requirement: str, filename: str, sha256: str, *, sdist: bool = False) -> Path:
    """Return the cached, checksummed registry file ``filename`` of ``requirement``."""
    target = cache_dir() / "downloads" / filename
    if target.exists() and sha256_of(target) == sha256:
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        pip_download(requirement, Path(tmp), sdist=sdist)
        got = Path(tmp) / filename
        if not got.exists():
            names = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
            raise FetchError(f"pip download {requirement} gave {names}, expected {filename}")
        digest = sha256_of(got)
        if digest != sha256:
            raise FetchError(f"{filename}: sha256 {digest} does not match the pinned {sha256}")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(got, target)
    return target


def ggml_sdist() -> Path:
    """The pinned llama-cpp-python sdist (ggml source and tokenizer test vocabularies)."""
    s = GGML_SDIST
    return fetch_file(f"{s['package']}=={s['version']}", s["filename"], s["sha256"], sdist=True)


def extract_members(archive: Path, prefix: str, dest: Path) -> Path:
    """Extract the members of ``archive`` under ``prefix`` into ``dest``; returns dest/prefix."""
    out = dest / prefix
    stamp = out / ".kvflash-extracted"
    if stamp.exists():
        return out
    with tarfile.open(archive, "r:gz") as tf:
        members = [m for m in tf.getmembers() if m.name == prefix or m.name.startswith(prefix + "/")]
        if not members:
            raise FetchError(f"{archive.name} has no {prefix}/")
        tf.extractall(dest, members=members, filter="data")
    stamp.write_text(archive.name + "\n")
    return out


def vocab_dir() -> Path:
    """Directory with ggml-vocab-*.gguf and their .inp/.out expected tokenizations."""
    return extract_members(ggml_sdist(), GGML_SDIST["models_dir"], cache_dir() / "src")


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "ggml-sdist":
        # CMake: unpack ggml into the build tree, print its path.
        print(extract_members(ggml_sdist(), GGML_SDIST["ggml_dir"], Path(argv[2])))
        return 0
    if len(argv) == 2 and argv[1] == "vocab-dir":
        print(vocab_dir())
        return 0
    print("usage: _registry.py ggml-sdist DEST | vocab-dir", file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except FetchError as e:
        print(f"kvflash: {e}", file=sys.stderr)
        sys.exit(1)
