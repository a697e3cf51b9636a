"""``kvflash rpc-server``: lend this machine's CPU to a kvflash client over ggml's RPC protocol.

The server is ggml's own (``ggml_backend_rpc_start_server`` from the pinned ggml kvflash is built with),
so a client's layers run on it as on a local ggml device.  The protocol has no authentication and no
encryption: whoever reaches the port can allocate memory and run graphs.  It binds loopback by default;
another address needs ``--allow-remote`` and belongs on a trusted network only.
"""
from __future__ import annotations

import ipaddress
import os
import sys

LOOPBACK_NAMES = {"localhost"}


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def serve(args) -> int:
    """The ``rpc-server`` subcommand (argparse namespace from cli.py)."""
    from . import _core
    if not is_loopback(args.host) and not args.allow_remote:
        raise SystemExit(f"kvflash rpc-server: {args.host} is not loopback; ggml's RPC protocol has no authentication, "
                         "so serving beyond this machine needs --allow-remote (trusted networks only)")
    if not 1 <= args.port <= 65535:
        raise SystemExit(f"kvflash rpc-server: --port must be in [1, 65535], got {args.port}")
    threads = args.threads or os.cpu_count() or 1
    if threads < 1:
        raise SystemExit("kvflash rpc-server: --threads must be >= 1")
    if args.cache_dir is not None and not os.path.isdir(args.cache_dir):
        raise SystemExit(f"kvflash rpc-server: --cache-dir {args.cache_dir} is not a directory")
    ep = endpoint(args.host, args.port)
    if not is_loopback(args.host):
        print(f"kvflash rpc-server: WARNING: serving {ep} without authentication", file=sys.stderr)
    sys.stdout.flush()
    try:
        _core.rpc_serve(ep, threads, args.cache_dir or "")
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"kvflash rpc-server: {e}") from None
    return 0
