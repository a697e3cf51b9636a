"""What this process may use of the machine: cores and memory, container limits included.

A container sees the host's CPUs in ``/proc/cpuinfo`` and its RAM in ``/proc/meminfo``;
what it may use is narrower: the CPU affinity mask, the cgroup's CPU quota and its memory
limit.  Every probe takes ``root`` (normally ``/``) so tests can point it at a fake tree.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterator, Optional, Union

PathLike = Union[str, os.PathLike]
_NO_LIMIT = 1 << 60          # cgroup v1 writes "unlimited" as a page-rounded 2^63 - 1
_FALLBACK_RAM = 4 << 30      # when nothing can be read


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def physical_cores(root: PathLike = "/") -> int:
    """Physical cores of the machine (not hyper-threads); ggml's CPU kernels scale with these."""
    text = _read(Path(root) / "proc/cpuinfo")
    cores = set()
    if text:
        phys = core = None
        for line in text.splitlines() + [""]:
            if line.startswith("physical id"):
                phys = line.split(":")[1].strip()
            elif line.startswith("core id"):
                core = line.split(":")[1].strip()
            elif not line.strip():
                if core is not None:
                    cores.add((phys, core))
                phys = core = None
    n_cpu = os.cpu_count() or 1
    return max(1, min(len(cores), n_cpu) if cores else n_cpu)


def cgroup_dirs(controller: str, root: PathLike = "/") -> Iterator[Path]:
    """The cgroup directories whose limits bind this process for ``controller``
    ("cpu" or "memory"), innermost first: its own group and every ancestor, in the
    v2 hierarchy and in the v1 hierarchy that carries the controller."""
    root = Path(root)
    text = _read(root / "proc/self/cgroup") or ""
    seen = set()
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, rel = parts
        if hid == "0" and ctrls == "":
            bases = [root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified"]
        elif controller in ctrls.split(","):
            bases = [root / "sys/fs/cgroup" / ctrls, root / "sys/fs/cgroup" / controller]
        else:
            continue
        for base in bases:
            rel_parts = [p for p in rel.strip().split("/") if p]
            for depth in range(len(rel_parts), -1, -1):
                d = base.joinpath(*rel_parts[:depth])
                if d not in seen and d.is_dir():
                    seen.add(d)
                    yield d


def cpu_quota(root: PathLike = "/") -> Optional[float]:
    """CPUs the cgroup quota allows (quota / period, the tightest level), None without a quota."""
    best = None
    for d in cgroup_dirs("cpu", root):
        quota = period = None
        v2 = _read(d / "cpu.max")
        if v2 is not None:
            fields = v2.split()
            if len(fields) == 2 and fields[0] != "max":
                quota, period = fields
        else:
            quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        try:
            q, p = int(quota), int(period)
        except (TypeError, ValueError):
            continue
        if q > 0 and p > 0:
            best = q / p if best is None else min(best, q / p)
    return best


def usable_cores(root: PathLike = "/", *, affinity: Optional[int] = None) -> int:
    """Cores this process can keep busy: the CPUs of its affinity mask, capped by the cgroup
    CPU quota (rounded up) and by the physical cores.  ``affinity`` overrides the mask (tests)."""
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            affinity = os.cpu_count() or 1
    n = min(affinity, physical_cores(root))
    quota = cpu_quota(root)
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)


def cgroup_memory_available(root: PathLike = "/") -> Optional[int]:
    """Bytes the cgroup memory limit leaves (limit minus usage, the tightest level), None without a limit."""
    best = None
    for d in cgroup_dirs("memory", root):
        for limit_f, usage_f in (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            text = _read(d / limit_f)
            if text is None:
                continue
            try:
                limit = int(text.strip())
            except ValueError:  # "max"
                break
            if limit >= _NO_LIMIT:
                break
            try:
                usage = int((_read(d / usage_f) or "0").strip())
            except ValueError:
                usage = 0
            left = max(0, limit - usage)
            best = left if best is None else min(best, left)
            break
    return best


def meminfo_available(root: PathLike = "/") -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes, None when it cannot be read."""
    for line in (_read(Path(root) / "proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def available_ram(root: PathLike = "/") -> int:
    """Bytes of RAM this process can still take: the cgroup's room first, never more than
    the machine's MemAvailable; 4 GiB when neither can be read."""
    known = [v for v in (cgroup_memory_available(root), meminfo_available(root)) if v is not None]
    return min(known) if known else _FALLBACK_RAM
