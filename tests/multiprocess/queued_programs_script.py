"""Collective programs queued faster than XLA:CPU runs them, with or without jmp's bound on the queue.

``python tests/multiprocess/queued_programs_script.py MODE ITERATIONS [reversed|same]`` (8 CPU devices in
``XLA_FLAGS``; under ``jmp.launch -n 2 --cpu-devices 4`` the devices of two processes): two programs, each an
all-reduce over every device, one over the devices in order and one over them reversed (``same``: in order
too), are dispatched alternately ITERATIONS times and nothing is read until the end. MODE ``bounded`` admits
each program's result to ``jmp.runtime.programs_in_flight`` (at most 2 in flight); ``unbounded`` does not, and
with enough iterations XLA:CPU deadlocks. Prints one JSON line per process when done. Loads only JAX, not the
jmp package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def programs_in_flight():
    """``jmp.runtime.programs_in_flight`` read alone (the jmp package would import torch)."""
    path = Path(__file__).resolve().parents[2] / "jmp" / "runtime" / "programs_in_flight.py"
    spec = importlib.util.spec_from_file_location("programs_in_flight", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def centred(mesh: Mesh):
    """(a program subtracting the mean over all devices, its input) on ``mesh``."""
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    program = jax.jit(lambda a: a - a.sum() / a.size, in_shardings=sharding, out_shardings=sharding)
    x = jax.make_array_from_callback((len(mesh.devices) * 256,), sharding, lambda _: np.ones(256, np.float32))
    return program, x


def main(mode: str, iterations: int, order: str = "reversed") -> None:
    if "WORLD_SIZE" in os.environ:  # under jmp.launch
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        port = int(os.environ["MASTER_PORT"]) + 1
        jax.distributed.initialize(f"127.0.0.1:{port}", int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]))
    window = programs_in_flight()
    window.bound(2 if mode == "bounded" else 0)
    devices = jax.devices()
    (forward, a), (backward, b) = (
        centred(Mesh(np.array(devices), ("x",))),
        centred(Mesh(np.array(devices[::-1] if order == "reversed" else devices), ("x",))),
    )
    jax.block_until_ready((forward(a), backward(b)))  # compiled before the clock starts
    start = time.perf_counter()
    for _ in range(iterations):
        a = forward(a)
        window.admit(a)
        b = backward(b)
        window.admit(b)
    jax.block_until_ready((a, b))
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "mode": mode,
                "programs": 2 * iterations,
                "seconds": time.perf_counter() - start,
                "kept": window.kept(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
