"""kvflash: long-context local LLM inference with a fixed-size, paged KV pool.

The attention KV lives in a pool of slots allocated at pool size; cold 64-token
chunks are paged to host memory bit-exact, and a relevance policy decides which
chunks hold the slots.

    import kvflash
    s = kvflash.Session("smollm2-135m", max_ctx=8192, kvflash=1024, policy="lru")
    for piece in s.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}]):
        print(piece, end="")
"""
from __future__ import annotations

from ._core import (Model, Pager, Runtime, SnapshotError, build_info, cuda_available, ggml_commit, ggml_version,
                    min_pool_tokens, vulkan_available)
from .models import DEFAULT_MODEL, list_models, resolve_model
from .policies import BasePolicy, ChunkView, LRUPolicy, Policy, Requirements, register_policy
from .session import PrefillProgress, Session

__version__ = "0.1.0"

__all__ = ["Session", "PrefillProgress", "Pager", "Model", "Runtime", "Policy", "BasePolicy", "Requirements",
           "register_policy", "ChunkView", "LRUPolicy", "resolve_model",
           "list_models", "DEFAULT_MODEL", "min_pool_tokens", "ggml_version", "ggml_commit", "cuda_available",
           "vulkan_available", "build_info", "SnapshotError", "__version__"]
