"""The x86 ISA levels the CPU kernels are compiled for, and the one this machine runs.

One build compiles the kernels once per level (build.py) into one extension module each,
`tokenmill.kernels._C_<level>`; at run time the highest level the CPU has is loaded, or the one
`TOKENMILL_CPU_ISA` caps it to (a developer on an AVX-512 machine runs what an AVX2-only machine
runs). Each level is a superset of the one before it. No torch import here: setup.py uses this
module before torch is importable in the build's environment.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path


def _load_envs():
    """tokenmill.envs; by path when this module was loaded by path (setup.py, the build backend:
    the package is not importable then). envs.py imports nothing from tokenmill."""
    if __name__.startswith("tokenmill."):
        # lazy: loaded by path (setup.py), tokenmill is not importable
        from tokenmill import envs as module

        return module
    name = "tokenmill_envs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "envs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


envs = _load_envs()
ISA_ENV = "TOKENMILL_CPU_ISA"


@dataclass(frozen=True)
class IsaLevel:
    name: str
    compile_flags: tuple[str, ...]
    # /proc/cpuinfo flags the level's code may use: all must be present to load it
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    # the predefined macros this level adds to the one before it (build.py compiles a unit again
    # for a level only if the unit tests one of them, or the vector width changes)
    macros: frozenset[str] = field(default_factory=frozenset)
    # the widest vectors the compiler may use on its own (auto-vectorized loops change with it)
    vector_width: int = 128
    # what users call such a CPU
    cpus: str = ""
    # torch's own kernels capped alike (env_for): ATen's ATEN_CPU_CAPABILITY, oneDNN's ONEDNN_MAX_CPU_ISA
    aten_capability: str = "default"
    onednn_isa: str = "SSE41"


_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

X86_LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel(
        "generic",
        ("-march=x86-64", "-mtune=generic"),
        frozenset(),
        frozenset({"__SSE__", "__SSE2__"}),
        128,
        "any x86-64",
        "default",
        "SSE41",
    ),
    IsaLevel(
        "avx2",
        ("-march=x86-64-v3", "-mtune=generic"),
        _V3,
        frozenset({"__AVX__", "__AVX2__", "__FMA__", "__F16C__", "__BMI__", "__BMI2__"}),
        256,
        "AVX2 + FMA (Intel Haswell and later, AMD Zen 1-3)",
        "avx2",
        "AVX2",
    ),
    IsaLevel(
        "avx512",
        ("-march=x86-64-v4", "-mtune=generic"),
        _V4,
        frozenset({"__AVX512F__", "__AVX512BW__", "__AVX512CD__", "__AVX512DQ__", "__AVX512VL__"}),
        512,
        "AVX-512 (Intel Skylake-SP)",
        "avx512",
        "AVX512_CORE",
    ),
    IsaLevel(
        "avx512_vnni",
        ("-march=x86-64-v4", "-mtune=generic", "-mavx512vnni"),
        _V4 | {"avx512_vnni"},
        frozenset({"__AVX512VNNI__"}),
        512,
        "AVX-512 VNNI (Intel Cascade Lake, Ice Lake)",
        "avx512",
        "AVX512_CORE_VNNI",
    ),
    IsaLevel(
        "avx512_bf16",
        ("-march=x86-64-v4", "-mtune=generic", "-mavx512vnni", "-mavx512bf16"),
        _V4 | {"avx512_vnni", "avx512_bf16"},
        frozenset({"__AVX512BF16__"}),
        512,
        "AVX-512 BF16 (AMD Zen 4 and 5, Intel Cooper Lake)",
        "avx512",
        "AVX512_CORE_BF16",
    ),
    IsaLevel(
        "amx",
        (
            "-march=x86-64-v4",
            "-mtune=generic",
            "-mavx512vnni",
            "-mavx512bf16",
            "-mamx-tile",
            "-mamx-bf16",
            "-mamx-int8",
        ),
        _V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
        frozenset({"__AMX_TILE__", "__AMX_BF16__", "__AMX_INT8__"}),
        512,
        "AMX (Intel Sapphire Rapids and later)",
        "avx512",
        "AVX512_CORE_AMX",
    ),
)
# Elsewhere (aarch64, ...): one level, the compiler's default target (the portable code paths).
OTHER_LEVELS: tuple[IsaLevel, ...] = (IsaLevel("generic", (), cpus="any"),)


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def levels() -> tuple[IsaLevel, ...]:
    """Every level a build for this architecture compiles, lowest first."""
    return X86_LEVELS if is_x86() else OTHER_LEVELS


def level_names() -> list[str]:
    return [lv.name for lv in levels()]


def level(name: str) -> IsaLevel:
    for lv in levels():
        if lv.name == name:
            return lv
    raise ValueError(f"unknown CPU ISA level {name!r}: choose one of {', '.join(level_names())}")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux names them (empty where /proc/cpuinfo is not there)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported(flags: frozenset[str] | None = None) -> list[IsaLevel]:
    """The levels this CPU can run, lowest first."""
    flags = cpu_flags() if flags is None else flags
    if not is_x86():
        return list(OTHER_LEVELS)
    if not flags:  # no /proc/cpuinfo: only what every x86-64 has
        return [X86_LEVELS[0]]
    return [lv for lv in X86_LEVELS if lv.cpu_flags <= flags]


def host_level(flags: frozenset[str] | None = None) -> IsaLevel:
    return supported(flags)[-1]


def selected_level(flags: frozenset[str] | None = None) -> IsaLevel:
    """The level to load: the CPU's highest, capped by TOKENMILL_CPU_ISA when set. A cap above the
    CPU's own level is an error (that code would die on an illegal instruction)."""
    top = host_level(flags)
    cap = envs.TOKENMILL_CPU_ISA
    if not cap:
        return top
    want = level(cap)
    names = [lv.name for lv in supported(flags)]
    if want.name not in names:
        raise ValueError(f"{ISA_ENV}={cap}: this CPU runs up to {top.name} ({', '.join(names)})")
    return want


def env_for(name: str) -> dict[str, str]:
    """The environment that makes a process compute as a CPU of level `name` does: these kernels
    capped, and torch's own (ATen's vectorized ops, oneDNN's matmuls) too, so that a developer on an
    AVX-512 machine sees the numbers an AVX2-only CI machine will (read when torch starts)."""
    lv = level(name)
    return {ISA_ENV: lv.name, "ATEN_CPU_CAPABILITY": lv.aten_capability, "ONEDNN_MAX_CPU_ISA": lv.onednn_isa}


def _main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m tokenmill.kernels.isa",
        description="The CPU kernels' ISA levels this machine runs, lowest first.",
    )
    p.add_argument(
        "--env",
        metavar="LEVEL",
        help="print the environment that computes as a LEVEL CPU does (for `env $(...) pytest ...`)",
    )
    ns = p.parse_args(argv)
    if ns.env:
        print(" ".join(f"{k}={v}" for k, v in env_for(ns.env).items()))
    else:
        print(" ".join(lv.name for lv in supported()))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
