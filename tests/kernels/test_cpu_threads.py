"""CPU quota / affinity detection (cpu_threads) from fake /proc and cgroup trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.kernels import cpu_kernels, cpu_threads


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
    proc = fake_host(
        tmp_path,
        [V2_MOUNT],
        ["0::/system.slice/app.service"],
        {
            "cgroup/cpu.max": "max 100000",
            "cgroup/system.slice/cpu.max": "50000 100000",
            "cgroup/system.slice/app.service/cpu.max": "300000 100000",
        },
    )
    assert cpu_threads.cgroup_cpu_limit(proc) == pytest.approx(0.5)
    assert cpu_threads.available_cpus(proc, affinity=4) == 1  # never below one


def test_v2_container_view(tmp_path):
    # /proc/self/cgroup names a host path the container's mount does not show: read the mount's root.
    proc = fake_host(
        tmp_path,
        ["40 30 0:31 /kubepods/pod1/abc @/cgroup rw - cgroup2 cgroup2 rw"],
        ["0::/../other"],
        {"cgroup/cpu.max": "200000 100000"},
    )
    assert cpu_threads.cgroup_cpu_limit(proc) == pytest.approx(2.0)


def test_v1_quota(tmp_path):
    mounts = [
        "30 25 0:26 / @/cgroup/memory rw - cgroup cgroup rw,memory",
        "31 25 0:27 / @/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct",
    ]
    cg = ["9:memory:/docker/abc", "4:cpu,cpuacct:/docker/abc", "0::/"]
    proc = fake_host(
        tmp_path,
        mounts,
        cg,
        {
            "cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1",
            "cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
            "cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000",
            "cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
            "cgroup/memory/docker/abc/cpu.cfs_quota_us": "1000",  # not the cpu hierarchy: ignored
        },
    )
    assert cpu_threads.cgroup_cpu_limit(proc) == pytest.approx(1.0)
    assert cpu_threads.available_cpus(proc, affinity=2) == 1


def test_v1_unlimited_hybrid(tmp_path):
    # This machine's layout: v1 controllers plus an empty v2 hierarchy at cgroup/unified.
    mounts = [
        "28 25 0:24 / @/cgroup/unified rw - cgroup2 cgroup2 rw",
        "31 25 0:27 / @/cgroup/cpu rw - cgroup cgroup rw,cpu",
    ]
    proc = fake_host(
        tmp_path,
        mounts,
        ["1:cpu:/", "0::/"],
        {
            "cgroup/cpu/cpu.cfs_quota_us": "-1",
            "cgroup/cpu/cpu.cfs_period_us": "100000",
            "cgroup/unified/cgroup.procs": "",
        },
    )
    assert cpu_threads.cgroup_cpu_limit(proc) is None
    assert cpu_threads.available_cpus(proc, affinity=2) == 2


def test_mount_point_with_space(tmp_path):
    proc = fake_host(
        tmp_path,
        [r"35 24 0:30 / @/my\040cgroup rw - cgroup2 cgroup2 rw"],
        ["0::/"],
        {"my cgroup/cpu.max": "100000 100000"},
    )
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


@pytest.mark.parametrize("threads", [2, 4])
def test_fused_step_barrier_wait_modes_give_the_same_logits(tiny_llama_dir, threads):
    """The fused step's barrier (sleep at once, adaptive spin, spin only) with as many threads as
    cores and with more (4 on 2 cores: threads sleep, share CPUs, are woken): every call's logits
    equal the op-by-op model's with the same thread count."""
    torch = pytest.importorskip("torch")
    from tokenmill import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory=0.02, enable_prefix_caching=False)
    runner = llm.engine.core.runner
    fd = runner.fast_decode
    if fd is None:
        pytest.skip("no fused decode step here (needs the C++ kernels with AVX512-BF16 or AVX2 + FMA)")
    assert fd.decoder.spin_ns == cpu_threads.barrier_spin_ns() and fd.decoder.adaptive_spin
    steps, inner = [], runner.execute

    def spy(sched):
        if not steps and len(sched.scheduled) == 3 and all(s.num_new_tokens == 1 for s in sched.scheduled):
            step = runner.prepare(sched)
            steps.append((step.input_ids, step.positions, step.meta, step.logits_rows, runner.kv_cache.clone()))
        return inner(sched)

    runner.execute = spy
    try:
        prompts = [[5 + (7 * i + j) % 200 for j in range(40 + 30 * i)] for i in range(3)]
        llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        )
    finally:
        runner.execute = inner
    ids, pos, meta, rows, kv = steps[0]
    have = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            runner.kv_cache.copy_(kv)
            want = runner.model.compute_logits(runner.model(ids, pos, runner.attn, meta)[rows])
            for spin_ns, adaptive in [(0, False), (100_000, True), (10**9, False)] * 5:
                fd.decoder.spin_ns, fd.decoder.adaptive_spin = spin_ns, adaptive
                runner.kv_cache.copy_(kv)
                assert torch.equal(fd(ids, pos, meta, rows), want), (spin_ns, adaptive)
    finally:
        torch.set_num_threads(have)
        fd.decoder.spin_ns, fd.decoder.adaptive_spin = cpu_threads.barrier_spin_ns(), True
    with pytest.raises(RuntimeError):
        fd.decoder.spin_ns = -1


