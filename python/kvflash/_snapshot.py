"""The checks a snapshot's session state meets before Session.load builds from it.  The session's JSON is the
core's to write and check (csrc/kvflash/session_file.h: every field's type and range, the built-in policies'
settings, the agreement with the cache's header, the same for the C API); what is Python's own is a user
policy's saved settings, held to the schema its name was registered with (kvflash.policies.register_policy)."""
from __future__ import annotations

import json
import os
from typing import Optional

from . import _core
from ._checks import is_int
from .policies import policy_entry

SNAPSHOT_APP_VERSION = _core.SESSION_LAYOUT   # the layout of the session's own JSON (the core's kSessionLayout)

_ANY = lambda v: True   # noqa: E731


def max_bytes_arg(max_bytes: Optional[int]) -> int:
    """max_bytes as the core takes it (0: no cap of the caller's), checked."""
    if max_bytes is not None and not is_int(max_bytes, 1):
        raise ValueError(f"max_bytes must be a positive integer (bytes) or None (no cap of yours), got {max_bytes!r}")
    return max_bytes or 0


def existing(path) -> str:
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"snapshot {p} does not exist")
    return p


def peek(path, max_bytes: Optional[int] = None) -> tuple[dict, dict]:
    """(header, session state) of a snapshot from small reads: the core checks the file's structure, caps and
    the session's JSON against the header; a user policy's settings are checked here."""
    p = existing(path)
    head, app_json = _core.Snapshot.peek_session(p, None, max_bytes_arg(max_bytes), f"snapshot {p}")
    app = json.loads(app_json)
    check_user_policy(app["policy"], p)
    return head, app


def check_user_policy(pol: dict, path) -> None:
    """A policy the core does not know (not lru, qk or the drafter) against the registry: saved settings need a
    policy registered under that name, and they must be what it was registered with (SnapshotError)."""
    if pol["name"] == "lru" or "qk" in pol or "drafter" in pol:
        return

    def bad(why):
        return _core.SnapshotError(f"snapshot {os.fspath(path)}: its session state is malformed: {why}")

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
