"""llama.cpp itself as the peer for kvflash's forward passes.

Builds libllama (CPU only, static) and the ``llama_logits`` driver (tests/cpp/llama_ref) from the pinned
sdist's vendor/llama.cpp -- the same sources kvflash's ggml comes from -- into the kvflash cache, once per
(sdist, driver source, compiler) and shared between processes under a file lock; then runs it as a
subprocess, so llama.cpp's ggml never shares a process with kvflash's own.

    logits(path, tokens, batched=True)  -> float32 [n_tokens, n_vocab], every token an output
                                           (flash_attn=True: ggml's flash attention, the peer of attn="ggml")
    normalized_error(a, b)              -> ||a - b|| / ||b|| over the whole array (test-backend-ops' NMSE, root)

The first build takes a few minutes on two cores (76 objects); later calls find the binary.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python" / "kvflash"))
import _registry  # noqa: E402  (stdlib only; the module kvflash's build uses to fetch the sdist)

PROJECT = Path(__file__).resolve().parent / "cpp" / "llama_ref"
# what of llama.cpp the build reads (the models/ vocabularies, tests and tools are not needed)
_MEMBERS = ("CMakeLists.txt", "cmake", "ggml", "include", "src", "vendor", "LICENSE")


class RefError(RuntimeError):
    """The reference could not be built, or llama.cpp refused or failed a run (its log is in the message)."""


def _key() -> str:
    h = hashlib.sha256(_registry.GGML_SDIST["sha256"].encode())
    for name in sorted(os.listdir(PROJECT)):
        h.update(name.encode() + b"\0" + (PROJECT / name).read_bytes())
    cc = shutil.which("c++") or shutil.which("g++") or ""
    if cc:
        h.update(subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.encode())
    return h.hexdigest()[:16]


def binary() -> Path:
    """The built ``llama_logits`` (built now if this cache has none)."""
    key = _key()
    base = _registry.cache_dir() / "llama-ref" / key
    exe = base / "bin" / "llama_logits"
    if exe.exists() and (base / "bin" / "done").exists():
        return exe
    base.mkdir(parents=True, exist_ok=True)
    with open(base / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)           # another process may be building the same key
        if exe.exists() and (base / "bin" / "done").exists():
            return exe
        _build(base)
    return exe


def _build(base: Path) -> None:
    llama_dir = _registry.GGML_SDIST["llama_dir"]
    sdist = _registry.ggml_sdist()
    src = base / "src" / llama_dir
    if not (src / ".kvflash-extracted").exists():
        import tarfile
        want = tuple(f"{llama_dir}/{m}" for m in _MEMBERS)
        with tarfile.open(sdist, "r:gz") as tf:
            members = [m for m in tf.getmembers() if m.name in want or m.name.startswith(tuple(w + "/" for w in want))]
            _registry._safe_extract(tf, members, base / "src")
        (src / ".kvflash-extracted").write_text(sdist.name + "\n")
    build = base / "build"
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RefError("cmake is not on PATH (pip install cmake ninja)")
    cfg = [cmake, "-S", str(PROJECT), "-B", str(build), f"-DLLAMA_REF_SOURCE={src}",
           "-DCMAKE_BUILD_TYPE=Release"]
    ninja = shutil.which("ninja")
    if ninja:
        cfg += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    jobs = str(max(1, min(os.cpu_count() or 1, 4)))
    log = base / "build.log"
    with open(log, "w") as f:
        for cmd in (cfg, [cmake, "--build", str(build), "--target", "llama_logits", "-j", jobs]):
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise RefError(f"building llama.cpp's reference failed (exit {rc}); log: {log}\n"
                               + log.read_text()[-3000:])
    (base / "bin").mkdir(exist_ok=True)
    tmp = base / "bin" / "llama_logits.tmp"
    shutil.copy2(build / "llama_logits", tmp)
    os.replace(tmp, base / "bin" / "llama_logits")
    (base / "bin" / "done").write_text(_key() + "\n")


def logits(path: str | os.PathLike, tokens, *, batched: bool = True, threads: int = 2,
           n_ctx: int | None = None, flash_attn: bool = False) -> np.ndarray:
    """llama.cpp's logits for every token of ``tokens`` (f16 K/V cache, flash attention off).

    batched: one llama_decode of all tokens; else one token per llama_decode.  flash_attn: ggml's
    flash attention instead (the peer of kvflash's attn="ggml" path: the same kernels by query count).
    """
    toks = np.asarray(tokens, dtype=np.int32)
    exe = binary()
    with tempfile.TemporaryDirectory() as d:
        tp, op = Path(d) / "t.i32", Path(d) / "l.f32"
        toks.tofile(tp)
        cmd = [str(exe), "--model", str(path), "--tokens", str(tp), "--out", str(op),
               "--mode", "batch" if batched else "single", "--threads", str(threads)]
        if n_ctx:
            cmd += ["--n-ctx", str(n_ctx)]
        if flash_attn:
            cmd += ["--flash-attn", "on"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise RefError(f"llama_logits exit {p.returncode}:\n{p.stderr[-4000:]}")
        out = np.fromfile(op, dtype=np.float32)
    if out.size % len(toks):
        raise RefError(f"llama_logits wrote {out.size} floats for {len(toks)} tokens")
    return out.reshape(len(toks), -1)


def normalized_error(a, b) -> float:
    """||a - b||_2 / ||b||_2 over the whole array (float64)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


if __name__ == "__main__":   # python tests/llama_ref.py: build (or find) the reference and print its path
    print(binary())
