"""The engine's own C++ CPU kernels, compiled from the package's source on first use.

Built with torch's cpp_extension (needs a C++ compiler and ninja) into a build folder keyed
by the source and flags, so only the first process on a machine pays the ~45 s build. If the
build fails, callers fall back to pure-torch code (TOKENMILL_NO_CPP_KERNELS=1 forces that).

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
from pathlib import Path

logger = logging.getLogger("tokenmill")
_lock = threading.Lock()
_module = None
_failed = False


def load():
    """The compiled module, or None when unavailable."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        try:
            from torch.utils.cpp_extension import load as load_ext

            build_dir = build_directory()
            build_dir.mkdir(parents=True, exist_ok=True)
            with open(build_dir / "tokenmill.flock", "w") as guard:
                fcntl.flock(guard, fcntl.LOCK_EX)  # one builder per machine; freed if it dies
                (build_dir / "lock").unlink(missing_ok=True)  # torch's own lock: stale if we got here
                _module = load_ext(name="tokenmill_cpu_kernels", sources=[str(p) for p in SOURCES], extra_cflags=_flags(),
                                   build_directory=str(build_dir), verbose=False)
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: use the torch path
            logger.warning("C++ CPU kernels unavailable (%s); using the pure-torch attention path", e)
            _failed = True
    return _module


SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("paged_attention.cpp", "paged_prefill.cpp", "quant_linear.cpp", "panel_linear.cpp", "fused_ops.cpp",
                        "decode_step.cpp", "bindings.cpp")]
# Not compiled alone, but part of the build key.
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("cpu_common.h", "elementwise.h", "linear.h", "paged_decode.h")]


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp", "-ffast-math", "-mprefer-vector-width=512"]
    if os.environ.get("TOKENMILL_PORTABLE_KERNELS") != "1":
        flags.append("-march=native")
    return flags


def build_directory() -> Path:
    """Where the module is built: keyed by source, flags, torch's ABI and the Python version."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    tag = f"{' '.join(_flags())}|{torch.__version__}|{sys.version}".encode()
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + tag).hexdigest()[:16]
    return Path(get_default_build_root()) / f"tokenmill_cpu_kernels_{key}"


def enabled() -> bool:
    return os.environ.get("TOKENMILL_NO_CPP_KERNELS") != "1"


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
