"""backend/host_limits.py on fake cgroup trees: limits on the process's own cgroup and on its
ancestors, in cgroup v2 and v1, as containers, pods and systemd units set them."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.host_limits import available_memory_bytes, cgroup_dirs, cpu_quota, usable_cpus

MIB = 2**20


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def v2(tmp_path):
    """A cgroup v2 mount whose process sits in /kubepods/pod1/ctr (cgroupns=host)."""
    root = tmp_path / "v2" / "cgroup"
    _write(root / "cgroup.controllers", "cpu memory\n")
    for d in ("kubepods", "kubepods/pod1", "kubepods/pod1/ctr"):
        (root / d).mkdir(parents=True)
    proc = tmp_path / "v2" / "proc_cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    return root, proc


@pytest.fixture
def v1(tmp_path):
    """A cgroup v1 host, as this CI machine is: memory below the root, cpu,cpuacct co-mounted."""
    root = tmp_path / "v1" / "cgroup"
    (root / "memory" / "process_api" / "abc").mkdir(parents=True)
    (root / "cpu,cpuacct" / "docker" / "c1").mkdir(parents=True)
    proc = tmp_path / "v1" / "proc_cgroup"
    proc.write_text("4:memory:/process_api/abc\n3:cpu,cpuacct:/docker/c1\n1:name=systemd:/\n0::/\n")
    return root, proc


def test_the_own_cgroup_and_its_ancestors_are_read_own_first(v2, v1):
    root, proc = v2
    assert cgroup_dirs("memory", root, proc) == [root, root / "kubepods/pod1/ctr", root / "kubepods/pod1",
                                                 root / "kubepods"]
    root, proc = v1
    assert cgroup_dirs("memory", root, proc) == [root / "memory", root / "memory/process_api/abc",
                                                 root / "memory/process_api"]
    assert cgroup_dirs("cpu", root, proc) == [root / "cpu,cpuacct/docker/c1", root / "cpu,cpuacct/docker",
                                              root / "cpu,cpuacct"]
    assert cgroup_dirs("memory", root, root / "missing") == [root / "memory"]  # no /proc: the roots
    outside = root.parent / "outside"
    outside.write_text("4:memory:/../../..\n")  # a cgroup outside the namespace: never above the mount
    assert cgroup_dirs("memory", root, outside) == [root / "memory"]


def test_memory_is_the_tightest_limit_along_the_hierarchy(v2, v1, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {64 * 1024**2} kB\nMemAvailable: {32 * 1024**2} kB\n")
    root, proc = v2
    dirs = cgroup_dirs("memory", root, proc)
    assert available_memory_bytes(dirs, meminfo) == 32 * 1024 * MIB  # no limit anywhere: MemAvailable
    _write(root / "memory.max", "max\n")
    # the pod's limit, not the container's (none), is what binds; its reclaimable cache counts
    _write(root / "kubepods/pod1/memory.max", f"{512 * MIB}\n")
    _write(root / "kubepods/pod1/memory.current", f"{480 * MIB}\n")
    _write(root / "kubepods/pod1/memory.stat", f"anon {96 * MIB}\nfile {384 * MIB}\ninactive_file {300 * MIB}\n")
    _write(root / "kubepods/pod1/ctr/memory.max", "max\n")
    _write(root / "kubepods/pod1/ctr/memory.current", f"{400 * MIB}\n")
    assert available_memory_bytes(dirs, meminfo) == 332 * MIB  # 512 - 480 + 300
    root, proc = v1
    dirs = cgroup_dirs("memory", root, proc)
    _write(root / "memory/memory.limit_in_bytes", f"{2**63 - 4096}\n")  # v1's "no limit"
    _write(root / "memory/memory.usage_in_bytes", f"{900 * MIB}\n")
    assert available_memory_bytes(dirs, meminfo) == 32 * 1024 * MIB
    _write(root / "memory/process_api/abc/memory.limit_in_bytes", f"{256 * MIB}\n")
    _write(root / "memory/process_api/abc/memory.usage_in_bytes", f"{200 * MIB}\n")
    _write(root / "memory/process_api/abc/memory.stat", f"total_inactive_file {100 * MIB}\n")
    assert available_memory_bytes(dirs, meminfo) == 156 * MIB  # 256 - 200 + 100
    assert available_memory_bytes([], tmp_path / "no_meminfo") is None  # not Linux: nothing known


def test_a_cpu_quota_caps_the_usable_cpus(v2, v1):
    root, proc = v2
    dirs = cgroup_dirs("cpu", root, proc)
    assert cpu_quota(dirs) is None and usable_cpus(dirs, affinity=16) == 16
    _write(root / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    _write(root / "kubepods/pod1/cpu.max", "250000 100000\n")  # --cpus 2.5 on the pod
    assert cpu_quota(dirs) == 2.5 and usable_cpus(dirs, affinity=16) == 3
    assert usable_cpus(dirs, affinity=2) == 2  # the affinity mask binds first
    _write(root / "kubepods/pod1/ctr/cpu.max", "50000 100000\n")
    assert usable_cpus(dirs, affinity=16) == 1  # half a CPU still runs one thread
    root, proc = v1
    dirs = cgroup_dirs("cpu", root, proc)
    _write(root / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cpu_quota(dirs) is None
    _write(root / "cpu,cpuacct/docker/c1/cpu.cfs_quota_us", "200000\n")
    _write(root / "cpu,cpuacct/docker/c1/cpu.cfs_period_us", "100000\n")
    assert usable_cpus(dirs, affinity=16) == 2


def test_the_server_thread_default_and_warning_follow_the_quota():
    from backend.triton_io import oversubscribed_threads, server_torch_threads

    assert server_torch_threads(cores=3) == 2 and server_torch_threads(cores=1) == 1
    assert oversubscribed_threads(3, cores=2) is not None
    # this host's own reading: at least one CPU, no more than its affinity mask
    import os

    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))
