"""The session's own JSON inside a snapshot (its APPS section) and the reads that check a file before it is
trusted.  Self-contained on purpose (the writing and checking are to move into the core): ``app_bytes`` builds
what ``Session.save`` hands the core, ``check_app`` holds what a file says to every field's type and range and
to the core's header, ``peek`` / ``read`` are the two phases of a load."""
from __future__ import annotations

import json
import os
from typing import Optional

from . import _core
from ._checks import MAX_DRAFT, KV_TYPES, int_in, is_bool, is_int, one_of, opt_int
from .policies import policy_entry

SNAPSHOT_APP_VERSION = 2   # the layout of the session's own JSON inside a snapshot (its APPS section); 2: no paths

_I32 = 2**31 - 1
# Every field of the session's JSON (app_bytes writes exactly these), with the values load/restore accept.
_APP_CONFIG = {
    "max_ctx": int_in(1, _core.MAX_CONTEXT), "kvflash": opt_int(1, _core.MAX_CONTEXT), "tau": int_in(1, _I32),
    "kv_type": one_of(*KV_TYPES), "chunk_tokens": int_in(1, 4096), "sink_chunks": int_in(0, _I32),
    "tail_window_chunks": int_in(0, _I32), "ubatch": int_in(1, _I32), "reeval_tokens": int_in(1, _I32),
    "seed": opt_int(0, 2**64 - 1), "allow_long_ctx": is_bool, "exact": is_bool,
    "exact_draft": opt_int(0, MAX_DRAFT), "exact_prefill": is_bool,
}
_APP_STATE = {"since_rescore": int_in(0, 2**63 - 1), "rescores": int_in(0, 2**63 - 1),
              "last_scores": lambda v: v is None or isinstance(v, list)}
_ANY = lambda v: True   # noqa: E731  (a field checked on its own below)


def app_bytes(config: dict, policy: dict, since_rescore: int, rescores: int, last_scores) -> bytes:
    """The session's JSON: its construction settings, the policy's spec (policies.policy_spec) and the rescore
    counters.  No paths: the model and a drafter are whoever loads it's to give (the header names the model's
    fingerprint)."""
    app = {"kvflash_session": SNAPSHOT_APP_VERSION, "config": config, "policy": policy,
           "state": {"since_rescore": since_rescore, "rescores": rescores,
                     "last_scores": None if last_scores is None else [float(x) for x in last_scores]}}
    return json.dumps(app).encode()


def check_max_bytes(max_bytes) -> None:
    if max_bytes is not None and not is_int(max_bytes, 1):
        raise ValueError(f"max_bytes must be a positive integer (bytes) or None (no cap of yours), got {max_bytes!r}")


def _existing(path) -> str:
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"snapshot {p} does not exist")
    return p


def read(path, runtime=None, max_bytes: Optional[int] = None):
    """The core's Snapshot of path, checked against runtime (its geometry caps the file) and max_bytes."""
    p = _existing(path)
    check_max_bytes(max_bytes)
    return _core.Snapshot.read(p, runtime=runtime, max_bytes=max_bytes or 0)


def peek(path, runtime=None, max_bytes: Optional[int] = None):
    """(header, app bytes, checked session state) of a snapshot, from small reads (Snapshot.peek; runtime's
    geometry and max_bytes cap the file's size)."""
    p = _existing(path)
    check_max_bytes(max_bytes)
    head, blob = _core.Snapshot.peek(p, runtime=runtime, max_bytes=max_bytes or 0)
    return head, blob, check_app(blob, head, path)


def check_app(blob: bytes, head: dict, path) -> dict:
    """The session's JSON from a snapshot's APPS section, every field Session.load and restore use held to its
    type and range and to the core's header (SnapshotError naming the first that is not); the policy's settings
    to the schema its name was registered with.  Nothing in it names a file."""
    where = f"snapshot {os.fspath(path)}"

    def bad(why):
        return _core.SnapshotError(f"{where}: its session state is malformed: {why}")

    try:
        app = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _core.SnapshotError(f"{where} holds no kvflash Session state (it was not written by Session.save)") \
            from None
    if not isinstance(app, dict) or "kvflash_session" not in app:
        raise _core.SnapshotError(f"{where} holds no kvflash Session state (it was not written by Session.save)")
    if app["kvflash_session"] != SNAPSHOT_APP_VERSION:
        raise _core.SnapshotError(f"{where} holds Session state of layout {app['kvflash_session']!r}; this kvflash "
                                  f"reads layout {SNAPSHOT_APP_VERSION}")

    def fields(d, spec, what):
        if not isinstance(d, dict):
            raise bad(f"{what} is not an object")
        if set(d) != set(spec):
            extra, missing = sorted(set(d) - set(spec)), sorted(set(spec) - set(d))
            raise bad(f"{what} has " + ("unknown field(s) " + ", ".join(map(repr, extra)) if extra else
                                        "no field(s) " + ", ".join(map(repr, missing))))
        for k, ok in spec.items():
            if not ok(d[k]):
                raise bad(f"{what}.{k} = {d[k]!r} is out of range or of the wrong type")

    fields(app, {"kvflash_session": _ANY, "config": _ANY, "policy": _ANY, "state": _ANY}, "the session state")
    fields(app["config"], _APP_CONFIG, "config")
    cfg, st, pol = app["config"], app["state"], app["policy"]
    fields(st, _APP_STATE, "state")
    n_chunks = -(-head["max_ctx"] // head["chunk_tokens"])
    ls = st["last_scores"]
    if ls is not None and (len(ls) > n_chunks or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                         and x == x for x in ls)):
        raise bad(f"state.last_scores is not a list of at most {n_chunks} numbers")
    if not isinstance(pol, dict) or not isinstance(pol.get("name"), str) or not 0 < len(pol["name"]) <= 200:
        raise bad("policy has no name")
    entry = policy_entry(pol["name"])
    if entry is None and set(pol) - {"name", "custom"}:
        raise bad(f"policy {pol['name']!r} saved settings but no policy of that name is registered here "
                  f"(kvflash.policies.register_policy it before loading)")
    if "custom" in pol or entry is None:   # settings not saved: the loader passes policy=
        fields(pol, {"name": _ANY, "custom": lambda v: v is True}, "policy")
    elif entry.settings is None:
        fields(pol, {"name": _ANY}, "policy")
    else:
        fields(pol, {"name": _ANY, entry.key: _ANY}, "policy")
        fields(pol[entry.key], entry.settings, f"policy.{entry.key}")
    # What builds the session must be what the core's header says the cache is.
    for k in ("max_ctx", "kv_type", "chunk_tokens", "sink_chunks", "tail_window_chunks"):
        if cfg[k] != head[k]:
            raise bad(f"config.{k} = {cfg[k]!r} but the cache's header has {head[k]!r}")
    if (cfg["kvflash"] is None) != bool(head["full_cache"]) or (
            cfg["kvflash"] is not None and cfg["kvflash"] != head["pool_tokens"]):
        raise bad(f"config.kvflash = {cfg['kvflash']!r} but the cache's header has a "
                  + ("full cache" if head["full_cache"] else f"pool of {head['pool_tokens']} tokens"))
    return app
