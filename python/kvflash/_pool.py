"""Pool sizing: the KV pool a session gets for kvflash="auto", an integer or None, and where a drafter is found."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import _core
from .devices import is_gpu
from .system import available_ram

AUTO_CAP_TOKENS = 16384
DRAFTER_DIRS = ("drafter", "draft")
DRAFTER_RESERVE_BYTES = 768 << 20   # what a drafter model is expected to take (DrafterPolicy's requirements)


def kv_bytes_per_token(hp: dict, kv_type: str, n_paged_layers: int) -> float:
    """Bytes of K+V per token across the paged layers, for a KV type."""
    block_bytes, block_elems = _core.kv_type_size(kv_type)  # ggml's type traits
    per_elem = block_bytes / block_elems
    return 2 * hp["head_dim"] * hp["n_head_kv"] * per_elem * n_paged_layers


def auto_pool(hp: dict, kv_type: str, n_paged_layers: int, weight_bytes: int, max_ctx: int,
              expect_drafter: bool = False, *, free_bytes: Optional[int] = None,
              cap_tokens: int = AUTO_CAP_TOKENS, device: str = "cpu", extra_bytes: int = 0) -> tuple[int, str]:
    """Pool size for kvflash="auto" and the reason, as the banner prints it.

    CPU: a share of available RAM after the weights and a headroom (plus what the policy
    needs beside the session: ``extra_bytes``, its ``Requirements.extra_bytes``;
    ``expect_drafter=True`` adds a drafter's DRAFTER_RESERVE_BYTES), halved, capped,
    rounded to 256, floor at the minimum pool, never above max_ctx.
    A GPU (device "cuda:N", "vulkan:N"): the same rule over free device memory, which the
    caller passes as free_bytes = Model.device_memory()[0], queried after the weights were
    loaded (so they are not subtracted again); the headroom is for compute buffers
    and the backend's workspaces, plus the policy's reserve.
    """
    floor = _core.min_pool_tokens()
    reserve = int(extra_bytes) + (DRAFTER_RESERVE_BYTES if expect_drafter else 0)
    if is_gpu(device):
        if free_bytes is None:
            raise ValueError(f"auto_pool on {device} needs free_bytes (free device memory after the weights)")
        free = free_bytes
        budget = max(0, free - (512 << 20) - reserve) // 2
        where = f"half of free {device} memory after weights and headroom, {free / 2**20:.0f} MiB free"
    else:
        free = available_ram() if free_bytes is None else free_bytes
        budget = max(0, free - weight_bytes - (1 << 30) - reserve) // 2
        where = "half of free RAM after weights and headroom"
    per_tok = kv_bytes_per_token(hp, kv_type, n_paged_layers)
    tokens = int(budget // per_tok) if per_tok > 0 else cap_tokens
    why = f"{budget / 2**20:.0f} MiB budget ({where})"
    if tokens > cap_tokens:
        tokens, why = cap_tokens, f"capped at {cap_tokens} ({why})"
    tokens = tokens // 256 * 256
    if tokens < floor:
        tokens, why = floor, f"floor {floor} ({why})"
    ctx_cap = (max_ctx + 255) // 256 * 256
    if tokens > ctx_cap:
        tokens, why = max(floor, ctx_cap), f"max_ctx {max_ctx} fits ({why})"
    return tokens, why


def recurrent_reserve(model) -> int:
    """Bytes the recurrent layers' state takes beside the KV (qwen35; 0 without recurrent layers): its rings on
    the device, and its host checkpoints plus the one a snapshot writes.  On the CPU both come out of the same
    RAM; on a GPU the host checkpoints do not, but counting them there only makes the pool smaller."""
    r = model.recurrent_bytes()
    return int(r["state_bytes"] + (r["checkpoints"] + 1) * r["checkpoint_bytes"])


def pool_tokens(model, kvflash, *, kv_type: str, max_ctx: int, chunk_tokens: int, sink_chunks: int,
                tail_window_chunks: int, extra_bytes: int = 0) -> tuple[int, str]:
    """(pool size, auto reason) for Session's kvflash= over a loaded model: 0 is the full cache (None, or "auto"
    when the whole context fits); the reason is "" unless kvflash is "auto"."""
    if kvflash is None:
        return 0, ""
    if kvflash == "auto":
        on_gpu = is_gpu(model.device)
        recr = recurrent_reserve(model)
        pool, why = auto_pool(model.hparams, kv_type, len(model.global_layers), model.weight_bytes, max_ctx,
                              device=model.device, extra_bytes=extra_bytes + recr,
                              free_bytes=model.device_memory()[0] if on_gpu else None)
        if recr:
            why += f"; {recr / 2**20:.1f} MiB kept for the recurrent state and its host checkpoints"
        if pool >= (max_ctx + 255) // 256 * 256:
            pool = 0  # the whole context fits: the full cache is the same thing, minus the paging
        return pool, why
    floor = _core.min_pool_tokens(chunk_tokens, sink_chunks, tail_window_chunks)
    if kvflash < floor:
        raise ValueError(f"kvflash pool of {kvflash} tokens is below the minimum {floor} "
                         f"((sink + tail + 2) chunks of {chunk_tokens}, rounded up to 256)")
    return kvflash, ""


def find_drafter(model_path: Path) -> Optional[Path]:
    """A drafter GGUF next to the model, or in drafter/ or draft/ beside it."""
    here = Path(model_path).parent
    for d in DRAFTER_DIRS:
        cand = sorted((here / d).glob("*.gguf")) if (here / d).is_dir() else []
        if cand:
            return cand[0]
    return None
