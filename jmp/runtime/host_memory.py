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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def allocated_bytes() -> int:
    """Bytes malloc has handed out and not had back (glibc's ``mallinfo2``; 0 where not glibc 2.33 or later).

    Unlike the resident size it leaves out the pages malloc keeps free, which depend on what ran before (a compile
    or a load from JAX's persistent cache leaves different amounts). It locks each arena in turn: not for polling."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return 0
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


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
