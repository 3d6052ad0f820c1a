"""The engine's own C++ CPU kernels, loaded for the ISA level this CPU runs.

The package ships them compiled, one extension module per x86 level
(`tokenmill.kernels._C_<level>`, built by `pip install` / `python -m build`: kernels/build.py);
the highest level the CPU has is loaded, or the one `TOKENMILL_CPU_ISA` caps it to
(kernels/isa.py). A source tree without them, a package built for other levels, against a torch
other than the one running, or from other sources (an editable install whose csrc was edited
since) compiles the one level needed on first use (the fallback:
about a minute, logged unit by unit) into `$TOKENMILL_CACHE_DIR/kernels` (default
~/.cache/tokenmill/kernels), keyed by sources, torch, Python and the environment, so later
starts load it. If that fails too, callers use pure-torch code (TOKENMILL_NO_CPP_KERNELS=1
forces that).

An flock around a fallback build (released by the OS when its holder dies) makes a second
process wait for the first, saying so, instead of compiling alongside it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill import envs

if TYPE_CHECKING:
    import torch


class KernelModule(Protocol):
    """The compiled module (csrc/bindings.cpp) as typed callers see it: the functions they call
    typed here, any other through __getattr__."""

    def argmax_rows(self, logits: torch.Tensor, /) -> torch.Tensor: ...
    def top_k_top_p(
        self, logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, /
    ) -> torch.Tensor: ...
    def __getattr__(self, name: str) -> Any: ...


logger = logging.getLogger("tokenmill")
_lock = threading.Lock()
_module: KernelModule | None = None
_failed = False
_error: str | None = None  # why the kernels are unavailable (for `tokenmill build-kernels`)
_origin: str | None = None  # where the loaded module came from: "package" or its cache folder
PACKAGE = "tokenmill.kernels"


def _kernels():
    """tokenmill.kernels' build and isa modules, imported when first needed rather than with the
    package (`python -m tokenmill.kernels.isa` runs isa as __main__ after importing tokenmill)."""
    # lazy: see above
    from tokenmill.kernels import build, isa

    return build, isa


def load() -> KernelModule | None:
    """The compiled module for this CPU's level, or None when unavailable."""
    global _module, _failed, _error
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        level = _kernels()[1].selected_level()  # a bad TOKENMILL_CPU_ISA is the user's error: raised, not hidden
        try:
            _module = _packaged(level) or _build(level)
        except Exception as e:  # noqa: BLE001 - no compiler, a failed compile, ...: use the torch path
            _error = f"{type(e).__name__}: {e}"
            logger.warning("C++ CPU kernels unavailable (%s); using the pure-torch path", e)
            _failed = True
    return _module


def build_error() -> str | None:
    return _error


def origin() -> str | None:
    """ "package" when the loaded kernels came with the package, else the cache folder they were built in."""
    return _origin


def _packaged(level):
    """The package's own module for `level` (an isa.IsaLevel), when it has one built against this torch."""
    global _origin
    import torch

    kernel_build = _kernels()[0]
    name = f"{PACKAGE}.{kernel_build.MODULE_PREFIX}{level.name}"
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        logger.warning(
            "no prebuilt CPU kernels for %s (%s) in this installation (%s)",
            level.name,
            level.cpus,
            "built with TOKENMILL_SKIP_KERNEL_BUILD or other TOKENMILL_KERNEL_LEVELS, or a source tree never installed",
        )
        return None
    info = kernel_build.read_build_info(Path(spec.origin).parent) or {}
    if info.get("torch") != torch.__version__:
        logger.warning(
            "the package's CPU kernels were built against torch %s, and this is torch %s",
            info.get("torch", "(unknown)"),
            torch.__version__,
        )
        return None
    if info.get("sources") != kernel_build.sources_digest():  # an editable install, its csrc edited since
        logger.warning("the package's CPU kernels were built from other sources than %s holds now", kernel_build.CSRC)
        return None
    module = importlib.import_module(name)
    _origin = "package"
    logger.info("CPU kernels: %s (%s), from the package", level.name, level.cpus)
    return module


