"""Device selection: "cpu", "cuda", "cuda:N", or "auto" (CUDA when this build has it and a device is visible)."""
from __future__ import annotations

import re

from . import _core

_CUDA_RE = re.compile(r"cuda(:\d+)?")


def resolve_device(device: str) -> str:
    """The device string a Model is loaded with.  "auto" becomes "cuda" when
    ``_core.cuda_available()`` (a KVFLASH_CUDA build with a visible device), else
    "cpu"; "cpu", "cuda" and "cuda:N" pass through (the native loader says what is
    wrong with them, e.g. CUDA in a build without it).  Anything else: ValueError."""
    if not isinstance(device, str):
        raise ValueError(f"device must be a string ('auto', 'cpu', 'cuda' or 'cuda:N'), got {device!r}")
    if device == "auto":
        return "cuda" if _core.cuda_available() else "cpu"
    if device == "cpu" or _CUDA_RE.fullmatch(device):
        return device
    raise ValueError(f"unknown device {device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
