"""kvflash.system over fake /proc and cgroup trees: cores from the affinity mask, the
cgroup CPU quota (v2 cpu.max, v1 cfs quota/period) and the physical cores; RAM from the
cgroup limit (v2 memory.max, v1 memory.limit_in_bytes) before /proc/meminfo."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Loaded from its file: the module needs neither the native extension nor the package.
_spec = importlib.util.spec_from_file_location(
    "kvflash_system", Path(__file__).resolve().parents[1] / "python" / "kvflash" / "system.py")
system = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(system)

GIB = 1 << 30


def cpuinfo(n_phys: int, threads_per_core: int = 1) -> str:
    blocks = []
    for c in range(n_phys):
        for _ in range(threads_per_core):
            blocks.append(f"processor\t: {len(blocks)}\nphysical id\t: 0\ncore id\t\t: {c}\n")
    return "\n".join(blocks) + "\n"


def make_root(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_no_limits_affinity_and_physical_cores(tmp_path):
    root = make_root(tmp_path, {"proc/cpuinfo": cpuinfo(4, threads_per_core=2), "proc/self/cgroup": "0::/\n"})
    assert system.physical_cores(root) == min(4, system.os.cpu_count())
    assert system.cpu_quota(root) is None
    assert system.usable_cores(root, affinity=1) == 1
    assert system.usable_cores(root, affinity=64) == system.physical_cores(root)  # never above physical


def test_cgroup_v2_cpu_max(tmp_path, monkeypatch):
    monkeypatch.setattr(system.os, "cpu_count", lambda: 16)
    root = make_root(tmp_path, {
        "proc/cpuinfo": cpuinfo(16),
        "proc/self/cgroup": "0::/box/job\n",
        "sys/fs/cgroup/box/cpu.max": "400000 100000\n",       # the parent: 4 CPUs
        "sys/fs/cgroup/box/job/cpu.max": "150000 100000\n",   # the job: 1.5 CPUs, the tighter
    })
    assert system.cpu_quota(root) == pytest.approx(1.5)
    assert system.usable_cores(root, affinity=16) == 2       # rounded up
    (root / "sys/fs/cgroup/box/job/cpu.max").write_text("max 100000\n")
    assert system.cpu_quota(root) == pytest.approx(4.0)
    assert system.usable_cores(root, affinity=3) == 3


def test_cgroup_v1_cfs_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(system.os, "cpu_count", lambda: 8)
    root = make_root(tmp_path, {
        "proc/cpuinfo": cpuinfo(8),
        "proc/self/cgroup": "4:memory:/\n3:cpu,cpuacct:/docker/abc\n0::/\n",
        "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
        "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    })
    assert system.cpu_quota(root) == pytest.approx(3.0)
    assert system.usable_cores(root, affinity=8) == 3
    (root / "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("-1\n")
    assert system.cpu_quota(root) is None
    assert system.usable_cores(root, affinity=8) == 8


def test_memory_cgroup_v2_before_meminfo(tmp_path):
    root = make_root(tmp_path, {
        "proc/meminfo": f"MemTotal: {64 * GIB // 1024} kB\nMemAvailable: {32 * GIB // 1024} kB\n",
        "proc/self/cgroup": "0::/job\n",
        "sys/fs/cgroup/job/memory.max": f"{8 * GIB}\n",
        "sys/fs/cgroup/job/memory.current": f"{3 * GIB}\n",
    })
    assert system.meminfo_available(root) == 32 * GIB
    assert system.available_ram(root) == 5 * GIB             # the cgroup's room, not the machine's
    (root / "sys/fs/cgroup/job/memory.max").write_text("max\n")
    assert system.available_ram(root) == 32 * GIB
    (root / "sys/fs/cgroup/job/memory.max").write_text(f"{64 * GIB}\n")
    assert system.available_ram(root) == 32 * GIB            # never more than MemAvailable


def test_memory_cgroup_v1(tmp_path):
    root = make_root(tmp_path, {
        "proc/meminfo": f"MemAvailable: {16 * GIB // 1024} kB\n",
        "proc/self/cgroup": "4:memory:/process/x\n1:cpu:/\n",
        "sys/fs/cgroup/memory/process/x/memory.limit_in_bytes": "9223372036854771712\n",  # unlimited
        "sys/fs/cgroup/memory/process/memory.limit_in_bytes": f"{2 * GIB}\n",          # the parent binds
        "sys/fs/cgroup/memory/process/memory.usage_in_bytes": f"{GIB // 2}\n",
    })
    assert system.available_ram(root) == GIB + GIB // 2


def test_nothing_readable(tmp_path):
    assert system.available_ram(tmp_path) == 4 * GIB
    assert system.cpu_quota(tmp_path) is None
    assert system.usable_cores(tmp_path, affinity=1) == 1
