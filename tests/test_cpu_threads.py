"""CPU quota / affinity detection (cpu_threads) from fake /proc and cgroup trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.model.layers import cpu_threads


def fake_host(tmp_path: Path, mountinfo: list[str], cgroup: list[str], files: dict[str, str]) -> Path:
    """A proc dir (mountinfo, cgroup) whose mount points are under tmp_path/fs; returns the proc dir."""
    proc = tmp_path / "proc"
    proc.mkdir()
    fs = tmp_path / "fs"
    (proc / "mountinfo").write_text("".join(line.replace("@", str(fs)) + "\n" for line in mountinfo))
    (proc / "cgroup").write_text("".join(line + "\n" for line in cgroup))
    for rel, text in files.items():
        f = fs / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    return proc


V2_MOUNT = "35 24 0:30 / @/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate"


def test_v2_quota(tmp_path):
    proc = fake_host(tmp_path, [V2_MOUNT], ["0::/"], {"cgroup/cpu.max": "150000 100000"})
    assert cpu_threads.cgroup_cpu_limit(proc) == pytest.approx(1.5)
    assert cpu_threads.available_cpus(proc, affinity=16) == 2  # rounded up
    assert cpu_threads.available_cpus(proc, affinity=1) == 1  # affinity is tighter


def test_v2_unlimited_and_missing(tmp_path):
    proc = fake_host(tmp_path, [V2_MOUNT], ["0::/"], {"cgroup/cpu.max": "max 100000"})
    assert cpu_threads.cgroup_cpu_limit(proc) is None
    assert cpu_threads.available_cpus(proc, affinity=8) == 8
    empty = tmp_path / "nothing"
    empty.mkdir()
    assert cpu_threads.cgroup_cpu_limit(empty) is None  # no mountinfo: not Linux, no limit
    assert cpu_threads.available_cpus(empty, affinity=3) == 3


def test_v2_nested_tightest_wins(tmp_path):
    # A host view: the process sits in /system.slice/app.service; its parent slice has the tighter quota.
    proc = fake_host(tmp_path, [V2_MOUNT], ["0::/system.slice/app.service"], {
        "cgroup/cpu.max": "max 100000",
        "cgroup/system.slice/cpu.max": "50000 100000",
        "cgroup/system.slice/app.service/cpu.max": "300000 100000",
    })
    assert cpu_threads.cgroup_cpu_limit(proc) == pytest.approx(0.5)
    assert cpu_threads.available_cpus(proc, affinity=4) == 1  # never below one


def test_v2_container_view(tmp_path):
    # /proc/self/cgroup names a host path the container's mount does not show: read the mount's root.
    proc = fake_host(tmp_path, ["40 30 0:31 /kubepods/pod1/abc @/cgroup rw - cgroup2 cgroup2 rw"],
                     ["0::/../other"], {"cgroup/cpu.max": "200000 100000"})
    assert cpu_threads.cgroup_cpu_limit(proc) == pytest.approx(2.0)


def test_v1_quota(tmp_path):
    mounts = [
        "30 25 0:26 / @/cgroup/memory rw - cgroup cgroup rw,memory",
        "31 25 0:27 / @/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct",
    ]
    cg = ["9:memory:/docker/abc", "4:cpu,cpuacct:/docker/abc", "0::/"]
    proc = fake_host(tmp_path, mounts, cg, {
        "cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1",
        "cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
        "cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000",
        "cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        "cgroup/memory/docker/abc/cpu.cfs_quota_us": "1000",  # not the cpu hierarchy: ignored
    })
    assert cpu_threads.cgroup_cpu_limit(proc) == pytest.approx(1.0)
    assert cpu_threads.available_cpus(proc, affinity=2) == 1


def test_v1_unlimited_hybrid(tmp_path):
    # This machine's layout: v1 controllers plus an empty v2 hierarchy at cgroup/unified.
    mounts = [
        "28 25 0:24 / @/cgroup/unified rw - cgroup2 cgroup2 rw",
        "31 25 0:27 / @/cgroup/cpu rw - cgroup cgroup rw,cpu",
    ]
    proc = fake_host(tmp_path, mounts, ["1:cpu:/", "0::/"], {
        "cgroup/cpu/cpu.cfs_quota_us": "-1", "cgroup/cpu/cpu.cfs_period_us": "100000",
        "cgroup/unified/cgroup.procs": "",
    })
    assert cpu_threads.cgroup_cpu_limit(proc) is None
    assert cpu_threads.available_cpus(proc, affinity=2) == 2


def test_mount_point_with_space(tmp_path):
    proc = fake_host(tmp_path, [r"35 24 0:30 / @/my\040cgroup rw - cgroup2 cgroup2 rw"], ["0::/"],
                     {"my cgroup/cpu.max": "100000 100000"})
    assert cpu_threads.cgroup_cpu_limit(proc) == pytest.approx(1.0)


def test_this_machine_does_not_raise():
    assert cpu_threads.available_cpus() >= 1
    assert "CPUs" in cpu_threads.describe()


def test_barrier_spin_env(monkeypatch):
    monkeypatch.delenv("TOKENMILL_SPIN_US", raising=False)
    assert cpu_threads.barrier_spin_ns() == 100_000
    monkeypatch.setenv("TOKENMILL_SPIN_US", "0")
    assert cpu_threads.barrier_spin_ns() == 0
    monkeypatch.setenv("TOKENMILL_SPIN_US", "2.5")
    assert cpu_threads.barrier_spin_ns() == 2500
    monkeypatch.setenv("TOKENMILL_SPIN_US", "fast")
    assert cpu_threads.barrier_spin_ns() == 100_000


def test_apply_cpu_limit(monkeypatch):
    torch = pytest.importorskip("torch")
    have = torch.get_num_threads()
    try:
        monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 1)
        assert cpu_threads.apply_cpu_limit() == 1
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 64)
        assert cpu_threads.apply_cpu_limit() == 1  # never raised
    finally:
        torch.set_num_threads(have)
