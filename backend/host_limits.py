"""What this process may use of its host: CPUs and memory, as a container's limits set them.

A container's limits live in cgroups: the CPU quota (`docker --cpus`, a Kubernetes CPU limit) and
the memory limit (`--memory`, systemd's `MemoryMax=`). The CPU affinity mask and /proc/meminfo
show the host's cores and memory, so sizing by them alone oversubscribes a limited container:
torch threads past the quota wait at every parallel region's barrier while the kernel throttles
them, and a KV pool past the memory limit ends in the OOM killer.

A limit may be set on the process's own cgroup or on any ancestor (a pod's limit sits above its
container's; under `cgroupns=host` the own cgroup is deep below the mount's root), and the
tightest applies. So each reading walks from the own cgroup, as /proc/self/cgroup names it, up to
the mount's root, for cgroup v2 and v1 alike.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")

# v1 writes "no limit" as a huge number (the largest page-aligned int64)
_NO_LIMIT = 2**60


def cgroup_dirs(controller: str, root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> list[Path]:
    """The cgroup directories whose limits on `controller` ("memory" or "cpu") apply to this
    process: its own and every ancestor up to the mount's root, in cgroup v2's unified hierarchy
    and v1's hierarchy of that controller. The roots are always included (a container with its
    own cgroup namespace sees its cgroup there); directories that do not exist are left out."""
    unified = root if (root / "cgroup.controllers").exists() else root / "unified"
    bases: list[tuple[Path, str]] = [(unified, "/"), (root / controller, "/")]
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if ".." in path.split("/"):
            # a cgroup outside this namespace's root (/proc shows it as ../..): not under the mount
            continue
        if controllers == "":
            bases.append((unified, path))
        elif controller in controllers.split(","):
            # v1 mounts co-mounted controllers as one directory ("cpu,cpuacct"), usually with a
            # link per controller; either name finds it.
            joined = root / controllers
            bases.append((joined if joined.is_dir() else root / controller, path))
    found: list[Path] = []
    for base, path in bases:
        own = base / path.strip("/")
        for d in (own, *own.parents):
            if d.is_dir() and d not in found:
                found.append(d)
            if d == base:
                break
    return found


def _read_int(file: Path) -> Optional[int]:
    try:
        return int(file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stat_field(file: Path, name: str) -> int:
    try:
        for line in file.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def available_memory_bytes(dirs: Optional[list[Path]] = None, meminfo: Path = MEMINFO) -> Optional[int]:
    """MemAvailable, or less where a cgroup memory limit leaves less; None where neither can be
    read (not Linux). A cgroup's usage counts file cache the kernel reclaims before failing an
    allocation (the model files read at a restart in the same container): its inactive part is
    counted as available, as MemAvailable counts it."""
    found: list[int] = []
    try:
        found += [int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()
                  if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for d in cgroup_dirs("memory") if dirs is None else dirs:
        for limit_name, usage_name, cache_field in (("memory.max", "memory.current", "inactive_file"),
                                                    ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                     "total_inactive_file")):
            limit, usage = _read_int(d / limit_name), _read_int(d / usage_name)  # v2's "max": no limit
            if limit is None or usage is None or limit >= _NO_LIMIT:
                continue
            found.append(limit - usage + _stat_field(d / "memory.stat", cache_field))
    return min(found) if found else None


def cpu_quota(dirs: Optional[list[Path]] = None) -> Optional[float]:
    """The CPUs' worth of time a cgroup CPU quota allows (2.5 for `--cpus 2.5`), the tightest
    along the hierarchy; None without one."""
    quotas: list[float] = []
    for d in cgroup_dirs("cpu") if dirs is None else dirs:
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "150000 100000"
            if quota != "max" and int(period) > 0:
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
        quota_us, period_us = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")  # v1: -1 none
        if quota_us is not None and quota_us > 0 and period_us:
            quotas.append(quota_us / period_us)
    return min(quotas) if quotas else None


def usable_cpus(dirs: Optional[list[Path]] = None, affinity: Optional[int] = None) -> int:
    """The CPUs this process can keep busy: those its affinity mask allows, capped by its cgroup
    CPU quota rounded up (a quota of 1.5 CPUs keeps two threads busy part of the time)."""
    cores = affinity if affinity is not None else len(os.sched_getaffinity(0))
    quota = cpu_quota(dirs)
    return max(1, min(cores, math.ceil(quota)) if quota is not None else cores)
