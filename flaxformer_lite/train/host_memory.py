"""Host memory that XLA frees stays with the process, for the next step to reuse.

XLA's CPU runtime allocates each step's temporary buffer (activations and gradients) with
``malloc`` and frees it when the step ends. glibc serves a block that large with a fresh ``mmap``
and unmaps it on ``free``, so every step the kernel maps and zeroes each of its pages again, a
cost in kernel CPU time that grows with the buffer. With large blocks served from glibc's heap
and the heap never given back, the next step reuses the same pages (no faults after the first
steps).

A thread's own malloc arena maps a block larger than its 64 MiB heap whatever the settings, so
every thread must share the main arena; a thread takes its arena when it first allocates and
keeps it, so only threads created afterwards follow the setting. Call this before JAX starts its
backend (and its worker threads), as ``train.py`` does: the settings hold for the whole process,
so it is the program's choice, not the library's.
"""

from __future__ import annotations

import ctypes
import platform

# mallopt(3) parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1  # -1: never return the heap's free top to the system
M_MMAP_MAX = -4  # 0: never serve a request with its own mmap
M_ARENA_MAX = -8  # 1: every thread allocates from the main arena


def reuse_freed_host_memory() -> bool:
    """Makes glibc keep freed memory for reuse; True if it did (False where the C library is not
    glibc). The process keeps its peak host memory mapped until it exits."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))
    return all([libc.mallopt(parameter, value) == 1 for parameter, value in settings])
