"""On CPU, glibc's malloc keeps the memory XLA frees for the next step instead of returning it to the system.

XLA:CPU allocates each run's buffers (tens of MB for a small convolutional net) with ``malloc`` and frees them
when the run ends. glibc serves blocks above its mmap threshold (at most 32 MiB) with fresh ``mmap``s and unmaps
them on ``free``, so every step faults in and zeroes its buffers' pages again: the seed's GroupedNet (batch 64,
one device) took 11,900 page faults per step and 43 ms; with the thresholds raised, 800 and 35 ms (PyTorch eager:
27 ms); at dp8 over 8 CPU devices 9,700 and 75 ms, then 700-1,000 and 66 ms. Such blocks now come from the heap
and stay there, as a caching allocator's do; the process's resident memory then stays at its peak between steps,
as it does under PyTorch's allocators. What remains: XLA's threads allocate from malloc arenas of their own,
whose heaps (64 MiB at most) go back to the system when wholly free, and blocks larger than a heap are mmapped
whatever the threshold; only ``GLIBC_TUNABLES=glibc.malloc.arena_max=1`` at the process's start avoids that,
and it measured no faster.

A process whose malloc the user configured (``GLIBC_TUNABLES`` naming ``glibc.malloc``, or glibc's ``MALLOC_*_``
variables) is left as configured, as is one whose C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger("jmp")

MMAP_THRESHOLD = 1 << 30  # blocks below this come from the heap (glibc's default moves between 128 KiB and 32 MiB)
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept up to this
TOP_PAD = 64 << 20  # each growth of the heap asks the system for this much more

# mallopt's parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")

_kept = False


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process (True when they are set, now or before)."""
    global _kept
    if _kept:
        return True
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(name in os.environ for name in _USER_SETTINGS):
        return False
    libc = _glibc()
    if libc is None:
        return False
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD))
    _kept = all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
    if _kept:
        logger.debug("malloc keeps freed blocks below %d MiB for reuse (XLA:CPU's buffers)", MMAP_THRESHOLD >> 20)
    return _kept


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return libc
