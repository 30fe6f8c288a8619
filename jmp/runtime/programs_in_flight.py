"""A bound on how many training steps' programs run ahead of the host on XLA:CPU, where too many deadlock.

JAX returns before a program runs, so a loop that reads no result queues programs without bound; XLA:CPU
gang-schedules multi-device programs on a fixed thread pool, and with a few dozen queued a rendezvous waits for
tasks that never start (``benchmarks/programs_in_flight.py``). After each optimizer update jmp keeps one shard of a
small gradient of the step and waits for the one kept ``limit`` steps before. GPUs and TPUs need no bound.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping
from typing import Any

import jax

STEPS_AHEAD_ON_CPU = 2  # a step program and an update each: at most ~6 collective programs queued
STEPS_AHEAD_VARIABLE = "JMP_CPU_STEPS_IN_FLIGHT"  # another bound for CPU meshes; 0 turns it off

_kept: collections.deque = collections.deque()
_limit = 0  # 0: no bound (one CPU device, or devices that queue programs on streams)


def bound(limit: int) -> None:
    """Let at most ``limit`` steps run ahead of the host (0: no bound). ``smp.init`` sets it from the mesh."""
    global _limit
    if limit < 0:
        raise ValueError(f"the number of steps in flight must be 0 (no bound) or more, got {limit}")
    _limit = limit
    _kept.clear()


def cpu_limit(environment: Mapping[str, str] = os.environ) -> int:
    """The bound for a mesh of several CPU devices: ``JMP_CPU_STEPS_IN_FLIGHT``, else ``STEPS_AHEAD_ON_CPU``."""
    text = environment.get(STEPS_AHEAD_VARIABLE, str(STEPS_AHEAD_ON_CPU))
    if not text.isdigit():
        raise ValueError(
            f"{STEPS_AHEAD_VARIABLE}={text!r}: give the number of training steps that may be queued ahead of the "
            f"host on a CPU mesh (a whole number; 0 for no bound, which can deadlock XLA:CPU)"
        )
    return int(text)


def limit() -> int:
    return _limit


def kept() -> int:
    """How many steps' results are kept to wait for (at most ``limit()``)."""
    return len(_kept)


def admit(result: Any) -> None:
    """``result`` of a step's program was just dispatched: wait until at most ``limit()`` steps may still run (a kept
    array donated since to a later program is skipped for the next newer one)."""
    if not _limit:
        return
    _kept.append(result)
    while len(_kept) > _limit:
        oldest = _kept.popleft()
        while oldest.is_deleted() and _kept:
            oldest = _kept.popleft()
        if not oldest.is_deleted():
            oldest.block_until_ready()


def admit_update(optimizer: Any) -> None:
    """The step-boundary callback: admit one shard of the smallest gradient the update read (the step program's)."""
    if not _limit:
        return
    grads, _ = optimizer.model.training_state.kept_grads_as_computed()
    leaves = [leaf for leaf in jax.tree.leaves(grads) if isinstance(leaf, jax.Array)]
    if leaves:
        admit(min(leaves, key=lambda leaf: leaf.size).addressable_shards[0].data)
