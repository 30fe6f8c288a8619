"""XLA:CPU's thread pool gets ``host_threads.LEVELS`` threads a device (``jmp.runtime.host_threads``): counted as
the pool's threads (named ``tf_XLAEigen``) in a process of its own, where the pool is made as a user's is."""

import logging
import os
import subprocess
import sys
import textwrap

import jax
import pytest
from jax._src import xla_bridge

from jmp.runtime import host_threads

_POOL_THREADS = """
    import os
    import sys
    import jax
    import jmp as smp

    if sys.argv[1] == "config":
        jax.config.update("jax_num_cpu_devices", 8)  # after the import: smp.init sizes the pool
    else:
        jax.devices()  # before smp.init: the import sized the pool
    smp.init({})
    names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    print(len(jax.devices()), names.count("tf_XLAEigen"))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the threads in Linux's /proc")
@pytest.mark.parametrize("devices_from", ["XLA_FLAGS", "config"])
def test_the_pool_jax_makes_has_threads_for_collectives_in_nested_loops(devices_from):
    env = {key: value for key, value in os.environ.items() if key != host_threads.VARIABLE}
    flags = host_threads._FORCED_COUNT.sub("", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags + (" --xla_force_host_platform_device_count=8" if devices_from == "XLA_FLAGS" else "")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_POOL_THREADS), devices_from],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    devices, threads = map(int, done.stdout.split())
    assert (devices, threads) == (8, max(host_threads.LEVELS * 8, len(os.sched_getaffinity(0))))


def test_reserve_asks_for_threads_per_device_where_the_cores_are_fewer(monkeypatch):
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    devices = 4 * len(os.sched_getaffinity(0))
    environ = {"XLA_FLAGS": f"--xla_cpu_use_fusion_emitters=false --xla_force_host_platform_device_count={devices}"}
    assert host_threads.reserve(environ) == host_threads.LEVELS * devices
    assert environ[host_threads.VARIABLE] == str(host_threads.LEVELS * devices)


@pytest.mark.parametrize(
    "environ",
    [
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=512", "PJRT_NPROC": "3"},  # the user's choice stands
        {"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"},  # one device: nothing waits for another
        {},
    ],
)
def test_reserve_leaves_the_pool_alone(monkeypatch, environ):
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    before = dict(environ)
    assert host_threads.reserve(environ) is None
    assert environ == before


def test_once_the_devices_are_made_reserve_says_what_to_set(caplog, monkeypatch):
    jax.devices()
    monkeypatch.setattr(host_threads.notices, "_SAID", set())
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=512"}
    with caplog.at_level(logging.WARNING, logger="jmp"):
        assert host_threads.reserve(environ) is None
        host_threads.reserve(environ)
    assert host_threads.VARIABLE not in environ
    assert [r.getMessage().count("PJRT_NPROC=2048") for r in caplog.records] == [1]
