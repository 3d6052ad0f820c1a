"""How many CPU threads to compute with, and how they wait: for shared hosts and containers.

torch's default thread count is the number of CPUs the process may run on (its affinity mask),
whatever its container's CPU quota: a container given 1 CPU of a 16-core host would start 16
threads that the quota throttles in turn. `available_cpus()` is the affinity count, lowered to
the cgroup CPU quota rounded up (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`,
the tightest along the process's cgroup path), as Java and Go (1.25) size their thread pools;
`apply_cpu_limit()` sets torch's thread count to it when that is fewer.

Waiting: the fused decode step's barriers (csrc/decode_step.cpp) spin for `barrier_spin_ns()`
(`TOKENMILL_SPIN_US`, default 100 us) and then sleep, so a step slows in proportion when other
processes take cores instead of spinning through their time slices (benchmarks/contention.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from pathlib import Path

from tokenmill import envs

logger = logging.getLogger("tokenmill")

DEFAULT_SPIN_US = 100.0
DEFAULT_GOMP_SPINCOUNT = 3000  # ~80 us of pauses on an AMD EPYC (libgomp's own default: 300,000, ~8 ms)
_omp_default_applied: str | None = None  # what openmp_wait_defaults set, for the start-up log


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040)."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _mounts(proc: Path) -> list[tuple[str, Path, str, set[str]]]:
    """(root inside the hierarchy, mount point, fs type, super options) of each cgroup mount."""
    out = []
    try:
        lines = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((_unescape(fields[3]), Path(_unescape(fields[4])), rest[0], set(rest[2].split(","))))
    return out


def _cgroup_paths(proc: Path) -> tuple[str | None, str | None]:
    """This process's cgroup path in the v2 hierarchy and in the v1 hierarchy holding `cpu`."""
    v2 = v1 = None
    try:
        lines = (proc / "cgroup").read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _limit_at(d: Path, v2: bool) -> float | None:
    """The CPU limit (CPUs) set in one cgroup directory, or None where there is none."""
    if v2:
        text = _read(d / "cpu.max")
        if not text:
            return None
        quota, _, period = text.partition(" ")
        if quota == "max":
            return None
        try:
            q, p = int(quota), int(period or 100000)
        except ValueError:
            return None
    else:
        quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        try:
            q, p = int(quota or -1), int(period or 100000)
        except ValueError:
            return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(proc: str | os.PathLike = "/proc/self") -> float | None:
    """CPUs this process's cgroup quota allows (e.g. 1.5), or None when unlimited or unknown.

    Reads `proc`/mountinfo for the cgroup mounts and `proc`/cgroup for the process's place in
    each hierarchy, then the quota of that cgroup and of each ancestor the mount shows (a
    container sees its own cgroup as the mount's root): the tightest wins.
    """
    proc = Path(proc)
    v2_path, v1_path = _cgroup_paths(proc)
    limits = []
    for root, mount, fstype, opts in _mounts(proc):
        v2 = fstype == "cgroup2"
        path = v2_path if v2 else (v1_path if "cpu" in opts else None)
        if path is None:
            continue
        # The process's cgroup relative to what this mount shows; outside it (another
        # namespace's view), only the mount's own root can be read.
        rel = os.path.relpath(path, root) if path == root or path.startswith(root.rstrip("/") + "/") else "."
        d = mount / rel if rel != "." else mount
        while True:
            lim = _limit_at(d, v2)
            if lim is not None:
                limits.append(lim)
            if d == mount or mount not in d.parents:
                break
            d = d.parent
    return min(limits) if limits else None


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (taskset, cpuset), or os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_cpus(proc: str | os.PathLike = "/proc/self", affinity: int | None = None) -> int:
    """The CPUs this process can use: its affinity count, capped by its cgroup quota rounded up."""
    n = affinity if affinity is not None else affinity_cpus()
    limit = cgroup_cpu_limit(proc)
    if limit is not None:
        n = min(n, max(1, math.ceil(limit - 1e-9)))
    return max(1, n)


def apply_cpu_limit() -> int:
    """Lowers torch's intra-op thread count to available_cpus() when it is higher (logged);
    returns the thread count in force. An explicit --num-threads bypasses this."""
    import torch

    n, have = available_cpus(), torch.get_num_threads()
    if n < have:
        logger.info(
            "using %d CPU threads, not %d: the CPU quota / affinity allows %d (%s); %s",
            n,
            have,
            n,
            describe(),
            openmp_wait_policy(),
        )
        torch.set_num_threads(n)
        return n
    logger.info("using %d CPU threads (%s); %s", have, describe(), openmp_wait_policy())
    return have


def _libgomp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line for line in f)
    except OSError:
        return "torch" in sys.modules


def cpu_quota_below_cpus() -> bool:
    """Whether a cgroup CPU quota (a container's CPU limit) allows fewer CPUs than the affinity mask."""
    limit = cgroup_cpu_limit()
    return limit is not None and limit < affinity_cpus()


@contextlib.contextmanager
def openmp_wait_defaults(environ=None, quota_below_cpus=cpu_quota_below_cpus):
    """Around the first `import torch`: how libgomp's waiting threads wait.

    libgomp reads its wait policy once, when it loads (with torch). Measured with one busy
    process beside the engine on 2 cores (benchmarks/contention.py, docs/benchmarks.md): any
    spinning (libgomp's 300,000 pauses, or 3,000) halves batch-1 decode and cuts 8- and 96-seq
    throughput to ~0.3x of quiet; OMP_WAIT_POLICY=passive (sleep at once) keeps 0.6-0.9x, but
    costs 3-12% on a quiet machine. So: passive where contention is built in, a CPU quota below
    the CPUs (a container's limit, whose threads are throttled in turn); else GOMP_SPINCOUNT=
    DEFAULT_GOMP_SPINCOUNT. Not when the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT, or libgomp
    is already loaded. The environment is restored after the block (child processes, such as
    benchmark peers, get the user's)."""
    env = os.environ if environ is None else environ
    global _omp_default_applied
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env or _libgomp_loaded():
        yield None
        return
    key, value = (
        ("OMP_WAIT_POLICY", "passive") if quota_below_cpus() else ("GOMP_SPINCOUNT", str(DEFAULT_GOMP_SPINCOUNT))
    )
    env[key] = value
    try:
        yield f"{key}={value}"
        _omp_default_applied = f"{key}={value}"
    finally:
        env.pop(key, None)


def openmp_wait_policy() -> str:
    """What libgomp's wait policy is in this process, in words (for the start-up log)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return "OpenMP wait policy from the environment"
    if _omp_default_applied == "OMP_WAIT_POLICY=passive":
        return "OMP_WAIT_POLICY=passive (tokenmill's default under a CPU quota)"
    if _omp_default_applied:
        return (
            f"{_omp_default_applied} (tokenmill's default; on a host shared with busy processes "
            "OMP_WAIT_POLICY=passive is up to 2x faster)"
        )
    return (
        "libgomp's default spin (torch was loaded before tokenmill: set OMP_WAIT_POLICY=passive before it "
        "on a shared machine)"
    )


def barrier_spin_ns() -> int:
    """The most the fused step's barriers spin before sleeping: TOKENMILL_SPIN_US (default 100)."""
    us = envs.TOKENMILL_SPIN_US  # not a number: the default, with a warning
    return max(0, int(us * 1000))


def describe() -> str:
    limit = cgroup_cpu_limit()
    quota = "no CPU quota" if limit is None else f"CPU quota {limit:g}"
    return f"{os.cpu_count()} CPUs, {affinity_cpus()} in the affinity mask, {quota}"
