"""The engine's own C++ CPU kernels, compiled from the package's source on first use.

Built with torch's cpp_extension (needs a C++ compiler and ninja) into torch's extension cache,
so only the first process on a machine pays the ~45 s build. If the build fails, callers fall
back to pure-torch code (TOKENMILL_NO_CPP_KERNELS=1 forces that).
"""

from __future__ import annotations

import logging
import os
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

            src = Path(__file__).parent / "csrc" / "paged_attention.cpp"
            flags = ["-O3", "-fopenmp", "-ffast-math", "-mprefer-vector-width=512"]
            if os.environ.get("TOKENMILL_PORTABLE_KERNELS") != "1":
                flags.append("-march=native")
            _module = load_ext(
                name="tokenmill_cpu_kernels_v2", sources=[str(src)], extra_cflags=flags, verbose=False
            )
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: use the torch path
            logger.warning("C++ CPU kernels unavailable (%s); using the pure-torch attention path", e)
            _failed = True
    return _module


def enabled() -> bool:
    return os.environ.get("TOKENMILL_NO_CPP_KERNELS") != "1"


_CPU_DTYPES = None


def ops_for(x):
    """The kernel module when x is a CPU float32/bfloat16 tensor and kernels are on, else None."""
    global _CPU_DTYPES
    if _CPU_DTYPES is None:
        import torch

        _CPU_DTYPES = (torch.float32, torch.bfloat16)
    if x.dtype not in _CPU_DTYPES or x.device.type != "cpu" or not enabled():
        return None
    return load()
