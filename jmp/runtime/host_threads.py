"""XLA:CPU's thread pool, sized before JAX makes it so that waiting collectives cannot take every thread.

XLA:CPU runs its devices on one pool of max(cores, devices) threads; a collective holds its thread until every
device joins it, and one device can wait in several at once (XLA starts a while loop, a layer scan or a pipeline's
microbatches, beside the collectives outside it): the pool can fill with waiting threads while a device has none to
start its part on (``benchmarks/host_threads.py``). XLA reads ``PJRT_NPROC`` when it makes the CPU client.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

import jax
from jax._src import xla_bridge  # JAX has no public way to ask whether its backends are made

from jmp.runtime import notices

LEVELS = 4  # threads a device: XLA orders collectives' starts, not their ends; 4 ended the deadlocks measured
VARIABLE = "PJRT_NPROC"
_FORCED_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def reserve(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """``LEVELS`` threads a device unless the cores are more or the user set it; once JAX made its devices, a notice."""
    forced = _FORCED_COUNT.findall(environ.get("XLA_FLAGS", ""))
    devices = jax.config.jax_num_cpu_devices if jax.config.jax_num_cpu_devices > 0 else int((forced or [1])[-1])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # as XLA counts
    if devices < 2 or LEVELS * devices <= cores or VARIABLE in environ:
        return None
    if getattr(xla_bridge, "backends_are_initialized", lambda: False)():  # gone from a later JAX: set it anyway
        said = "JAX made %d CPU devices on %d threads, where collectives can deadlock: set %s=%d before its first call"
        notices.warn_once("host_threads", said, devices, max(devices, cores), VARIABLE, LEVELS * devices)
        return None
    environ[VARIABLE] = str(LEVELS * devices)
    return LEVELS * devices
