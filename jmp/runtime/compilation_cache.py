"""JAX's persistent compilation cache on by default, and what each step program's compile cost.

The cache is ``JMP_COMPILATION_CACHE`` (``0`` / ``off``: none), else JAX's own setting, else
``$XDG_CACHE_HOME/jmp/xla``; the config key ``compilation_cache: False`` turns it off. ``timed(name)`` logs
a step program's first call: its tracing and XLA time, or that it came from the cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

logger = logging.getLogger("jmp")

ENVIRONMENT = "JMP_COMPILATION_CACHE"
_OFF = {"0", "off", "false", "no"}
# programs that compile faster than this are not worth a file (JAX's default is 1 s)
MIN_COMPILE_SECONDS = 0.3
MAX_CACHE_BYTES = 4 * 2**30  # least recently used entries go first

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def cache_directory(enabled: bool = True) -> Path | None:
    """Where compiled programs are kept (None: not kept), from the environment and JAX's own setting."""
    chosen = os.environ.get(ENVIRONMENT, "").strip()
    if not enabled or chosen.lower() in _OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jmp" / "xla"


def configure_cache(enabled: bool = True) -> Path | None:
    """Turn JAX's persistent compilation cache on at ``cache_directory`` (or off); returns the directory."""
    directory = cache_directory(enabled)
    before = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    jax.config.update("jax_enable_compilation_cache", directory is not None)
    if directory is not None:
        jax.config.update("jax_compilation_cache_dir", str(directory))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
        jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    if before != (str(directory) if directory is not None else None):
        compilation_cache.reset_cache()  # JAX decides whether to use the cache once, at its first compile
    return directory


class _Tally(threading.local):
    def __init__(self) -> None:
        self.active = False
        self.seconds = {_TRACE: 0.0, _LOWER: 0.0, _COMPILE: 0.0}
        self.hits = 0


_tally = _Tally()
_listening = False


def _on_duration(event: str, seconds: float, **_: object) -> None:
    if _tally.active and event in _tally.seconds:
        _tally.seconds[event] += seconds


def _on_event(event: str, **_: object) -> None:
    if _tally.active and event == _CACHE_HIT:
        _tally.hits += 1


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """Log at INFO how long compiling (or loading from the cache) the programs run inside took."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    if _tally.active:  # nested: the outer one reports
        yield
        return
    _tally.__init__()
    _tally.active = True
    start = time.perf_counter()
    try:
        yield
    finally:
        _tally.active = False
    seconds = _tally.seconds
    if not any(seconds.values()):
        return
    tracing = seconds[_TRACE] + seconds[_LOWER]
    how = "loaded from the compilation cache" if _tally.hits else "compiled"
    logger.info(
        "%s %s in %.1f s (tracing %.1f s, XLA %.1f s; first call %.1f s)",
        how,
        name,
        tracing + seconds[_COMPILE],
        tracing,
        seconds[_COMPILE],
        time.perf_counter() - start,
    )
