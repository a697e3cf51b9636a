"""GGUF key/value metadata as plain Python values, read by ggml's own GGUF reader.

The one metadata path: ``_core.gguf_metadata`` (the reader Model::load uses).  Loading
the 151,936-token qwen2 vocabulary takes ~70 ms that way, ~9 s through the ``gguf``
package's GGUFReader (which builds a numpy view per array element), so that reader
is kept only as an independent cross-check (``use_gguf_reader=True``, for tests).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

_GGUF_MAGIC = b"GGUF"


def read_gguf_metadata(path: str | os.PathLike, *, prefix: str | None = None,
                       use_gguf_reader: bool = False) -> dict[str, Any]:
    """Read the key/value metadata of a GGUF file as plain Python values.

    Only the header is parsed; tensor data is never touched.  Arrays become Python
    lists, strings that are not valid UTF-8 keep their bytes as surrogates.
    ``prefix`` keeps only keys that start with it.  Raises ValueError for files that
    are not GGUF or that ggml cannot read.  ``use_gguf_reader=True`` reads through the
    ``gguf`` package instead (slow; a reference for tests).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != _GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {_GGUF_MAGIC!r})")
    if use_gguf_reader:
        return _read_with_gguf_package(path, prefix)
    from kvflash import _core  # absolute: the tokenizer tests load this package's files directly

    return _core.gguf_metadata(path, prefix)


def md_list(v: Any) -> list:
    """A metadata array as a list (None: empty)."""
    if v is None:
        return []
    if isinstance(v, np.ndarray):
        return v.tolist()
    return list(v)


def md_int(v: Any) -> int | None:
    """A metadata integer (a one-element array too), None when absent."""
    if v is None:
        return None
    if isinstance(v, (list, tuple, np.ndarray)):
        v = md_list(v)
        if len(v) != 1:
            raise ValueError(f"expected a scalar, got {v!r}")
        v = v[0]
    return int(v)


def md_str(v: Any) -> str | None:
    """A metadata string (bytes decoded as UTF-8), None when absent."""
    if v is None:
        return None
    if isinstance(v, (bytes, bytearray, np.ndarray)):
        return bytes(v).decode("utf-8")
    return str(v)


def _read_with_gguf_package(path: str, prefix: str | None) -> dict[str, Any]:
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf raises plain ValueError/struct errors
        raise ValueError(f"{path}: cannot read GGUF metadata ({e})") from e
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or (prefix is not None and not key.startswith(prefix)) or not field.types:
            continue
        types = field.types
        if types[0] == gguf.GGUFValueType.ARRAY:
            if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
                out[key] = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
            else:
                out[key] = [field.parts[i].tolist()[0] for i in field.data]
        elif types[0] == gguf.GGUFValueType.STRING:
            out[key] = bytes(field.parts[-1]).decode("utf-8", errors="surrogateescape")
        else:
            out[key] = field.parts[-1].tolist()[0]
    return out
