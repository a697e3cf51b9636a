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