def cache_directory(level: str | None = None) -> Path:
    """Where the fallback build of `level` (default: the selected one) goes: keyed by sources,
    torch, Python and the environment's sys.prefix, so that two venvs build apart."""
    import torch

    kernel_build, kernel_isa = _kernels()
    level = level or kernel_isa.selected_level().name
    sources = sorted(kernel_build.CSRC.glob("*.cpp")) + sorted(kernel_build.CSRC.glob("*.h"))
    env = [level, torch.__version__, sys.version, sys.prefix, os.environ.get("CXX", "")]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + "|".join(env).encode()).hexdigest()[:16]
    root = Path(envs.TOKENMILL_CACHE_DIR)
    return root / "kernels" / f"{level}-{key}"


def _build(level):
    global _origin
    kernel_build = _kernels()[0]
    folder = cache_directory(level.name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "tokenmill.flock", "a+") as guard:  # "a+": a waiter must not erase the holder's pid
        _acquire(guard, folder)  # one builder per environment; freed if it dies
        path = folder / kernel_build.module_file(level.name)
        if not path.exists():
            logger.warning(
                "compiling the CPU kernels for %s into %s (first use with this environment: the "
                "package has none built for it); `tokenmill build-kernels` does it ahead",
                level.name,
                folder,
            )
            t0 = time.perf_counter()
            _load_ext(folder, level.name)
            logger.warning("compiled the CPU kernels in %.0f s", time.perf_counter() - t0)
        module = _import_file(path, level.name)
    _origin = str(folder)
    logger.info("CPU kernels: %s (%s), from %s", level.name, level.cpus, folder)
    return module


def _load_ext(folder: Path, level: str) -> None:
    """Compiles `level`'s module into folder (tests replace this with a stand-in)."""
    _kernels()[0].build(folder, [level], work=folder / "work", log=logger.info)


def _import_file(path: Path, level: str):
    name = f"{PACKAGE}.{_kernels()[0].MODULE_PREFIX}{level}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:  # a test's stand-in build leaves no module file
        raise ImportError(f"no module at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def load_level(level: str):
    """The module of one ISA level (tests compare levels in one process), built on first use
    where the package has none. Raises where this CPU cannot run it."""
    kernel_isa = _kernels()[1]
    lv = kernel_isa.level(level)
    if lv.name not in [s.name for s in kernel_isa.supported()]:
        raise ValueError(f"this CPU cannot run the {level} kernels")
    return _packaged(lv) or _build(lv)


def _acquire(guard, folder: Path) -> None:
    """flock the build folder, saying so when another process holds it (its pid is in the file)."""
    try:
        fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        guard.seek(0)
        holder = guard.read().strip() or "?"
        logger.warning("waiting for another process (pid %s) building the CPU kernels in %s", holder, folder)
        fcntl.flock(guard, fcntl.LOCK_EX)
    guard.truncate(0)
    guard.write(str(os.getpid()))
    guard.flush()


def enabled() -> bool:
    return not envs.TOKENMILL_NO_CPP_KERNELS


def batch_invariant() -> bool:
    """Whether bf16 models compute each row the same way whatever else is in its step: every
    attention row through the rows kernel (csrc/paged_decode.h), bf16 linears in panels at every
    batch size (linear.py). The default; TOKENMILL_BATCH_INVARIANT=0 turns it off for models loaded
    after (oneDNN for prompt steps, the prefill attention kernel, decode attention split over the
    threads at small batches: faster prompts where oneDNN has AMX, but bf16 results that depend on
    the batch). Read from the environment so that tensor-parallel workers, spawned processes, agree."""
    return envs.TOKENMILL_BATCH_INVARIANT


def set_batch_invariant(on: bool | None) -> None:
    """Sets TOKENMILL_BATCH_INVARIANT for models loaded from now on (None: unsets it: on)."""
    envs.override("TOKENMILL_BATCH_INVARIANT", None if on is None else "1" if on else "0")


_CPU_DTYPES = None


def ops_for(x: torch.Tensor) -> KernelModule | None:
    """The kernel module when x is a CPU float32/bfloat16 tensor and kernels are on, else None."""
    global _CPU_DTYPES
    if _CPU_DTYPES is None:
        import torch

        _CPU_DTYPES = (torch.float32, torch.bfloat16)
    if not x.is_cpu or x.dtype not in _CPU_DTYPES or not enabled():
        return None
    return _module if _module is not None else load()
