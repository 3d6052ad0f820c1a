"""Compiles the engine's C++ CPU kernels into one extension module per ISA level.

`pip install .`, `pip install -e .` and `python -m build` run this through setup.py, so the
kernels ship compiled in the package (tokenmill/kernels/_C_<level>.so); a source tree without
them (or a torch other than the one they were built against) builds the one level this machine
loads on first use instead, into a cache folder (cpu_kernels.py), and says so.

What it compiles: each kernel unit (csrc/*.cpp but the two below) once per level that changes
it: a unit is compiled again for a level only if it tests one of the macros the level adds
(`__AVX512BF16__`, `__AMX_TILE__`, ..., in its own text or a header it includes) or the level
widens the vectors the compiler may use; otherwise the level links the lower level's object.
bindings.cpp (pybind11 and torch/extension.h: the one costly unit) is compiled once, with no ISA
flags, and module_init.cpp (the module's entry point, a few lines) once per level. Units run in
parallel ($MAX_JOBS, default the machine's cores), heaviest first, one line each as they finish;
objects are kept in a work folder keyed by their inputs, so a second build (an editable install
after a wheel, say) only links.

Loaded by setup.py by path, before tokenmill or torch could be imported by name: no imports from
tokenmill here but isa.py, loaded the same way.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

try:
    from tokenmill.kernels import isa
except ImportError:  # setup.py, which loads this file by path, registers isa first under this name
    import tokenmill_kernels_isa as isa  # type: ignore[no-redef]

CSRC = Path(__file__).resolve().parent / "csrc"
BINDINGS = "bindings.cpp"
MODULE_INIT = "module_init.cpp"
MODULE_PREFIX = "_C_"
BUILD_INFO = "build_info.json"
PCH_HEADER = "torch_lite.h"  # what every kernel unit includes first: precompiled once per level
# Compile order before any timing is known: the slowest units first, so that two jobs finish together.
_HEAVY_FIRST = (
    "paged_attention.cpp",
    "paged_rows.cpp",
    "paged_prefill.cpp",
    "quant_panels.cpp",
    "quant_linear.cpp",
    "w8a8.cpp",
    "decode_step.cpp",
    "panel_linear.cpp",
    "sampling.cpp",
)
COMMON_FLAGS = (
    "-O3",
    "-fopenmp",
    "-ffast-math",
    "-mprefer-vector-width=512",
    "-fPIC",
    "-std=c++20",
    "-fvisibility=hidden",
)

Log = Callable[[str], None]


def module_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def module_file(level: str) -> str:
    return f"{MODULE_PREFIX}{level}{module_suffix()}"


def kernel_units() -> list[Path]:
    return sorted(p for p in CSRC.glob("*.cpp") if p.name not in (BINDINGS, MODULE_INIT))


def _included_text(path: Path, seen: set[Path] | None = None) -> str:
    """The file's text and that of every csrc header it includes, transitively."""
    seen = set() if seen is None else seen
    if path in seen or not path.exists():
        return ""
    seen.add(path)
    text = path.read_text(encoding="utf-8")
    parts = [text]
    for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M):
        parts.append(_included_text(CSRC / name, seen))
    return "\n".join(parts)


def effective_level(unit_text: str, level: isa.IsaLevel, levels: tuple[isa.IsaLevel, ...]) -> isa.IsaLevel:
    """The lowest level whose object of this unit equals `level`'s: same vector width and the same
    answer to every ISA macro the unit tests."""

    def signature(upto: int) -> tuple[int, frozenset[str]]:
        tested = frozenset(m for lv in levels[: upto + 1] for m in lv.macros if re.search(rf"\b{m}\b", unit_text))
        return levels[upto].vector_width, tested

    idx = [lv.name for lv in levels].index(level.name)
    want = signature(idx)
    for i in range(idx + 1):
        if signature(i) == want:
            return levels[i]
    return level


# What the kernels compile against, printed as JSON by a Python that imports torch.
_TORCH_PROBE = """
import json, sys, sysconfig, torch
from torch.utils import cpp_extension as c
try:
    inc = list(c.include_paths("cpu"))
except TypeError:  # before torch 2.6: no device argument
    inc = list(c.include_paths())
print(json.dumps({"version": torch.__version__, "include_dirs": inc + [sysconfig.get_paths()["include"]],
                  "lib": c.TORCH_LIB_PATH, "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
                  "where": torch.__file__}))
"""


def _probe(clean: bool) -> dict | None:
    env = dict(os.environ)
    if clean:  # pip's isolated build environment hides the target environment through these
        for name in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME"):
            env.pop(name, None)
    r = subprocess.run([sys.executable, "-c", _TORCH_PROBE], env=env, capture_output=True, text=True)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None


def target_torch() -> dict | None:
    """The torch of the environment being installed into (or run in): the one the kernels will run with."""
    return _probe(clean=True)


