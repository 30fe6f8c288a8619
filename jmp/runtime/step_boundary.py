"""What runs at the step boundary, after each optimizer update: packages below the optimizer in the data flow
(``jmp.saving``'s preemption checkpoint) register here instead of being imported by it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_callbacks: list[Callable[[Any], None]] = []


def after_each_step(callback: Callable[[Any], None]) -> None:
    """Call ``callback(optimizer)`` after every update of every ``DistributedOptimizer``."""
    _callbacks.append(callback)


def step_ended(optimizer: Any) -> None:
    """Called by the optimizer once its update is issued (and its state in place)."""
    for callback in _callbacks:
        callback(optimizer)
