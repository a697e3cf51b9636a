"""Command-line values the CLI and the server both parse (a module of its own: neither imports the other)."""


def pool_arg(value: str):
    """--kvflash: an integer pool size, 'auto', or 'off' (the full cache: None)."""
    if value in ("off", "none", "full"):
        return None
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"kvflash: --kvflash must be an integer, 'auto' or 'off', got {value!r}") from None


def exact_prefill_arg(value):
    """--kvflash-exact-prefill: 'on' (or the flag alone), 'off', 'auto' -> Session's True, False, 'auto'."""
    if isinstance(value, bool):
        return value
    if value in ("on", "off", "auto"):
        return {"on": True, "off": False}.get(value, "auto")
    raise SystemExit(f"kvflash: --kvflash-exact-prefill must be 'on', 'off' or 'auto', got {value!r}")


def chunk_tokens_arg(value: str):
    """--kvflash-chunk-tokens (an argparse type): 'auto' (by the pool's size) or a chunk size in tokens."""
    import argparse
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer (a divisor of 256 or a multiple of "
                                         f"it), got {value!r}")
    return n