def build_torch() -> dict:
    """The torch to compile against: the target environment's, else (pip installed the build
    requirement into its isolated environment: build_backend/) the build environment's."""
    info = target_torch() or _probe(clean=False)
    if info is None:
        raise RuntimeError(
            "the CPU kernels compile against torch, which is not installed: pip install torch==2.13.0 first"
        )
    return info


@dataclass
class Toolchain:
    cxx: list[str]
    version: str
    torch_version: str
    include_dirs: list[str]
    torch_lib: str
    cxx11_abi: int
    torch_where: str = ""

    @staticmethod
    def find() -> Toolchain:
        cxx = shlex.split(os.environ.get("CXX") or "c++")
        try:
            out = subprocess.run([*cxx, "--version"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise RuntimeError(f"no C++ compiler ({' '.join(cxx)}: {e})") from None
        t = build_torch()
        return Toolchain(
            cxx,
            out.splitlines()[0] if out else "?",
            t["version"],
            t["include_dirs"],
            t["lib"],
            t["cxx11_abi"],
            t["where"],
        )


@dataclass
class Job:
    source: Path
    level: str  # the level whose flags compile it ("" for bindings: no ISA flags)
    flags: list[str]
    obj: Path
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.source.name} ({self.level or 'any level'})"


def plan(levels: list[str], tc: Toolchain, work: Path) -> tuple[list[Job], dict[str, list[Job]]]:
    """The compile jobs, and each level's objects to link."""
    all_levels = isa.levels()
    base = list(COMMON_FLAGS) + [f"-D_GLIBCXX_USE_CXX11_ABI={tc.cxx11_abi}", f"-I{CSRC}"]
    base += [f for d in tc.include_dirs for f in ("-isystem", d)]
    headers = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.h")))
    # torch's and Python's versions stand for their headers, not the folders holding them: pip's
    # isolated builds find torch in a new temporary folder each time, and should still hit the cache
    env_key = "|".join([tc.version, tc.torch_version, sys.version]).encode()

    jobs: dict[tuple[str, str], Job] = {}

    def job(src: Path, lv: str, flags: list[str]) -> Job:
        key = (src.name, lv)
        if key not in jobs:
            # not the include folders' paths (see env_key; csrc's files are hashed themselves): a clone
            # or a pip build elsewhere of the same sources hits the same objects
            keyed = [f for f in flags if not f.startswith(("/", "-I"))]
            digest = hashlib.sha256(src.read_bytes() + headers + " ".join(keyed).encode() + env_key).hexdigest()[:16]
            jobs[key] = Job(src, lv, flags, work / "obj" / f"{src.stem}.{lv or 'any'}.{digest}.o")
        return jobs[key]

    generic = isa.levels()[0].compile_flags
    bindings = job(
        CSRC / BINDINGS, "", base + list(generic) + ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    )
    texts = {u: _included_text(u) for u in kernel_units()}
    links: dict[str, list[Job]] = {}
    for name in levels:
        lv = isa.level(name)
        objs = []
        for unit, text in texts.items():
            eff = effective_level(text, lv, all_levels)
            j = job(
                unit,
                eff.name,
                base + list(eff.compile_flags) + ["-include", str(pch_header(work, eff.name)), "-Winvalid-pch"],
            )
            objs.append(j)
        init = job(CSRC / MODULE_INIT, name, base + list(generic) + [f"-DTM_ISA_LEVEL={name}"])
        links[name] = [*objs, init, bindings]  # bindings last: the kernel units' copies of shared inlines win
    return list(jobs.values()), links


def pch_header(work: Path, level: str) -> Path:
    """The copy of torch_lite.h force-included by `level`'s units; its .gch beside it, when built,
    is used instead (GCC checks it was made with the same flags, and reads the header otherwise)."""
    return work / "pch" / level / PCH_HEADER


def _precompile(tc: Toolchain, work: Path, unit_job: Job) -> float:
    """torch_lite.h precompiled with the flags of a unit job of its level: ~3 s once instead of
    ~2 s per unit (torch's headers), for the same objects bit for bit."""
    header = pch_header(work, unit_job.level)
    header.parent.mkdir(parents=True, exist_ok=True)
    header.write_bytes((CSRC / PCH_HEADER).read_bytes())
    flags = [f for f in unit_job.flags if f != "-Winvalid-pch"]
    cut = flags.index("-include")
    flags = flags[:cut] + flags[cut + 2 :]
    t0 = time.perf_counter()
    r = subprocess.run(
        [*tc.cxx, *flags, "-x", "c++-header", str(header), "-o", str(header) + ".gch"], capture_output=True, text=True
    )
    if r.returncode != 0:  # not fatal: the units read the header itself
        Path(str(header) + ".gch").unlink(missing_ok=True)
    return time.perf_counter() - t0


def _order(jobs: list[Job], timings: dict[str, float]) -> list[Job]:
    def cost(j: Job) -> float:
        t = timings.get(f"{j.source.name}:{j.level}")
        if t is not None:
            return t
        if j.source.name == BINDINGS:
            return 1e6
        rank = _HEAVY_FIRST.index(j.source.name) if j.source.name in _HEAVY_FIRST else len(_HEAVY_FIRST)
        return 1e5 - rank * 100 + len(isa.level(j.level).macros if j.level else ())

    return sorted(jobs, key=cost, reverse=True)


def _compile(tc: Toolchain, j: Job) -> None:
    j.obj.parent.mkdir(parents=True, exist_ok=True)
    tmp = j.obj.with_name(j.obj.name + f".{os.getpid()}.tmp")
    t0 = time.perf_counter()
    r = subprocess.run([*tc.cxx, *j.flags, "-c", str(j.source), "-o", str(tmp)], capture_output=True, text=True)
    j.seconds = time.perf_counter() - t0
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {j.label} failed:\n{r.stderr[-4000:]}")
    os.replace(tmp, j.obj)


def _link(tc: Toolchain, objs: list[Job], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    cmd = [
        *tc.cxx,
        "-shared",
        *[str(j.obj) for j in objs],
        "-o",
        str(tmp),
        f"-L{tc.torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        "-ltorch_python",
        "-fopenmp",
        "-Wl,-O1",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"linking {out.name} failed:\n{r.stderr[-4000:]}")
    os.replace(tmp, out)


def default_jobs() -> int:
    return max(1, int(os.environ.get("MAX_JOBS") or 0) or os.cpu_count() or 1)


def build(
    out_dir: Path, levels: list[str] | None = None, work: Path | None = None, jobs: int | None = None, log: Log = print
) -> dict[str, Path]:
    """Compiles and links the modules of `levels` (default: every level of this architecture) into
    out_dir; returns {level: module path}. Raises RuntimeError with the compiler's message."""
    t_start = time.perf_counter()
    levels = levels or isa.level_names()
    tc = Toolchain.find()
    work = Path(work) if work is not None else Path(tempfile.gettempdir()) / "tokenmill-kernels-build"
    todo, links = plan(levels, tc, work)
    timings_file = work / "timings.json"
    try:
        timings = json.loads(timings_file.read_text())
    except (OSError, ValueError):
        timings = {}
    fresh = [j for j in todo if not j.obj.exists()]
    jobs = jobs or default_jobs()
    log(
        f"compiling the CPU kernels for {len(levels)} ISA level(s) ({', '.join(levels)}): {len(fresh)} of "
        f"{len(todo)} units to compile ({len(todo) - len(fresh)} already compiled in {work}), {jobs} at a time, "
        f"with {tc.version}, against torch {tc.torch_version} ({Path(tc.torch_where).parent})"
    )
    width = len(str(len(fresh)))
    done = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        pch_for = {j.level: j for j in fresh if "-include" in j.flags}  # one unit job per level needing it
        for level, seconds in zip(pch_for, pool.map(lambda j: _precompile(tc, work, j), pch_for.values())):
            log(f"[pch] {PCH_HEADER} ({level}): {seconds:.1f} s")
        futures = {pool.submit(_compile, tc, j): j for j in _order(fresh, timings)}
        try:
            for fut in concurrent.futures.as_completed(futures):
                fut.result()
                j = futures[fut]
                done += 1
                timings[f"{j.source.name}:{j.level}"] = round(j.seconds, 1)
                log(f"[{done:>{width}}/{len(fresh)}] {j.label}: {j.seconds:.1f} s")
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    out_dir.mkdir(parents=True, exist_ok=True)
    built = {}
    for name in levels:
        built[name] = out_dir / module_file(name)
        _link(tc, links[name], built[name])
    info = {
        "torch": tc.torch_version,
        "python": sys.version.split()[0],
        "compiler": tc.version,
        "levels": levels,
        "sources": sources_digest(),
        "objects": {name: sorted(f"{j.source.name}:{j.level or 'any'}" for j in links[name]) for name in levels},
    }
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")
    try:
        timings_file.write_text(json.dumps(timings, indent=0, sort_keys=True) + "\n")
    except OSError:
        pass
    _prune(work, todo)
    shutil.rmtree(work / "pch", ignore_errors=True)  # ~160 MB a level; the objects are what is kept
    log(
        f"compiled the CPU kernels in {time.perf_counter() - t_start:.0f} s: {', '.join(module_file(n) for n in levels)} "
        f"in {out_dir}"
    )
    return built


def _prune(work: Path, keep: list[Job]) -> None:
    """Objects of older sources or flags go (a work folder would otherwise grow with every edit)."""
    wanted = {j.obj.name for j in keep}
    for p in (work / "obj").glob("*.o"):
        if p.name not in wanted:
            p.unlink(missing_ok=True)


def sources_digest() -> str:
    """What the modules are compiled from (every csrc file): recorded in the build's info, so that a
    source tree edited since its install compiles again rather than load stale kernels."""
    files = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()[:16]


def read_build_info(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None
