"""The engine's own C++ CPU kernels, compiled from the package's source on first use.

Built with torch's cpp_extension (needs a C++ compiler and ninja) into a build folder under
torch's build root (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) keyed by the source,
the flags and the environment (torch, Python, sys.prefix), so two venvs never share or wait on
one build. The sources are compiled from copies inside that folder, so checkouts of the same
sources (git worktrees, a reinstall elsewhere) share one build. Only the first process pays for
the build (130 s on 2 idle cores, 476 s on 2 busy ones; `tokenmill build-kernels` does it
ahead); it says so in the log.
If the build fails, callers fall back to pure-torch code (TOKENMILL_NO_CPP_KERNELS=1 forces that).

torch guards a build with a lock file that it waits on forever if the builder was killed
mid-build; an flock (released by the OS when its holder dies) around the build lets the next
process clear such a stale file instead of hanging.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger("tokenmill")
_lock = threading.Lock()
_module = None
_failed = False
_error: str | None = None  # why the build failed (for `tokenmill build-kernels`)
NAME = "tokenmill_cpu_kernels"


def load():
    """The compiled module, or None when unavailable."""
    global _module, _failed, _error
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        try:
            _module = _build()
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: use the torch path
            _error = f"{type(e).__name__}: {e}"
            logger.warning("C++ CPU kernels unavailable (%s); using the pure-torch attention path", e)
            _failed = True
    return _module


def build_error() -> str | None:
    return _error


def _build():
    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "tokenmill.flock", "a+") as guard:  # "a+": a waiter must not erase the holder's pid
        _acquire(guard, build_dir)  # one builder per environment; freed if it dies
        (build_dir / "lock").unlink(missing_ok=True)  # torch's own lock: stale if we got here
        fresh = not (build_dir / f"{NAME}.so").exists()
        if fresh:  # minutes of silence otherwise, which the next log line would be blamed for
            logger.warning("compiling the CPU kernels into %s (first run with this environment on this machine: "
                           "about 2 min on 2 idle cores, more when they are busy, less with more cores; "
                           "`tokenmill build-kernels` does it ahead)",
                           build_dir)
        t0 = time.perf_counter()
        module = _load_ext(build_dir)
        if fresh:
            logger.warning("compiled the CPU kernels in %.0f s", time.perf_counter() - t0)
        return module


def _acquire(guard, build_dir: Path) -> None:
    """flock the build folder, saying so when another process holds it (its pid is in the file)."""
    try:
        fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        guard.seek(0)
        holder = guard.read().strip() or "?"
        logger.warning("waiting for another process (pid %s) building the CPU kernels in %s", holder, build_dir)
        fcntl.flock(guard, fcntl.LOCK_EX)
    guard.truncate(0)
    guard.write(str(os.getpid()))
    guard.flush()


def _load_ext(build_dir: Path):
    from torch.utils.cpp_extension import load as load_ext

    # ninja's default of cores + 2 jobs adds compilers of ~1.5 GB each and no speed; torch reads MAX_JOBS
    saved = os.environ.get("MAX_JOBS")
    os.environ["MAX_JOBS"] = saved or str(os.cpu_count() or 1)
    try:
        return load_ext(name=NAME, sources=_staged_sources(build_dir), extra_cflags=_flags(),
                        build_directory=str(build_dir), verbose=False)
    finally:
        if saved is None:
            del os.environ["MAX_JOBS"]


def _staged_sources(build_dir: Path) -> list[str]:
    """Copies of the sources and headers in the build folder, rewritten only when they differ (so
    ninja sees the same paths and times): the commands ninja records then name no checkout."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    for p in SOURCES + HEADERS:
        data, dst = p.read_bytes(), staged / p.name
        if not dst.exists() or dst.read_bytes() != data:
            dst.write_bytes(data)
    return [str(staged / p.name) for p in SOURCES]


SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("paged_attention.cpp", "paged_prefill.cpp", "quant_linear.cpp", "quant_panels.cpp", "panel_linear.cpp", "fused_ops.cpp",
                        "decode_step.cpp", "lora.cpp", "moe.cpp", "shm_allreduce.cpp", "w8a8.cpp", "sampling.cpp",
                        "bindings.cpp")]
# Not compiled alone, but part of the build key: every header, so a new one cannot be forgotten.
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp", "-ffast-math", "-mprefer-vector-width=512"]
    if os.environ.get("TOKENMILL_PORTABLE_KERNELS") != "1":
        flags.append("-march=native")
    return flags


def build_directory() -> Path:
    """Where the module is built: under torch's build root ($TORCH_EXTENSIONS_DIR or
    ~/.cache/torch_extensions), keyed by source, flags, torch, Python and the environment's
    sys.prefix, so two venvs build apart and two checkouts of the same sources share a build."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    env = [" ".join(_flags()), torch.__version__, sys.version, sys.prefix]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + "|".join(env).encode()).hexdigest()[:16]
    # torch's own load() reads TORCH_EXTENSIONS_DIR, but only when no build_directory is given
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / f"{NAME}_{key}"


def enabled() -> bool:
    return os.environ.get("TOKENMILL_NO_CPP_KERNELS") != "1"


def batch_invariant() -> bool:
    """Whether bf16 models compute each row the same way whatever else is in its step: every
    attention row through the rows kernel (csrc/paged_decode.h), bf16 linears in panels at every
    batch size (linear.py). The default; TOKENMILL_BATCH_INVARIANT=0 turns it off for models loaded
    after (oneDNN for prompt steps, the prefill attention kernel, decode attention split over the
    threads at small batches: faster prompts where oneDNN has AMX, but bf16 results that depend on
    the batch). Read from the environment so that tensor-parallel workers, spawned processes, agree."""
    return os.environ.get("TOKENMILL_BATCH_INVARIANT", "1") != "0"


def set_batch_invariant(on: bool | None) -> None:
    """Sets TOKENMILL_BATCH_INVARIANT for models loaded from now on (None: unsets it: on)."""
    if on is None:
        os.environ.pop("TOKENMILL_BATCH_INVARIANT", None)
    else:
        os.environ["TOKENMILL_BATCH_INVARIANT"] = "1" if on else "0"


_CPU_DTYPES = None


def ops_for(x):
    """The kernel module when x is a CPU float32/bfloat16 tensor and kernels are on, else None."""
    global _CPU_DTYPES
    if _CPU_DTYPES is None:
        import torch

        _CPU_DTYPES = (torch.float32, torch.bfloat16)
    if not x.is_cpu or x.dtype not in _CPU_DTYPES or not enabled():
        return None
    return _module if _module is not None else load()
