"""Value checks at the Python boundary: Session's arguments and the validators the snapshot's JSON and the
policies' saved settings are held to.  Every refusal is a ValueError naming the argument (STYLE.md 3: a
GGML_ASSERT reached from bad input would abort the interpreter)."""
from __future__ import annotations

from . import _core

MAX_DRAFT = _core.MAX_DRAFT   # drafts per exact-mode round, at most (the core's kMaxDraft)
MAX_CONTEXT = _core.MAX_CONTEXT   # positions a session holds, at most (the core's kMaxContext)
KV_TYPES = ("f16", "q8_0", "q4_0")


def is_int(v, lo=None, hi=None) -> bool:
    """An int (not a bool) in [lo, hi] (a bound of None: open)."""
    return isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo) and (hi is None or v <= hi)


def int_in(lo=None, hi=None):
    return lambda v: is_int(v, lo, hi)


def opt_int(lo=None, hi=None):
    return lambda v: v is None or is_int(v, lo, hi)


def one_of(*vals):
    return lambda v: isinstance(v, str) and v in vals


def is_bool(v) -> bool:
    return isinstance(v, bool)


def check_session_args(*, kv_type, threads, max_host_bytes, exact, exact_prefill, exact_draft, tau, kvflash,
                       reeval_tokens, prefill_rescore=0, prefill_reread=False, exact_prefill_until=None) -> None:
    """Session's arguments that need no model to check."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type must be 'f16', 'q8_0' or 'q4_0', got {kv_type!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if max_host_bytes is not None and not is_int(max_host_bytes, 1):
        raise ValueError(f"max_host_bytes must be a positive integer (bytes) or None (no cap), got {max_host_bytes!r}")
    if not isinstance(exact, bool):
        raise ValueError(f"exact must be True or False, got {exact!r}")
    if not isinstance(exact_prefill, bool) and exact_prefill != "auto":
        raise ValueError(f"exact_prefill must be True, False or 'auto' (on where the model's paged layers are few, "
                         f"up to Model.auto_exact_prefill_until), got {exact_prefill!r}")
    if exact_prefill_until is not None and not is_int(exact_prefill_until, 0, MAX_CONTEXT):
        raise ValueError(f"exact_prefill_until must be None or an integer in [0, {MAX_CONTEXT}] (the position where "
                         f"exact prefill stops; 0: no cap), got {exact_prefill_until!r}")
    if exact_draft is not None and not is_int(exact_draft, 0, MAX_DRAFT):
        raise ValueError(f"exact_draft must be None (adaptive) or an integer in [0, {MAX_DRAFT}] (drafts per "
                         f"round), got {exact_draft!r}")
    if not isinstance(tau, int) or tau < 1:
        raise ValueError(f"tau must be a positive integer (decoded tokens between rescores), got {tau!r}")
    if kvflash is not None and kvflash != "auto" and not is_int(kvflash):
        raise ValueError(f"kvflash must be 'auto', an integer pool size in tokens, or None, got {kvflash!r}")
    if not isinstance(reeval_tokens, int) or reeval_tokens < 1:
        raise ValueError(f"reeval_tokens must be a positive integer, got {reeval_tokens!r}")
    if not is_int(prefill_rescore, 0):
        raise ValueError(f"prefill_rescore must be an integer >= 0 (pooled prefill pieces between qk rescores; 0: "
                         f"none), got {prefill_rescore!r}")
    if not isinstance(prefill_reread, bool):
        raise ValueError(f"prefill_reread must be True or False, got {prefill_reread!r}")


def check_max_ctx(max_ctx, n_ctx_train: int, allow_long_ctx: bool) -> None:
    if not is_int(max_ctx, 1):
        raise ValueError(f"max_ctx must be a positive integer, got {max_ctx!r}")
    _core.check_max_ctx(max_ctx)  # the core's one size guard, before anything is sized from max_ctx
    if max_ctx > n_ctx_train and not allow_long_ctx:
        raise ValueError(f"max_ctx {max_ctx} is above the {n_ctx_train} tokens this model was trained "
                         f"for; lower it, or pass allow_long_ctx=True to run past the trained context")


def check_prefill_piece(prefill_piece, pool: int, chunk_tokens: int, sink_chunks: int, tail_window_chunks: int):
    """prefill_piece: the tokens a prompt's eval takes at a time once the pool is full (None: one chunk)."""
    if prefill_piece is None:
        return
    room = pool - (sink_chunks + tail_window_chunks + 1) * chunk_tokens
    if not is_int(prefill_piece, 1) or prefill_piece % chunk_tokens:
        raise ValueError(f"prefill_piece must be a positive multiple of chunk_tokens ({chunk_tokens}), "
                         f"got {prefill_piece!r}")
    if pool > 0 and prefill_piece > room:
        raise ValueError(f"prefill_piece {prefill_piece} does not fit the pool's evictable room of {room} "
                         f"tokens (pool minus sink, tail window and the open chunk)")


def check_exact_device(device: str, exact: bool, exact_prefill: bool, prefill_reread: bool = False) -> None:
    if exact and not str(device).startswith("cpu"):
        raise ValueError(f"exact=True verifies on the CPU backend (its attention reads the host store in place); "
                         f"the model is on {device}: use device='cpu'")
    if exact_prefill is True and not str(device).startswith("cpu"):
        raise ValueError(f"exact_prefill=True reads the host store in place on the CPU backend; the model is on "
                         f"{device}: use device='cpu'")
    if prefill_reread and not str(device).startswith("cpu"):
        raise ValueError(f"prefill_reread=True reads chunks again over the host store on the CPU backend; the model "
                         f"is on {device}: use device='cpu'")


def rpc_args(rpc, tensor_split):
    """rpc= and tensor_split= as the core takes them: ([endpoint, ...], [weight, ...]), checked."""
    if rpc is None:
        rpc = []
    elif isinstance(rpc, str):
        rpc = [e for e in rpc.split(",") if e]
    else:
        rpc = list(rpc)
    if not all(isinstance(e, str) for e in rpc):
        raise ValueError(f"rpc must be 'host:port' strings (or one comma-separated string), got {rpc!r}")
    for e in rpc:
        _core.check_rpc_endpoint(e)
    if tensor_split is None:
        split = []
    else:
        if isinstance(tensor_split, str):
            tensor_split = [x for x in tensor_split.split(",") if x]
        try:
            split = [float(x) for x in tensor_split]
        except (TypeError, ValueError):
            raise ValueError(f"tensor_split must be numbers (one weight per rpc endpoint, and optionally one more for "
                             f"this process), got {tensor_split!r}") from None
        if not rpc:
            raise ValueError("tensor_split needs rpc endpoints to split the layers over")
    return rpc, split


def check_generate_args(max_tokens, temperature, top_p, min_p, stop) -> list[str]:
    """generate()'s sampling arguments; returns the stop strings as a list."""
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
    if not (temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if not (0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not (0 <= min_p < 1):
        raise ValueError(f"min_p must be in [0, 1), got {min_p!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError("stop must be a non-empty string or a list of them")
    return stops
