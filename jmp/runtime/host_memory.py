"""On CPU, glibc's malloc keeps the memory XLA frees for the next step instead of returning it to the system.

XLA:CPU mallocs and frees each run's buffers; above glibc's mmap threshold every step faults in and zeroes fresh pages.
Raised thresholds keep such blocks on the heap, as a caching allocator would; what a compile frees is given back after
it (it would stay resident at the next step's peak). A process whose malloc the user configured (``GLIBC_TUNABLES``
naming ``glibc.malloc``, ``MALLOC_*_``), or whose C library is not glibc, is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import jax

MMAP_THRESHOLD = 1 << 30  # blocks below this come from the heap (glibc's default moves between 128 KiB and 32 MiB)
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept up to this
TOP_PAD = 64 << 20  # each growth of the heap asks the system for this much more

# mallopt's parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")

_COMPILED = "/jax/core/compile/backend_compile_duration"
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
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, *_, **__: event == _COMPILED and libc.malloc_trim(0)
        )
    return _kept


def resident_bytes() -> int:
    """The process's anonymous resident bytes once malloc has given its free pages back (0 where not glibc)."""
    libc = _glibc()
    if libc is None:
        return 0
    libc.malloc_trim(0)
    with open("/proc/self/statm") as f:
        _, resident, shared = f.read().split()[:3]  # pages; shared: file-backed (the libraries' code)
    return (int(resident) - int(shared)) * os.sysconf("SC_PAGE_SIZE")


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
