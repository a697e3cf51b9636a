"""kvflash: long-context local LLM inference with a fixed-size, paged KV pool.

The attention KV lives in a pool of slots allocated at pool size; cold 64-token
chunks are paged to host memory bit-exact, and a relevance policy decides which
chunks hold the slots.
"""
from __future__ import annotations

from ._core import Pager, ggml_commit, ggml_version, min_pool_tokens

__version__ = "0.1.0"

__all__ = ["Pager", "min_pool_tokens", "ggml_version", "ggml_commit", "__version__"]
