"""Fetching pinned artifacts from the package registry pip is configured for.

Stdlib only: CMake runs this file as a script at configure time, before the
native module exists (``python _registry.py ggml-sdist``), and the Python layer
imports it to fetch models and tokenizer test vocabularies.  Nothing here names
a registry address; pip's own configuration decides where packages come from.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
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
    # llama.cpp itself: the core's tokenizer is llama.cpp's vocabulary code (src/llama-vocab.cpp and the few
    # files it needs), compiled from here at build time (third_party/ggml/llama_vocab.cmake)
    "llama_dir": "llama_cpp_python-0.3.36/vendor/llama.cpp",
    # the llama.cpp commit the sdist vendors (ggml's own build would report the enclosing checkout's)
    "llama_cpp_commit": "0c1e570",
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


def _bundled_pip_wheel() -> Path | None:
    """A pip wheel shipped with this interpreter (ensurepip's, or Debian's python-wheels)."""
    try:
        import ensurepip
        dirs = [Path(ensurepip.__file__).parent / "_bundled"]
    except ImportError:
        dirs = []
    dirs.append(Path("/usr/share/python-wheels"))
    for d in dirs:
        wheels = sorted(d.glob("pip-*-py3-none-any.whl")) if d.is_dir() else []
        if wheels:
            return wheels[-1]
    return None


def pip_command() -> list[str]:
    """The command that runs pip here, whether or not pip is installed in this environment.

    In order: this interpreter's pip; pip run straight from the wheel the interpreter
    ships for ensurepip (a wheel is a runnable zip: nothing is installed); a pip on PATH.
    A venv made by ``uv venv`` or pip's isolated build environment has no pip of its own.
    """
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    wheel = _bundled_pip_wheel()
    if wheel is not None:
        return [sys.executable, str(wheel / "pip")]
    for name in ("pip3", "pip"):
        exe = shutil.which(name)
        if exe:
            return [exe]
    raise FetchError(
        f"no pip to download with: {sys.executable} cannot import pip, ships no ensurepip wheel, and no pip "
        "is on PATH. Install pip in this environment (`uv pip install pip` or `python -m ensurepip`), or get "
        "the file by hand (see the message of kvflash.resolve_model) and pass its path.")


def _pip_env() -> dict:
    """pip's environment: uv's index setting carries over when pip has none of its own."""
    env = dict(os.environ)
    if "PIP_INDEX_URL" not in env:
        for key in ("UV_DEFAULT_INDEX", "UV_INDEX_URL"):
            if env.get(key):
                env["PIP_INDEX_URL"] = env[key]
                break
    return env


def pip_download(requirement: str, dest: Path, *, sdist: bool = False) -> None:
    """Run ``pip download --no-deps`` for one pinned requirement into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = pip_command() + ["download", "--no-deps", "--disable-pip-version-check", "-d", str(dest)]
    if sdist:
        # Only this package as a source archive: pip reads its metadata in an isolated
        # environment of its build requirements, which come as wheels (`:all:` would
        # force those to be built from source too).
        cmd += ["--no-binary", requirement.split("==")[0]]
    cmd.append(requirement)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_pip_env())
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
        _safe_extract(tf, members, dest)
    stamp.write_text(archive.name + "\n")
    return out


def _safe_extract(tf: tarfile.TarFile, members: list, dest: Path) -> None:
    """Extract regular files and directories only, never outside ``dest``.

    Python's ``filter="data"`` does this where it exists (3.12, and 3.8.17 / 3.9.17 /
    3.10.12 / 3.11.4 onwards); older interpreters get the same checks here.
    """
    if hasattr(tarfile, "data_filter"):
        tf.extractall(dest, members=members, filter="data")
        return
    root = dest.resolve()
    for m in members:
        target = (dest / m.name).resolve()
        if m.name.startswith("/") or (target != root and root not in target.parents):
            raise FetchError(f"archive member {m.name!r} would land outside {dest}")
        if not (m.isfile() or m.isdir()):
            raise FetchError(f"archive member {m.name!r} is not a regular file or directory")
        m.mode = (m.mode | 0o600) & 0o755 if m.isfile() else 0o755
    tf.extractall(dest, members=members)


def vocab_dir() -> Path:
    """Directory with ggml-vocab-*.gguf and their .inp/.out expected tokenizations."""
    return extract_members(ggml_sdist(), GGML_SDIST["models_dir"], cache_dir() / "src")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[1] == "ggml-commit":
        print(GGML_SDIST["llama_cpp_commit"])
        return 0
    if len(argv) == 3 and argv[1] == "ggml-sdist":
        # CMake: unpack ggml into the build tree, print its path.
        print(extract_members(ggml_sdist(), GGML_SDIST["ggml_dir"], Path(argv[2])))
        return 0
    if len(argv) == 3 and argv[1] == "llama-src":
        # CMake: unpack llama.cpp's src/ and include/ (the vocabulary code) into the build tree, print
        # the llama.cpp directory that holds them.
        for sub in ("src", "include"):
            extract_members(ggml_sdist(), f"{GGML_SDIST['llama_dir']}/{sub}", Path(argv[2]))
        print(Path(argv[2]) / GGML_SDIST["llama_dir"])
        return 0
    if len(argv) == 2 and argv[1] == "vocab-dir":
        print(vocab_dir())
        return 0
    print("usage: _registry.py ggml-sdist DEST | llama-src DEST | ggml-commit | vocab-dir", file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except FetchError as e:
        print(f"kvflash: {e}", file=sys.stderr)
        sys.exit(1)
