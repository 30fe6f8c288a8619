"""On CPU, glibc's malloc keeps the memory XLA frees for reuse within a step, and gives it back between steps.

XLA:CPU mallocs and frees each run's buffers; above glibc's mmap threshold every step faults in and zeroes fresh pages.
Raised thresholds keep such blocks on the heap, as a caching allocator would (``keep_freed_memory``). The threads
share one heap (``one_heap``), so that a block freed by one is reused by another, and what a compile or a step left
free goes back to the system after it (``give_back_between_steps``): kept, it stayed resident at every later step's
peak, which crept up step after step. A process whose malloc the user configured (``GLIBC_TUNABLES`` naming
``glibc.malloc``, ``MALLOC_*_``), or whose C library is not glibc, is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os

import jax

from jmp.runtime import step_boundary

MMAP_THRESHOLD = 1 << 30  # blocks below this come from the heap (glibc's default moves between 128 KiB and 32 MiB)
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept up to this
TOP_PAD = 64 << 20  # each growth of the heap asks the system for this much more
GIVE_BACK_ABOVE = 64 << 20  # between steps, free pages go back once the process grew this much since the last time

# mallopt's parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")

_COMPILED = "/jax/core/compile/backend_compile_duration"
_kept = False
_libc: ctypes.CDLL | None = None
_resident_after_give_back = 0


def one_heap() -> bool:
    """Before JAX starts XLA's threads (``import jmp``, ``smp.init``), on a host with no accelerator for JAX: glibc's
    malloc gives every thread the one heap (``M_ARENA_MAX`` 1; True when set).

    By default a thread allocates from one of up to 8 heaps a core, and a heap reuses only the blocks freed into it;
    XLA runs a device's work on whichever thread of its pool is free, so a block freed into one heap was allocated
    afresh in another, and each heap's top, which ``malloc_trim`` leaves, stayed at the most it had held. A thread
    that allocated before keeps its heap."""
    chosen = jax.config.jax_platforms  # JAX_PLATFORMS
    if _user_configured() or (chosen and chosen.split(",")[0] != "cpu"):
        return False
    if not chosen and importlib.metadata.entry_points(group="jax_plugins"):
        return False  # a GPU or TPU plugin: the host's threads keep a heap each
    libc = _glibc()
    return libc is not None and libc.mallopt(_M_ARENA_MAX, 1) == 1


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process (True when they are set, now or before)."""
    global _kept, _libc
    if _kept:
        return True
    if _user_configured() or (libc := _glibc()) is None:
        return False
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD))
    _kept = all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
    if _kept:
        _libc = libc
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, *_, **__: event == _COMPILED and libc.malloc_trim(0)
        )
        step_boundary.after_each_step(give_back_between_steps)
    return _kept


def give_back_between_steps(_optimizer: object = None) -> None:
    """After an optimizer update, or a forward-only step: once the process's anonymous resident size has grown
    ``GIVE_BACK_ABOVE`` since the last time, hand the pages of malloc's free blocks back to the system
    (``malloc_trim``). Within a step the blocks are reused; a small process, which grows less, keeps them."""
    global _resident_after_give_back
    if _libc is not None and anonymous_resident_bytes() - _resident_after_give_back > GIVE_BACK_ABOVE:
        _libc.malloc_trim(0)
        _resident_after_give_back = anonymous_resident_bytes()


def anonymous_resident_bytes() -> int:
    """The process's resident size less its file-backed pages (the libraries' code, which the kernel can drop)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


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


def _user_configured() -> bool:
    return "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(name in os.environ for name in _USER_SETTINGS)


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
