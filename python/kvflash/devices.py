"""Device selection: "cpu", "cuda", "cuda:N", "vulkan", "vulkan:N", or "auto" (a GPU when this build has one's
backend and a device is visible: CUDA first, then Vulkan; else the CPU)."""
from __future__ import annotations

import re

from . import _core

_GPU_RE = re.compile(r"(cuda|vulkan)(:\d+)?")
FORMS = "'auto', 'cpu', 'cuda', 'cuda:N', 'vulkan' or 'vulkan:N'"


def resolve_device(device: str) -> str:
    """The device string a Model is loaded with.  "auto" becomes what ``_core.auto_device()`` picks now
    ("cuda:0", else "vulkan:0", else "cpu"); "cpu", "cuda[:N]" and "vulkan[:N]" pass through (the native
    loader says what is wrong with them, e.g. a GPU backend this build lacks).  Anything else: ValueError."""
    if not isinstance(device, str):
        raise ValueError(f"device must be a string ({FORMS}), got {device!r}")
    if device == "auto":
        return _core.auto_device()
    if device == "cpu" or _GPU_RE.fullmatch(device):
        return device
    raise ValueError(f"unknown device {device!r}: use {FORMS}")


def is_gpu(device: str) -> bool:
    """A device string of a GPU (any of ggml's GPU backends), as Model.device spells it."""
    return device != "cpu"