def test_barrier_spin_budget_is_cut_only_for_descheduled_threads():
    """The fused step's adaptive barrier: a spin that sees the wait end doubles the budget (+1 us);
    one that runs out is cut to a quarter (not below 2 us) only when the whole wait lasted 0.5 ms
    or more (a descheduled thread), and raised to twice a shorter wait (a thread's own wake-up
    from sleep, which the old rule cut for too, trapping every later barrier in sleeping)."""
    kernels = cpu_kernels.load()
    if kernels is None or not hasattr(kernels, "barrier_next_spin_budget"):
        pytest.skip("no fused decode step here")
    nxt, cap = kernels.barrier_next_spin_budget, 100_000
    assert nxt(2_000, cap, -1) == 5_000 and nxt(80_000, cap, -1) == cap  # the spin saw the others come
    assert nxt(100_000, cap, 3_000_000) == 25_000 and nxt(4_000, cap, 600_000) == 2_000  # descheduled
    assert nxt(2_000, cap, 60_000) == 100_000 and nxt(2_000, cap, 20_000) == 40_000  # slept through a short wait
    assert nxt(30_000, cap, 5_000) == 30_000  # (never below what it had)
    budget = 2_000  # from the floor, waits of a sleeper's wake-up (80 us) bring spinning back at once
    for _ in range(3):
        budget = nxt(budget, cap, 80_000)
    assert budget == cap


def test_openmp_wait_defaults(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_libgomp_loaded", lambda: False)
    env = {"PATH": "/bin"}
    with cpu_threads.openmp_wait_defaults(env, quota_below_cpus=lambda: False) as applied:
        assert applied and env["GOMP_SPINCOUNT"] == str(cpu_threads.DEFAULT_GOMP_SPINCOUNT)
    assert env == {"PATH": "/bin"}  # restored: child processes get the user's environment
    with cpu_threads.openmp_wait_defaults(env, quota_below_cpus=lambda: True) as applied:
        assert applied == "OMP_WAIT_POLICY=passive" and env["OMP_WAIT_POLICY"] == "passive"  # a container's limit
    assert env == {"PATH": "/bin"}
    for user in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "5"}):
        env = dict(user)
        with cpu_threads.openmp_wait_defaults(env) as applied:
            assert not applied and env == user  # the user's choice stands
    monkeypatch.setattr(cpu_threads, "_libgomp_loaded", lambda: True)
    env = {}
    with cpu_threads.openmp_wait_defaults(env) as applied:
        assert not applied and env == {}  # too late: libgomp has read its settings


def test_libgomp_loaded_here():
    pytest.importorskip("torch")
    assert cpu_threads._libgomp_loaded() in (True, False)
    policy = cpu_threads.openmp_wait_policy()
    assert any(word in policy for word in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OpenMP wait policy"))
