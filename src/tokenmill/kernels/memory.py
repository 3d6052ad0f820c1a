"""Memory the kernels stream from: buffers on transparent huge pages, and their pages faulted in
by a background thread.

A batch-1 decode step reads every weight once, so it runs at the speed memory streams them; on
4 KiB pages each stream stops for page walks far more often than on 2 MiB ones (a TLB entry covers
512x more). The paged KV cache is read scattered (its blocks lie anywhere in it) and gains alike.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import sys
import threading
import time
import weakref

import torch

logger = logging.getLogger("tokenmill")

HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14+


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes, 2 MiB-aligned, advised to use transparent huge pages (its pages
    are touched, hence allocated, on first write: write it before reading it)."""
    # Private: shared anonymous memory is shmem, which has its own (usually disabled) THP setting.
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # keeps the mapping alive
    offset = -whole.data_ptr() % HUGE_PAGE
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % HUGE_PAGE or HUGE_PAGE)
        except OSError as e:  # a kernel without THP: plain pages
            logger.debug("madvise(MADV_HUGEPAGE) failed: %s", e)
    return whole[offset : offset + nbytes]


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on transparent huge pages: for what a step reads all of, scattered (the paged KV
    cache: its blocks lie anywhere in it, and on 4 KiB pages each block's read missed the TLB)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return huge_page_buffer(max(nbytes, 1))[:nbytes].view(dtype).view(shape)


def populate_in_background(
    t: torch.Tensor, chunk: int = 32 * HUGE_PAGE, what: str = "KV cache"
) -> threading.Thread | None:
    """Fault in the pages of t (a huge_page_empty tensor) from a nice-19 thread, chunk by chunk,
    so that the steps do not: the KV cache is written where its blocks land, and its first pass
    through the pool faulted in the steps' own threads (~1 s a GiB on a VM; 10% of a W8A8 prompt
    step's time on SmolLM2). The end state is vLLM's, whose cache is torch.zeros at start-up,
    without the seconds of memset before serving. MADV_POPULATE_WRITE leaves the contents as they
    are, so it may run beside the engine's writes.

    The thread holds t's address, never t: whoever lets t go (its engine dropped, a cache re-sized)
    runs a finalizer that waits out the chunk in flight and stops the thread, and t is freed there;
    at interpreter exit the finalizer runs from atexit. Held by the thread during a call (as it once
    was), t could lose its last reference on that thread: t's storage (torch.frombuffer over an
    mmap) is then unmapped in a C++ deleter that releases the GIL, and an interpreter exit meanwhile
    ends the daemon thread with pthread_exit inside that noexcept deleter: "terminate called without
    an active exception", exit status 134, after a script had done its work."""
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if sys.platform != "linux" or nbytes == 0 or start % mmap.PAGESIZE:
        return None
    madvise = _libc_madvise()
    # Held while a chunk is faulted in. Reentrant: should a garbage collection on the thread itself
    # free t (in a cycle), the finalizer runs there, inside the lock.
    lock, stop = threading.RLock(), threading.Event()

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # a Linux thread's own nice value
        except OSError:
            pass
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk):
            with lock:
                if stop.is_set():  # t is gone (or going): its memory may be unmapped
                    return
                failed = madvise(start + off, min(chunk, nbytes - off), MADV_POPULATE_WRITE) != 0
            if failed:
                if not stop.is_set():  # (else t went during the call) a kernel without MADV_POPULATE_WRITE
                    logger.info(
                        "%s: background thread stopped (madvise: %s); pages fault in on first write",
                        what,
                        os.strerror(ctypes.get_errno()),
                    )
                return
        # (benchmarks/compare/run.py waits for this line before it measures a tokenmill server)
        logger.info(
            "%s: %.2f GiB faulted in by a background thread in %.1f s", what, nbytes / 2**30, time.perf_counter() - t0
        )

    # Runs where t is freed, or at interpreter exit (atexit: before daemon threads are cut off).
    weakref.finalize(t, _stop_populating, lock, stop)
    thread = threading.Thread(target=run, name="tokenmill-populate", daemon=True)
    logger.info("%s: faulting in %.2f GiB from a background thread", what, nbytes / 2**30)
    thread.start()
    return thread


def _libc_madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise  # ctypes: the GIL is released during the call
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _stop_populating(lock: threading.RLock, stop: threading.Event) -> None:
    with lock:  # waits out the chunk in flight: t's memory stays mapped until then
        stop.set()
